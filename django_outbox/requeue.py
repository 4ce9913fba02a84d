"""Bulk redrive and replay: requeue every outbox row a selection names, in batches.

Used by ``manage.py outbox_requeue`` and by the admin dashboard's "requeue all N" pages,
so both select and change rows the same way. A selection names one status:

- DEAD (the default): *redrive* dead letters once their cause is fixed;
- PENDING: make rows waiting in retry backoff due now: attempted at least once and due
  later than now (:func:`waiting_to_retry`). Every other PENDING row is left alone and
  counted: a row due already (never attempted, or its backoff over) is not late because
  of a backoff, and requeueing it would only reset its age, the figure that says the relay
  is down; a row a relay is publishing right now would be published twice; a scheduled
  event not due yet is not late; in ordered mode a row waiting behind an earlier event of
  its aggregate goes out after it whatever its due time;
- SENT: *replay* events already delivered, for a consumer that lost its data. They keep
  their ``event_id`` and carry the ``x-outbox-replay`` header (how many times).

Every selected row becomes PENDING, due now by the database clock, with ``retry_count`` 0
(:meth:`~django_outbox.querysets.OutboxEventQuerySet.requeue`); ``last_error`` stays until
the next attempt. The rows are changed oldest first in batches, each in its own short
transaction, so the table is never locked for long and the relay starts on the first batch
while the next ones are requeued.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q
from django.utils import timezone

from . import ordering
from .db import DbNow, db_now
from .models import OutboxEvent, Status, outbox_db
from .querysets import OutboxEventQuerySet
from .schedule import scheduled_q

#: Rows per batch unless told otherwise: one UPDATE of this many ids per transaction.
DEFAULT_BATCH_SIZE = 500
#: How many rows a dry run shows.
SAMPLE_SIZE = 10
#: The statuses a selection may name, by the names the command and the docs use.
STATUSES = {"dead": Status.DEAD, "pending": Status.PENDING, "sent": Status.SENT}

#: What a replay of SENT rows finds with OUTBOX_RETENTION_DAYS = 0 (``outbox_requeue
#: --status sent`` says it before it starts).
NO_SENT_ROWS = (
    "OUTBOX_RETENTION_DAYS is 0: the relay deletes each event once the broker confirmed it, "
    "so there are no SENT rows to replay but those kept from before the setting; replay "
    "from the broker (or your own archive) instead."
)

#: ``--since``/``--until``: a moment, or how long ago (by the database clock).
Moment = datetime | timedelta


@dataclass(frozen=True)
class Selection:
    """Which rows to requeue: one status, narrowed by any of the other fields.

    ``since``/``until`` bound ``created_at`` (``since`` <= created_at < ``until``); a
    ``timedelta`` means that long before now, by the database clock. ``error_contains``
    matches ``last_error`` case-insensitively. Aware datetimes under ``USE_TZ``, naive
    ones (local time) without it, as Django stores them.
    """

    status: Status = Status.DEAD
    event_types: tuple[str, ...] = ()
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    error_contains: str | None = None
    since: Moment | None = None
    until: Moment | None = None

    @property
    def replay(self) -> bool:
        """Selecting SENT rows is a replay: they are published again."""
        return self.status == Status.SENT

    def check(self) -> None:
        """Raise ValueError for a selection that cannot mean what was asked."""
        if self.status not in STATUSES.values():
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")
        for name in ("aggregate_type", "aggregate_id", "error_contains"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} is empty; leave it out to select any")
        if any(not event_type for event_type in self.event_types):
            raise ValueError("an event type is empty; leave it out to select any")
        for name in ("since", "until"):
            value = getattr(self, name)
            if isinstance(value, datetime) and settings.USE_TZ and timezone.is_naive(value):
                raise ValueError(
                    f"{name} {value.isoformat()} has no time zone; give one, e.g. "
                    f"{value.isoformat()}Z for UTC or {value.isoformat()}+08:00"
                )
            if isinstance(value, timedelta) and value < timedelta(0):
                raise ValueError(f"{name} is a negative duration")

    def resolved(self, now: datetime) -> Selection:
        """This selection with ``since``/``until`` as datetimes, measured back from ``now``
        (the database clock), so every batch of a run works on the same window."""
        since, until = (_moment(m, now) for m in (self.since, self.until))
        if since is not None and until is not None and not since < until:
            raise ValueError(
                f"since ({since.isoformat()}) is not before until ({until.isoformat()}): "
                "no row can match"
            )
        return replace(self, since=since, until=until)

    def queryset(self, using: str | None = None) -> OutboxEventQuerySet:
        """The selected rows (call :meth:`resolved` first if ``since``/``until`` may be
        durations). PENDING: only those :func:`waiting_to_retry` (in ordered mode this
        reads which rows wait behind an earlier event now, see there)."""
        rows = self.matching(using)
        return waiting_to_retry(rows) if self.status == Status.PENDING else rows

    def matching(self, using: str | None = None) -> OutboxEventQuerySet:
        """Every row of the status that the other filters match, whatever it waits for."""
        rows = OutboxEvent.objects.using(outbox_db(using)).filter(status=self.status)
        if self.event_types:
            rows = rows.filter(event_type__in=self.event_types)
        if self.aggregate_type is not None:
            rows = rows.filter(aggregate_type=self.aggregate_type)
        if self.aggregate_id is not None:
            rows = rows.filter(aggregate_id=self.aggregate_id)
        if self.error_contains is not None:
            rows = rows.filter(last_error__icontains=self.error_contains)
        for bound, lookup in ((self.since, "created_at__gte"), (self.until, "created_at__lt")):
            if isinstance(bound, timedelta):
                raise TypeError("resolve the selection's durations first (Selection.resolved)")
            if bound is not None:
                rows = rows.filter(**{lookup: bound})
        return rows

    def describe(self) -> str:
        """The filters in words, for the summary line and the admin's confirmation page."""
        parts = []
        if self.event_types:
            parts.append("event_type " + " or ".join(self.event_types))
        if self.aggregate_type is not None or self.aggregate_id is not None:
            aggregate_type = self.aggregate_type if self.aggregate_type is not None else "*"
            aggregate_id = self.aggregate_id if self.aggregate_id is not None else "*"
            parts.append(f"aggregate {aggregate_type}:{aggregate_id}")
        if self.error_contains is not None:
            parts.append(f"last_error containing {self.error_contains!r}")
        if self.since is not None:
            parts.append(f"created since {_shown(self.since)}")
        if self.until is not None:
            parts.append(f"created before {_shown(self.until)}")
        return ", ".join(parts) or "no other filter"


