"""Batched deletion of old SENT (and, when asked, DEAD) outbox rows.

Used by ``manage.py purge_outbox`` and reusable from a Celery beat task. Each batch selects
at most ``batch_size`` ids and deletes them by id in its own short transaction, so business
writes never wait behind one huge ``DELETE``; MySQL's ``DELETE ... LIMIT`` has no ORM form
and PostgreSQL has no ``LIMIT`` on ``DELETE`` at all, so select-then-delete-by-id is the
portable shape. Age is measured on ``created_at`` by the database clock, which the
``(status, created_at)`` index ``django_outbox_created_idx`` serves for both statuses.

The consumers' inbox (``InboxMessage``) is purged in the same run, in the same batches, by
``processed_at`` (index ``django_outbox_inbox_at_idx``), after OUTBOX_INBOX_RETENTION_DAYS:
never sooner than the outbox's retention of SENT rows, since an event can be replayed or
requeued as long as its outbox row is kept and the inbox row is what makes the consumer
skip it then (docs/operations.md, "Retention", says why the default of 14 days is safe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

from django.db import router

from . import partitions as partitioned
from .conf import OutboxSettings, outbox_settings
from .db import DbNow
from .exceptions import OutboxError
from .models import InboxMessage, OutboxEvent, Status, outbox_db

#: Below this retention purge() refuses unless ``force=True``: the article keeps sent rows
#: at least 3 days so an incident can still be investigated from the table.
MIN_RETENTION_DAYS = 3


class RetentionTooShort(OutboxError, ValueError):
    """The retention asked for is below MIN_RETENTION_DAYS and force was not given."""


@dataclass
class PurgeResult:
    """What one purge did (or, on a dry run, would do)."""

    older_than_days: float
    sent: int = 0
    dead: int = 0
    batches: int = 0
    dry_run: bool = False
    include_dead: bool = False
    #: The inbox's retention this run used; None: the inbox was not purged (why: inbox_kept).
    inbox_days: float | None = None
    inbox: int = 0
    inbox_batches: int = 0
    inbox_kept: str = ""
    #: What the caller should tell the operator (the command prints them on stderr).
    warnings: list[str] = field(default_factory=list)
    #: A partitioned outbox (PostgreSQL, outbox_partition): partitions dropped whole, and
    #: those past the retention kept, with why (the rows in them that are not SENT).
    partitions_dropped: list[str] = field(default_factory=list)
    partitions_kept: dict[str, str] = field(default_factory=dict)
    partitions_created: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Outbox rows (sent and dead); the inbox's are counted apart."""
        return self.sent + self.dead

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        dead = f"{self.dead} dead" if self.include_dead else "dead rows kept"
        if self.inbox_days is None:
            inbox = f"inbox kept ({self.inbox_kept})"
        else:
            inbox = (
                f"inbox: {verb} {self.inbox} row(s) older than {self.inbox_days:g} day(s) "
                f"in {self.inbox_batches} batch(es)"
            )
        text = (
            f"purge_outbox: {verb} {self.total} row(s) older than {self.older_than_days:g} "
            f"day(s) ({self.sent} sent, {dead}) in {self.batches} batch(es); {inbox}"
        )
        if self.partitions_dropped or self.partitions_kept or self.partitions_created:
            drop = "would drop" if self.dry_run else "dropped"
            text += (
                f"; partitions: {drop} {len(self.partitions_dropped)} holding SENT rows only, "
                f"kept {len(self.partitions_kept)} past retention, created "
                f"{len(self.partitions_created)} ahead"
            )
        return text


