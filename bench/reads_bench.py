"""What a big backlog costs the outbox's readers: the five reads that must answer in under a
second with a million PENDING rows (issue 31), each at ``--small`` rows and at ``--backlog``.

The outbox is loaded as ``backlog_bench`` loads it (PENDING rows due now, written by the
database itself, statistics refreshed), first ``--small`` rows (10,000), then ``--backlog``
(default 1,000,000 on PostgreSQL, 200,000 on MariaDB), and each read is timed ``--repeat``
times (median, ms):

1. ``start-up``: a relay built (in-memory backend, no broker) until its first batch is
   settled: ``Relay(...)`` then ``drain(max_events=batch size)``;
2. ``outbox_stats``: ``manage.py outbox_stats`` (``call_command``);
3. ``gauges``: one Prometheus scrape of the outbox collector (``OutboxCollector.collect()``);
4. ``changelist``: ``GET /admin/django_outbox/outboxevent/`` as a superuser (Django's test
   client: the whole view, template included);
5. ``dashboard``: ``GET /admin/django_outbox/outboxevent/dashboard/``, the same way.

::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test python -m bench.reads_bench
        [--smoke] [--backlog N] [--small 10000] [--repeat 5] [--batch-size 1000]

It runs in its own database (created next to ``DATABASE_URL``'s, migrated, dropped at the
end). Numbers are only comparable on the same machine and load; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable

from bench.backlog_bench import backlog_parser, load, start

READS = ("start-up", "outbox_stats", "gauges", "changelist", "dashboard")
SMOKE = {"backlog": 3000, "small": 300, "repeat": 1}
#: The target of issue 31, per read, with a million rows.
TARGET_MS = 1000.0


def readers(batch_size: int) -> dict[str, Callable[[], object]]:
    """One callable per read, each doing the whole read once."""
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client
    from django.urls import reverse

    from django_outbox.backends.locmem import LocmemBackend
    from django_outbox.metrics import OutboxCollector
    from django_outbox.relay import Relay

    user_model = get_user_model()
    user = user_model.objects.filter(username="bench-admin").first()
    if user is None:
        user = user_model.objects.create_superuser("bench-admin", "bench@example.com", "x")
    client = Client()
    client.force_login(user)
    changelist = reverse("admin:django_outbox_outboxevent_changelist")
    dashboard = reverse("admin:django_outbox_outboxevent_dashboard")

    def start_up() -> object:
        relay = Relay(backend=LocmemBackend(), batch_size=batch_size)
        try:
            result = relay.drain(max_events=batch_size)
        finally:
            relay.close()
        if not result.sent:
            raise RuntimeError(f"the relay's first pass sent nothing: {result.summary()}")
        return result

    def get(url: str) -> Callable[[], object]:
        def read() -> object:
            response = client.get(url)
            if response.status_code != 200:
                raise RuntimeError(f"GET {url}: {response.status_code}")
            return response.content

        return read

    return {
        "start-up": start_up,
        "outbox_stats": lambda: call_command("outbox_stats", stdout=io.StringIO()),
        "gauges": lambda: list(OutboxCollector().collect()),
        "changelist": get(changelist),
        "dashboard": get(dashboard),
    }


def measure(rows: int, args: argparse.Namespace) -> dict[str, float]:
    """Load ``rows`` PENDING rows, then time each read: ms, median of ``--repeat``."""
    seconds = load(rows, "unordered", 1)
    reads = readers(args.batch_size)
    figures = {}
    for name in READS:
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            reads[name]()
            times.append((time.perf_counter() - started) * 1000)
        figures[name] = statistics.median(times)
    line = ", ".join(f"{name} {ms:7.1f}" for name, ms in figures.items())
    print(f"  {rows:>10,} rows (loaded in {seconds:5.1f} s), ms: {line}", flush=True)
    return figures


def main(argv: list[str] | None = None) -> None:
    p = backlog_parser(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="times each read is timed (median)")
    p.add_argument("--batch-size", type=int, default=1000, help="the relay's first batch")
    args = p.parse_args(argv)
    connection, old_name, backlog = start(args, SMOKE, f"median of {args.repeat}")
    try:
        small = measure(args.small, args)
        big = measure(backlog, args)
        print(f"with {backlog:,} rows (target < {TARGET_MS:.0f} ms), big / small:")
        for name in READS:
            mark = "ok" if big[name] < TARGET_MS else "OVER"
            print(
                f"  {name:<13} {big[name]:8.1f} ms  {mark:<4}  "
                f"{big[name] / max(small[name], 0.001):6.1f}x"
            )
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
