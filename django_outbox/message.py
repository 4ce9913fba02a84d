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
``x-outbox-replay``  replays only: how many times the event was published again
                    after it had been sent (``outbox_requeue --status sent``); a
                    replay keeps its ``message_id``, so a consumer that still has the
                    event in its inbox takes it as a duplicate
=================  ===========================================================

Nor may they use the names the broker and the consumer count deliveries in
(``x-delivery-count``, ``x-death``, ``x-first-death-*``, ``x-last-death-*``,
``x-outbox-*``): see :func:`is_reserved_header`.

A Celery task message (``django_outbox.backends.celery.CeleryBackend`` with a task
configured for the event type) carries the same fields as one JSON-compatible argument,
the *task envelope* built by :func:`encode_task_envelope`: ``event_id``, ``event_type``,
``payload`` and ``headers`` (the headers above included).

This is the ``native`` message format; :mod:`django_outbox.formats` adds the CloudEvents
ones (``OUTBOX_MESSAGE_FORMAT``), and :func:`decode` reads all of them.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from django.core.serializers.json import DjangoJSONEncoder
from django.utils.dateparse import parse_datetime

if TYPE_CHECKING:
    from .models import OutboxEvent

CONTENT_TYPE = "application/json"

# The message formats (OUTBOX_MESSAGE_FORMAT, django_outbox.formats), which decode() tells
# apart and ReceivedEvent.format names.
NATIVE = "native"
CLOUDEVENTS = "cloudevents"  # CloudEvents 1.0, binary content mode
CLOUDEVENTS_STRUCTURED = "cloudevents-structured"  # application/cloudevents+json
#: The values of OUTBOX_MESSAGE_FORMAT and of ReceivedEvent.format.
FORMATS = (NATIVE, CLOUDEVENTS, CLOUDEVENTS_STRUCTURED)
SPECVERSION = "1.0"
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
#: The prefix of the attribute headers the relay writes in binary mode: the separator every
#: version of the CloudEvents AMQP binding allows (its current draft prefers ``_``, and asks
#: receivers to read both).
CLOUDEVENTS_PREFIX = "cloudEvents:"
#: The prefixes binary mode is read with: the AMQP binding's two, and the RabbitMQ
#: binding's (Knative eventing-rabbitmq, the ``rabbitmq`` module of the Python SDK).
CLOUDEVENTS_READ_PREFIXES = ("cloudEvents:", "cloudEvents_", "ce-")
#: The attributes every CloudEvent has, besides specversion.
CLOUDEVENTS_REQUIRED = ("id", "source", "type")
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
#: Set by the relay on a replayed event: how many times it was replayed (1 for the first).
REPLAY_HEADER = "x-outbox-replay"
#: An event's own header that the RabbitMQ backend also publishes as the message's AMQP
#: ``priority`` property (an int, 0..255), which a priority queue (``x-max-priority``)
#: delivers by; the Django tasks backend sets it from a task's priority (docs/tasks.md).
PRIORITY_HEADER = "x-outbox-priority"
#: Where the CloudEvents AMQP binding puts an event's attributes (django_outbox.formats):
#: an own header there would be taken for one, or overwritten by the relay's.
CLOUDEVENTS_HEADER_PREFIXES = ("cloudEvents:", "cloudEvents_")


def is_reserved_header(name: str) -> bool:
    """Whether an event's own headers may not use ``name``: the relay sets it, the broker
    or the consumer counts deliveries in it, or it would read as a CloudEvents attribute.
    :data:`PRIORITY_HEADER` is the one ``x-outbox-`` name an event sets itself."""
    return name != PRIORITY_HEADER and (
        name in RESERVED_HEADERS
        or name in DELIVERY_HEADERS
        or name.startswith(DELIVERY_HEADER_PREFIXES)
        or name.startswith(CLOUDEVENTS_HEADER_PREFIXES)
    )


# One encoder for every body (it keeps no state between calls): compact, UTF-8 as is.
_BODY_ENCODER = DjangoJSONEncoder(ensure_ascii=False, separators=(",", ":"))