def waiting_to_retry(rows: OutboxEventQuerySet) -> OutboxEventQuerySet:
    """The PENDING rows of ``rows`` that wait in a retry backoff: attempted at least once,
    due later than now by the database clock, held by no relay, not scheduled for later
    and, in ordered mode, not waiting behind an earlier event of their aggregate.

    That last part is read now, as a list of ids to leave out: the claim's filter for it
    (:func:`django_outbox.ordering.heads_only`) reads the outbox table in a subquery, which
    MySQL refuses in an UPDATE of that table. Rows in a backoff are few (an outage of the
    broker counts no attempt), and a row that falls behind one after this read waits all
    the same: the claim takes heads only.
    """
    rows = (
        rows.filter(status=Status.PENDING, retry_count__gt=0, next_retry_time__gt=DbNow())
        .exclude_in_flight()
        .exclude(scheduled_q())
    )
    behind = _behind_a_head(rows)
    return rows.exclude(pk__in=behind) if behind else rows


def _behind_a_head(rows: OutboxEventQuerySet) -> list[int]:
    """The ids of the ordered rows of ``rows`` that are not their aggregate's head."""
    if ordering.ordered_q(ordering.current_ordered()) is None:
        return []
    heads = set(ordering.heads_only(rows).values_list("pk", flat=True))
    return [pk for pk in rows.values_list("pk", flat=True) if pk not in heads]


#: Why a PENDING row is left alone, in the order the summary names them.
LEFT_ALONE = {
    "due": "due already (a relay takes them when one runs)",
    "in_flight": "being published by a relay",
    "scheduled": "scheduled for later",
    "behind": "waiting behind an earlier event of their aggregate",
}


def _left_alone(selection: Selection, using: str, matched: int) -> dict[str, int]:
    """How many PENDING rows the filters match that ``selection`` leaves alone, and why."""
    leased = Q(leased_until__gt=DbNow())
    scheduled = Q(due_at__gt=DbNow())
    counts = selection.matching(using).aggregate(
        total=Count("pk"),
        in_flight=Count("pk", filter=leased),
        scheduled=Count("pk", filter=scheduled & ~leased),
        due=Count("pk", filter=Q(next_retry_time__lte=DbNow()) & ~leased & ~scheduled),
    )
    total = counts.pop("total")
    # The rest waits in a backoff behind an earlier event (the counts are a moment apart).
    counts["behind"] = max(0, total - matched - sum(counts.values()))
    return {reason: counts[reason] for reason in LEFT_ALONE if counts[reason]}


