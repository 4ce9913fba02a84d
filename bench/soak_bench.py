"""Does the outbox stay small and fast through millions of events? A soak: steady emits,
the relay draining, the retention job on its schedule.

One run, on its own database (created on the server, migrated, dropped afterwards) and its
own exchange and queue (deleted afterwards):

1. a ``manage.py publish_outbox`` child process relays to RabbitMQ, as deployed; a consumer
   child process reads the bench queue and notes when each event arrived;
2. ``--writers`` threads in this process (each its own connection, like a web app's
   workers) commit ``--events`` events at ``--rate`` events/s in all, one event per
   ``outbox.atomic()`` transaction, and time each transaction, commit included;
3. the retention job runs as documented (what ``manage.py purge_outbox`` runs, batches of
   ``OUTBOX_PURGE_BATCH_SIZE`` with the default pause, in a child process that stays up, as
   a scheduler's worker would), with time compressed: SENT rows are kept ``--retention``
   seconds (default a fifth of the run) and the job runs every seventh of that (the
   documented daily run against a 7-day retention);
4. ``--mode``: ``default`` keeps SENT rows until the job deletes them; ``delete`` runs the
   relay with ``OUTBOX_RETENTION_DAYS = 0`` (its settle deletes what the broker confirmed;
   the job then only has the inbox to purge); ``partitioned`` (PostgreSQL) converts the
   table first (``outbox_partition --convert``, a partition per interval of the job), and
   the job drops whole partitions; ``--autovacuum tuned`` (PostgreSQL) gives the table the
   autovacuum settings docs/operations.md recommends, ``--autovacuum job`` has the job
   VACUUM the table after each pass (for a server that runs with ``autovacuum = off``, as
   this project's development machine does).

Per tenth of the events it prints: emit p50/p99 (the transaction, commit included),
commit -> delivered p50/p99, the drain rate (events the consumer got per second in that
tenth) and the backlog left at its end, the table's and its indexes' size and, on
PostgreSQL, its dead tuples, and the retention passes that started in it (their longest
time, their longest batch, and the slowest emit that overlapped one). Last, the issue's
targets: last tenth against the first.

Commit -> delivered stands for commit -> SENT: the broker hands a persistent message to
the consumer about when it confirms it to the relay, and in ``delete`` mode no ``sent_at``
survives to read (the settle deletes the row). It does not include the settle's own few
milliseconds, in either mode.

    python -m bench.soak_bench [--smoke] [--events 2000000] [--rate 1000] [--writers 8]
        [--mode default|delete|partitioned] [--autovacuum default|tuned|job]
        [--database postgres|mariadb] [--database-url URL]
        [--retention SECONDS] [--retention-every SECONDS]

The server comes from ``--database-url``, else ``PG_URL``/``MARIADB_URL``, else
``DATABASE_URL`` when it names that kind of server, else the local default. Numbers are only
comparable on the same machine and load; nothing is asserted.
"""

from __future__ import annotations

import argparse
import array
import bisect
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.common import DEFAULT_URL, emit_sample
from bench.relay_bench import (
    ROOT,
    SERVERS,
    RelayChild,
    bench_database,
    percentile,
    server_url,
    setup_django,
)
from django_outbox.masking import mask_url

MODES = ("default", "delete", "partitioned")
#: --autovacuum tuned: the outbox table's own settings (docs/operations.md, "Sizing the
#: outbox"): vacuum after a fixed number of dead rows, not a fifth of the table, unthrottled.
TUNED_AUTOVACUUM = (
    "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 20000, "
    "autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 20000, "
    "autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 20000, "
    "autovacuum_vacuum_cost_delay = 0"
)
SMOKE = {"events": 2000, "rate": 400.0, "writers": 4, "retention": 2.0, "every": 1.0}
TENTHS = 10
#: The documented schedule: purge_outbox daily, SENT rows kept 7 days.
RUNS_PER_RETENTION = 7


