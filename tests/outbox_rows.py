"""Rows with chosen ages for the monitoring tests (admin, stats, metrics, outbox_stats).

Ages are measured back from the database clock, as the figures themselves are.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from django_outbox.models import OutboxEvent, Status
from django_outbox.stats import db_now


def make_events(*specs: dict[str, Any]) -> list[OutboxEvent]:
    """Insert one row per spec: status, retry_count, age (s), sent_age (s), event_type, ..."""
    now = db_now()
    rows = []
    for spec in specs:
        spec = dict(spec)
        age = spec.pop("age", 0.0)
        sent_age = spec.pop("sent_age", None)
        status = spec.pop("status", Status.PENDING)
        created = now - timedelta(seconds=age)
        fields: dict[str, Any] = {
            "event_id": uuid.uuid4().hex,
            "event_type": "ORDER_CREATED",
            "aggregate_type": "ORDER",
            "aggregate_id": "A-1",
            "payload": {"n": 1},
            "occurred_at": created,
            "created_at": created,
            "next_retry_time": created,
            "status": status,
            "sent_at": (
                now - timedelta(seconds=sent_age if sent_age is not None else age)
                if status == Status.SENT
                else None
            ),
        }
        fields.update(spec)
        rows.append(OutboxEvent(**fields))
    return OutboxEvent.objects.bulk_create(rows)
