"""The outbox's gauges, read from the table at every scrape: what is pending, dead, how
late, blocked or scheduled (:func:`gauges`), and in which databases (:func:`outbox_databases`).

Part of the data layer, so that the Prometheus collector (``metrics.py``) reads them
without the reporting module; ``stats.py`` builds the dashboard's and ``outbox_stats``'
snapshot on them, so all of them show the same figures. Each is measured against the
database clock (:func:`~django_outbox.db.db_now`): counts by status, the scheduled rows and
when the oldest PENDING row became due (``COALESCE(due_at, created_at)``) in one pass over
the PENDING and DEAD rows, which the counts need anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connections, router
from django.db.models import Count, Min, Q

from .conf import outbox_settings
from .db import db_now, django_datetime
from .models import OutboxEvent, Status, outbox_db
from .schedule import due_since, scheduled_q


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


def gauges(using: str | None = None) -> Gauges:
    """PENDING count, DEAD count and oldest PENDING age: two short queries."""
    using = outbox_db(using)
    now = db_now(using)
    # Scheduled rows are cut at the instant every other figure is measured from.
    scheduled = scheduled_q(now)
    figures = (
        OutboxEvent.objects.using(using)
        .filter(status__in=[Status.PENDING, Status.DEAD])
        .aggregate(
            pending=Count("id", filter=Q(status=Status.PENDING) & ~scheduled),
            scheduled=Count("id", filter=scheduled),
            dead=Count("id", filter=Q(status=Status.DEAD)),
            oldest=Min(due_since(), filter=Q(status=Status.PENDING) & ~scheduled),
        )
    )
    oldest = django_datetime(figures["oldest"]) if figures["oldest"] is not None else None
    age = max((now - oldest).total_seconds(), 0.0) if oldest is not None else 0.0
    dead = figures["dead"] or 0
    return Gauges(
        pending=figures["pending"] or 0,
        dead=dead,
        oldest_pending_age=age,
        oldest_pending_due_since=oldest,
        now=now,
        # Only DEAD rows can block (a PENDING head is being retried), so skip the query
        # when there are none: it looks at DEAD rows only, a handful in triage.
        blocked_aggregates=(
            OutboxEvent.objects.using(using).blocked_aggregates().count() if dead else 0
        ),
        scheduled=figures["scheduled"] or 0,
    )


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