def encode_json(value: Any) -> str:
    """``value`` as compact JSON, as a body is encoded (Decimal, datetime and UUID as text)."""
    return _BODY_ENCODER.encode(value)


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
    # Set by the claim on ordered rows only (django_outbox.ordering).
    if event.previous_sequence is not None:
        headers["previous_sequence"] = event.previous_sequence
    # getattr: a row built by hand (a test, a custom backend) may not carry the column.
    if getattr(event, "replay_count", 0):
        headers[REPLAY_HEADER] = event.replay_count
    return headers


# -- text headers (NATS): every value a string ---------------------------------------------
#: A NATS message's event_type (what AMQP carries in its ``type`` property).
TYPE_HEADER = "x-outbox-type"
#: The names of a NATS message's headers whose values are JSON, ``,`` between them: an
#: event's own header that is not text (a number, a list) keeps its type on the way.
JSON_HEADERS = "x-outbox-json"
#: The relay's headers whose values are integers: written as digits, which :func:`decode`
#: reads as integers, whatever the transport.
INTEGER_HEADERS = frozenset({"attempt", "sequence", "previous_sequence", REPLAY_HEADER})
# What a header value may carry as it is: printable US-ASCII but space, '"' and '%', the
# characters the CloudEvents NATS binding percent-encodes (every other one is encoded).
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')
_NEEDS_ESCAPE = re.compile(f"[^{re.escape(_HEADER_SAFE)}]")


def escape_header_value(value: str) -> str:
    """``value`` as a text header's value: percent-encoded as the CloudEvents NATS protocol
    binding says (space, ``"``, ``%`` and every character outside printable US-ASCII, as
    its UTF-8 bytes), so that any client reads it back whole."""
    if _NEEDS_ESCAPE.search(value) is None:
        return value
    return quote(value, safe=_HEADER_SAFE)


def unescape_header_value(value: str) -> str:
    """The value :func:`escape_header_value` encoded (a double-quoted value, which older
    CloudEvents senders wrote, is unquoted first); a value that is not valid percent-encoded
    UTF-8 comes back as it is."""
    if len(value) > 1 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    if "%" not in value:
        return value
    try:
        return unquote(value, errors="strict")
    except UnicodeDecodeError:
        return value


