"""Outbox rows for tests: the one place that builds them.

- :func:`make_events` inserts rows at chosen ages, measured back from the database clock as
  the relay and the figures measure them;
- :func:`expire_leases` ends the leases of claimed rows, as if their relay had died;
- :func:`make_inbox` inserts consumer inbox rows processed at chosen ages (database clock);
- :func:`unsaved_event` builds a row that is never saved, only handed to the encoders, a
  backend or a consumer; :func:`wire_rows` is a batch of them whose every field shows on
  the wire; :func:`delivered` is a row as a consumer's transport hands it over, and
  :func:`decided` what a consumer made of a message.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from django.db import connections
from django.utils import timezone as django_timezone

from django_outbox.consumer import Action, Decision, HandlerResult, Outcome
from django_outbox.db import db_now
from django_outbox.message import Delivery, encode_body, encode_headers
from django_outbox.models import InboxMessage, OutboxEvent, Status, outbox_db

#: ``occurred_at`` of :func:`wire_rows`: microseconds, so that their encoding shows.
OCCURRED = datetime(2026, 5, 17, 8, 30, 15, 123456, tzinfo=timezone.utc)


def make_events(
    *specs: dict[str, Any] | tuple[str, str], using: str | None = None, **common: Any
) -> list[OutboxEvent]:
    """Insert one row per spec, in order (ids ascending), and return them with their ids.

    A spec is a dict of fields plus ``age`` (seconds since created_at, default 0),
    ``sent_age`` (since sent_at, for SENT rows; default ``age``) and ``due_age`` (since
    next_retry_time; default ``age``); or an ``(aggregate_type, aggregate_id)`` pair.
    ``common`` applies to every row, under each spec. ``using``: the database (default the
    outbox's).
    """
    using = outbox_db(using)
    now = db_now(using)
    rows = []
    for spec in specs:
        if isinstance(spec, tuple):
            spec = {"aggregate_type": spec[0], "aggregate_id": spec[1]}
        fields = {**common, **spec}
        age = fields.pop("age", 0.0)
        sent_age = fields.pop("sent_age", age)
        due_age = fields.pop("due_age", age)
        status = fields.pop("status", Status.PENDING)
        created = now - timedelta(seconds=age)
        rows.append(
            OutboxEvent(
                **{
                    "event_id": uuid.uuid4().hex,
                    "event_type": "ORDER_CREATED",
                    "aggregate_type": "ORDER",
                    "aggregate_id": "A-1",
                    "payload": {"n": 1},
                    "occurred_at": created,
                    "created_at": created,
                    "next_retry_time": now - timedelta(seconds=due_age),
                    "status": status,
                    "sent_at": now - timedelta(seconds=sent_age) if status == Status.SENT else None,
                    **fields,
                }
            )
        )
    if connections[using].features.can_return_rows_from_bulk_insert:
        return OutboxEvent.objects.using(using).bulk_create(rows, batch_size=2000)
    for row in rows:  # MySQL returns no ids from a bulk insert
        row.save(using=using, force_insert=True)
    return rows


def expire_leases(rows: Any = None) -> int:
    """End the lease of the claimed rows of ``rows`` (a queryset; default every row), as if
    their relay had frozen or died a lease ago: any relay may claim them again. Returns how
    many rows had a lease."""
    queryset = OutboxEvent.objects.all() if rows is None else rows
    return queryset.filter(leased_until__isnull=False).update(
        leased_until=db_now(queryset.db) - timedelta(seconds=1)
    )


def make_inbox(*ages_days: float, handler: str = "tests.Handler") -> list[InboxMessage]:
    """One inbox row per age: processed ``age`` days before the database clock's now.

    ``processed_at`` is ``auto_now_add``, so it is set by an update after the insert.
    """
    now = db_now()
    rows = []
    for age in ages_days:
        row = InboxMessage.objects.create(
            handler=handler, source_event_id=uuid.uuid4().hex, event_type="ORDER_CREATED"
        )
        InboxMessage.objects.filter(pk=row.pk).update(processed_at=now - timedelta(days=age))
        rows.append(row)
    return rows


def unsaved_event(
    event_type: str = "ORDER_CREATED", *, pk: int = 1, payload: Any = None, **fields: Any
) -> OutboxEvent:
    """A row with a pk that is never saved; its default payload is an order the points
    service's handler can award points for."""
    now = django_timezone.now()
    if payload is None:
        payload = {"order_id": pk, "number": f"N{pk}", "user_id": 7, "amount": Decimal("12.50")}
    return OutboxEvent(
        **{
            "pk": pk,
            "event_id": uuid.uuid4().hex,
            "event_type": event_type,
            "aggregate_type": "ORDER",
            "aggregate_id": f"N{pk}",
            "payload": payload,
            "headers": {},
            "occurred_at": now,
            "next_retry_time": now,
            "created_at": now,
            **fields,
        }
    )


def wire_rows(
    count: int, *, event_type: str = "ORDER_CREATED", start: int = 1
) -> list[OutboxEvent]:
    """Unsaved rows numbered from ``start``, as the relay hands them to a backend: a
    non-ASCII payload, a header of their own and :data:`OCCURRED`."""
    return [
        unsaved_event(
            event_type,
            pk=pk,
            aggregate_type="orders.Order",
            aggregate_id=f"A-{pk}",
            payload={"order_id": pk, "total": "12.50", "note": "über"},
            headers={"trace_id": f"t-{pk}"},
            occurred_at=OCCURRED,
            retry_count=0,
        )
        for pk in range(start, start + count)
    ]


def delivered(event: OutboxEvent, **fields: Any) -> Delivery:
    """``event`` as a native message that a consumer's transport delivered (``fields``
    change what it says: ``redelivered``, ``number``, ``content_type``, ...)."""
    return Delivery(
        encode_body(event),
        message_id=event.event_id,
        message_type=event.event_type,
        headers=encode_headers(event),
        **fields,
    )


def decided(outcome: Outcome, message_format: str = "", action: Action | None = None) -> Decision:
    """A consumer's decision on one message: its outcome, the format it came in (none:
    undecodable), and what the transport does (by default what the outcome implies)."""
    if action is None:
        retried = outcome in (Outcome.FAILED, Outcome.EARLY)
        action = (
            Action.ACKNOWLEDGE
            if outcome.acknowledge
            else Action.RETRY
            if retried
            else Action.DEAD_LETTER
        )
    results = (HandlerResult(outcome, message_format=message_format),) if message_format else ()
    return Decision(action, outcome, results)
