"""Does a purge make emit() wait? Emit latency in another connection with and without a purge.

One run, on its own database (created on the server, migrated, dropped afterwards):

1. fill: ``--count`` SENT rows 30 days old and ``--young`` SENT rows one day old (kept by a
   7-day retention), written by one ``INSERT ... SELECT`` per 100,000 rows on the server
   (``generate_series`` on PostgreSQL, the Sequence engine's ``seq_1_to_N`` on MariaDB),
   then ``VACUUM ANALYZE`` / ``ANALYZE TABLE``, as a table looks after a day of traffic;
2. an emitter child process (its own connection, its own interpreter) commits one event
   per transaction through ``outbox.atomic()``/``emit()`` at ``--rate`` events/s and times
   each transaction, commit included;
3. for ``--seconds`` the emitter runs alone (the baseline), then this process runs
   ``purge(older_than_days=7)`` with ``--batch-size`` while it goes on, and times each
   batch (its SELECT, DELETE and COMMIT).

It prints emit latency percentiles without and during the purge, and how long each purge
batch took. Numbers are only comparable on the same machine and load; nothing is asserted::

    python -m bench.purge_bench [--smoke] [--count 1000000] [--young 100000]
        [--database postgres|mariadb] [--database-url URL] [--batch-size 1000]
        [--rate 200] [--seconds 10] [--isolation "read committed"|"repeatable read"]
        [--repeat 1]

With ``--repeat R`` the purge runs R times (the table is filled again before each) and the
medians are printed last. The server comes from ``--database-url``, else
``PG_URL``/``MARIADB_URL``, else ``DATABASE_URL`` when it names that kind of server, else
the local default.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import (
    SAMPLE_AGGREGATE_TYPE,
    SAMPLE_EVENT_TYPE,
    SAMPLE_OCCURRED_AT,
    SAMPLE_PAYLOAD,
    Stopwatch,
    emit_sample,
    parser,
)
from bench.relay_bench import SERVERS, bench_database, percentile, server_url, setup_django
from django_outbox.masking import mask_url

SMOKE = {"count": 3000, "young": 300, "batch_size": 500, "seconds": 0.5, "rate": 100.0}
FILL_CHUNK = 100_000
RETENTION_DAYS = 7


# -- filling the table on the server ---------------------------------------------------------
def fill(count: int, young: int) -> float:
    """Insert ``count`` old and then ``young`` recent SENT rows; return the seconds it took."""
    from django.db import connection

    with Stopwatch() as t:
        first = 0
        for total, age_days in ((count, 30), (young, 1)):
            for start in range(first, first + total, FILL_CHUNK):
                _insert_sent(start, min(first + total, start + FILL_CHUNK) - start, age_days)
            first += total
        table = _table()
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"VACUUM ANALYZE {table}")
                # The fill's WAL would set off checkpoints during the runs; a table purged
                # days after it was written is past a checkpoint too (so every page the purge
                # touches first writes a full-page image, as in production).
                cursor.execute("CHECKPOINT")
            else:
                cursor.execute(f"ANALYZE TABLE {table}")
                cursor.fetchall()
    return t.seconds


def _table() -> str:
    from django.db import connection

    from django_outbox.models import OutboxEvent

    return connection.ops.quote_name(OutboxEvent._meta.db_table)


def _insert_sent(start: int, n: int, age_days: int) -> None:
    """``n`` SENT rows numbered from ``start``, ``age_days`` old (one ms apart, in id order)."""
    from django.db import connection

    payload = json.dumps(SAMPLE_PAYLOAD)
    columns = (
        "event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at, "
        "status, retry_count, next_retry_time, lease_token, last_error, created_at, "
        "updated_at, sent_at"
    )
    if connection.vendor == "postgresql":
        age = "statement_timestamp() - make_interval(days => %s) + i * interval '1 ms'"
        sql = (
            f"INSERT INTO {_table()} ({columns}) "
            f"SELECT 'bench-' || i, %s, i::text, %s, %s::jsonb, '{{}}'::jsonb, %s, 1, 0, "
            f"{age}, '', '', {age}, {age}, {age} "
            f"FROM generate_series(%s, %s) AS i"
        )
        ages = [age_days, age_days, age_days, age_days]
        params = [
            SAMPLE_AGGREGATE_TYPE,
            SAMPLE_EVENT_TYPE,
            payload,
            SAMPLE_OCCURRED_AT,
            *ages,
            start + 1,
            start + n,
        ]
    else:
        # The Sequence engine's virtual table seq_1_to_N (MariaDB 10.0+, on by default).
        age = "UTC_TIMESTAMP(6) - INTERVAL %s DAY + INTERVAL (seq * 1000) MICROSECOND"
        sql = (
            f"INSERT INTO {_table()} ({columns}) "
            f"SELECT CONCAT('bench-', seq), %s, seq, %s, %s, '{{}}', %s, 1, 0, "
            f"{age}, '', '', {age}, {age}, {age} "
            f"FROM seq_{start + 1}_to_{start + n}"
        )
        params = [
            SAMPLE_AGGREGATE_TYPE,
            SAMPLE_EVENT_TYPE,
            payload,
            SAMPLE_OCCURRED_AT.replace(tzinfo=None),
            age_days,
            age_days,
            age_days,
            age_days,
        ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


# -- the emitter child -----------------------------------------------------------------------
def emitter(rate: float) -> None:
    """The child: emit one event per transaction at ``rate``/s until SIGTERM, then print
    one JSON list of ``[monotonic start, seconds]`` pairs on stdout."""
    import django

    django.setup()
    from django_outbox import outbox

    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    timings: list[tuple[float, float]] = []
    interval = 1.0 / rate
    sequence = 0
    next_at = time.monotonic()
    while not stop:
        started = time.monotonic()
        with outbox.atomic() as box:
            emit_sample(box, sequence)
        timings.append((started, time.monotonic() - started))
        if sequence == 0:
            print("ready", flush=True)
        sequence += 1
        next_at += interval
        pause = next_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_at = time.monotonic()  # fell behind: do not burst to catch up
    print(json.dumps(timings), flush=True)


class Emitter:
    def __init__(self, env: dict[str, str], rate: float) -> None:
        command = [sys.executable, "-m", "bench.purge_bench", "--emitter", "--rate", str(rate)]
        self.process = subprocess.Popen(
            command, env=env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            self.process.kill()
            raise RuntimeError(f"the emitter did not start: {line!r}")

    def stop(self) -> list[tuple[float, float]]:
        self.process.send_signal(signal.SIGTERM)
        out, _ = self.process.communicate(timeout=60)
        if self.process.returncode != 0:
            raise RuntimeError(f"the emitter exited with {self.process.returncode}")
        return [tuple(pair) for pair in json.loads(out.decode().splitlines()[-1])]


# -- one run ---------------------------------------------------------------------------------
@dataclass
class Run:
    rows: int = 0
    purge_started: float = 0.0
    purge_seconds: float = 0.0
    batches: list[tuple[float, float, int]] = field(default_factory=list)  # start, s, rows
    baseline: list[float] = field(default_factory=list)  # emit seconds without purge
    during: list[float] = field(default_factory=list)  # emit seconds during the purge
    slow: list[tuple[float, float]] = field(default_factory=list)  # slowest: s, at (purge s)
    in_batch: list[float] = field(default_factory=list)  # during, overlapping a batch
    between: list[float] = field(default_factory=list)  # during, in no batch

    def slowest(self) -> str:
        """The slowest emits during the purge and the batch each overlapped: where to look."""
        start = self.purge_started
        parts = []
        for took, at in self.slow:
            overlapped = [
                f"batch {n + 1} ({s * 1000:.0f} ms)"
                for n, (b, s, _) in enumerate(self.batches)
                if b - start < at + took and at < b - start + s
            ]
            parts.append(
                f"{took * 1000:.0f} ms at {at:.2f} s ({', '.join(overlapped) or 'between batches'})"
            )
        return "slowest emits during purge: " + "; ".join(parts)

    def split_during(self, timings: list[tuple[float, float]]) -> None:
        """Emits during the purge that overlapped a batch, and those that fell between
        batches (in a pause): the two see the same machine at the same time, so their
        difference is what a batch costs an emit, whatever else the machine is doing."""
        starts = [b for b, _, _ in self.batches]
        for at, took in timings:
            n = bisect.bisect_right(starts, at + took) - 1  # the last batch begun by its end
            overlaps = n >= 0 and starts[n] + self.batches[n][1] > at
            (self.in_batch if overlaps else self.between).append(took)

    def figures(self) -> dict[str, float]:
        batch = [s for _, s, _ in self.batches]
        return {
            "emit p50 in batch": percentile(self.in_batch, 0.5) if self.in_batch else 0.0,
            "emit p99 in batch": percentile(self.in_batch, 0.99) if self.in_batch else 0.0,
            "emit max in batch": max(self.in_batch, default=0.0),
            "emit p50 between": percentile(self.between, 0.5) if self.between else 0.0,
            "emit p99 between": percentile(self.between, 0.99) if self.between else 0.0,
            "emit max between": max(self.between, default=0.0),
            "emit p50 without": percentile(self.baseline, 0.5),
            "emit p99 without": percentile(self.baseline, 0.99),
            "emit max without": max(self.baseline),
            "emit p50 during": percentile(self.during, 0.5),
            "emit p99 during": percentile(self.during, 0.99),
            "emit max during": max(self.during),
            "batch p50": percentile(batch, 0.5),
            "batch p99": percentile(batch, 0.99),
            "batch max": max(batch),
            "rows/s": self.rows / self.purge_seconds,
        }


def run_once(
    env: dict[str, str],
    *,
    rate: float,
    seconds: float,
    batch_size: int,
    pause_ratio: float | None = None,
) -> Run:
    from django_outbox.purge import purge

    run = Run()
    emitter_child = Emitter(env, rate)
    try:
        time.sleep(seconds)
        purge_started = time.monotonic()

        def batch_done(kind: str, rows: int, took: float) -> None:
            run.batches.append((time.monotonic() - took, took, rows))

        result = purge(
            older_than_days=RETENTION_DAYS,
            batch_size=batch_size,
            on_batch=batch_done,
            pause_ratio=pause_ratio,
        )
        purge_ended = time.monotonic()
    finally:
        timings = emitter_child.stop()
    run.rows = result.sent
    run.purge_started = purge_started
    run.purge_seconds = purge_ended - purge_started
    run.baseline = [s for at, s in timings if at < purge_started]
    run.during = [s for at, s in timings if purge_started <= at < purge_ended]
    run.split_during([(at, s) for at, s in timings if purge_started <= at < purge_ended])
    run.slow = sorted(
        ((s, at - purge_started) for at, s in timings if purge_started <= at < purge_ended),
        reverse=True,
    )[:3]
    if not run.baseline or not run.during:
        raise RuntimeError(
            f"no emit was timed {'during' if run.baseline else 'before'} the purge: "
            "raise --rate or --seconds"
        )
    return run


def print_run(title: str, figures: dict[str, float], counts: str) -> None:
    ms = {k: v * 1000 for k, v in figures.items() if k != "rows/s"}
    print(f"-- {title} {counts}")
    print(
        f"{'emit() without purge':<28} p50 {ms['emit p50 without']:7.1f} ms  "
        f"p99 {ms['emit p99 without']:7.1f} ms  max {ms['emit max without']:7.1f} ms"
    )
    print(
        f"{'emit() during purge':<28} p50 {ms['emit p50 during']:7.1f} ms  "
        f"p99 {ms['emit p99 during']:7.1f} ms  max {ms['emit max during']:7.1f} ms"
    )
    print(
        f"{'  overlapping a batch':<28} p50 {ms['emit p50 in batch']:7.1f} ms  "
        f"p99 {ms['emit p99 in batch']:7.1f} ms  max {ms['emit max in batch']:7.1f} ms"
    )
    print(
        f"{'  between batches':<28} p50 {ms['emit p50 between']:7.1f} ms  "
        f"p99 {ms['emit p99 between']:7.1f} ms  max {ms['emit max between']:7.1f} ms"
    )
    print(
        f"{'purge batch (txn)':<28} p50 {ms['batch p50']:7.1f} ms  "
        f"p99 {ms['batch p99']:7.1f} ms  max {ms['batch max']:7.1f} ms  "
        f"{figures['rows/s']:,.0f} rows/s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0], default_count=1_000_000)
    p.add_argument("--emitter", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--young", type=int, default=None, help="recent SENT rows kept (count/10)")
    p.add_argument("--database", choices=sorted(SERVERS), default="postgres")
    p.add_argument("--database-url", default=None, help="the server (its database is unused)")
    p.add_argument("--batch-size", type=int, default=None, help="OUTBOX_PURGE_BATCH_SIZE")
    p.add_argument(
        "--pause-ratio", type=float, default=None, help="OUTBOX_PURGE_PAUSE_RATIO (default 1)"
    )
    p.add_argument("--rate", type=float, default=200.0, help="emits/s, one per transaction")
    p.add_argument("--seconds", type=float, default=10.0, help="emitter alone before the purge")
    p.add_argument(
        "--isolation",
        default=None,
        help="MariaDB: DATABASES OPTIONS isolation_level of both processes "
        "(default: the demo's 'read committed')",
    )
    args = p.parse_args(argv)
    if args.emitter:
        emitter(args.rate)
        return
    if args.smoke:
        args.count, args.young = SMOKE["count"], SMOKE["young"]
        args.seconds, args.rate = SMOKE["seconds"], SMOKE["rate"]
        args.batch_size = args.batch_size or SMOKE["batch_size"]
    young = args.count // 10 if args.young is None else args.young
    batch_size = args.batch_size or 1000
    server = server_url(args.database, args.database_url)
    if args.isolation:
        os.environ["BENCH_ISOLATION"] = args.isolation
    print(
        f"purge bench: {args.database} {mask_url(server)}, {args.count:,} old + {young:,} "
        f"recent SENT rows, batch {batch_size}, pause ratio "
        f"{'default' if args.pause_ratio is None else f'{args.pause_ratio:g}'}, "
        f"emit {args.rate:g}/s, {args.repeat} run(s)"
        + (f", isolation {args.isolation}" if args.isolation else ""),
        flush=True,
    )
    # A SIGTERM (e.g. `timeout`) still drops the database.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    runs = []
    with bench_database(server) as database_url:
        env = setup_django(database_url, "unused", args.url)
        for number in range(1, args.repeat + 1):
            if number > 1:
                _truncate()
            took = fill(args.count, young)
            print(f"fill: {args.count + young:,} rows in {took:.1f} s", flush=True)
            run = run_once(
                env,
                rate=args.rate,
                seconds=args.seconds,
                batch_size=batch_size,
                pause_ratio=args.pause_ratio,
            )
            runs.append(run)
            counts = (
                f"({run.rows:,} rows in {len(run.batches)} batches, {run.purge_seconds:.1f} s; "
                f"{len(run.baseline)} emits without, {len(run.during)} during)"
            )
            print_run(f"run {number}", run.figures(), counts)
            print(run.slowest(), flush=True)
    if args.repeat > 1:
        keys = runs[0].figures()
        medians = {k: statistics.median(r.figures()[k] for r in runs) for k in keys}
        print_run(f"median of {args.repeat} runs", medians, "")


def _truncate() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE TABLE {_table()}")


if __name__ == "__main__":
    main()
