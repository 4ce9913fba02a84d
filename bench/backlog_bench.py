"""A big backlog against a small one: a claim's time and the drain rate, in one run.

For each backlog shape, the outbox is loaded with ``--small`` PENDING rows (10,000), then
emptied and loaded with ``--backlog`` rows (default 1,000,000 on PostgreSQL, 200,000 on
MariaDB), and each time measured:

1. claim: ``due().claim(--batch-size)`` then ``release()`` (no broker), ``--claims`` times:
   ms per claim, median. The rows go back, so every claim sees the same backlog;
2. drain: one relay on real RabbitMQ draining ``--drain`` events of that backlog
   (``Relay.drain(max_events=)``): events/s.

The shapes, written as live traffic writes them (one row after another, aggregates
interleaved):

* ``unordered``: ordered mode off;
* ``ordered``: ``OUTBOX_ORDERED`` over ``--aggregates`` aggregates (10,000), round robin;
* ``hot``: ``OUTBOX_ORDERED``, one aggregate holding the whole backlog (a hot aggregate
  behind a million: every claim that looks for heads finds one, runs of
  ``OUTBOX_ORDERED_RUN`` behind it).

The last lines give big / small for each figure (a claim's time: lower is better, the
target is at most 1.5x; the drain rate: small / big, same target). The rows are written by
the database itself (``generate_series`` on PostgreSQL, the ``seq_1_to_N`` sequence engine
on MariaDB): a million rows load in seconds, not through ``emit()``. It runs in its own
database (created next to ``DATABASE_URL``'s, migrated, dropped at the end) and its own
exchange and queue::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test python -m bench.backlog_bench
        [--smoke] [--backlog N] [--small 10000] [--aggregates 10000] [--drain 5000]
        [--claims 20] [--batch-size 100] [--shapes unordered,ordered,hot]

Numbers are only comparable on the same machine and load; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from bench.common import (
    DEFAULT_URL,
    SAMPLE_AGGREGATE_TYPE,
    SAMPLE_EVENT_TYPE,
    SAMPLE_PAYLOAD,
    Stopwatch,
    analyze,
    bench_exchange,
)
from bench.ordered_bench import setup_database

SHAPES = ("unordered", "ordered", "hot")
BACKLOG = {"postgresql": 1_000_000, "mysql": 200_000}
SMOKE = {"backlog": 3000, "small": 300, "aggregates": 50, "drain": 200, "claims": 3}


@dataclass
class Figures:
    rows: int
    claim_ms: float
    rate: float


def load(count: int, shape: str, aggregates: int) -> float:
    """Empty the outbox and write ``count`` PENDING rows of ``shape``, due now, as emit()
    writes them; returns the seconds it took (statistics refreshed, as autovacuum would)."""
    from django.db import connection

    from django_outbox.models import OutboxEvent

    quote = connection.ops.quote_name
    table = quote(OutboxEvent._meta.db_table)
    salt = uuid.uuid4().hex[:8]
    postgres = connection.vendor == "postgresql"
    n = "g" if postgres else "seq"
    text = (lambda e: f"({e})::text") if postgres else (lambda e: f"CAST({e} AS CHAR)")
    aggregate = {
        "unordered": text(n),
        "ordered": text(f"MOD({n}, {int(aggregates)})"),
        "hot": "'hot'",
    }[shape]
    now = "statement_timestamp()" if postgres else "NOW(6)"
    columns = (
        "event_id, event_type, aggregate_type, aggregate_id, payload, headers, occurred_at, "
        "status, retry_count, replay_count, next_retry_time, leased_until, lease_token, "
        "last_error, due_at, created_at, updated_at, sent_at"
    )
    event_id = f"md5('{salt}' || {n})" if postgres else f"MD5(CONCAT('{salt}', {n}))"
    values = (
        f"{event_id}, %s, %s, {aggregate}, %s, '{{}}', {now}, 0, 0, 0, {now}, {now}, '', '', "
        f"NULL, {now}, {now}, NULL"
    )
    source = (
        "generate_series(1, %s) AS g" if postgres else f"seq_1_to_{int(count)}"
    )  # MariaDB's sequence engine: a table of 1..N, no parameter
    params: list[object] = [SAMPLE_EVENT_TYPE, SAMPLE_AGGREGATE_TYPE, json.dumps(SAMPLE_PAYLOAD)]
    if postgres:
        params.append(count)
    with Stopwatch() as t:
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE TABLE {table}")
            cursor.execute(
                f"INSERT INTO {table} ({columns}) SELECT {values} FROM {source} ORDER BY {n}",
                params,
            )
        analyze()
    return t.seconds


def claim_ms(shape: str, batch_size: int, claims: int) -> float:
    """ms of a claim of ``batch_size`` (released at once), median of ``claims``."""
    from django.test.utils import override_settings

    from django_outbox import ordering
    from django_outbox.models import OutboxEvent

    events = OutboxEvent.objects.all()
    ordered = shape != "unordered"
    times = []
    with override_settings(OUTBOX_ORDERED=ordered):
        for _ in range(claims):
            started = time.perf_counter()
            token, rows = events.due().claim(
                batch_size, lease_seconds=60, ordered=ordered, run=ordering.current_run()
            )
            times.append((time.perf_counter() - started) * 1000)
            if not rows:
                raise RuntimeError("a claim found nothing: the backlog is not due")
            events.release(token, [row.pk for row in rows])
    return statistics.median(times)


def drain_rate(shape: str, count: int, *, url: str, batch_size: int) -> float:
    """Events/s of one relay draining ``count`` events of the backlog, on RabbitMQ."""
    from django.test.utils import override_settings

    from django_outbox.backends.pika import PikaBackend
    from django_outbox.relay import Relay

    with (
        bench_exchange(url, prefix="bench.backlog") as exchange,
        override_settings(OUTBOX_ORDERED=shape != "unordered"),
    ):
        relay = Relay(backend=PikaBackend(broker_url=url, exchange=exchange), batch_size=batch_size)
        relay.backend.open()  # connecting is not what is measured
        relay._opened = True
        try:
            with Stopwatch() as t:
                result = relay.drain(max_events=count)
        finally:
            relay.close()
    if result.sent != count:
        raise RuntimeError(f"drained {result.summary()} of {count} events")
    return count / t.seconds


def measure(shape: str, rows: int, args: argparse.Namespace) -> Figures:
    seconds = load(rows, shape, args.aggregates)
    claim = claim_ms(shape, args.batch_size, args.claims)
    rate = drain_rate(shape, min(args.drain, rows), url=args.url, batch_size=args.batch_size)
    print(
        f"  {shape:<10} {rows:>10,} rows (loaded in {seconds:5.1f} s): "
        f"claim {claim:8.2f} ms median, drain {rate:8,.0f} events/s",
        flush=True,
    )
    return Figures(rows, claim, rate)


def backlog_parser(description: str) -> argparse.ArgumentParser:
    """The options every bench of a small backlog against a big one takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script runs")
    p.add_argument(
        "--backlog", type=int, default=None, help="the big backlog (1M PostgreSQL, 200k MariaDB)"
    )
    p.add_argument("--small", type=int, default=10_000, help="the small backlog")
    return p


