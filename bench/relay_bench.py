"""The relay end to end: publish_outbox on a real database and RabbitMQ, against raw pika.

One run measures, on its own database (created on the server, dropped afterwards) and its
own exchange and queue (deleted afterwards):

1. the baseline: raw pika publishing the same messages with pipelined confirms, no
   database (``bench.raw_pika``), once just before the drain and once just after; the
   baseline is their mean;
2. drain: a ``manage.py publish_outbox`` child process, already running and connected,
   is paused (``SIGSTOP``) while ``--count`` events are committed through ``emit()``, then
   resumed: events/s from ``SIGCONT`` to the last row's ``sent_at``, and the ratio to (1),
   measured back to back so both see the same machine load;
3. latency: a producer commits ``--rate`` events/s for ``--seconds`` through
   ``outbox.atomic()``/``emit()``, one event per transaction, from ``--producers``
   threads; per event the time from its
   commit to its ``sent_at`` (written in the settle, after the broker's confirm): p50/p99;
4. the relay child's peak RSS (``VmHWM``), and its RSS when idle before the first drain;
5. where the CPU went in (1) and (2), per event: the publisher or relay, RabbitMQ and the
   database server (whole processes, found by name on this machine). With all of them on
   a few cores, their sum bounds what the relay can reach, whatever the relay does;
6. what the database wrote per event, for the backlog's emits and for the drain: on
   PostgreSQL row versions (and how many updates were HOT, which add no index entry),
   index growth and WAL bytes/records/full-page images (``pg_stat_*``); on MariaDB the
   redo log.

    python -m bench.relay_bench [--smoke] [--count 20000] [--repeat 3] [--transport nats|redis]
        [--database postgres|mariadb] [--rate 500] [--seconds 10] [--producers 4] [--batch-size N]
        [--profile relay.prof]

``--transport nats`` runs the same on NATS JetStream (``--url``, default ``$NATS_URL``):
the baseline is nats-py's best asynchronous JetStream publish awaiting every ack
(``bench.raw_nats``), the relay publishes into a throwaway stream. ``--transport redis``
on Redis Streams (``--url``, default ``$REDIS_URL``): the baseline is redis-py's best
pipelined ``XADD`` (``bench.raw_redis``), the relay adds to throwaway streams.

With ``--repeat R`` every measurement runs R times; each run's lines are printed and the
medians last. The server comes from ``--database-url``, else ``PG_URL``/``MARIADB_URL``,
else ``DATABASE_URL`` when it names that kind of server, else the local default.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit, urlunsplit

from bench.common import (
    DEFAULT_URL,
    CpuMeter,
    analyze,
    count_from,
    emit_sample,
    parser,
    proc_status_kib,
    report,
    use_database,
)
from bench.raw_nats import DEFAULT_NATS_URL, bench_stream, best_raw_nats_rate, purge_stream
from bench.raw_pika import raw_pika_rate
from bench.raw_redis import DEFAULT_REDIS_URL, bench_streams, best_raw_redis_rate, purge_streams
from django_outbox.masking import mask_url

ROOT = Path(__file__).resolve().parents[1]
MANAGE = ROOT / "testproject" / "manage.py"
SERVERS = {
    "postgres": ("PG_URL", "postgres://postgres@127.0.0.1:5432/postgres", ("postgres",)),
    "mariadb": ("MARIADB_URL", "mysql://root@127.0.0.1:3306/mysql", ("mysql", "mariadb")),
}
SMOKE_SECONDS = 1.0


# -- the benchmark's own database -----------------------------------------------------------
def server_url(kind: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    env_name, default, schemes = SERVERS[kind]
    if os.environ.get(env_name):
        return os.environ[env_name]
    current = os.environ.get("DATABASE_URL", "")
    if urlsplit(current).scheme in schemes:
        return current
    return default


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))


def _admin_connection(url: str) -> Any:
    parts = urlsplit(url)
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    if parts.scheme.startswith("postgres"):
        import psycopg

        return psycopg.connect(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 5432,
            user=user or "postgres",
            password=password or None,
            dbname="postgres",
            autocommit=True,
        )
    import MySQLdb

    return MySQLdb.connect(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 3306,
        user=user or "root",
        password=password,
    )


@contextlib.contextmanager
def bench_database(url: str) -> Iterator[str]:
    """A fresh, uniquely named database on the server ``url`` points at; dropped afterwards.

    Yields the URL of the new database.
    """
    name = f"outbox_bench_{uuid.uuid4().hex[:8]}"
    postgres = urlsplit(url).scheme.startswith("postgres")
    quoted = f'"{name}"' if postgres else f"`{name}`"
    create = f"CREATE DATABASE {quoted}" + ("" if postgres else " CHARACTER SET utf8mb4")
    admin = _admin_connection(url)
    try:
        admin.cursor().execute(create)
        yield with_database(url, name)
    finally:
        from django.db import connections

        connections.close_all()
        drop = f"DROP DATABASE IF EXISTS {quoted}" + (" WITH (FORCE)" if postgres else "")
        admin.cursor().execute(drop)
        admin.close()


def setup_django(
    database_url: str, exchange: str, amqp_url: str, transport: str = "amqp"
) -> dict[str, str]:
    """Configure Django in this process; return the environment of the relay child."""
    for path in (str(ROOT), str(ROOT / "testproject")):
        if path not in sys.path:
            sys.path.insert(0, path)
    env = dict(os.environ)
    if transport == "nats":
        env.update(BENCH_TRANSPORT="nats", BENCH_BROKER_URL=amqp_url, BENCH_NATS_STREAM=exchange)
    if transport == "redis":
        env.update(BENCH_TRANSPORT="redis", BENCH_BROKER_URL=amqp_url)
    env.update(
        DJANGO_SETTINGS_MODULE="bench.settings",
        DATABASE_URL=database_url,
        BENCH_EXCHANGE=exchange,
        AMQP_URL=amqp_url,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT), str(ROOT / "testproject"), *filter(None, [env.get("PYTHONPATH")])]
        ),
        PYTHONUNBUFFERED="1",
    )
    os.environ.update(
        {
            k: env[k]
            for k in (
                "DJANGO_SETTINGS_MODULE",
                "DATABASE_URL",
                "BENCH_EXCHANGE",
                "BENCH_TRANSPORT",
                "BENCH_BROKER_URL",
                "BENCH_NATS_STREAM",
            )
            if k in env
        }
    )
    import django
    from django.apps import apps
    from django.conf import settings
    from django.core.management import call_command

    if apps.ready:  # after another bench in this interpreter (python -m bench)
        use_database(database_url)
        settings.OUTBOX_EXCHANGE = exchange
    django.setup()
    call_command("migrate", verbosity=0)
    return env


# -- the relay child -------------------------------------------------------------------------
class RelayChild:
    """``python testproject/manage.py publish_outbox`` running in a child process."""

    def __init__(self, env: dict[str, str], args: list[str], profile: str | None) -> None:
        command = [sys.executable]
        if profile:
            command += ["-m", "cProfile", "-o", profile]
        command += [str(MANAGE), "publish_outbox", *args]
        self.log: TextIO = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_mib(self) -> float:
        return proc_status_kib("VmRSS", self.pid) / 1024

    def peak_rss_mib(self) -> float:
        return proc_status_kib("VmHWM", self.pid) / 1024

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"publish_outbox exited with {self.process.returncode}:\n{self.output()}"
            )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        code = self.process.returncode
        if code != 0:
            print(f"publish_outbox exited with {code}:\n{self.output()}", file=sys.stderr)
        self.log.close()
        return code


# -- producing and waiting -------------------------------------------------------------------
def load_backlog(count: int, chunk: int = 1000) -> None:
    """Commit ``count`` events through emit(), ``chunk`` per transaction."""
    from django_outbox import outbox

    for start in range(0, count, chunk):
        with outbox.atomic() as box:
            for i in range(start, min(count, start + chunk)):
                emit_sample(box, i)


def wait_until_sent(relay: RelayChild, timeout: float) -> None:
    from django.db import connection

    from django_outbox.models import OutboxEvent, Status

    deadline = time.monotonic() + timeout
    while OutboxEvent.objects.exclude(status=Status.SENT).exists():
        relay.check_alive()
        if time.monotonic() > deadline:
            counts = OutboxEvent.objects.all().status_counts()
            raise RuntimeError(f"events not sent within {timeout:.0f} s: {counts}")
        time.sleep(0.05)
        connection.close_if_unusable_or_obsolete()


def last_sent_at() -> float:
    from django.db.models import Max

    from django_outbox.models import OutboxEvent

    value = OutboxEvent.objects.aggregate(last=Max("sent_at"))["last"]
    return float(value.timestamp())


def clear_outbox(amqp_url: str, queue: str, transport: str = "amqp") -> None:
    """Empty the table and the bench queue (or stream) so every run starts alike."""
    import pika
    from django.db import connection

    from django_outbox.models import OutboxEvent

    # TRUNCATE, not DELETE: deleted rows stay in the table and its indexes as dead tuples
    # until a vacuum, and each run would claim through more of them than the one before.
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE TABLE {connection.ops.quote_name(OutboxEvent._meta.db_table)}")
    if transport == "nats":
        purge_stream(amqp_url, queue)
        return
    if transport == "redis":
        purge_streams(amqp_url, queue)
        return
    broker = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        broker.channel().queue_purge(queue)
    finally:
        broker.close()


def warm_up(relay: RelayChild) -> None:
    """A few events through the relay, so it has connected to the broker before timing."""
    from django_outbox import outbox

    with outbox.atomic() as box:
        for i in range(10):
            emit_sample(box, i)
    wait_until_sent(relay, 60)


def measure_drain(
    relay: RelayChild, count: int, meter: CpuMeter, writes: tuple[WriteMeter, WriteMeter]
) -> float:
    """Events/s of the relay over a backlog of ``count`` events committed while it was
    paused (``SIGSTOP``, as if it had been down): from ``SIGCONT`` to the last ``sent_at``.
    ``meter`` counts the CPU used meanwhile; ``writes`` what the database wrote for the
    backlog's emits and for the drain.
    """
    emitted, drained = writes
    relay.process.send_signal(signal.SIGSTOP)
    try:
        emitted.start()
        load_backlog(count)
        emitted.stop()
        analyze()
        drained.start()
    finally:
        meter.start()
        resumed = time.time()
        relay.process.send_signal(signal.SIGCONT)
    wait_until_sent(relay, 120 + count / 50)
    meter.stop()
    rate = count / (last_sent_at() - resumed)
    drained.stop()
    return rate


class WriteMeter:
    """What the database wrote for the outbox between ``start()`` and ``stop()``, per event.

    PostgreSQL: row versions written (inserts, updates and how many were HOT: a HOT update
    adds no index entry), index pages grown, and the WAL (bytes, records, full-page images;
    server-wide, ``pg_stat_wal``, so the bench's database should be the only busy one).
    MariaDB: the redo log written (``Innodb_lsn_current``) and rows written (``Handler_*``),
    both server-wide.
    Each backend flushes its statistics a while after it goes idle (seen: over a second),
    so ``stop()`` waits until they stop changing, unless ``settle`` is off (``--smoke``,
    whose figures mean nothing: on a server others use they may never settle, and the wait
    was up to 30 s of the smoke run).
    """

    FLUSH_WAIT = 3.0

    def __init__(self, *, settle: bool = True) -> None:
        self.settle = settle
        self.before: dict[str, float] = {}
        self.delta: dict[str, float] = {}

    @staticmethod
    def _read() -> dict[str, float]:
        from django.db import connection

        from django_outbox.models import OutboxEvent

        table = OutboxEvent._meta.db_table
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_stat_clear_snapshot()")
                cursor.execute(
                    "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                    "WHERE relname = %s",
                    [table],
                )
                ins, upd, hot = cursor.fetchone()
                cursor.execute(
                    "SELECT coalesce(sum(pg_relation_size(indexrelid)), 0) FROM pg_index "
                    "WHERE indrelid = %s::regclass",
                    [table],
                )
                (index_bytes,) = cursor.fetchone()
                # The WAL position is exact at once; pg_stat_wal's counts wait for the flush.
                cursor.execute(
                    "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, wal_records, wal_fpi "
                    "FROM pg_stat_wal"
                )
                wal_bytes, wal_records, wal_fpi = cursor.fetchone()
                return {
                    "inserts": ins,
                    "updates": upd,
                    "hot": hot,
                    "index_bytes": index_bytes,
                    "wal_bytes": float(wal_bytes),
                    "wal_records": wal_records,
                    "wal_fpi": wal_fpi,
                }
            cursor.execute(
                "SHOW GLOBAL STATUS WHERE Variable_name IN "
                "('Innodb_lsn_current', 'Handler_update', 'Handler_write')"
            )
            return {name: float(value) for name, value in cursor.fetchall()}

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> None:
        # Read until two readings FLUSH_WAIT apart agree: every backend has flushed.
        after = self._read()
        for _ in range(5 if self.settle else 0):
            time.sleep(self.FLUSH_WAIT)
            again = self._read()
            if again == after:
                break
            after = again
        self.delta = {name: after[name] - self.before[name] for name in after}

    def per_event(self, count: int) -> str:
        d = {name: value / count for name, value in self.delta.items()}
        if "wal_bytes" in d:
            updates = self.delta["updates"]
            hot = self.delta["hot"] / updates if updates else 0.0
            return (
                f"rows written {d['inserts'] + d['updates']:.2f} ({d['inserts']:.2f} inserts, "
                f"{d['updates']:.2f} updates, {hot:.0%} HOT), index growth "
                f"{d['index_bytes']:,.0f} B, WAL {d['wal_bytes']:,.0f} B in "
                f"{d['wal_records']:.1f} records ({d['wal_fpi']:.2f} full-page images)"
            )
        if "Innodb_lsn_current" in d:
            return (
                f"rows written {d['Handler_write'] + d['Handler_update']:.2f} "
                f"({d['Handler_write']:.2f} inserts, {d['Handler_update']:.2f} updates), "
                f"redo log {d['Innodb_lsn_current']:,.0f} B"
            )
        return "n/a"


BROKER_PROCESS = ["-x", "beam.smp"]  # a local RabbitMQ
BROKER_PROCESSES = {
    "amqp": BROKER_PROCESS,
    "nats": ["-x", "nats-server"],
    "redis": ["-x", "redis-server"],
}
DATABASE_PROCESS = {"postgres": ["-x", "postgres"], "mariadb": ["-x", "mariadbd"]}


def cpu_line(baseline: CpuMeter, drain: CpuMeter, count: int) -> str:
    """Where the CPU went, per event, in both measurements: on a machine with few cores the
    relay's ceiling is the sum of these over the cores, not the publisher alone."""
    return (
        f"  CPU per event (server-wide, {os.cpu_count()} cores): baseline "
        f"{baseline.per_event(count) or 'n/a'}; drain {drain.per_event(count) or 'n/a'}"
    )


@dataclass
class Latency:
    offered: float
    achieved: float
    count: int
    p50: float
    p99: float
    worst: float

    def line(self) -> str:
        text = (
            f"{'commit -> SENT (confirmed) latency':<40}  offered {self.offered:,.0f}/s "
            f"(achieved {self.achieved:,.0f}/s, {self.count:,} events): "
            f"p50 {self.p50 * 1000:6.1f} ms  p99 {self.p99 * 1000:6.1f} ms  "
            f"max {self.worst * 1000:6.1f} ms"
        )
        if self.achieved < 0.9 * self.offered:
            text += "\n  (the producers fell behind the offered rate: the machine is saturated)"
        return text


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def measure_latency(relay: RelayChild, rate: float, seconds: float, producers: int) -> Latency:
    """Commit ``rate`` events/s, one per transaction, and time each one to its sent_at.

    ``producers`` threads (each with its own connection, like the workers of a web app)
    share the schedule: one thread cannot commit 500 transactions/s when every commit waits
    for the WAL flush.
    """
    import threading

    from django.db import connection

    from django_outbox import outbox
    from django_outbox.models import OutboxEvent

    total = max(1, int(rate * seconds))
    committed: dict[str, float] = {}
    errors: list[BaseException] = []
    started = time.perf_counter()

    def produce(first: int) -> None:
        try:
            for i in range(first, total, producers):
                pause = started + i / rate - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                with outbox.atomic() as box:
                    event = emit_sample(box, i)
                committed[event.event_id] = time.time()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    achieved = total / (time.perf_counter() - started)
    wait_until_sent(relay, 60 + seconds)
    rows = OutboxEvent.objects.filter(event_id__in=list(committed)).values_list(
        "event_id", "sent_at"
    )
    latencies = [sent_at.timestamp() - committed[event_id] for event_id, sent_at in rows]
    if len(latencies) != total:
        raise RuntimeError(f"{len(latencies)} of {total} events found sent")
    return Latency(
        rate,
        achieved,
        total,
        percentile(latencies, 0.50),
        percentile(latencies, 0.99),
        max(latencies),
    )


# -- the run ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--database", choices=sorted(SERVERS), default="postgres")
    p.add_argument("--database-url", default=None, help="the server (its database is unused)")
    p.add_argument("--rate", type=float, default=500.0, help="offered load, events/s")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of the offered load")
    p.add_argument("--producers", type=int, default=4, help="threads committing the load")
    p.add_argument("--batch-size", type=int, default=None, help="publish_outbox --batch-size")
    p.add_argument(
        "--interval",
        default=None,
        help="publish_outbox --interval (default: its own on PostgreSQL, 100ms on MariaDB, "
        "which has no NOTIFY to wake it)",
    )
    p.add_argument("--profile", default=None, help="run the relay under cProfile, to this file")
    p.add_argument(
        "--transport",
        choices=["amqp", "nats", "redis"],
        default="amqp",
        help="the broker: RabbitMQ (default), NATS JetStream (--url default $NATS_URL) or "
        "Redis Streams (--url default $REDIS_URL)",
    )
    args = p.parse_args(argv)
    nats = args.transport == "nats"
    on_redis = args.transport == "redis"
    if nats and args.url == DEFAULT_URL:
        args.url = DEFAULT_NATS_URL
    if on_redis and args.url == DEFAULT_URL:
        args.url = DEFAULT_REDIS_URL
    broker_process = BROKER_PROCESSES[args.transport]

    def raw_rate() -> float:
        if nats:
            return best_raw_nats_rate(count, url=args.url)
        if on_redis:
            return best_raw_redis_rate(count, url=args.url)
        return raw_pika_rate(count, url=args.url)

    baseline_name = {
        "nats": "raw nats-py (best window)",
        "redis": "raw redis-py (best pipeline depth)",
    }.get(args.transport, "raw pika (window 1000)")
    count = count_from(args)
    seconds = SMOKE_SECONDS if args.smoke else args.seconds
    server = server_url(args.database, args.database_url)
    relay_args = []
    if args.batch_size:
        relay_args += ["--batch-size", str(args.batch_size)]
    interval = args.interval or (None if args.database == "postgres" else "100ms")
    if interval:
        relay_args += ["--interval", interval]
    print(
        f"relay bench: {args.database} {mask_url(server)}, {mask_url(args.url)}, "
        f"{count:,} events, {args.repeat} run(s), publish_outbox {' '.join(relay_args)}",
        flush=True,
    )

    from bench.common import bench_exchange

    broker = (
        bench_stream(args.url, prefix="BENCH_RELAY")
        if nats
        else bench_streams(args.url, prefix="bench-relay")
        if on_redis
        else bench_exchange(args.url, prefix="bench.relay")
    )
    with bench_database(server) as database_url, broker as exchange:
        env = setup_django(database_url, exchange, args.url, args.transport)
        relay = RelayChild(env, relay_args, args.profile)
        code = 1
        try:
            warm_up(relay)
            # RabbitMQ publishes faster after its first run of this size (seen: raw pika
            # 11k -> 15k -> 18k events/s over three runs): one unmeasured round first, so
            # run 1 is compared with a broker as warm as in the runs after it.
            raw_rate()
            idle_rss = relay.rss_mib()
            ratios, drains, baselines, latencies = [], [], [], []
            for run in range(1, args.repeat + 1):
                clear_outbox(args.url, exchange, args.transport)
                baseline_cpu = CpuMeter({"publisher": [os.getpid()], "broker": broker_process})
                baseline_cpu.start()
                before = raw_rate()
                baseline_cpu.stop()
                drain_cpu = CpuMeter(
                    {
                        "relay": [relay.pid],
                        "broker": broker_process,
                        "database": DATABASE_PROCESS[args.database],
                    }
                )
                writes = (WriteMeter(settle=not args.smoke), WriteMeter(settle=not args.smoke))
                drain = measure_drain(relay, count, drain_cpu, writes)
                # The broker's speed drifts within a run (its queue, the disk, the other
                # process on the core): the baseline is the mean of one raw run just before
                # the drain and one just after, so a drift moves both sides of the ratio.
                after = raw_rate()
                baseline = (before + after) / 2
                clear_outbox(args.url, exchange, args.transport)
                latency = measure_latency(relay, args.rate, seconds, args.producers)
                baselines.append(baseline)
                drains.append(drain)
                ratios.append(drain / baseline)
                latencies.append(latency)
                print(f"-- run {run}")
                report(f"{baseline_name} = baseline", baseline, count=count)
                print(f"  (baseline before the drain {before:,.0f}/s, after it {after:,.0f}/s)")
                report(
                    "publish_outbox drain",
                    drain,
                    baseline=baseline,
                    count=count,
                    peak_rss=relay.peak_rss_mib(),
                )
                print(cpu_line(baseline_cpu, drain_cpu, count))
                print(f"  database writes per event: emit {writes[0].per_event(count)}")
                print(f"                             drain {writes[1].per_event(count)}")
                print(latency.line(), flush=True)
            peak = relay.peak_rss_mib()
        finally:
            code = relay.stop()
    if code != 0:
        raise SystemExit(f"publish_outbox exited with {code}")
    median = statistics.median
    print(f"-- median of {args.repeat} run(s)")
    report(f"{baseline_name} = baseline", median(baselines), count=count)
    print(
        f"{'publish_outbox drain':<40}  {median(drains):>10,.0f} events/s  {count:>8,} msgs  "
        f"peak RSS {peak:6.1f} MiB (idle {idle_rss:.1f})  ratio {median(ratios):5.2f}"
    )
    print(
        Latency(
            args.rate,
            median(x.achieved for x in latencies),
            latencies[0].count,
            median(x.p50 for x in latencies),
            median(x.p99 for x in latencies),
            max(x.worst for x in latencies),
        ).line()
    )
    if args.profile:
        import pstats

        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