# -- the consumer child ----------------------------------------------------------------------
def consumer(url: str, queue: str, out: str) -> None:
    """The child: read ``queue`` until SIGTERM, writing ``sequence arrival-time`` per
    message to ``out`` (the sequence is the sample event's aggregate id)."""
    import pika

    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=2000)
    with open(out, "w", buffering=1 << 20) as sink:
        print("ready", flush=True)
        while not stop:
            for method, properties, _ in channel.consume(
                queue, auto_ack=False, inactivity_timeout=0.2
            ):
                if method is None:
                    break
                arrived = time.time()
                aggregate_id = (properties.headers or {}).get("aggregate_id", "")
                sink.write(f"{aggregate_id} {arrived:.6f}\n")
                # One ack for many: what a consumer acking per message would cost the
                # broker is not what is measured.
                if method.delivery_tag % 500 == 0:
                    channel.basic_ack(method.delivery_tag, multiple=True)
                if stop:
                    break
        channel.cancel()
    connection.close()


class Consumer:
    def __init__(self, env: dict[str, str], url: str, queue: str) -> None:
        self.out = tempfile.NamedTemporaryFile("r", suffix=".soak", delete=False)  # noqa: SIM115
        command = [
            sys.executable,
            "-m",
            "bench.soak_bench",
            "--consumer",
            "--url",
            url,
            "--queue",
            queue,
            "--out",
            self.out.name,
        ]
        self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            self.process.kill()
            raise RuntimeError(f"the consumer did not start: {line!r}")

    def discard(self) -> None:
        """Stop it if it still runs (a run that failed), before its queue goes."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if os.path.exists(self.out.name):
            os.unlink(self.out.name)

    def stop(self, events: int) -> array.array[float]:
        """Stop it and return, per sequence, when the event first arrived (0: never)."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        arrived = array.array("d", bytes(8 * events))
        with open(self.out.name) as lines:
            for line in lines:
                sequence, _, at = line.partition(" ")
                if sequence.isdigit() and int(sequence) < events:
                    n = int(sequence)
                    if not arrived[n]:  # a duplicate keeps the first arrival
                        arrived[n] = float(at)
        os.unlink(self.out.name)
        return arrived


# -- the retention job -----------------------------------------------------------------------
@dataclass
class Pass:
    started: float  # time.time()
    seconds: float
    deleted: int
    longest_batch: float


def _vacuum() -> None:
    """VACUUM the outbox table (every partition of it), as autovacuum would."""
    from django.db import connection

    from django_outbox.models import OutboxEvent

    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM {connection.ops.quote_name(OutboxEvent._meta.db_table)}")


def retention_child(every: float, older_than_days: float | None, vacuum: bool = False) -> None:
    """The child: ``purge()`` (what ``purge_outbox`` and the Celery task ``django_outbox.purge``
    run) every ``every`` seconds, as a scheduler that is already up would start it, until
    SIGTERM; one JSON line per pass; with ``vacuum``, a VACUUM of the table after each
    (``--autovacuum job``). A process of its own, so its work does not take this
    process's GIL from the writers, and its start-up is not timed as part of a pass."""
    import json

    import django

    django.setup()
    from django_outbox.purge import purge

    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    print("ready", flush=True)
    while not stop:
        deadline = time.monotonic() + every
        while not stop and time.monotonic() < deadline:
            time.sleep(0.05)
        if stop:
            break
        batches: list[float] = []
        started = time.time()
        result = purge(
            older_than_days=older_than_days,
            force=True,
            on_batch=lambda kind, rows, took, into=batches: into.append(took),
        )
        if vacuum:
            _vacuum()
        print(
            json.dumps([started, time.time() - started, result.total, max(batches, default=0)]),
            flush=True,
        )


class RetentionJob:
    """The retention child: its passes, read as they come."""

    def __init__(
        self, env: dict[str, str], every: float, older_than_days: float | None, vacuum: bool
    ) -> None:
        command = [sys.executable, "-m", "bench.soak_bench", "--retention-child"]
        if vacuum:
            command += ["--autovacuum", "job"]
        command += ["--retention-every", str(every)]
        if older_than_days is not None:
            command += ["--older-than-days", repr(older_than_days)]
        self.passes: list[Pass] = []
        self.process = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            self.process.kill()
            raise RuntimeError(f"the retention job did not start: {line!r}")
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        import json

        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.passes.append(Pass(*json.loads(line)))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        # A pass under way finishes first.
        self.process.wait(600)
        self.thread.join()
        if self.process.returncode != 0:
            raise RuntimeError(f"the retention job exited with {self.process.returncode}")


