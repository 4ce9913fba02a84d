"""Prometheus metrics of the relay and the compensator, and the outbox table's gauges.

Names follow django-prometheus: ``django_outbox_*``, counters end in ``_total``, durations
in ``_seconds``; labels are few and bounded. The relay calls the small functions below so
it never touches prometheus_client itself.

Two kinds of metric live here:

- **process counters** (published, failures, dead, latencies): each relay replica counts
  what *it* did; ``sum()`` them across replicas.
- **database gauges** (pending, dead, oldest pending age, blocked aggregates, scheduled):
  read from the outbox table at scrape time by :class:`OutboxCollector` through
  :mod:`django_outbox.gauges` (which the dashboard's figures use too). Every process that
  exposes them reports the *same* table, so aggregate them with ``max()``, never ``sum()``
  (docs/monitoring.md has the PromQL).

Every metric carries ``database``, the alias of the outbox it describes: a project whose
outbox lives in several databases runs a relay per alias and reads one gauge sample each.

The collector is registered on prometheus_client's default registry when the app is ready,
so django-prometheus's ``/metrics`` view in the web process serves it; the worker commands
serve the same registry on ``--metrics-port`` through :func:`start_metrics_server`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from django.db import connections
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("django_outbox.metrics")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)

EVENTS_PUBLISHED = Counter(
    "django_outbox_events_published_total",
    "Events confirmed by the broker and marked SENT.",
    ["event_type", "job", "database"],
)
PUBLISH_FAILURES = Counter(
    "django_outbox_publish_failures_total",
    "Failed publish attempts, by reason (unroutable, nacked, timeout, connection_lost, ...).",
    ["reason", "job", "database"],
)
EVENTS_DEAD = Counter(
    "django_outbox_events_dead_total",
    "Events that became DEAD (dead letters).",
    ["job", "database"],
)
COMMIT_TO_CONFIRM = Histogram(
    "django_outbox_commit_to_confirm_seconds",
    "Time from when the event became due (its creation, or its scheduled time; database "
    "clock) to its broker confirm.",
    ["database"],
    buckets=LATENCY_BUCKETS,
)
BATCH_DURATION = Histogram(
    "django_outbox_batch_duration_seconds",
    "Duration of one claim-publish-settle batch.",
    ["job", "database"],
)


# ``database`` is the alias of the outbox the relay works on (``--database``): one relay
# process per alias, so a project with several databases tells their figures apart.


def published(event_types: Iterable[str], job: str, database: str) -> None:
    counts: dict[str, int] = {}
    for event_type in event_types:
        counts[event_type] = counts.get(event_type, 0) + 1
    for event_type, n in counts.items():
        EVENTS_PUBLISHED.labels(event_type=event_type, job=job, database=database).inc(n)


def failed(reason: str, n: int, job: str, database: str) -> None:
    if n:
        PUBLISH_FAILURES.labels(reason=reason, job=job, database=database).inc(n)


def dead(n: int, job: str, database: str) -> None:
    if n:
        EVENTS_DEAD.labels(job=job, database=database).inc(n)


def confirm_latencies(seconds: Iterable[float], database: str) -> None:
    histogram = COMMIT_TO_CONFIRM.labels(database=database)
    for value in seconds:
        histogram.observe(max(value, 0.0))


def batch_duration(seconds: float, job: str, database: str) -> None:
    BATCH_DURATION.labels(job=job, database=database).observe(seconds)


# --- database gauges, read at scrape time ---------------------------------------------------

PENDING_EVENTS = "django_outbox_pending_events"
DEAD_EVENTS = "django_outbox_dead_events"
OLDEST_PENDING_AGE = "django_outbox_oldest_pending_age_seconds"
BLOCKED_AGGREGATES = "django_outbox_blocked_aggregates"
SCHEDULED_EVENTS = "django_outbox_scheduled_events"
DATABASE_UP = "django_outbox_database_up"
SCRAPE_DURATION = "django_outbox_stats_scrape_duration_seconds"

_GAUGE_HELP = {
    PENDING_EVENTS: (
        "Outbox rows in status PENDING, scheduled ones not due yet left out (database "
        "gauge: aggregate with max())."
    ),
    DEAD_EVENTS: "Outbox rows in status DEAD, waiting for triage (database gauge: max()).",
    OLDEST_PENDING_AGE: (
        "Seconds since the oldest PENDING row became due (was created, or reached its "
        "scheduled time), by the database clock; 0 when nothing is due (database gauge: "
        "max())."
    ),
    SCHEDULED_EVENTS: (
        "Outbox rows scheduled for later (emit(deliver_at=, delay=)) and not due yet "
        "(database gauge: max())."
    ),
    BLOCKED_AGGREGATES: (
        "Ordered mode: aggregates whose head event is DEAD, holding back their later events "
        "until it is requeued (database gauge: max())."
    ),
    DATABASE_UP: "1 if the outbox gauges were read from the database at this scrape, else 0.",
    SCRAPE_DURATION: "Seconds the outbox gauges' database queries took at this scrape.",
}


class OutboxCollector(Collector):
    """Reads the outbox gauges from the database each time Prometheus scrapes.

    One sample per outbox database, labelled ``database`` with its alias: ``using`` when
    given (a relay's ``--database``), else every alias of
    :func:`~django_outbox.gauges.outbox_databases`. A scrape never fails because of a
    database: one that cannot be read reports ``django_outbox_database_up 0`` and no other
    gauge (so an alert on them does not fire on stale numbers; alert on ``database_up`` or
    ``absent()`` instead).
    """

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def describe(self) -> Iterator[Metric]:
        # Without describe(), registering would call collect() and hit the database at
        # import time; the names alone are enough for the registry's duplicate check.
        for name, help_text in _GAUGE_HELP.items():
            yield GaugeMetricFamily(name, help_text, labels=["database"])

    def databases(self) -> list[str]:
        from .gauges import outbox_databases

        # At each scrape, not once: DATABASE_ROUTERS and OUTBOX_DATABASES are read at use.
        return [self.using] if self.using else outbox_databases()

    def collect(self) -> Iterator[Metric]:
        from .gauges import gauges

        families = {
            name: GaugeMetricFamily(name, help_text, labels=["database"])
            for name, help_text in _GAUGE_HELP.items()
        }
        for using in self.databases():
            started = time.monotonic()
            try:
                figures = gauges(using)
            except Exception as exc:  # any database trouble must not break the whole scrape
                logger.warning("Cannot read the outbox gauges from database %r: %s", using, exc)
                families[DATABASE_UP].add_metric([using], 0)
                continue
            elapsed = time.monotonic() - started
            for name, value in (
                (PENDING_EVENTS, figures.pending),
                (DEAD_EVENTS, figures.dead),
                (OLDEST_PENDING_AGE, figures.oldest_pending_age),
                (BLOCKED_AGGREGATES, figures.blocked_aggregates),
                (SCHEDULED_EVENTS, figures.scheduled),
                (DATABASE_UP, 1),
                (SCRAPE_DURATION, elapsed),
            ):
                families[name].add_metric([using], value)
        yield from (family for family in families.values() if family.samples)


_collector: OutboxCollector | None = None
_collector_lock = threading.Lock()


def register_collector(registry: CollectorRegistry = REGISTRY) -> OutboxCollector:
    """Register the database-gauge collector once on ``registry`` (idempotent).

    Called from ``OutboxConfig.ready()``; call it yourself only for a custom registry
    (then keep the returned collector to unregister it).
    """
    global _collector
    if registry is not REGISTRY:
        collector = OutboxCollector()
        registry.register(collector)
        return collector
    with _collector_lock:
        if _collector is None:
            _collector = OutboxCollector()
            REGISTRY.register(_collector)
        return _collector


class _ClosingRegistry:
    """The default registry, closing this thread's database connections after a scrape.

    prometheus_client's server answers each scrape in a fresh thread; Django opens one
    connection per thread, so without this every scrape would leave a connection behind.
    """

    def collect(self) -> Iterator[Metric]:
        try:
            yield from REGISTRY.collect()
        finally:
            connections.close_all()

    def restricted_registry(self, names: Iterable[str]) -> Any:
        return _RestrictedClosingRegistry(REGISTRY.restricted_registry(names))


class _RestrictedClosingRegistry:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self.inner.collect()
        finally:
            connections.close_all()


def start_metrics_server(port: int, addr: str = "0.0.0.0", *, using: str | None = None) -> Any:
    """Serve the metrics of this process on ``http://addr:port/metrics`` (daemon thread).

    Used by the worker commands' ``--metrics-port``; ``using`` (their ``--database``)
    limits the database gauges to that alias, the one the process works on. Returns the
    WSGI server; call its ``shutdown()`` and ``server_close()`` to stop it (tests do).
    Port 0 picks a free port (``server.server_port`` tells which).
    """
    from prometheus_client import start_wsgi_server

    register_collector().using = using
    server, _thread = start_wsgi_server(port, addr=addr, registry=_ClosingRegistry())  # type: ignore[arg-type]
    logger.info("Serving Prometheus metrics on %s:%d/metrics", addr, server.server_port)
    return server