@dataclass
class RequeueResult:
    """What one run did (or, on a dry run, would do)."""

    selection: Selection
    #: Rows the selection matched when the requeue started (all of them, whatever the limit).
    matched: int
    #: Rows requeued; on a dry run, how many would be (the limit applied).
    changed: int = 0
    batches: int = 0
    dry_run: bool = False
    limit: int | None = None
    #: A dry run's first rows, oldest first (at most SAMPLE_SIZE).
    sample: list[OutboxEvent] = field(default_factory=list)
    #: PENDING selections: the rows the filters match that wait for something else than a
    #: retry, by reason (a key of LEFT_ALONE); reasons with no row are left out.
    left_alone: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return self._summary() + self._left_alone_note()

    def _left_alone_note(self) -> str:
        if not self.left_alone:
            return ""
        reasons = ", ".join(f"{n} {LEFT_ALONE[reason]}" for reason, n in self.left_alone.items())
        return (
            f"; left alone {sum(self.left_alone.values())} pending event(s) not waiting "
            f"to retry: {reasons}"
        )

    def _summary(self) -> str:
        status = Status(self.selection.status).name.lower()
        filters = self.selection.describe()
        if not self.matched:
            if self.selection.status == Status.PENDING:
                return (
                    f"outbox_requeue: no pending event waits to retry ({filters}); nothing changed"
                )
            return f"outbox_requeue: no {status} event matches ({filters}); nothing changed"
        verb, done = ("replay", "replayed") if self.selection.replay else ("requeue", "requeued")
        limited = (
            f" (of {self.matched} matching; --limit {self.limit})"
            if (self.limit is not None and self.matched > self.limit)
            else ""
        )
        if self.dry_run:
            return (
                f"outbox_requeue: would {verb} {self.changed} {status} event(s) ({filters})"
                f"{limited}; dry run, nothing changed"
            )
        line = (
            f"outbox_requeue: {done} {self.changed} {status} event(s) ({filters}){limited} "
            f"in {self.batches} batch(es): due now, retry_count 0"
        )
        if self.selection.replay:
            line += (
                "; they keep their event_id and carry the x-outbox-replay header, so a "
                "consumer that still has them takes them as duplicates"
            )
        return line

    def sample_lines(self) -> list[str]:
        """One line per sampled row: what an operator checks before the real run."""
        return [
            f"  id={row.pk} {row.event_type} event_id={row.event_id} "
            f"aggregate={row.aggregate_type}:{row.aggregate_id} retry_count={row.retry_count} "
            f"created_at={row.created_at.isoformat()}"
            + (f" last_error={' '.join(row.last_error.split())[:80]}" if row.last_error else "")
            for row in self.sample
        ]


def requeue(
    selection: Selection,
    *,
    limit: int | None = None,
    batch_size: int | None = None,
    dry_run: bool = False,
    using: str | None = None,
) -> RequeueResult:
    """Requeue (or, for SENT rows, replay) the rows ``selection`` names, oldest first,
    ``batch_size`` at a time, at most ``limit``. ``dry_run`` counts and samples them and
    changes nothing. Raises ValueError for a selection or a size that makes no sense."""
    size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    for name, value in (("batch_size", size), ("limit", limit)):
        if value is not None and not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    selection.check()
    db = outbox_db(using)
    selection = selection.resolved(db_now(db))
    rows = selection.queryset(db)
    matched = rows.count()
    result = RequeueResult(selection=selection, matched=matched, dry_run=dry_run, limit=limit)
    if selection.status == Status.PENDING:  # counted before the rows change
        result.left_alone = _left_alone(selection, db, matched)
    if dry_run:
        result.changed = matched if limit is None else min(matched, limit)
        result.sample = list(rows.order_by("pk")[: min(SAMPLE_SIZE, result.changed)])
    elif matched:
        result.changed, result.batches = rows.requeue_in_batches(
            size, limit=limit, replay=selection.replay
        )
    return result


def _moment(value: Moment | None, now: datetime) -> datetime | None:
    if isinstance(value, timedelta):
        return now - value
    if value is not None and not settings.USE_TZ and timezone.is_aware(value):
        # Without time zones Django stores local times in TIME_ZONE.
        return timezone.make_naive(value, timezone.get_default_timezone())
    return value


def _shown(value: Moment) -> str:
    if isinstance(value, timedelta):
        return f"{value} ago"
    return value.isoformat()