def purge(
    *,
    older_than_days: float | None = None,
    batch_size: int | None = None,
    include_dead: bool | None = None,
    dry_run: bool = False,
    force: bool = False,
    using: str | None = None,
    on_batch: Callable[[str, int, float], None] | None = None,
    pause_ratio: float | None = None,
) -> PurgeResult:
    """Delete SENT rows created more than ``older_than_days`` ago, in batches.

    With OUTBOX_RETENTION_DAYS = 0 (the relay deletes confirmed rows itself) and no
    ``older_than_days``, every SENT row goes, whatever its age: the ones left from before
    the setting, and any replayed since (``requeue(replay=True)`` of a row kept from then).

    ``None`` arguments take OUTBOX_RETENTION_DAYS, OUTBOX_PURGE_BATCH_SIZE,
    OUTBOX_PURGE_DEAD and OUTBOX_PURGE_PAUSE_RATIO (the pause after each batch, as a
    multiple of the batch's time). DEAD rows are deleted only with ``include_dead``: they were never
    delivered. PENDING rows are never touched. ``dry_run`` counts and deletes nothing.
    Raises RetentionTooShort below 3 days unless ``force``. ``on_batch(kind, rows,
    seconds)`` is told of each committed batch (``kind``: "sent" or "dead").
    """
    days = outbox_settings.RETENTION_DAYS if older_than_days is None else older_than_days
    size = outbox_settings.PURGE_BATCH_SIZE if batch_size is None else batch_size
    dead_too = outbox_settings.PURGE_DEAD if include_dead is None else include_dead
    keeps_none = older_than_days is None and outbox_settings.deletes_on_confirm
    if not (days > 0 or keeps_none):
        raise ValueError(f"older_than_days must be positive, got {days!r}.")
    if not (isinstance(size, int) and size > 0):
        raise ValueError(f"batch_size must be a positive integer, got {size!r}.")
    pause = outbox_settings.PURGE_PAUSE_RATIO if pause_ratio is None else pause_ratio
    if not (_positive(pause) or (pause == 0 and not isinstance(pause, bool))):
        raise ValueError(
            f"OUTBOX_PURGE_PAUSE_RATIO must be a number >= 0 (0: no pause), got {pause!r}."
        )
    inbox_setting = outbox_settings.INBOX_RETENTION_DAYS
    if inbox_setting is not None and not _positive(inbox_setting):
        raise ValueError(
            "OUTBOX_INBOX_RETENTION_DAYS must be a positive number of days or None, got "
            f"{inbox_setting!r}."
        )
    if days < MIN_RETENTION_DAYS and not force and not keeps_none:
        raise RetentionTooShort(
            f"A retention of {days:g} day(s) is below {MIN_RETENTION_DAYS}: sent rows are "
            "what an incident is investigated from. Use 3 days or more, or pass --force "
            "(force=True) if you really mean it."
        )
    db = outbox_db(using)
    result = PurgeResult(older_than_days=days, dry_run=dry_run, include_dead=bool(dead_too))
    if not keeps_none and partitioned.is_partitioned(db):
        # Whole partitions first: what is left past the cutoff is in partitions kept for
        # their PENDING/DEAD rows (or the DEFAULT one), for the batched DELETE below.
        if not dry_run:
            result.partitions_created = partitioned.ensure_partitions(db)
        dropped = partitioned.drop_partitions(db, timedelta(days=days), dry_run=dry_run)
        result.partitions_dropped, result.partitions_kept = dropped.dropped, dropped.kept
        for name, why in dropped.kept.items():
            result.warnings.append(f"partition {name} is past retention and kept: {why}")
    statuses = [Status.SENT, Status.DEAD] if dead_too else [Status.SENT]
    for status in statuses:
        old = OutboxEvent.objects.using(db).filter(status=status)
        if not (keeps_none and status == Status.SENT):
            # DEAD rows keep a retention even then: OUTBOX_RETENTION_DAYS' default.
            age = days or OutboxSettings.RETENTION_DAYS.default
            old = old.filter(created_at__lt=DbNow() - timedelta(days=age))
        if dry_run:
            count = old.count()
        else:
            report = None if on_batch is None else partial(on_batch, status.name.lower())
            count, batches = old.delete_in_batches(size, on_batch=report, pause_ratio=pause)
            result.batches += batches
        if status == Status.SENT:
            result.sent = count
        else:
            result.dead = count
    _purge_inbox(result, using, size, on_batch, pause)
    return result


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def inbox_retention_days(outbox_days: float) -> tuple[float | None, str]:
    """The inbox's retention for a run that keeps SENT rows ``outbox_days``, and a warning.

    OUTBOX_INBOX_RETENTION_DAYS, raised to the outbox's retention (this run's and
    OUTBOX_RETENTION_DAYS) when it is shorter: an inbox row must outlive the outbox row it
    de-duplicates, which can be replayed or requeued until it is purged. None: keep the inbox.
    The warning is "" unless a value the settings give explicitly was raised (the default,
    14, simply follows a longer outbox retention).
    """
    setting = outbox_settings.INBOX_RETENTION_DAYS
    if setting is None:
        return None, ""
    configured = outbox_settings.RETENTION_DAYS
    floor = max(outbox_days, configured if _positive(configured) else 0)
    if setting >= floor:
        return float(setting), ""
    if not outbox_settings.is_set("INBOX_RETENTION_DAYS"):
        return float(floor), ""
    return float(floor), (
        f"OUTBOX_INBOX_RETENTION_DAYS ({setting:g}) is shorter than the outbox's retention of "
        f"SENT rows ({floor:g} days): inbox rows are kept {floor:g} days."
    )


def _purge_inbox(
    result: PurgeResult,
    using: str | None,
    size: int,
    on_batch: Callable[[str, int, float], None] | None,
    pause: float,
) -> None:
    """Delete (or count) the inbox rows past their retention, on the outbox's alias when
    one was given, else where the router writes the inbox."""
    days, warning = inbox_retention_days(result.older_than_days)
    db = using or router.db_for_write(InboxMessage)
    if days is None:
        result.inbox_kept = "OUTBOX_INBOX_RETENTION_DAYS is None"
        return
    if not router.allow_migrate_model(db, InboxMessage):
        result.inbox_kept = f"no inbox table on database {db!r}"
        return
    if warning:
        result.warnings.append(warning)
    result.inbox_days = days
    old = InboxMessage.objects.using(db).processed_before(days)
    if result.dry_run:
        result.inbox = old.count()
        return
    report = None if on_batch is None else partial(on_batch, "inbox")
    result.inbox, result.inbox_batches = old.delete_in_batches(
        size, on_batch=report, pause_ratio=pause
    )
