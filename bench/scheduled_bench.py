"""A backlog of scheduled events against the relay's claim, the gauges and emit().

Scheduled events (``emit(deliver_at=, delay=)``) wait in the table as PENDING rows, with
lower ids than the due rows emitted after them. This measures, with and without a backlog
of ``--scheduled`` events due in a week written first, in the same database:

1. claim: one relay claiming and settling ``--due`` due rows, ``--batch-size`` a claim
   (``due().claim()`` then ``mark_sent()``, no broker): ms per claim, median; and the plan
   of the claim query (EXPLAIN), to see whether it walks the scheduled rows;
2. gauges: ``stats.gauges()``, what every Prometheus scrape and admin page reads: ms, median;
3. emit: ``outbox.atomic()`` blocks of 1,000 events, unscheduled and all scheduled
   (``delay``): ms per block, median.

It runs in its own database (created next to ``DATABASE_URL``'s, migrated, dropped at the
end); no broker::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test python -m bench.scheduled_bench
        [--smoke] [--scheduled 100000] [--due 5000] [--batch-size 100]

Numbers are only comparable on the same machine and load; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
import uuid
from datetime import timedelta

from bench.common import SAMPLE_AGGREGATE_TYPE, SAMPLE_EVENT_TYPE, SAMPLE_PAYLOAD, analyze
from bench.ordered_bench import setup_database

SMOKE = {"scheduled": 2000, "due": 300}


def write_scheduled(count: int) -> None:
    """``count`` rows due in a week, written as emit() writes them (``new_pending``)."""
    from django.utils import timezone

    from django_outbox.models import OutboxEvent

    now = timezone.now()
    for start in range(0, count, 5000):
        OutboxEvent.objects.bulk_create(
            [
                OutboxEvent.objects.new_pending(
                    delay=timedelta(days=7),
                    event_id=uuid.uuid4().hex,
                    event_type="REMINDER",
                    aggregate_type=SAMPLE_AGGREGATE_TYPE,
                    aggregate_id=str(i),
                    payload=SAMPLE_PAYLOAD,
                    occurred_at=now,
                )
                for i in range(start, min(start + 5000, count))
            ]
        )


def emit_blocks(blocks: int, **schedule: object) -> list[float]:
    """ms of each of ``blocks`` outbox.atomic() blocks of 1,000 events."""
    from django_outbox import outbox

    times = []
    for _ in range(blocks):
        started = time.perf_counter()
        with outbox.atomic() as box:
            for i in range(1000):
                box.emit(SAMPLE_EVENT_TYPE, payload=SAMPLE_PAYLOAD, aggregate_id=i, **schedule)
        times.append((time.perf_counter() - started) * 1000)
    return times


def claim_times(batch_size: int) -> list[float]:
    """ms of each claim (and its settle) while due rows remain."""
    from django_outbox.models import OutboxEvent

    events = OutboxEvent.objects.all()
    times = []
    while True:
        started = time.perf_counter()
        token, rows = events.due().claim(batch_size, lease_seconds=60, ordered=False)
        if not rows:
            break
        events.mark_sent(token, [row.pk for row in rows])
        times.append((time.perf_counter() - started) * 1000)
    return times


def claim_plan(batch_size: int) -> str:
    """EXPLAIN of the claim: PostgreSQL's UPDATE ... RETURNING, MySQL/MariaDB's locking
    SELECT (their lease UPDATE is by primary key)."""
    from django.db import connection, transaction

    from django_outbox.models import OutboxEvent

    events = OutboxEvent.objects.all()
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            sql, params = events._lease_sql(events.due(), batch_size, 60, "plan")
        else:
            locked = events.due().select_for_update(skip_locked=True).order_by("id")
            query = locked.values("id")[:batch_size].query
            sql, params = query.get_compiler(using="default").as_sql()
        cursor.execute(f"EXPLAIN {sql}", params)
        rows = cursor.fetchall()
        transaction.set_rollback(True)
    return "\n".join("    " + " | ".join(str(c) for c in row) for row in rows)


def gauge_times(repeat: int = 9) -> list[float]:
    from django_outbox import stats

    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        stats.gauges()
        times.append((time.perf_counter() - started) * 1000)
    return times


def measure(label: str, args: argparse.Namespace) -> None:
    from django_outbox.models import OutboxEvent

    # Due rows, emitted after the scheduled ones: higher ids.
    emit_times = emit_blocks(max(1, args.due // 1000))
    scheduled_emit = emit_blocks(3, delay=timedelta(days=7))
    OutboxEvent.objects.scheduled().filter(event_type=SAMPLE_EVENT_TYPE).delete()
    gauges = gauge_times()
    plan = claim_plan(args.batch_size)
    claims = claim_times(args.batch_size)
    print(f"{label}:")
    print(f"  claim+settle of {args.batch_size}: {statistics.median(claims):.2f} ms median")
    print(f"  gauges(): {statistics.median(gauges):.2f} ms median")
    print(f"  emit block of 1,000, unscheduled: {statistics.median(emit_times):.1f} ms median")
    print(f"  emit block of 1,000, delay=:     {statistics.median(scheduled_emit):.1f} ms median")
    print(f"  claim plan:\n{plan}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script runs")
    p.add_argument("--scheduled", type=int, default=100_000)
    p.add_argument("--due", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=100)
    args = p.parse_args(argv)
    if args.smoke:
        args.scheduled, args.due = SMOKE["scheduled"], SMOKE["due"]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    connection, old_name = setup_database()
    print(f"database: {connection.vendor}", flush=True)
    try:
        measure("no scheduled backlog", args)
        write_scheduled(args.scheduled)
        analyze()  # statistics as autovacuum would have them
        measure(f"{args.scheduled} scheduled events waiting, lower ids", args)
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