def encode_text_headers(headers: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``headers`` (:func:`encode_headers`' or a format's) as name and text pairs, for a
    transport whose header values are text: the relay's integers as digits, any other
    value that is not text as JSON (its name listed in :data:`JSON_HEADERS`), each value
    escaped (:func:`escape_header_value`)."""
    pairs: list[tuple[str, str]] = []
    typed: list[str] = []
    for name, value in headers.items():
        if not isinstance(value, str):
            if name in INTEGER_HEADERS and type(value) is int:
                value = str(value)
            else:
                typed.append(name)
                value = _BODY_ENCODER.encode(value)
        pairs.append((name, escape_header_value(value)))
    if typed:
        pairs.append((JSON_HEADERS, ",".join(typed)))
    return pairs


def decode_text_headers(headers: Mapping[str, str]) -> dict[str, Any]:
    """What :func:`encode_text_headers` wrote, read back: each value unescaped, the ones
    listed in :data:`JSON_HEADERS` parsed (a value that is not JSON stays text)."""
    typed = set(filter(None, str(headers.get(JSON_HEADERS, "")).split(",")))
    decoded: dict[str, Any] = {}
    for name, value in headers.items():
        if name == JSON_HEADERS:
            continue
        text = unescape_header_value(value) if isinstance(value, str) else value
        if name in typed:
            with contextlib.suppress(TypeError, ValueError, RecursionError):
                text = json.loads(text)
        decoded[name] = text
    return decoded


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
    #: How many times the producer replayed this event after it had been sent (0: never;
    #: the ``x-outbox-replay`` header). A replay keeps its ``event_id``.
    replay: int = 0
    #: The format the message came in (django_outbox.formats): "native", "cloudevents"
    #: (CloudEvents binary content mode) or "cloudevents-structured".
    format: str = NATIVE
    #: A CloudEvent's context attributes (specversion, id, source, type, subject, time as a
    #: datetime, extensions), whoever sent it; empty for a native message.
    cloudevent: Mapping[str, Any] = field(default_factory=dict)


class UndecodableMessage(ValueError):
    """A delivered message is not a well-formed outbox event: no message_id or type, a body
    that is not JSON, a content type that is not JSON, or a reserved header of the wrong type
    or out of range. Its text says which; the consumer dead-letters the message with it."""


# The columns a consumer stores these in (OutboxEvent, InboxMessage, AggregateSequence):
# a longer value could only fail later, inside the handler's transaction, on every retry.
MAX_EVENT_ID_LENGTH = 64
MAX_EVENT_TYPE_LENGTH = 128
MAX_AGGREGATE_LENGTH = 64
# sequence and previous_sequence are outbox row ids: a BigAutoField (signed 64-bit).
MAX_SEQUENCE = 2**63 - 1


@dataclass(frozen=True)
class Delivery:
    """One message as a transport delivered it: what decoding and the dispatcher need, and
    nothing of the broker's client (the seam between a transport and the consumer).

    ``message_id``, ``message_type``, ``headers`` and ``content_type`` are what the publisher
    set, unchecked: :func:`decode` checks them.
    """

    body: bytes
    message_id: Any = None
    message_type: Any = None
    headers: Any = None
    content_type: str | None = None
    #: The broker says it delivered this message before (AMQP ``redelivered``).
    redelivered: bool = False
    #: Which delivery of the message this is, 1 for the first, as the transport counts them.
    number: int = 1
    #: Why the transport could not count the deliveries (a publisher set the header the
    #: count is kept in); ``""`` when it could. A failure then cannot be retried safely.
    count_error: str = ""
    #: The transport it came through ("amqp", "locmem", ...), for log lines.
    transport: str = ""


def decode(delivery: Delivery) -> ReceivedEvent:
    """Rebuild the event from a delivered message, in any format the relay publishes
    (:mod:`django_outbox.formats`): a CloudEvent in structured mode by its content type, in
    binary mode by a ``specversion`` attribute header, else native.

    Raises :class:`UndecodableMessage` (and nothing else) for a message that is not a
    well-formed outbox event, whatever its properties, headers and body hold.
    """
    body, message_id, message_type = delivery.body, delivery.message_id, delivery.message_type
    headers, content_type = delivery.headers, delivery.content_type
    redelivered = delivery.redelivered
    if content_type and content_type[:23].lower() == "application/cloudevents":
        return _decode_structured(
            body,
            message_id=message_id,
            headers=_table(headers, message_id),
            redelivered=redelivered,
            content_type=content_type,
        )
    if headers:
        table = _table(headers, message_id)
        prefix = _binary_prefix(table)
        if prefix:
            return _decode_binary(
                body,
                prefix=prefix,
                message_id=message_id,
                headers=table,
                redelivered=redelivered,
                content_type=content_type,
            )
    if not message_id:
        raise UndecodableMessage(
            "the message is not an outbox event: it has no message_id (the event_id) and is "
            "no CloudEvent either (no cloudEvents:specversion header, content type not "
            "application/cloudevents+json)"
        )
    if not message_type:
        raise UndecodableMessage(f"message {_shown(message_id)} has no type (the event_type)")
    if content_type and not _is_json(content_type):
        raise UndecodableMessage(
            f"message {_shown(message_id)} has content type {_shown(content_type)}, not "
            f"{CONTENT_TYPE}"
        )
    try:
        # UTF-8 only (RFC 8259 for JSON between systems; the relay writes UTF-8): given
        # bytes, json.loads would guess UTF-16 or UTF-32 from NUL bytes and take b"\x002"
        # for the number 2.
        payload = json.loads(body.decode("utf-8") if isinstance(body, bytes) else body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: a body nested deeper than the interpreter's recursion limit.
        raise UndecodableMessage(
            f"message {_shown(message_id)} body is not JSON: {type(exc).__name__}: {exc}"
        ) from exc
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


def _table(headers: Any, message_id: Any) -> Mapping[str, Any]:
    if not isinstance(headers, Mapping):
        raise UndecodableMessage(
            f"message {_shown(message_id)}: headers are a {type(headers).__name__}, not a table"
        )
    return headers


def _received(
    message_id: Any,
    message_type: Any,
    payload: Any,
    headers: Any,
    redelivered: bool,
    *,
    format: str = NATIVE,
    cloudevent: Mapping[str, Any] | None = None,
    occurred_at: datetime | None = None,
) -> ReceivedEvent:
    """The event, from values a publisher chose: every one is checked, and a wrong one raises
    :class:`UndecodableMessage` naming it (never a ``ValueError`` or ``TypeError`` from deep
    inside, which a consumer would take for a handler failure or die of)."""
    event_id = _text(message_id, "message_id", MAX_EVENT_ID_LENGTH, message_id)
    if headers is not None and not isinstance(headers, Mapping):
        raise UndecodableMessage(
            f"message {_shown(event_id)}: headers are a {type(headers).__name__}, not a table"
        )
    headers = dict(headers or {})
    own = {k: v for k, v in headers.items() if k not in RESERVED_HEADERS and k != REPLAY_HEADER}
    attempt = _integer(headers, "attempt", 1, event_id)
    replay = _integer(headers, REPLAY_HEADER, 1, event_id)
    return ReceivedEvent(
        event_id=event_id,
        event_type=_text(message_type, "type", MAX_EVENT_TYPE_LENGTH, event_id),
        payload=payload,
        aggregate_type=_text(
            headers.get("aggregate_type"), "aggregate_type", MAX_AGGREGATE_LENGTH, event_id
        ),
        aggregate_id=_text(
            headers.get("aggregate_id"), "aggregate_id", MAX_AGGREGATE_LENGTH, event_id
        ),
        occurred_at=occurred_at or _datetime(headers.get("occurred_at"), event_id),
        attempt=1 if attempt is None else attempt,
        sequence=_integer(headers, "sequence", 1, event_id),
        previous_sequence=_integer(headers, "previous_sequence", 0, event_id),
        headers=own,
        redelivered=redelivered,
        replay=replay or 0,
        format=format,
        cloudevent=cloudevent or {},
    )


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut: a reason names the bad value without carrying all of it."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == CONTENT_TYPE or (media.startswith("application/") and media.endswith("+json"))


def _text(value: Any, name: str, max_length: int, event_id: Any) -> str:
    """A text property or header: a string, UTF-8 bytes or an integer; None is ``""``."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            raise UndecodableMessage(
                f"message {_shown(event_id)}: {name} {_shown(value)} is not UTF-8"
            ) from None
    elif isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise UndecodableMessage(
            f"message {_shown(event_id)}: {name} is a {type(value).__name__}, not text"
        )
    if len(value) > max_length:
        raise UndecodableMessage(
            f"message {_shown(event_id)}: {name} is {len(value)} characters long, more than "
            f"{max_length}"
        )
    return value


