"""Helpers shared by the benchmark scripts: arguments, the sample message, timing, memory.

Conventions (every script in bench/ follows them):

* run from the repository root as a module: ``python -m bench.raw_pika [--smoke]``;
  ``python -m bench --smoke`` runs every script's smoke run in one interpreter (CI), so a
  script's ``main(argv)`` must run after another's in the same process: Django is then set
  up already, and :func:`use_database` points it at the script's own database;
* ``--smoke`` runs a few hundred messages: it proves the script works (CI, after a change),
  the figure it prints means nothing;
* ``--count N`` sets the number of messages, ``--url`` the broker (default ``AMQP_URL`` or
  the local guest account), ``--repeat R`` keeps the best of R runs;
* every figure is printed by :func:`report` as one aligned line: name, events/s, elapsed
  seconds, peak RSS, and the ratio to the baseline when there is one;
* every broker object a run needs is made by :func:`bench_exchange` with a unique name and
  deleted afterwards, so benchmarks can run against a shared RabbitMQ.

Numbers are only comparable on the same machine, broker and load; nothing here asserts a
speed.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

from django_outbox.masking import mask_url

DEFAULT_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SMOKE_COUNT = 300
DEFAULT_COUNT = 20_000

# A realistic outbox event: the payload an order service emits, and the aggregate fields
# that become headers. The raw baseline and the outbox benchmarks publish this same shape,
# so the messages on the wire are the same size.
SAMPLE_PAYLOAD: dict[str, Any] = {
    "order_id": 1234567,
    "customer_id": 98765,
    "status": "CREATED",
    "currency": "EUR",
    "total": "129.90",
    "items": [
        {"sku": "SKU-000123", "quantity": 2, "price": "39.95"},
        {"sku": "SKU-004567", "quantity": 1, "price": "50.00"},
    ],
    "shipping": {"country": "DE", "postcode": "10115", "method": "standard"},
}
SAMPLE_EVENT_TYPE = "ORDER_CREATED"
SAMPLE_AGGREGATE_TYPE = "orders.Order"
SAMPLE_OCCURRED_AT = datetime(2026, 5, 17, 8, 30, 15, 123456, tzinfo=timezone.utc)


def sample_headers(sequence: int) -> dict[str, Any]:
    """The headers an outbox event carries (django_outbox.message.encode_headers)."""
    return {
        "aggregate_type": SAMPLE_AGGREGATE_TYPE,
        "aggregate_id": str(sequence),
        "occurred_at": SAMPLE_OCCURRED_AT.isoformat(),
        "attempt": 1,
        "sequence": sequence,
    }


def emit_sample(box: Any, sequence: int) -> Any:
    """Emit the sample event of every bench, its aggregate id ``sequence``, through ``box``
    (an ``outbox.atomic()`` block or the ``outbox`` module)."""
    return box.emit(
        SAMPLE_EVENT_TYPE,
        payload=SAMPLE_PAYLOAD,
        aggregate_type=SAMPLE_AGGREGATE_TYPE,
        aggregate_id=sequence,
        occurred_at=SAMPLE_OCCURRED_AT,
    )


def parser(description: str, *, default_count: int = DEFAULT_COUNT) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help=f"only {SMOKE_COUNT} messages")
    p.add_argument("--count", type=int, default=default_count, help="messages per run")
    p.add_argument("--repeat", type=int, default=1, help="runs; the best one is reported")
    p.add_argument("--url", default=DEFAULT_URL, help="AMQP URL (default: $AMQP_URL)")
    return p


def count_from(args: argparse.Namespace) -> int:
    return SMOKE_COUNT if args.smoke else args.count


def sample_row(aggregate_id: int, **fields: Any) -> Any:
    """An unsaved OutboxEvent of the sample event, its aggregate id ``aggregate_id``;
    ``fields`` set the rest (``pk``, ``created_at``...)."""
    from django_outbox.models import OutboxEvent

    return OutboxEvent(
        event_id=uuid.uuid4().hex,
        event_type=SAMPLE_EVENT_TYPE,
        aggregate_type=SAMPLE_AGGREGATE_TYPE,
        aggregate_id=str(aggregate_id),
        payload=SAMPLE_PAYLOAD,
        occurred_at=SAMPLE_OCCURRED_AT,
        **fields,
    )


def main_of_a_raw_client(
    argv: list[str] | None, doc: str, client: str, rate: Callable[..., float], **knob: Any
) -> None:
    """The ``main()`` of a raw client's baseline, ``rate(count, url=, <knob>=)``: the one
    keyword ``knob`` names the setting tried and its default values (0: no limit), e.g.
    ``window=(0, 1000)``; ``--<knob>s`` takes a comma list of them. One report line per
    value, the best of ``--repeat``; ``--url`` defaults to ``rate``'s own. ``doc`` is the
    script's docstring, ``client`` names the client in the output."""
    ((name, values),) = knob.items()
    p = parser(doc.splitlines()[0])
    p.set_defaults(url=inspect.signature(rate).parameters["url"].default)
    p.add_argument(f"--{name}s", default=",".join(map(str, values)))
    args = p.parse_args(argv)
    count = count_from(args)
    print(f"{client}: {mask_url(args.url)}, {count:,} messages, {args.repeat} run(s)")
    for value in (int(v) for v in getattr(args, f"{name}s").split(",")):
        best = best_of(args.repeat, lambda v=value: rate(count, url=args.url, **{name: v}))
        report(f"{client}, {name} {value or 'all'}", best, count=count)


