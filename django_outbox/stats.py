"""The outbox's health figures, computed in one place from the table itself.

The article's lesson is to watch the outbox table, not the broker's send rate: the PENDING
count (and its trend), the age of the oldest PENDING event and the number of dead letters
catch every incident early. The admin dashboard, the Prometheus collector and
``manage.py outbox_stats`` all read their figures from here, so the three never disagree.

Every figure is measured against the **database clock**: :func:`~django_outbox.db.db_now`
reads it once per snapshot and all windows are cut from that instant, so a relay host with a
skewed clock or a web server in another time zone changes nothing. The queries stay on the
model's indexes:

- counts by status, the scheduled rows and when the oldest PENDING row became due
  (``COALESCE(due_at, created_at)``): :mod:`~django_outbox.gauges` reads them, for the
  Prometheus collector too, each count exact up to
  :data:`~django_outbox.counting.EXACT_UP_TO` rows and the database's estimate above it
  (``Gauges.estimated``; the text and the dashboard say "about");
- the triage table and the "created" trend, in one pass: ``status IN (0, 1, 2) AND
  created_at >= ...``, again ``(status, created_at)`` (the ``IN`` lets PostgreSQL and
  MySQL use the index without a leading equality on status); exact, so it reads every row
  created in the window;
- "sent" in a window: ``status = SENT AND created_at >= window start - SENT_LOOKBACK AND
  sent_at >= window start``. There is no index on ``sent_at``; bounding ``created_at`` keeps
  the scan to recent rows instead of every SENT row kept for the retention period. A row
  created more than ``SENT_LOOKBACK`` before the window and sent inside it (a delivery after
  a day-long outage) is not counted in "sent"; it is still counted where it matters, in the
  PENDING figures until it is sent.
- blocked aggregates (ordered mode): DEAD rows only, each probed for a later PENDING and an
  earlier unsent row of its aggregate on ``(aggregate_type, aggregate_id, status, id)``;
  skipped when nothing is DEAD.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from django.db.models import Case, CharField, Count, Value, When
from django.db.models.functions import TruncMinute
from django.utils import timezone as django_timezone

from . import ordering
from .counting import EXACT_UP_TO
from .db import django_datetime
from .gauges import Gauges, gauges

# The dashboard reads which databases to show here, with the rest of its figures.
from .gauges import outbox_databases as outbox_databases
from .models import OutboxEvent, Status, outbox_db

#: The default window of the triage table, "sent" and the trend: the article's last hour.
DEFAULT_WINDOW = 3600.0
#: How far before a window a row may have been created and still count as "sent" in it.
SENT_LOOKBACK = timedelta(days=1)
#: Number of bars of the trend, whatever the window (one per minute for an hour).
TREND_BUCKETS = 60
#: How many event types the "top dead letters" list names.
TOP_DEAD_TYPES = 10
#: How many blocked aggregates (ordered mode) the dashboard and outbox_stats list.
TOP_BLOCKED = 20

_ALL_STATUSES = [int(s) for s in Status]


@dataclass(frozen=True)
class TriageRow:
    """One cell group of the article's ``GROUP BY status, retry_count`` query."""

    status: int
    retry_count: int
    count: int

    @property
    def status_label(self) -> str:
        return str(Status(self.status).label)


@dataclass(frozen=True)
class TrendBucket:
    """Rows created and rows sent in ``[start, start + width)``."""

    start: datetime
    created: int
    sent: int


@dataclass(frozen=True)
class BlockedAggregate:
    """Ordered mode: a DEAD head and how many PENDING events of its aggregate wait on it."""

    id: int
    event_id: str
    event_type: str
    aggregate_type: str
    aggregate_id: str
    waiting: int
    last_error: str