def _integer(headers: Mapping[str, Any], name: str, minimum: int, event_id: str) -> int | None:
    """An integer header from ``minimum`` to :data:`MAX_SEQUENCE` (a string of digits too,
    as other publishers send); None when absent."""
    value = headers.get(name)
    if value is None:
        return None
    number = value
    if isinstance(value, (str, bytes)) and value.isascii() and value.strip().isdigit():
        number = int(value)
    if (
        isinstance(number, int)
        and not isinstance(number, bool)
        and minimum <= number <= MAX_SEQUENCE
    ):
        return number
    raise UndecodableMessage(
        f"message {_shown(event_id)}: header {name} is {_shown(value)}, not an integer from "
        f"{minimum} to {MAX_SEQUENCE}"
    )


def _datetime(value: Any, event_id: str) -> datetime | None:
    """``occurred_at``: ISO 8601 text (what the relay sends) or an AMQP timestamp."""
    if value is None or isinstance(value, datetime):
        return value
    parsed = None
    if isinstance(value, str):
        try:
            parsed = parse_datetime(value)
        except ValueError:  # well formed but not a date: 2024-13-45
            parsed = None
    if parsed is None:
        raise UndecodableMessage(
            f"message {_shown(event_id)}: header occurred_at is {_shown(value)}, not an ISO "
            "8601 date and time"
        )
    return parsed


# -- CloudEvents (django_outbox.formats writes them) ---------------------------------------