# -- measuring the table ---------------------------------------------------------------------
def table_figures() -> tuple[int, int, int | None]:
    """The outbox table's size and its indexes' size in bytes, and its dead tuples
    (PostgreSQL; None elsewhere)."""
    from django.db import connection

    from django_outbox.models import OutboxEvent

    table = OutboxEvent._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # The table and, when partitioned, every partition of it.
            # (pg_partition_tree() lists nothing for a table that is not partitioned.)
            cursor.execute(
                "SELECT SUM(pg_table_size(t.relid)), SUM(pg_indexes_size(t.relid)), "
                "COALESCE(SUM(s.n_dead_tup), 0) FROM (SELECT relid FROM pg_partition_tree(%s) "
                "UNION SELECT to_regclass(%s)) t "
                "LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid",
                [table, table],
            )
            size, indexes, dead = cursor.fetchone()
            return int(size), int(indexes), int(dead)
        # InnoDB's persistent statistics are refreshed only after a tenth of the rows changed:
        # sample them again (a few pages, not a scan).
        cursor.execute(f"ANALYZE TABLE {connection.ops.quote_name(table)}")
        cursor.fetchall()
        cursor.execute(
            "SELECT data_length, index_length FROM information_schema.TABLES "
            "WHERE table_schema = DATABASE() AND table_name = %s",
            [table],
        )
        size, indexes = cursor.fetchone()
        return int(size), int(indexes), None


def prepare_table(mode: str, autovacuum: str, *, span: float, history: float) -> None:
    """The table as ``--mode`` and ``--autovacuum`` want it, before the relay starts."""
    from datetime import timedelta

    from django.db import connection

    from django_outbox.models import OutboxEvent
    from django_outbox.partitions import convert

    if connection.vendor != "postgresql":
        if mode == "partitioned" or autovacuum != "default":
            raise SystemExit("--mode partitioned and --autovacuum are PostgreSQL only")
        return
    if autovacuum == "tuned":
        table = connection.ops.quote_name(OutboxEvent._meta.db_table)
        with connection.cursor() as cursor:
            # Before a conversion: each partition takes the table's storage parameters.
            cursor.execute(f"ALTER TABLE {table} SET ({TUNED_AUTOVACUUM})")
    if mode == "partitioned":
        # A partition per purge interval, as a day per daily purge; a few spans ahead, so a
        # run that created none in time still finds them (the DEFAULT one catches the rest).
        convert(
            "default",
            span=timedelta(seconds=span),
            history=timedelta(seconds=history),
            ahead=3,
        )


def backlog() -> int:
    from django_outbox.models import OutboxEvent

    return OutboxEvent.objects.pending().count()


@dataclass
class Tenth:
    number: int
    ended: float = 0.0  # perf_counter when its last event was committed
    wall_ended: float = 0.0  # time.time() then
    size: int = 0
    indexes: int = 0
    dead: int | None = None
    backlog: int = 0
    emit: list[float] = field(default_factory=list)
    delivered: list[float] = field(default_factory=list)
    drain_rate: float = 0.0
    passes: list[Pass] = field(default_factory=list)
    emit_in_pass: float = 0.0  # the slowest emit that overlapped a retention pass
    emit_outside: float = 0.0  # the slowest emit that overlapped none: what the machine does


# -- the run ---------------------------------------------------------------------------------
class Writers:
    """``writers`` threads committing ``events`` events at ``rate``/s in all, one per
    transaction; per event: when its transaction began and when it had committed
    (time.time()), and how long it took (perf_counter)."""

    def __init__(self, events: int, rate: float, writers: int) -> None:
        self.events, self.rate, self.writers = events, rate, writers
        self.began = array.array("d", bytes(8 * events))
        self.took = array.array("d", bytes(8 * events))
        self.committed = array.array("d", bytes(8 * events))
        self.done = [0] * writers
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._write, args=(k,), daemon=True) for k in range(writers)
        ]

    def start(self) -> None:
        self.started, self.wall_started = time.perf_counter(), time.time()
        for thread in self.threads:
            thread.start()

    def emitted(self) -> int:
        return sum(self.done)

    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)

    def _write(self, first: int) -> None:
        from django.db import connection

        from django_outbox import outbox

        try:
            for i in range(first, self.events, self.writers):
                pause = self.started + i / self.rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                began = time.perf_counter()
                with outbox.atomic() as box:
                    emit_sample(box, i)
                self.took[i] = time.perf_counter() - began
                self.committed[i] = time.time()
                self.began[i] = self.committed[i] - self.took[i]
                self.done[first] += 1
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            connection.close()


