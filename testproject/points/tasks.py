"""The points service as a Celery worker: the same award, as an idempotent task."""

from __future__ import annotations

from celery import shared_task

from django_outbox.celery import IdempotentTask
from django_outbox.message import ReceivedEvent

from .handlers import AwardPointsHandler
from .models import PointsLedger


@shared_task(base=IdempotentTask, name="points.award_points", dedup_model=PointsLedger)
def award_points(event: ReceivedEvent) -> None:
    """ORDER_CREATED -> one ledger row; a redelivered task hits the unique source_event_id."""
    AwardPointsHandler().handle(event)
