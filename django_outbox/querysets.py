"""Querysets that speak the outbox's domain: pending, due, stale, dead, claim."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import models, transaction

from .db import DbNow

if TYPE_CHECKING:
    from .models import OutboxEvent

# Plain ints so this module does not import models (models imports this module).
PENDING, SENT, DEAD = 0, 1, 2


def _seconds(value: float | timedelta) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


class OutboxEventQuerySet(models.QuerySet["OutboxEvent"]):
    def pending(self) -> OutboxEventQuerySet:
        """Not yet confirmed by the broker (including rows leased by a relay right now)."""
        return self.filter(status=PENDING)

    def sent(self) -> OutboxEventQuerySet:
        return self.filter(status=SENT)

    def dead(self) -> OutboxEventQuerySet:
        return self.filter(status=DEAD)

    def due(self) -> OutboxEventQuerySet:
        """PENDING rows whose next_retry_time has passed, by the database clock."""
        return self.pending().filter(next_retry_time__lte=DbNow())

    def stale(self, older_than: float | timedelta) -> OutboxEventQuerySet:
        """PENDING rows created at least ``older_than`` ago (seconds or a timedelta)."""
        return self.pending().filter(created_at__lte=DbNow() - _seconds(older_than))

    def created_since(self, seconds: float | timedelta) -> OutboxEventQuerySet:
        return self.filter(created_at__gte=DbNow() - _seconds(seconds))

    def for_aggregate(self, aggregate_type: str, aggregate_id: str) -> OutboxEventQuerySet:
        return self.filter(aggregate_type=aggregate_type, aggregate_id=str(aggregate_id))

    def claim(
        self,
        limit: int,
        *,
        lease_seconds: float,
        token: str | None = None,
    ) -> tuple[str, list[OutboxEvent]]:
        """Lease up to ``limit`` rows of this queryset, oldest first, for one relay pass.

        Rows are locked with ``SELECT ... FOR UPDATE SKIP LOCKED`` in a short transaction
        that pushes ``next_retry_time`` forward by ``lease_seconds`` and stamps a fresh
        ``lease_token``; the transaction commits before this returns, so nothing is held
        open while the caller publishes. Another relay skips locked rows, and once committed
        the rows are no longer due until the lease runs out. Returns the token (settles are
        fenced on it) and the claimed rows. Call it on ``due()`` or ``stale()``.
        """
        token = token or uuid.uuid4().hex
        with transaction.atomic(using=self.db):
            rows = list(self.select_for_update(skip_locked=True).order_by("id")[:limit])
            if rows:
                self.model._default_manager.using(self.db).filter(
                    pk__in=[row.pk for row in rows]
                ).update(
                    next_retry_time=DbNow() + _seconds(lease_seconds),
                    lease_token=token,
                )
        for row in rows:
            row.lease_token = token
        return token, rows

    def held_by(self, token: str) -> OutboxEventQuerySet:
        """Rows still PENDING under the claim ``token``: the fence of every settle."""
        return self.filter(status=PENDING, lease_token=token)

    def status_counts(self) -> dict[int, int]:
        rows: Any = self.order_by().values_list("status").annotate(n=models.Count("id"))
        return {status: n for status, n in rows}
