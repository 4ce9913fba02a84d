"""The message formats the relay can publish in, and reading CloudEvents on the consumer side.

``OUTBOX_MESSAGE_FORMAT`` chooses one for the whole relay:

``native`` (the default)
    The format of :mod:`django_outbox.message`: the payload as the JSON body, the event in
    AMQP properties (``message_id``, ``type``, ``timestamp``) and headers.
``cloudevents``
    The native message, plus the event's CloudEvents 1.0 context attributes in headers
    prefixed ``cloudEvents:``: the *binary content mode* of the CloudEvents AMQP protocol
    binding. ``content_type`` (``application/json``) is the ``datacontenttype`` and the
    body, the payload, is the event ``data``, both as in ``native``.
``cloudevents-structured``
    The native properties and headers, with the whole event as the body: a CloudEvents
    JSON event format object (``content_type`` ``application/cloudevents+json``) whose
    ``data`` is the payload.

The attributes: ``specversion`` ``1.0``, ``id`` the event_id, ``source``
``OUTBOX_CLOUDEVENTS_SOURCE``, ``type`` the event_type, ``subject``
``<aggregate_type>/<aggregate_id>`` (left out when the event has no aggregate), ``time``
the occurred_at (RFC 3339, microseconds and offset).

A format is chosen once, when a backend is built (:func:`get_format`): the backend binds
its ``content_type``, ``encode_body`` and ``encode_headers`` and calls them for every
event, so the native format costs per event what it did before there were formats.

The consumer reads every format whatever the relay's setting, from any producer
(:func:`django_outbox.message.decode`, which this module's encoders build on: the reading
side lives there so that ``message`` imports nothing of the app).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.utils import timezone as django_timezone

from .conf import outbox_settings
from .exceptions import ImproperlyConfiguredBackend
from .message import (
    _BODY_ENCODER,
    CLOUDEVENTS,
    CLOUDEVENTS_PREFIX,
    CLOUDEVENTS_STRUCTURED,
    CONTENT_TYPE,
    FORMATS,
    NATIVE,
    SPECVERSION,
    STRUCTURED_CONTENT_TYPE,
    encode_body,
    encode_headers,
)

if TYPE_CHECKING:
    from .models import OutboxEvent

__all__ = [
    "AMQP_BINDING",
    "CLOUDEVENTS",
    "CLOUDEVENTS_STRUCTURED",
    "FORMATS",
    "NATIVE",
    "NATS_BINDING",
    "Binding",
    "MessageFormat",
    "default_source",
    "get_format",
]


@dataclass(frozen=True)
class MessageFormat:
    """How a backend turns an event into a message: one per OUTBOX_MESSAGE_FORMAT value."""

    name: str
    #: The AMQP ``content_type`` of every message.
    content_type: str
    encode_body: Callable[[OutboxEvent], bytes]
    encode_headers: Callable[[OutboxEvent], dict[str, Any]]


@dataclass(frozen=True)
class Binding:
    """Where a CloudEvents protocol binding puts an event's attributes in binary mode."""

    #: The prefix of the attribute headers.
    prefix: str
    #: ``datacontenttype`` is an attribute header too (NATS), not only the protocol's own
    #: content type (AMQP).
    datacontenttype: bool = False


#: The AMQP binding (RabbitMQ, Celery): ``cloudEvents:`` headers.
AMQP_BINDING = Binding(CLOUDEVENTS_PREFIX)
#: The NATS binding: ``ce-`` headers, ``ce-datacontenttype`` among them (a transport whose
#: header values are text percent-encodes them: message.encode_text_headers()).
NATS_BINDING = Binding("ce-", datacontenttype=True)


def get_format(
    name: str | None = None, *, source: str | None = None, binding: Binding = AMQP_BINDING
) -> MessageFormat:
    """The format named ``name`` (default: OUTBOX_MESSAGE_FORMAT), its CloudEvents
    ``source`` from ``source`` (default: :func:`default_source`), its binary mode's
    attribute headers as ``binding`` says (default: the AMQP binding's)."""
    name = outbox_settings.MESSAGE_FORMAT if name is None else name
    if name == NATIVE:
        return _NATIVE
    if name not in FORMATS:
        raise ImproperlyConfiguredBackend(
            f"OUTBOX_MESSAGE_FORMAT is {name!r}; use one of {', '.join(map(repr, FORMATS))}."
        )
    source = default_source() if source is None else source
    attributes = _attributes_function(source)
    if name == CLOUDEVENTS:
        prefix = binding.prefix

        def binary_headers(event: OutboxEvent) -> dict[str, Any]:
            headers = encode_headers(event)
            for attribute, value in attributes(event).items():
                headers[prefix + attribute] = value
            if binding.datacontenttype:
                headers[prefix + "datacontenttype"] = CONTENT_TYPE
            return headers

        return MessageFormat(name, CONTENT_TYPE, encode_body, binary_headers)

    def structured_body(event: OutboxEvent) -> bytes:
        envelope = attributes(event)
        envelope["datacontenttype"] = CONTENT_TYPE
        envelope["data"] = event.payload
        return _BODY_ENCODER.encode(envelope).encode()

    return MessageFormat(name, STRUCTURED_CONTENT_TYPE, structured_body, encode_headers)


_NATIVE = MessageFormat(NATIVE, CONTENT_TYPE, encode_body, encode_headers)


def default_source() -> str:
    """OUTBOX_CLOUDEVENTS_SOURCE, else ``/`` and the top package of the settings module
    (``/mysite`` for ``mysite.settings``): the same for every process of one project."""
    source = outbox_settings.CLOUDEVENTS_SOURCE
    if source:
        return source
    module = getattr(settings, "SETTINGS_MODULE", "") or ""
    return "/" + (module.partition(".")[0] or "django-outbox")


def _attributes_function(source: str) -> Callable[[OutboxEvent], dict[str, Any]]:
    def attributes(event: OutboxEvent) -> dict[str, Any]:
        values = {
            "specversion": SPECVERSION,
            "id": event.event_id,
            "source": source,
            "type": event.event_type,
            "time": rfc3339(event.occurred_at),
        }
        subject = _subject(event.aggregate_type, event.aggregate_id)
        if subject:
            values["subject"] = subject
        return values

    return attributes


def _subject(aggregate_type: str, aggregate_id: str) -> str:
    if aggregate_type and aggregate_id:
        return f"{aggregate_type}/{aggregate_id}"
    return aggregate_type or aggregate_id or ""


def rfc3339(value: datetime) -> str:
    """``value`` in RFC 3339 (what CloudEvents' ``time`` is): with an offset always; a naive
    datetime (USE_TZ = False) is in the default time zone, as Django stores it."""
    if value.tzinfo is None:
        value = django_timezone.make_aware(value, django_timezone.get_default_timezone())
    return value.isoformat()