# -- timing and memory -------------------------------------------------------------------
@dataclass
class Measurement:
    name: str
    count: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("inf")


class Stopwatch:
    """``with Stopwatch() as t: ...``; then ``t.seconds`` (monotonic, high resolution)."""

    def __enter__(self) -> Stopwatch:
        self.started = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started


def publish_rate(backend: Any, batches: list[list[Any]]) -> float:
    """Events/s of ``backend.publish()`` over ``batches``, as the relay hands them over.

    The backend is opened first (connecting is not what is measured: the relay connects
    once) and closed after; any failed event stops the run, since a rate of failures means
    nothing.
    """
    backend.open()
    try:
        with Stopwatch() as t:
            for batch in batches:
                results = backend.publish(batch)
                if not all(r.ok for r in results):
                    failed = next(r for r in results if not r.ok)
                    raise RuntimeError(f"publish failed: {failed.reason}: {failed.error}")
    finally:
        backend.close()
    return sum(len(b) for b in batches) / t.seconds


def best_of(repeat: int, run: Callable[[], float]) -> float:
    """Run ``run`` (which returns events/s) ``repeat`` times and keep the fastest."""
    return max(run() for _ in range(max(1, repeat)))


def proc_status_kib(field: str, pid: int | str = "self") -> int:
    """A ``VmRSS``/``VmHWM`` figure of a process (this one by default) in KiB, from /proc."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def proc_cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds a process has used, from /proc (0 where it is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds used between ``start()`` and ``stop()`` by groups of processes, each
    found by ``pgrep`` arguments (``["-x", "beam.smp"]``) or given as pids.

    Server-wide: a database or broker serving others meanwhile is counted too. Processes
    that start or end in between are not counted.
    """

    def __init__(self, groups: dict[str, list[str] | list[int]]) -> None:
        self.groups = groups
        self.used: dict[str, float] = {}
        self._pids: dict[str, list[int | str]] = {}
        self._start: dict[tuple[str, int | str], float] = {}

    @staticmethod
    def _find(spec: list[str] | list[int]) -> list[int | str]:
        if all(isinstance(item, int) for item in spec):
            return list(spec)
        found = subprocess.run(["pgrep", *map(str, spec)], capture_output=True, text=True)
        return list(found.stdout.split())

    def start(self) -> None:
        for name, spec in self.groups.items():
            self._pids[name] = self._find(spec)
            self._start.update({(name, p): proc_cpu_seconds(p) for p in self._pids[name]})

    def stop(self) -> dict[str, float]:
        self.used = {
            # A process gone meanwhile reads 0: it counts nothing rather than a negative.
            name: sum(
                max(0.0, proc_cpu_seconds(p) - self._start[name, p]) for p in self._pids[name]
            )
            for name in self.groups
        }
        return self.used

    def per_event(self, count: int) -> str:
        """``relay 160 us, broker 146 us, ...`` per event, or '' when nothing was found."""
        parts = [
            f"{name} {seconds / count * 1e6:,.0f} us"
            for name, seconds in self.used.items()
            if self._pids.get(name) and count
        ]
        return ", ".join(parts)


