"""Ordered mode's drain rate against unordered, same backlog, one relay, real RabbitMQ.

Two backlogs, each drained once unordered (the baseline) and once with ``OUTBOX_ORDERED``:

* many aggregates: 1,000 aggregates x 20 events, written round by round (every aggregate
  gets its n-th event before any gets its n+1-th, in a shuffled order), as live traffic
  interleaves them;
* a hot aggregate: 1 aggregate x 5,000 events. Ordered, a batch holds the aggregate's head
  and a run behind it (``OUTBOX_ORDERED_RUN``), published one event at a time, each after
  the previous one's confirm: the rate is bounded by the broker's confirm round trip
  (``--run 1``: heads only, one claim-publish-confirm-settle round trip per event).
  ``--behind N`` queues N more events of the hot aggregate behind the 5,000 drained (a
  backlog after an outage): what each claim costs as the backlog grows.

It runs in its own database (created next to ``DATABASE_URL``'s, migrated, dropped at the
end) and its own exchange and queue (deleted at the end)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test python -m bench.ordered_bench
        [--smoke] [--aggregates 1000] [--events 20] [--hot 5000] [--batch-size 100]
        [--repeat 1] [--run 100] [--behind 0]
"""

from __future__ import annotations

import os
import random
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from bench.backend_bench import backend_rate
from bench.common import (
    Stopwatch,
    analyze,
    bench_exchange,
    best_of,
    parser,
    report,
    sample_row,
)

SMOKE = {"aggregates": 50, "events": 6, "hot": 100}


def setup_database() -> tuple[Any, str]:
    """Django on the demo's settings, in a fresh database named for this run."""
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root / "testproject")]
    os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    import django
    from django.apps import apps
    from django.conf import settings

    if not apps.ready:  # alone; after another bench (python -m bench) Django keeps its own
        os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"

    name = f"bench_ordered_{uuid.uuid4().hex[:8]}"
    if "sqlite" in settings.DATABASES["default"]["ENGINE"]:
        raise SystemExit("ordered_bench needs PostgreSQL or MariaDB (DATABASE_URL)")
    settings.DATABASES["default"].setdefault("TEST", {})["NAME"] = name
    settings.LOGGING_CONFIG = None
    django.setup()
    from django.db import connection

    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True)
    return connection, old_name


def write_backlog(aggregates: int, events: int, seed: int = 9) -> int:
    from django.utils import timezone

    from django_outbox.models import OutboxEvent

    rng = random.Random(seed)
    now = timezone.now()
    rows = []
    for _n in range(events):
        order = list(range(aggregates))
        rng.shuffle(order)
        rows += [sample_row(a, created_at=now, next_retry_time=now) for a in order]
    OutboxEvent.objects.bulk_create(rows, batch_size=2000)
    return len(rows)


def drain_rate(
    aggregates: int,
    events: int,
    *,
    ordered: bool,
    url: str,
    batch_size: int,
    run: int = 100,
    behind: int = 0,
) -> float:
    """Events/s of one relay draining the backlog (writing it is not measured); with
    ``behind`` (one aggregate), as many more events left queued behind the ones drained."""
    from django.test.utils import override_settings

    from django_outbox.backends.pika import PikaBackend
    from django_outbox.models import OutboxEvent
    from django_outbox.relay import Relay

    OutboxEvent.objects.all().delete()
    count = write_backlog(aggregates, events + behind) - behind
    if behind:  # a backlog that built up: statistics as autovacuum would have them
        analyze()
    with (
        bench_exchange(url, prefix="bench.ordered") as exchange,
        override_settings(OUTBOX_ORDERED=ordered, OUTBOX_ORDERED_RUN=run),
    ):
        relay = Relay(backend=PikaBackend(broker_url=url, exchange=exchange), batch_size=batch_size)
        relay.backend.open()  # connecting is not what is measured
        relay._opened = True
        try:
            with Stopwatch() as t:
                result = relay.drain(max_events=count)
        finally:
            relay.close()
    if result.sent != count or OutboxEvent.objects.pending().count() != behind:
        raise RuntimeError(f"drained {result.summary()} of {count} events")
    return count / t.seconds


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--aggregates", type=int, default=1000)
    p.add_argument("--events", type=int, default=20, help="events per aggregate")
    p.add_argument("--hot", type=int, default=5000, help="events of the hot aggregate")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument(
        "--run", type=int, default=100, help="OUTBOX_ORDERED_RUN (1: heads only, as before runs)"
    )
    p.add_argument(
        "--behind", type=int, default=0, help="events queued behind the hot aggregate's drain"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.aggregates, args.events, args.hot = (
            SMOKE["aggregates"],
            SMOKE["events"],
            SMOKE["hot"],
        )
    # A SIGTERM (e.g. `timeout`) still drops the database, the exchange and the queue.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    connection, old_name = setup_database()
    print(
        f"database: {connection.vendor}, batch size {args.batch_size}, "
        f"OUTBOX_ORDERED_RUN {args.run}",
        flush=True,
    )
    hot_behind = f", {args.behind:,} behind" if args.behind else ""
    try:
        for label, aggregates, events in (
            (f"many aggregates ({args.aggregates} x {args.events})", args.aggregates, args.events),
            (f"hot aggregate (1 x {args.hot}{hot_behind})", 1, args.hot),
        ):
            behind = args.behind if aggregates == 1 else 0
            count = aggregates * events
            rates = {
                ordered: best_of(
                    args.repeat,
                    lambda a=aggregates, e=events, o=ordered, b=behind: drain_rate(
                        a,
                        e,
                        ordered=o,
                        url=args.url,
                        batch_size=args.batch_size,
                        run=args.run,
                        behind=b,
                    ),
                )
                for ordered in (False, True)
            }
            report(f"{label}, unordered = baseline", rates[False], count=count)
            report(f"{label}, ordered", rates[True], baseline=rates[False], count=count)
        # What bounds a hot aggregate: each of its events waits for the previous one's
        # confirm, so it cannot drain faster than PikaBackend publishing one event at a
        # time (measured here, after the drains, under the same load).
        bound_count = min(args.hot, 2000)
        bound = best_of(args.repeat, lambda: backend_rate(bound_count, url=args.url, batch_size=1))
        report("one publish + confirm at a time (the bound)", bound, count=bound_count)
        report("hot aggregate, ordered / the bound", rates[True], baseline=bound, count=count)
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
