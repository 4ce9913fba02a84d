"""Consumer tasks used by the Celery tests (the worker loads them with --include)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import shared_task
from django.db import connection

from django_outbox.celery import IdempotentTask
from django_outbox.message import ReceivedEvent
from points.handlers import AwardPointsHandler
from points.models import PointsLedger

#: Calls of failing_award, per event id (eager tests only: same process).
calls: dict[str, int] = {}


@shared_task(base=IdempotentTask, name="tests.inbox_award")
def inbox_award(event: ReceivedEvent) -> str:
    """Inbox style: de-duplicated by an InboxMessage row named after the task."""
    PointsLedger.objects.create(
        source_event_id=f"inbox-{event.event_id}", user_id=1, order_number="x", points=1
    )
    return f"awarded {event.event_id}"


@shared_task(
    base=IdempotentTask, name="tests.failing_award", dedup_model=PointsLedger, max_retries=2
)
def failing_award(event: ReceivedEvent) -> None:
    """Writes its ledger row, then raises: rolled back and retried, then the task fails."""
    calls[event.event_id] = calls.get(event.event_id, 0) + 1
    AwardPointsHandler().handle(event)
    raise RuntimeError("boom after the write")


@shared_task(base=IdempotentTask, name="tests.blocking_award", dedup_model=PointsLedger)
def blocking_award(event: ReceivedEvent) -> None:
    """Writes the row, announces it in a file, then waits there: the test kills the worker."""
    AwardPointsHandler().handle(event)
    marker = Path(os.environ["CELERY_BLOCK_FILE"])
    if not marker.exists():
        marker.write_text(event.event_id)
        while marker.exists():
            time.sleep(0.05)


@shared_task(
    base=IdempotentTask, name="tests.database_fault_award", dedup_model=PointsLedger, max_retries=1
)
def database_fault_award(event: ReceivedEvent) -> None:
    """Its database refuses the first four calls (a table not migrated yet), then it works."""
    calls[event.event_id] = calls.get(event.event_id, 0) + 1
    if calls[event.event_id] <= 4:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM table_not_migrated_yet")
    AwardPointsHandler().handle(event)