def _binary_prefix(headers: Mapping[str, Any]) -> str:
    """The prefix a binary-mode CloudEvent's attributes have in ``headers``; ``""`` when
    they hold none (no ``specversion`` under any prefix): not a binary-mode CloudEvent."""
    for prefix in CLOUDEVENTS_READ_PREFIXES:
        if prefix + "specversion" in headers:
            return prefix
    return ""


def _decode_binary(
    body: bytes,
    *,
    prefix: str,
    message_id: Any,
    headers: Mapping[str, Any],
    redelivered: bool,
    content_type: str | None,
) -> ReceivedEvent:
    """A binary-mode CloudEvent: attributes in ``prefix``-ed headers, the body its data."""
    attributes: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for name, value in headers.items():
        if isinstance(name, str) and name.startswith(CLOUDEVENTS_READ_PREFIXES):
            # One prefix per message (the binding says so); others are the sender's own,
            # unless they give an attribute another value (_check_agree).
            if name.startswith(prefix):
                attributes[name[len(prefix) :]] = value
            continue
        plain[name] = value
    shown = attributes.get("id") or message_id
    _check_agree(attributes, prefix, headers, shown)
    # The AMQP content type is the datacontenttype; none means JSON, as for native messages.
    if content_type and not _is_json(content_type):
        raise UndecodableMessage(
            f"CloudEvent {_shown(shown)} has datacontenttype {_shown(content_type)}; the "
            f"consumer reads {CONTENT_TYPE} data only"
        )
    payload = _json_data(body, shown, "body")
    return _cloudevent(attributes, payload, plain, redelivered, CLOUDEVENTS, f"header {prefix}")