@dataclass(frozen=True)
class OutboxStats:
    """A snapshot of everything the dashboard and ``outbox_stats`` show."""

    gauges: Gauges
    window: float
    sent_in_window: int
    created_in_window: int
    triage: list[TriageRow]
    top_dead_types: list[tuple[str, int]]
    trend: list[TrendBucket]
    trend_bucket_seconds: float
    #: Ordered mode: the first blocked aggregates (at most ``TOP_BLOCKED``), oldest first.
    blocked: list[BlockedAggregate] = field(default_factory=list)
    #: Further figures shown as they are by the dashboard and ``outbox_stats``.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def blocked_aggregates(self) -> int:
        return self.gauges.blocked_aggregates

    @property
    def pending(self) -> int:
        return self.gauges.pending

    @property
    def scheduled(self) -> int:
        return self.gauges.scheduled

    @property
    def dead(self) -> int:
        return self.gauges.dead

    @property
    def oldest_pending_age(self) -> float:
        return self.gauges.oldest_pending_age

    def triage_matrix(self) -> tuple[list[int], list[tuple[str, list[int]]]]:
        """The triage table as (retry counts, [(status label, counts per retry count)])."""
        retries = sorted({row.retry_count for row in self.triage})
        cells = {(row.status, row.retry_count): row.count for row in self.triage}
        table = [
            (str(status.label), [cells.get((int(status), r), 0) for r in retries])
            for status in Status
        ]
        return retries, table

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``outbox_stats --json``); datetimes as ISO 8601 UTC strings
        (under ``USE_TZ = False``, local times in ``TIME_ZONE`` converted to UTC)."""
        gauges = asdict(self.gauges)
        return {
            "now": _iso(self.gauges.now),
            "window_seconds": self.window,
            "pending": self.pending,
            "scheduled": self.scheduled,
            "dead": self.dead,
            # Which of the three are the database's estimate (above EXACT_UP_TO rows).
            "estimated": list(self.gauges.estimated),
            "oldest_pending_age_seconds": round(self.oldest_pending_age, 3),
            "oldest_pending_due_since": _iso(gauges["oldest_pending_due_since"]),
            # The name before scheduled events (0.1.0); the same value, kept for scripts.
            "oldest_pending_created_at": _iso(gauges["oldest_pending_due_since"]),
            "sent_in_window": self.sent_in_window,
            "created_in_window": self.created_in_window,
            "triage": [
                {
                    "status": row.status_label,
                    "status_code": row.status,
                    "retry_count": row.retry_count,
                    "count": row.count,
                }
                for row in self.triage
            ],
            "top_dead_event_types": [
                {"event_type": event_type, "count": n} for event_type, n in self.top_dead_types
            ],
            "trend_bucket_seconds": self.trend_bucket_seconds,
            "trend": [
                {"start": _iso(b.start), "created": b.created, "sent": b.sent} for b in self.trend
            ],
            "blocked_aggregates": self.blocked_aggregates,
            "blocked": [asdict(b) for b in self.blocked],
            **self.extra,
        }

    def as_text(self, crossed: Sequence[str] = ()) -> str:
        """The terminal report of ``outbox_stats``, ending with the ``crossed`` thresholds."""
        window = format_age(self.window)
        age = format_age(self.oldest_pending_age) if self.pending else "-"
        shown = self.gauges.shown
        figures = [
            ("PENDING", shown("pending")),
            ("scheduled", shown("scheduled")),
            ("oldest PENDING age", age),
            ("DEAD", shown("dead")),
            (f"SENT (last {window})", self.sent_in_window),
            (f"created (last {window})", self.created_in_window),
            *sorted(self.extra.items()),
        ]
        if ordering.is_enabled():
            figures.append(("blocked aggregates", self.blocked_aggregates))
        pad = max(len(label) for label, _ in figures)
        lines = [f"{label:<{pad}}  {value}" for label, value in figures]
        if self.gauges.estimated:
            lines.append(
                f"(about: the database's estimate; counts above {EXACT_UP_TO:,} rows are not "
                "read row by row)"
            )
        lines.append("")
        retries, table = self.triage_matrix()
        lines.append(f"status x retry_count, rows created in the last {window}:")
        if retries:
            width = max(6, *(len(str(n)) for _, counts in table for n in counts))
            header = "status   " + " ".join(f"{r:>{width}}" for r in retries)
            lines.append(header)
            for label, counts in table:
                lines.append(f"{label:<8} " + " ".join(f"{n:>{width}}" for n in counts))
        else:
            lines.append("  (no rows)")
        if self.top_dead_types:
            lines.append("")
            lines.append("top event types among dead letters:")
            lines += [f"  {n:>6}  {event_type}" for event_type, n in self.top_dead_types]
        if self.blocked:
            lines.append("")
            lines.append(
                "aggregates blocked by a DEAD head (fix the cause, then requeue the head):"
            )
            lines += [
                f"  {b.aggregate_type}:{b.aggregate_id}  head id={b.id} {b.event_type} "
                f"event_id={b.event_id}  {b.waiting} waiting  {' '.join(b.last_error.split())[:80]}"
                for b in self.blocked
            ]
        for message in crossed:
            lines.append("")
            lines.append(f"THRESHOLD CROSSED: {message}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Thresholds:
    """Limits on the figures (``outbox_stats --max-*``); None is no limit."""

    max_pending: int | None = None
    max_oldest_age: float | None = None
    max_dead: int | None = None
    max_blocked: int | None = None

    def crossed(self, snapshot: OutboxStats) -> list[str]:
        """One sentence per limit the snapshot is over; empty when it keeps them all."""
        crossed = []
        if self.max_pending is not None and snapshot.pending > self.max_pending:
            crossed.append(
                f"{snapshot.pending} PENDING events, more than --max-pending {self.max_pending}"
            )
        if self.max_oldest_age is not None and snapshot.oldest_pending_age > self.max_oldest_age:
            crossed.append(
                f"oldest PENDING event is {snapshot.oldest_pending_age:.0f}s old, older than "
                f"--max-oldest-age {self.max_oldest_age:g}s"
            )
        if self.max_dead is not None and snapshot.dead > self.max_dead:
            crossed.append(f"{snapshot.dead} DEAD events, more than --max-dead {self.max_dead}")
        if self.max_blocked is not None and snapshot.blocked_aggregates > self.max_blocked:
            crossed.append(
                f"{snapshot.blocked_aggregates} aggregates blocked by a DEAD head, more than "
                f"--max-blocked {self.max_blocked}"
            )
        return crossed


def format_age(seconds: float) -> str:
    """``3 d 4 h``, ``2 h 5 min``, ``1 h``, ``4 min 12 s`` or ``9 s``: two units at most."""
    seconds = int(seconds)
    units = [("d", 86400), ("h", 3600), ("min", 60), ("s", 1)]
    for i, (name, size) in enumerate(units[:-1]):
        if seconds >= size:
            big, rest = divmod(seconds, size)
            small_name, small_size = units[i + 1]
            small = rest // small_size
            return f"{big} {name} {small} {small_name}" if small else f"{big} {name}"
    return f"{seconds} s"


def _iso(value: datetime | None) -> str | None:
    """ISO 8601 in UTC. Under ``USE_TZ = False`` a naive value is local time in
    ``TIME_ZONE`` (how Django stores and returns it), so it is labelled with that zone's
    offset before conversion, never taken for UTC."""
    if value is None:
        return None
    if django_timezone.is_naive(value):
        value = value.replace(tzinfo=django_timezone.get_default_timezone())
    return value.astimezone(timezone.utc).isoformat()


def blocked_aggregates(
    using: str | None = None, limit: int = TOP_BLOCKED
) -> list[BlockedAggregate]:
    """Ordered mode: the DEAD heads holding back their aggregates, oldest first."""
    rows = OutboxEvent.objects.using(outbox_db(using)).blocked_aggregates()[:limit]
    return [
        BlockedAggregate(
            id=row.pk,
            event_id=row.event_id,
            event_type=row.event_type,
            aggregate_type=row.aggregate_type,
            aggregate_id=row.aggregate_id,
            waiting=row.waiting or 0,  # type: ignore[attr-defined]
            last_error=row.last_error,
        )
        for row in rows
    ]


def _bucket_seconds(window: float) -> float:
    """Width of one trend bar: whole minutes, so per-minute counts add up exactly."""
    return max(1, math.ceil(window / TREND_BUCKETS / 60)) * 60.0


def collect(
    *,
    window: float = DEFAULT_WINDOW,
    using: str | None = None,
    top: int = TOP_DEAD_TYPES,
) -> OutboxStats:
    """Everything the dashboard and ``outbox_stats`` show, for the last ``window`` seconds."""
    if window <= 0:
        raise ValueError(f"window must be a positive number of seconds, not {window!r}")
    using = outbox_db(using)
    g = gauges(using)
    events = OutboxEvent.objects.using(using).order_by()
    start = g.now - timedelta(seconds=window)
    recent = events.filter(status__in=_ALL_STATUSES, created_at__gte=start)

    # The article's triage query, SELECT status, retry_count, COUNT(*) ... GROUP BY both,
    # and the "created" trend, in one pass over the window's rows: grouped by minute too
    # (TruncMinute in UTC needs no time zone tables on MySQL). Two passes took twice as
    # long with a million rows created in the window (bench.reads_bench).
    width = _bucket_seconds(window)
    end = g.now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    first = end - timedelta(seconds=width * TREND_BUCKETS)  # after start: a whole minute
    cells: dict[tuple[int, int], int] = {}
    created_by_minute: dict[datetime, int] = {}
    for status, retry_count, minute, n in (
        recent.annotate(minute=TruncMinute("created_at", tzinfo=timezone.utc))
        .values_list("status", "retry_count", "minute")
        .annotate(n=Count("id"))
        .order_by()
    ):
        cells[status, retry_count] = cells.get((status, retry_count), 0) + n
        minute = django_datetime(minute)
        created_by_minute[minute] = created_by_minute.get(minute, 0) + n
    triage = [
        TriageRow(status=status, retry_count=retry_count, count=n)
        for (status, retry_count), n in sorted(cells.items())
    ]
    created_in_window = sum(cells.values())

    sent_recent = events.filter(
        status=Status.SENT, created_at__gte=start - SENT_LOOKBACK, sent_at__gte=start
    )
    top_dead = list(
        events.filter(status=Status.DEAD)
        .values_list("event_type")
        .annotate(n=Count("id"))
        .order_by("-n", "event_type")[:top]
    )

    # The trend's bars: per-minute counts folded into TREND_BUCKETS bars here.
    sent_by_minute = _per_minute(sent_recent.filter(sent_at__gte=first), "sent_at")
    created_counts = [0] * TREND_BUCKETS
    sent_counts = [0] * TREND_BUCKETS
    for counts, by_minute in ((created_counts, created_by_minute), (sent_counts, sent_by_minute)):
        for minute, n in by_minute.items():
            index = int((minute - first).total_seconds() // width)
            if 0 <= index < TREND_BUCKETS:
                counts[index] += n
    bars = [
        TrendBucket(
            start=first + timedelta(seconds=width * i),
            created=created_counts[i],
            sent=sent_counts[i],
        )
        for i in range(TREND_BUCKETS)
    ]

    return OutboxStats(
        gauges=g,
        window=float(window),
        sent_in_window=sent_recent.count(),
        created_in_window=created_in_window,
        triage=triage,
        top_dead_types=[(event_type, n) for event_type, n in top_dead],
        trend=bars,
        trend_bucket_seconds=width,
        blocked=blocked_aggregates(using) if g.blocked_aggregates else [],
    )


def _per_minute(queryset: Any, column: str) -> dict[datetime, int]:
    rows = (
        queryset.annotate(minute=TruncMinute(column, tzinfo=timezone.utc))
        .values_list("minute")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {django_datetime(minute): n for minute, n in rows}


# -- dead letters by failure reason (the admin dashboard) --------------------------------------
@dataclass(frozen=True)
class DeadReason:
    """DEAD rows whose last attempt failed for one reason (``[unroutable] ...``)."""

    #: A :class:`~django_outbox.backends.base.Reason` value; "" for any other last_error.
    reason: str
    count: int
    #: The ``last_error`` of the most recently created of them.
    last_error: str

    @property
    def marker(self) -> str:
        """What ``last_error`` starts with for this reason (what a requeue selects on)."""
        return f"[{self.reason}]" if self.reason else ""


def dead_reasons(reasons: Sequence[str], using: str | None = None) -> list[DeadReason]:
    """DEAD rows grouped by the reason of their last failed attempt, most first.

    The relay records each failure as ``[reason] error`` (``relay.engine``; ``reasons`` are
    the :class:`~django_outbox.backends.base.Reason` values, passed in because the figures
    do not import the backends); a row marked dead by hand, or a last_error written
    otherwise, counts under reason "". One grouped
    query over the DEAD rows, then one per reason found for its latest error, read
    backwards along ``(status, created_at)``: it stops at the first row of that reason.
    """
    dead = OutboxEvent.objects.using(outbox_db(using)).filter(status=Status.DEAD).order_by()
    reason = Case(
        *[When(last_error__startswith=f"[{r}]", then=Value(r)) for r in reasons],
        default=Value(""),
        output_field=CharField(),
    )
    by_reason = dead.annotate(reason=reason)
    counts = by_reason.values_list("reason").annotate(n=Count("id")).order_by()
    result = []
    for value, n in sorted(counts, key=lambda row: (-row[1], row[0] == "", row[0])):
        latest = (
            by_reason.filter(reason=value)
            .order_by("-created_at", "-id")
            .values_list("last_error", flat=True)[:1]
        )
        result.append(DeadReason(reason=value, count=n, last_error=next(iter(latest), "")))
    return result