def start(args: argparse.Namespace, smoke: dict[str, int], details: str) -> tuple[Any, str, int]:
    """The sizes of ``--smoke`` applied, a fresh database (the connection, the name to
    give back) and the big backlog's size: ``--backlog``, or this database's default;
    printed with ``details``."""
    if args.smoke:
        for name, value in smoke.items():
            setattr(args, name, value)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    connection, old_name = setup_database()
    backlog = args.backlog or BACKLOG.get(connection.vendor, 200_000)
    print(
        f"database: {connection.vendor}, small {args.small:,}, big {backlog:,}, {details}",
        flush=True,
    )
    return connection, old_name, backlog


def main(argv: list[str] | None = None) -> None:
    p = backlog_parser(__doc__.splitlines()[0])
    p.add_argument("--aggregates", type=int, default=10_000, help="aggregates of 'ordered'")
    p.add_argument("--drain", type=int, default=5000, help="events drained per backlog")
    p.add_argument("--claims", type=int, default=20, help="claims timed per backlog")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES)
    )
    p.add_argument("--url", default=DEFAULT_URL, help="AMQP URL (default: $AMQP_URL)")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if unknown := set(shapes) - set(SHAPES):
        p.error(f"unknown shapes {sorted(unknown)}: choose among {', '.join(SHAPES)}")
    connection, old_name, backlog = start(
        args, SMOKE, f"batch size {args.batch_size}, drain {args.drain:,}"
    )
    try:
        ratios = []
        for shape in shapes:
            small = measure(shape, args.small, args)
            big = measure(shape, backlog, args)
            ratios.append((shape, big.claim_ms / small.claim_ms, small.rate / big.rate))
        print("big / small (target <= 1.5):")
        for shape, claim, rate in ratios:
            print(f"  {shape:<10} claim time {claim:5.2f}x, drain time per event {rate:5.2f}x")
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
