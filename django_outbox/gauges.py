"""The outbox's gauges, read from the table at every scrape: what is pending, dead, how
late, blocked or scheduled (:func:`gauges`), and in which databases (:func:`outbox_databases`).

Part of the data layer, so that the Prometheus collector (``metrics.py``) reads them
without the reporting module; ``stats.py`` builds the dashboard's and ``outbox_stats``'
snapshot on them, so all of them show the same figures. Each is measured against the
database clock (:func:`~django_outbox.db.db_now`), in short queries that read no more
than :data:`~django_outbox.counting.EXACT_UP_TO` rows each, however big the backlog:

- the counts by status and of the scheduled rows: exact up to that bound, above it the
  database's estimate (:func:`~django_outbox.counting.count_rows`; ``Gauges.estimated``
  names them, and the pages say "about");
- when the oldest PENDING row became due (``COALESCE(due_at, created_at)``): the oldest
  row never scheduled nor requeued, first along ``(status, created_at)``, and the earliest
  ``due_at`` among the rows created before it (:func:`oldest_due_since`).

One pass over every PENDING row, as this was before, took 290 ms with a million of them
on PostgreSQL; ``bench.reads_bench`` measures it (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connections, router
from django.db.models import Min, QuerySet

from .conf import outbox_settings
from .counting import RowCount, count_rows
from .db import db_now, django_datetime
from .models import OutboxEvent, Status, outbox_db
from .schedule import due_q, scheduled_q


@dataclass(frozen=True)
class Gauges:
    """The three figures worth alerting on; cheap enough to read at every scrape.

    A *scheduled* event (``emit(deliver_at=, delay=)``) that is not due yet is counted in
    ``scheduled`` only: it is PENDING in the table, but waiting is what it was asked to do.
    """

    #: PENDING rows that are due (or in flight, or in retry backoff): not scheduled ones.
    pending: int
    dead: int
    #: Seconds since the oldest PENDING row became due (created, or reached its scheduled
    #: time, or was requeued), by the database clock; 0 when none.
    oldest_pending_age: float
    #: When the oldest PENDING row became due: its ``created_at`` unless it was scheduled
    #: or requeued (None when nothing is pending).
    oldest_pending_due_since: datetime | None
    now: datetime
    #: Ordered mode: aggregates whose head event is DEAD and holds back later events.
    blocked_aggregates: int = 0
    #: PENDING rows scheduled for later and not due yet.
    scheduled: int = 0
    #: The counts above :data:`~django_outbox.counting.EXACT_UP_TO` ("pending",
    #: "scheduled", "dead"): their value is the database's estimate.
    estimated: tuple[str, ...] = ()

    def shown(self, name: str) -> str:
        """Count ``name`` as a page shows it: ``1234``, or ``about 1,000,000``."""
        return str(RowCount(getattr(self, name), name in self.estimated))


def gauges(using: str | None = None) -> Gauges:
    """PENDING count, DEAD count and oldest PENDING age: short queries, bounded reads."""
    using = outbox_db(using)
    now = db_now(using)
    events = OutboxEvent.objects.using(using).order_by()
    pending = events.filter(status=Status.PENDING)
    counts = {
        # Not scheduled for later: due, in flight or in retry backoff.
        "pending": count_rows(pending.filter(due_q(now))),
        # A row scheduled for later has next_retry_time = due_at (emit() writes both, and
        # only a requeue or a failed attempt moves it, after it became due), so the
        # redundant condition lets the count walk (status, next_retry_time) past ``now``
        # instead of every PENDING row.
        "scheduled": count_rows(pending.filter(scheduled_q(now), next_retry_time__gt=now)),
        "dead": count_rows(events.filter(status=Status.DEAD)),
    }
    oldest = oldest_due_since(pending, now)
    age = max((now - oldest).total_seconds(), 0.0) if oldest is not None else 0.0
    dead = counts["dead"].value
    return Gauges(
        pending=counts["pending"].value,
        dead=dead,
        oldest_pending_age=age,
        oldest_pending_due_since=oldest,
        now=now,
        # Only DEAD rows can block (a PENDING head is being retried), so skip the query
        # when there are none: it looks at DEAD rows only, a handful in triage.
        blocked_aggregates=(
            OutboxEvent.objects.using(using).blocked_aggregates().count() if dead else 0
        ),
        scheduled=counts["scheduled"].value,
        estimated=tuple(name for name, count in counts.items() if count.estimated),
    )


def oldest_due_since(pending: QuerySet[OutboxEvent], now: datetime) -> datetime | None:
    """When the oldest PENDING row that is not scheduled for later became due, the minimum
    of ``COALESCE(due_at, created_at)`` (:func:`~django_outbox.schedule.due_since`),
    without reading every PENDING row (``due_at`` has no index: it would cost every
    ``emit()`` a write).

    First the oldest row never scheduled nor requeued (``due_at`` empty): the first entry
    along ``(status, created_at)`` that has no ``due_at``. A row with a ``due_at`` became
    due no earlier than it was created, so only those created before that one can be
    older: the earliest ``due_at`` that has passed among them, a range of the same index
    (the scheduled and requeued rows older than the backlog's oldest, not the backlog).
    """
    first = (
        pending.filter(due_at__isnull=True)
        .order_by("created_at")
        .values_list("created_at", flat=True)
        .first()
    )
    earlier = pending.filter(due_at__isnull=False, due_at__lte=now)
    if first is not None:
        earlier = earlier.filter(created_at__lt=first)
    found = [
        django_datetime(value)
        for value in (first, earlier.aggregate(oldest=Min("due_at"))["oldest"])
        if value is not None
    ]
    return min(found, default=None)


def outbox_databases() -> list[str]:
    """The aliases whose outbox the dashboard and the gauges show, the write alias first.

    ``OUTBOX_DATABASES`` when set (each shown, as down when it cannot be read); else the
    router's write alias (:func:`~django_outbox.models.outbox_db`) and every other alias
    the router lets the outbox migrate to that answers and holds the table. Looking is
    one catalogue query per alias; an alias that cannot be reached is left out, so pin
    the list in a project whose second database must show as down when it is down.
    """
    configured = outbox_settings.DATABASES  # an empty list counts as unset
    if configured:
        return list(configured)
    write = outbox_db()
    found = [write]
    found += [
        alias
        for alias in connections
        if alias != write
        and router.allow_migrate_model(alias, OutboxEvent)
        and holds_outbox_table(alias)
    ]
    return found


def holds_outbox_table(using: str) -> bool:
    """Whether database ``using`` answers and has the outbox table (its migrations ran)."""
    connection = connections[using]
    try:
        with connection.cursor() as cursor:
            tables = connection.introspection.table_names(cursor)
    except Exception:  # down, or (in tests) an alias the test may not use
        return False
    return OutboxEvent._meta.db_table in tables
