"""The wire format of an outbox event: one place for the relay's and the consumer's side.

A message carries the payload as its JSON body and everything else in AMQP properties:
``message_id`` is the event_id, ``type`` the event_type, ``timestamp`` the occurred_at
(whole seconds), and these headers, which the event's own headers may not use:

=================  ===========================================================
``aggregate_type``  e.g. ``orders.Order``
``aggregate_id``    e.g. ``42``
``occurred_at``     business time, ISO 8601 with microseconds and offset
``attempt``         1 for the first publish of the row, 2 for its first retry, ...
``sequence``        the outbox row id: increasing in commit order per database
``previous_sequence``  ordered mode only: the ``sequence`` of the aggregate's previous
                    event that was published (0 when there is none): a consumer that
                    has not processed it yet knows this event came early
=================  ===========================================================

Nor may they use the names the broker and the consumer count deliveries in
(``x-delivery-count``, ``x-death``, ``x-first-death-*``, ``x-last-death-*``,
``x-outbox-*``): see :func:`is_reserved_header`.

A Celery task message (``django_outbox.backends.celery.CeleryBackend`` with a task
configured for the event type) carries the same fields as one JSON-compatible argument,
the *task envelope* built by :func:`encode_task_envelope`: ``event_id``, ``event_type``,
``payload`` and ``headers`` (the headers above included).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.core.serializers.json import DjangoJSONEncoder
from django.utils.dateparse import parse_datetime

if TYPE_CHECKING:
    from .models import OutboxEvent

CONTENT_TYPE = "application/json"
RESERVED_HEADERS = frozenset(
    {"aggregate_type", "aggregate_id", "occurred_at", "attempt", "sequence", "previous_sequence"}
)
#: Where the broker and the consumer count deliveries (a quorum queue's x-delivery-count,
#: a classic queue consumer's x-outbox-delivery) and RabbitMQ records dead-lettering
#: (x-death, x-first-death-*, x-last-death-*). A producer that set one would change how
#: often its message is retried, so an event's own headers may not use them, nor any other
#: name in this package's x-outbox- namespace.
DELIVERY_HEADERS = frozenset({"x-delivery-count", "x-death"})
DELIVERY_HEADER_PREFIXES = ("x-outbox-", "x-first-death-", "x-last-death-")


def is_reserved_header(name: str) -> bool:
    """Whether an event's own headers may not use ``name``: the relay sets it, or the
    broker or the consumer counts deliveries in it."""
    return (
        name in RESERVED_HEADERS
        or name in DELIVERY_HEADERS
        or name.startswith(DELIVERY_HEADER_PREFIXES)
    )


# One encoder for every body (it keeps no state between calls): compact, UTF-8 as is.
_BODY_ENCODER = DjangoJSONEncoder(ensure_ascii=False, separators=(",", ":"))


def encode_body(event: OutboxEvent) -> bytes:
    return _BODY_ENCODER.encode(event.payload).encode()


def encode_headers(event: OutboxEvent) -> dict[str, Any]:
    headers: dict[str, Any] = dict(event.headers or {})
    headers.update(
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        occurred_at=event.occurred_at.isoformat(),
        attempt=event.retry_count + 1,
        sequence=event.pk,
    )
    # Set by the claim on ordered rows only (OutboxEventQuerySet.claim).
    previous = getattr(event, "previous_sequence", None)
    if previous is not None:
        headers["previous_sequence"] = previous
    return headers


def encode_task_envelope(event: OutboxEvent) -> dict[str, Any]:
    """The event as the single argument of a Celery task (plain JSON types only)."""
    # Through the JSON encoder and back: Decimal, datetime and UUID become strings, as they
    # would in a message body, whatever serializer the Celery app uses.
    payload = json.loads(encode_body(event))
    headers = json.loads(json.dumps(encode_headers(event), cls=DjangoJSONEncoder))
    return {
        "event_id": event.event_id,
        "event_type": event.event_type,
        "payload": payload,
        "headers": headers,
    }


@dataclass(frozen=True)
class ReceivedEvent:
    """An event as a consumer sees it, rebuilt from a delivered message."""

    event_id: str
    event_type: str
    payload: Any
    aggregate_type: str = ""
    aggregate_id: str = ""
    occurred_at: datetime | None = None
    attempt: int = 1
    sequence: int | None = None
    #: Ordered events only: the sequence of the aggregate's previous event (0: none).
    previous_sequence: int | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    redelivered: bool = False


class UndecodableMessage(ValueError):
    """A delivered message is not an outbox event (no message_id/type, or not JSON)."""


def decode(
    body: bytes,
    *,
    message_id: str | None,
    message_type: str | None,
    headers: Mapping[str, Any] | None,
    redelivered: bool = False,
) -> ReceivedEvent:
    """Rebuild the event from a message body and its AMQP properties."""
    if not message_id:
        raise UndecodableMessage("the message has no message_id (the outbox event_id)")
    if not message_type:
        raise UndecodableMessage(f"message {message_id} has no type (the event_type)")
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise UndecodableMessage(f"message {message_id} body is not JSON: {exc}") from exc
    return _received(message_id, message_type, payload, headers, redelivered)


def decode_task_envelope(envelope: Any, *, redelivered: bool = False) -> ReceivedEvent:
    """Rebuild the event from a Celery task's argument (see :func:`encode_task_envelope`)."""
    if isinstance(envelope, ReceivedEvent):
        return envelope
    if not isinstance(envelope, Mapping):
        raise UndecodableMessage(
            f"a task argument of type {type(envelope).__name__} is not an outbox event "
            "envelope (a dict with event_id, event_type, payload and headers)"
        )
    if not envelope.get("event_id"):
        raise UndecodableMessage("the task envelope has no event_id")
    if not envelope.get("event_type"):
        raise UndecodableMessage(f"task envelope {envelope['event_id']} has no event_type")
    return _received(
        envelope["event_id"],
        envelope["event_type"],
        envelope.get("payload"),
        envelope.get("headers"),
        redelivered,
    )


def _received(
    message_id: Any,
    message_type: Any,
    payload: Any,
    headers: Mapping[str, Any] | None,
    redelivered: bool,
) -> ReceivedEvent:
    headers = dict(headers or {})
    own = {k: v for k, v in headers.items() if k not in RESERVED_HEADERS}
    occurred_raw = headers.get("occurred_at")
    occurred = parse_datetime(occurred_raw) if isinstance(occurred_raw, str) else None
    sequence = headers.get("sequence")
    previous = headers.get("previous_sequence")

    def _text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value or "")

    return ReceivedEvent(
        event_id=_text(message_id),
        event_type=_text(message_type),
        payload=payload,
        aggregate_type=_text(headers.get("aggregate_type")),
        aggregate_id=_text(headers.get("aggregate_id")),
        occurred_at=occurred,
        attempt=int(headers.get("attempt") or 1),
        sequence=int(sequence) if sequence is not None else None,
        previous_sequence=int(previous) if previous is not None else None,
        headers=own,
        redelivered=redelivered,
    )
