"""Batched deletion of old SENT (and, when asked, DEAD) outbox rows.

Used by ``manage.py purge_outbox`` and reusable from a Celery beat task. Each batch selects
at most ``batch_size`` ids and deletes them by id in its own short transaction, so business
writes never wait behind one huge ``DELETE``; MySQL's ``DELETE ... LIMIT`` has no ORM form
and PostgreSQL has no ``LIMIT`` on ``DELETE`` at all, so select-then-delete-by-id is the
portable shape. Age is measured on ``created_at`` by the database clock, which the
``(status, created_at)`` index ``django_outbox_created_idx`` serves for both statuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from .conf import outbox_settings
from .db import DbNow
from .exceptions import OutboxError
from .models import OutboxEvent, Status, outbox_db

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

    @property
    def total(self) -> int:
        return self.sent + self.dead

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        dead = f"{self.dead} dead" if self.include_dead else "dead rows kept"
        return (
            f"purge_outbox: {verb} {self.total} row(s) older than {self.older_than_days:g} "
            f"day(s) ({self.sent} sent, {dead}) in {self.batches} batch(es)"
        )


def purge(
    *,
    older_than_days: float | None = None,
    batch_size: int | None = None,
    include_dead: bool | None = None,
    dry_run: bool = False,
    force: bool = False,
    using: str | None = None,
) -> PurgeResult:
    """Delete SENT rows created more than ``older_than_days`` ago, in batches.

    ``None`` arguments take OUTBOX_RETENTION_DAYS, OUTBOX_PURGE_BATCH_SIZE and
    OUTBOX_PURGE_DEAD. DEAD rows are deleted only with ``include_dead``: they were never
    delivered. PENDING rows are never touched. ``dry_run`` counts and deletes nothing.
    Raises RetentionTooShort below 3 days unless ``force``.
    """
    days = outbox_settings.RETENTION_DAYS if older_than_days is None else older_than_days
    size = outbox_settings.PURGE_BATCH_SIZE if batch_size is None else batch_size
    dead_too = outbox_settings.PURGE_DEAD if include_dead is None else include_dead
    if not days > 0:
        raise ValueError(f"older_than_days must be positive, got {days!r}.")
    if not (isinstance(size, int) and size > 0):
        raise ValueError(f"batch_size must be a positive integer, got {size!r}.")
    if days < MIN_RETENTION_DAYS and not force:
        raise RetentionTooShort(
            f"A retention of {days:g} day(s) is below {MIN_RETENTION_DAYS}: sent rows are "
            "what an incident is investigated from. Use 3 days or more, or pass --force "
            "(force=True) if you really mean it."
        )
    db = outbox_db(using)
    result = PurgeResult(older_than_days=days, dry_run=dry_run, include_dead=bool(dead_too))
    statuses = [Status.SENT, Status.DEAD] if dead_too else [Status.SENT]
    for status in statuses:
        old = OutboxEvent.objects.using(db).filter(
            status=status, created_at__lt=DbNow() - timedelta(days=days)
        )
        if dry_run:
            count = old.count()
        else:
            count, batches = old.delete_in_batches(size)
            result.batches += batches
        if status == Status.SENT:
            result.sent = count
        else:
            result.dead = count
    return result