def _decode_structured(
    body: bytes,
    *,
    message_id: Any,
    headers: Mapping[str, Any] | None,
    redelivered: bool,
    content_type: str,
) -> ReceivedEvent:
    """A structured-mode CloudEvent: the JSON event format object as the body."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media != STRUCTURED_CONTENT_TYPE:
        raise UndecodableMessage(
            f"message {_shown(message_id)} is a CloudEvent in the event format "
            f"{_shown(media)}; the consumer reads {STRUCTURED_CONTENT_TYPE} only"
        )
    envelope = _json_data(body, message_id, "body")
    if not isinstance(envelope, dict):
        raise UndecodableMessage(
            f"message {_shown(message_id)}: a {STRUCTURED_CONTENT_TYPE} body is a "
            f"{type(envelope).__name__}, not a JSON object"
        )
    shown = envelope.get("id") or message_id
    data_type = envelope.get("datacontenttype")
    if data_type is not None and not (isinstance(data_type, str) and _is_json(data_type)):
        raise UndecodableMessage(
            f"CloudEvent {_shown(shown)} has datacontenttype {_shown(data_type)}; the "
            f"consumer reads {CONTENT_TYPE} data only"
        )
    attributes = {k: v for k, v in envelope.items() if k not in ("data", "data_base64")}
    time = attributes.get("time")
    if time is not None and not isinstance(time, str):
        # The JSON event format writes a Timestamp as a string, and nothing else.
        raise UndecodableMessage(
            f"CloudEvent {_shown(shown)}: time is {_shown(time)}, a JSON "
            f"{_json_type(time)}; the JSON event format writes it as an RFC 3339 string"
        )
    if envelope.get("data") is not None and envelope.get("data_base64") is not None:
        raise UndecodableMessage(
            f"CloudEvent {_shown(shown)} has both data and data_base64; the JSON event "
            "format allows one of them"
        )
    _check_agree(attributes, "", headers or {}, shown)
    if envelope.get("data_base64") is not None:
        try:
            data = base64.b64decode(envelope["data_base64"], validate=True)
        except (TypeError, ValueError, binascii.Error) as exc:
            raise UndecodableMessage(
                f"CloudEvent {_shown(shown)}: data_base64 is not base64: {exc}"
            ) from exc
        payload = _json_data(data, shown, "data_base64")
    else:
        payload = envelope.get("data")
    plain = {
        k: v
        for k, v in (headers or {}).items()
        if not str(k).startswith(CLOUDEVENTS_HEADER_PREFIXES)
    }
    return _cloudevent(attributes, payload, plain, redelivered, CLOUDEVENTS_STRUCTURED, "")


def _check_agree(
    attributes: Mapping[str, Any], prefix: str, headers: Mapping[str, Any], shown: Any
) -> None:
    """Raise :class:`UndecodableMessage` if a header under any CloudEvents prefix gives one
    of ``attributes`` (read from the headers under ``prefix``, or from the body when
    ``prefix`` is empty) another value: the message would carry two events, two ids to
    de-duplicate on or two types to dispatch on, and which one is meant is a guess."""
    for name, value in headers.items():
        attribute = _unprefixed(name)
        ours = attributes.get(attribute) if attribute else None
        if ours is None or value is None or _agree(attribute, ours, value):
            continue
        where = f"header {prefix}{attribute}" if prefix else "the body"
        raise UndecodableMessage(
            f"CloudEvent {_shown(shown)}: {attribute} is {_shown(ours)} in {where} and "
            f"{_shown(value)} in header {name}; a message carries one event"
        )


def _unprefixed(name: Any) -> str:
    """The attribute a header names under a CloudEvents prefix; ``""`` for another header."""
    if isinstance(name, str):
        for prefix in CLOUDEVENTS_READ_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix) :]
    return ""


def _agree(attribute: str, one: Any, other: Any) -> bool:
    one, other = (v.decode(errors="replace") if isinstance(v, bytes) else v for v in (one, other))
    if one == other:
        return True
    if attribute != "time":
        return False
    try:  # the same moment written two ways (RFC 3339 text, an AMQP timestamp)
        moments = [_time(v, "") for v in (one, other)]
    except UndecodableMessage:
        return False
    # pika reads an AMQP timestamp as a naive datetime in UTC.
    return len({m.replace(tzinfo=m.tzinfo or timezone.utc) for m in moments if m}) == 1


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "array" if isinstance(value, list) else "object"


def _json_data(data: bytes, shown: Any, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UndecodableMessage(
            f"CloudEvent {_shown(shown)}: the {what} is not JSON: {type(exc).__name__}: {exc}"
        ) from exc


def _cloudevent(
    attributes: dict[str, Any],
    payload: Any,
    headers: dict[str, Any],
    redelivered: bool,
    format: str,
    where: str,
) -> ReceivedEvent:
    """The event from a CloudEvent's attributes: each required one present and well formed,
    else :class:`UndecodableMessage` naming it (``where`` says where it was looked for)."""
    for name, value in attributes.items():
        if isinstance(value, bytes):
            attributes[name] = _text(value, f"CloudEvents attribute {name}", len(value), "")
    shown = attributes.get("id")
    specversion = attributes.get("specversion")
    if specversion != SPECVERSION:
        raise UndecodableMessage(
            f"CloudEvent {_shown(shown)} has specversion {_shown(specversion)}; the consumer "
            f"reads CloudEvents {SPECVERSION}"
        )
    for name in CLOUDEVENTS_REQUIRED:
        value = attributes.get(name)
        if not (isinstance(value, str) and value):
            problem = "is missing" if value is None else f"is {_shown(value)}, not text"
            location = f" ({where}{name})" if where else ""
            raise UndecodableMessage(
                f"CloudEvent {_shown(shown)}: the required attribute {name}{location} {problem}"
            )
    event_id = _text(attributes["id"], "CloudEvents id", MAX_EVENT_ID_LENGTH, attributes["id"])
    time = attributes.get("time")
    occurred_at = _time(time, event_id) if time is not None else None
    if occurred_at is not None:
        attributes["time"] = occurred_at
    return _received(
        event_id,
        attributes["type"],
        payload,
        headers,
        redelivered,
        format=format,
        cloudevent=attributes,
        occurred_at=occurred_at,
    )


def _time(value: Any, event_id: str) -> datetime | None:
    """``time``: RFC 3339 text (the canonical form), an AMQP timestamp (a datetime, as pika
    reads one) or milliseconds since the epoch (an AMQP 1.0 timestamp as a number, what the
    Python SDK's AMQP binding writes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value / 1000, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            pass
    elif isinstance(value, (str, datetime)):
        try:
            return _datetime(value, event_id)
        except UndecodableMessage:
            pass
    raise UndecodableMessage(
        f"CloudEvent {_shown(event_id)}: time is {_shown(value)}, not an RFC 3339 timestamp"
    )
