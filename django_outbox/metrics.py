"""Prometheus metrics of the relay and the compensator.

Names follow django-prometheus: ``django_outbox_*``, counters end in ``_total``, durations
in ``_seconds``; labels are few and bounded. The relay calls the small functions below so
it never touches prometheus_client itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)

EVENTS_PUBLISHED = Counter(
    "django_outbox_events_published_total",
    "Events confirmed by the broker and marked SENT.",
    ["event_type", "job"],
)
PUBLISH_FAILURES = Counter(
    "django_outbox_publish_failures_total",
    "Failed publish attempts, by reason (unroutable, nacked, timeout, connection_lost, ...).",
    ["reason", "job"],
)
EVENTS_DEAD = Counter(
    "django_outbox_events_dead_total",
    "Events that became DEAD (dead letters).",
    ["job"],
)
COMMIT_TO_CONFIRM = Histogram(
    "django_outbox_commit_to_confirm_seconds",
    "Time from the event's creation (database clock) to its broker confirm.",
    buckets=LATENCY_BUCKETS,
)
BATCH_DURATION = Histogram(
    "django_outbox_batch_duration_seconds",
    "Duration of one claim-publish-settle batch.",
    ["job"],
)


def published(event_types: Iterable[str], job: str) -> None:
    counts: dict[str, int] = {}
    for event_type in event_types:
        counts[event_type] = counts.get(event_type, 0) + 1
    for event_type, n in counts.items():
        EVENTS_PUBLISHED.labels(event_type=event_type, job=job).inc(n)


def failed(reason: str, n: int, job: str) -> None:
    if n:
        PUBLISH_FAILURES.labels(reason=reason, job=job).inc(n)


def dead(n: int, job: str) -> None:
    if n:
        EVENTS_DEAD.labels(job=job).inc(n)


def confirm_latencies(seconds: Iterable[float]) -> None:
    for value in seconds:
        COMMIT_TO_CONFIRM.observe(max(value, 0.0))


def batch_duration(seconds: float, job: str) -> None:
    BATCH_DURATION.labels(job=job).observe(seconds)