def soak(
    env: dict[str, str],
    *,
    events: int,
    rate: float,
    writers: int,
    older_than_days: float | None,
    every: float,
    consumer_child: Consumer,
    vacuum: bool = False,
) -> list[Tenth]:
    from django.db import connection

    tenths = [Tenth(n + 1) for n in range(TENTHS)]
    bounds = [events * (n + 1) // TENTHS for n in range(TENTHS)]
    job = RetentionJob(env, every, older_than_days, vacuum)
    writing = Writers(events, rate, writers)
    writing.start()
    try:
        current = 0
        while current < TENTHS:
            if writing.errors:
                raise writing.errors[0]
            if writing.emitted() >= bounds[current] or not writing.alive():
                tenth = tenths[current]
                tenth.ended, tenth.wall_ended = time.perf_counter(), time.time()
                tenth.size, tenth.indexes, tenth.dead = table_figures()
                tenth.backlog = backlog()
                connection.close()
                print(
                    f"  tenth {tenth.number}: {bounds[current]:,} events in "
                    f"{tenth.ended - writing.started:,.0f} s, backlog {tenth.backlog:,}, "
                    f"table+indexes {(tenth.size + tenth.indexes) / 2**20:,.1f} MiB",
                    flush=True,
                )
                current += 1
                continue
            time.sleep(0.2)
        if writing.errors:
            raise writing.errors[0]
        achieved = events / (time.perf_counter() - writing.started)
        if achieved < 0.9 * rate:
            print(
                f"  the writers fell behind: {achieved:,.0f} events/s of {rate:g} offered "
                "(the machine is saturated; lower --rate)",
                flush=True,
            )
        _wait_drained(events / rate + 120)
    finally:
        job.stop()
    arrived = consumer_child.stop(events)
    missing = sum(1 for at in arrived if not at)
    if missing:
        raise RuntimeError(f"{missing:,} of {events:,} events never reached the consumer")
    wall_start = writing.wall_started
    for n, tenth in enumerate(tenths):
        first, last = (bounds[n - 1] if n else 0), bounds[n]
        tenth.emit = list(writing.took[first:last])
        tenth.delivered = [
            arrived[i] - writing.committed[i] for i in range(first, last) if writing.committed[i]
        ]
        began = tenths[n - 1].wall_ended if n else wall_start
        got = sum(1 for at in arrived if began <= at < tenth.wall_ended)
        tenth.drain_rate = got / max(1e-9, tenth.wall_ended - began)
        tenth.passes = [p for p in job.passes if began <= p.started < tenth.wall_ended]
    # The slowest emit overlapping each pass, wherever its tenth: the emits in the order
    # they began, and each pass looks at those that began in it or up to the longest emit
    # before it.
    order = sorted(range(events), key=writing.began.__getitem__)
    starts = [writing.began[i] for i in order]
    longest = max(writing.took)
    overlapping: set[int] = set()
    for p in job.passes:
        owner = next((t for t in tenths if p in t.passes), tenths[-1])
        low = bisect.bisect_left(starts, p.started - longest)
        high = bisect.bisect_right(starts, p.started + p.seconds)
        during = [i for i in order[low:high] if writing.began[i] + writing.took[i] > p.started]
        overlapping.update(during)
        slowest = max((writing.took[i] for i in during), default=0.0)
        owner.emit_in_pass = max(owner.emit_in_pass, slowest)
    # The same figure for the emits no pass overlapped: when it is as high, what made the
    # slowest emit in a pass slow was the machine, not the pass's locks.
    for n, tenth in enumerate(tenths):
        first, last = (bounds[n - 1] if n else 0), bounds[n]
        tenth.emit_outside = max(
            (writing.took[i] for i in range(first, last) if i not in overlapping), default=0.0
        )
    return tenths


def _wait_drained(timeout: float) -> None:
    from django.db import connection

    deadline = time.monotonic() + timeout
    while backlog():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the relay did not drain within {timeout:.0f} s")
        time.sleep(0.2)
    connection.close()
    time.sleep(1.0)  # the last confirms' deliveries reach the consumer


def print_tenths(tenths: list[Tenth]) -> None:
    print(
        f"{'tenth':>5} {'emit p50':>9} {'p99':>7} {'deliv p50':>10} {'p99':>7} "
        f"{'drain/s':>8} {'backlog':>8} {'table MiB':>10} {'index MiB':>10} {'dead tup':>9} "
        f"{'purges':>6} {'longest':>8} {'batch':>6} {'emit max in purge':>18}"
    )
    for t in tenths:
        longest = max((p.seconds for p in t.passes), default=0.0)
        batch = max((p.longest_batch for p in t.passes), default=0.0)
        print(
            f"{t.number:>5} {percentile(t.emit, 0.5) * 1000:7.1f}ms "
            f"{percentile(t.emit, 0.99) * 1000:5.1f}ms "
            f"{percentile(t.delivered, 0.5) * 1000:8.1f}ms "
            f"{percentile(t.delivered, 0.99) * 1000:5.0f}ms "
            f"{t.drain_rate:8,.0f} {t.backlog:8,} {t.size / 2**20:10,.1f} "
            f"{t.indexes / 2**20:10,.1f} {'-' if t.dead is None else f'{t.dead:,}':>9} "
            f"{len(t.passes):>6} {longest * 1000:6.0f}ms {batch * 1000:4.0f}ms "
            f"{t.emit_in_pass * 1000:16.1f}ms",
            flush=True,
        )


def print_targets(tenths: list[Tenth], window_tenth: int) -> None:
    """The issue's targets: last tenth against the first (the size against the first
    tenth by whose end the retention window had filled)."""
    first, last = tenths[0], tenths[-1]

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "n/a"

    emit = (percentile(last.emit, 0.99), percentile(first.emit, 0.99))
    delivered = (percentile(last.delivered, 0.99), percentile(first.delivered, 0.99))
    full = tenths[min(window_tenth, len(tenths)) - 1]
    size = (last.size + last.indexes, full.size + full.indexes)
    in_pass = max(t.emit_in_pass for t in tenths)
    outside = max(t.emit_outside for t in tenths)
    print("-- targets (last tenth against the first)")
    print(
        f"emit p99: {emit[0] * 1000:.1f} ms vs {emit[1] * 1000:.1f} ms = "
        f"{ratio(*emit)} (target <= 1.3x)"
    )
    print(
        f"commit -> delivered p99: {delivered[0] * 1000:.0f} ms vs "
        f"{delivered[1] * 1000:.0f} ms = {ratio(*delivered)} (target <= 1.3x)"
    )
    print(
        f"table + indexes: {size[0] / 2**20:,.1f} MiB at the end vs {size[1] / 2**20:,.1f} MiB "
        f"once the retention window had filled (tenth {full.number}) = {ratio(*size)} "
        "(target: bounded, not growing with the events passed)"
    )
    print(
        f"slowest emit overlapping a retention pass: {in_pass * 1000:.1f} ms (target <= 50 ms; "
        "an upper bound on what a pass's locks cost: anything else slow counts too); "
        f"slowest emit that overlapped no pass: {outside * 1000:.1f} ms",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few thousand events, for CI")
    p.add_argument("--events", type=int, default=2_000_000, help="events in all")
    p.add_argument("--rate", type=float, default=1000.0, help="emits/s in all")
    p.add_argument("--writers", type=int, default=8, help="threads emitting")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="default",
        help="default: SENT rows kept, purged in batches; delete: OUTBOX_RETENTION_DAYS = 0; "
        "partitioned: outbox_partition --convert, a partition per purge interval",
    )
    p.add_argument(
        "--autovacuum",
        choices=["default", "tuned", "job"],
        default="default",
        help="PostgreSQL: the server's autovacuum settings, the table's own (tuned), or a "
        "VACUUM of the table by the retention job after each pass (job)",
    )
    p.add_argument("--database", choices=sorted(SERVERS), default="postgres")
    p.add_argument("--database-url", default=None, help="the server (its database is unused)")
    p.add_argument("--url", default=DEFAULT_URL, help="AMQP URL (default: $AMQP_URL)")
    p.add_argument(
        "--retention", type=float, default=None, help="seconds SENT rows are kept (run/5)"
    )
    p.add_argument(
        "--retention-every", type=float, default=None, help="seconds between purges (retention/7)"
    )
    p.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--queue", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--retention-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--older-than-days", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.retention_child:
        retention_child(args.retention_every, args.older_than_days, args.autovacuum == "job")
        return
    if args.consumer:
        consumer(args.url, args.queue, args.out)
        return
    if args.smoke:
        args.events, args.rate, args.writers = SMOKE["events"], SMOKE["rate"], SMOKE["writers"]
        args.retention, args.retention_every = SMOKE["retention"], SMOKE["every"]
    duration = args.events / args.rate
    retention = args.retention or max(10.0, duration / 5)
    every = args.retention_every or retention / RUNS_PER_RETENTION
    server = server_url(args.database, args.database_url)
    relay_args = [] if args.database == "postgres" else ["--interval", "100ms"]
    print(
        f"soak bench: {args.database} {mask_url(server)}, mode {args.mode}, autovacuum "
        f"{args.autovacuum}, "
        f"{args.events:,} events at {args.rate:g}/s from {args.writers} writers "
        f"(~{duration / 60:.1f} min), SENT kept {retention:g} s, purge_outbox every {every:g} s",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    with bench_database(server) as database_url, soak_exchange(args.url) as ex:
        env = setup_django(database_url, ex, args.url)
        older_than_days = None if args.mode == "delete" else retention / 86400
        if args.mode == "delete":
            env["BENCH_RETENTION_DAYS"] = "0"
        prepare_table(args.mode, args.autovacuum, span=every, history=retention)
        relay = RelayChild(env, relay_args, None)
        code = 1
        consumer_child: Consumer | None = None
        try:
            _warm_up(relay, args.url, ex)
            consumer_child = Consumer(env, args.url, ex)
            tenths = soak(
                env,
                events=args.events,
                rate=args.rate,
                writers=args.writers,
                older_than_days=older_than_days,
                every=every,
                consumer_child=consumer_child,
                vacuum=args.autovacuum == "job",
            )
        finally:
            code = relay.stop()
            if consumer_child is not None:
                consumer_child.discard()
        print_tenths(tenths)
        # The first tenth by whose end SENT rows older than the window had started to go.
        window_tenth = min(TENTHS, int(retention / (duration / TENTHS)) + 2)
        print_targets(tenths, window_tenth)
    if code != 0:
        raise SystemExit(f"publish_outbox exited with {code}")


@contextlib.contextmanager
def soak_exchange(url: str) -> Iterator[str]:
    """As :func:`bench.common.bench_exchange`, with a connection of its own to declare and
    another to delete: one held idle through a soak is closed by the broker (heartbeats)."""
    import pika

    name = f"bench.soak.{uuid.uuid4().hex[:10]}"

    def channel_do(*calls: tuple[str, tuple[Any, ...], dict[str, Any]]) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(url))
        try:
            channel = connection.channel()
            for method, args, kwargs in calls:
                getattr(channel, method)(*args, **kwargs)
        finally:
            connection.close()

    channel_do(
        ("exchange_declare", (name,), {"exchange_type": "topic", "durable": True}),
        ("queue_declare", (name,), {"durable": True}),
        ("queue_bind", (name, name), {"routing_key": "#"}),
    )
    try:
        yield name
    finally:
        channel_do(("queue_delete", (name,), {}), ("exchange_delete", (name,), {}))


def _warm_up(relay: RelayChild, url: str, queue: str) -> None:
    """A few events through the relay (connected to the broker before the soak begins),
    then an empty queue for the consumer."""
    import pika

    from django_outbox import outbox
    from django_outbox.models import OutboxEvent, Status

    with outbox.atomic() as box:
        for i in range(10):
            box.emit("WARM_UP", payload={}, aggregate_type="bench", aggregate_id=f"warm-{i}")
    deadline = time.monotonic() + 60
    while OutboxEvent.objects.exclude(status=Status.SENT).exists():
        relay.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError("the relay did not send the warm-up events")
        time.sleep(0.05)
    broker = pika.BlockingConnection(pika.URLParameters(url))
    try:
        broker.channel().queue_purge(queue)
    finally:
        broker.close()


if __name__ == "__main__":
    main()