def rss_mib() -> float:
    """Current resident memory of this process, MiB (0 where /proc is missing)."""
    return proc_status_kib("VmRSS") / 1024


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB."""
    peak = proc_status_kib("VmHWM")
    if not peak:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return peak / 1024


def report(
    name: str,
    rate: float,
    *,
    baseline: float | None = None,
    count: int = 0,
    peak_rss: float | None = None,
) -> str:
    """Print (and return) one result line; the ratio is ``rate / baseline``.

    ``peak_rss`` (MiB) is that of the process measured, when it is not this one.
    """
    parts = [f"{name:<40}", f"{rate:>10,.0f} events/s"]
    if count:
        parts.append(f"{count:>8,} msgs")
    parts.append(f"peak RSS {peak_rss_mib() if peak_rss is None else peak_rss:6.1f} MiB")
    if baseline:
        parts.append(f"ratio {rate / baseline:5.2f}")
    line = "  ".join(parts)
    print(line, flush=True)
    return line


# -- broker objects -----------------------------------------------------------------------
@contextlib.contextmanager
def bench_exchange(url: str = DEFAULT_URL, *, prefix: str = "bench") -> Iterator[str]:
    """A unique durable topic exchange with one durable queue bound to ``#``; both are
    deleted afterwards. Yields the exchange name.

    The queue is durable and the messages persistent, so confirms cost what they cost in
    production (RabbitMQ confirms a persistent message once it is written to disk).
    """
    import pika

    name = f"{prefix}.{uuid.uuid4().hex[:10]}"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.exchange_declare(name, exchange_type="topic", durable=True)
        channel.queue_declare(name, durable=True)
        channel.queue_bind(name, name, routing_key="#")
        try:
            yield name
        finally:
            channel.queue_delete(name)
            channel.exchange_delete(name)
    finally:
        connection.close()


def analyze() -> None:
    """Refresh the table's statistics, as autovacuum/autoanalyze would have by then."""
    from django.db import connection

    from django_outbox.models import OutboxEvent

    table = connection.ops.quote_name(OutboxEvent._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"ANALYZE {table}" if connection.vendor == "postgresql" else f"ANALYZE TABLE {table}"
        )
        if connection.vendor != "postgresql":
            cursor.fetchall()


def use_database(url: str) -> None:
    """Point this process's default database at the database ``url`` names.

    For a script that runs after another in the same interpreter (``python -m bench``):
    Django keeps the settings it was set up with, and only the database name changes (the
    server must be the same; a fresh database of the script's own, as
    ``relay_bench.bench_database()`` makes). As Django's test runner does with its test
    database.
    """
    from django.conf import settings
    from django.db import connections

    schemes = {"postgresql": ("postgres",), "mysql": ("mysql", "mariadb")}
    vendor = connections["default"].vendor
    if not urlsplit(url).scheme.startswith(schemes.get(vendor, (vendor,))):
        raise SystemExit(f"{mask_url(url)} is not on the {vendor} server Django was set up with")
    name = urlsplit(url).path.lstrip("/")
    connections.close_all()
    settings.DATABASES["default"]["NAME"] = name
    connections["default"].settings_dict["NAME"] = name


def setup_django(settings_module: str | None = None) -> None:
    """Configure Django for a benchmark that needs the models but no database.

    With ``settings_module`` (or ``DJANGO_SETTINGS_MODULE``) that module is used; otherwise
    a minimal in-memory configuration with django_outbox installed.
    """
    import django
    from django.conf import settings

    if settings_module:
        os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        settings.configure(
            INSTALLED_APPS=["django.contrib.contenttypes", "django_outbox"],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
            USE_TZ=True,
            LOGGING_CONFIG=None,
        )
    django.setup()
