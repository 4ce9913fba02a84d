"""OpenTelemetry tracing of events, from ``emit()`` through the relay to each handler.

The only module that imports OpenTelemetry (the ``otel`` extra: ``opentelemetry-api``).
Without it every function here returns at its first line and nothing is imported; with the
API and no SDK configured, every span is a no-op. The spans follow the OpenTelemetry
messaging semantic conventions (docs/tracing.md shows the tree):

- ``emit()`` inside an active span: a PRODUCER **create** span, a child of that span, whose
  context (``traceparent``, ``tracestate``, ``baggage``: whatever the global propagator
  writes) is stored in the event's headers, so each event keeps the context of the request
  that wrote it and the relay publishes it as AMQP headers. A context the caller put in the
  headers is kept as it is, and no create span is made (the convention's custom creation
  context).
- the relay, for each event that carries a context: a CLIENT **publish** span, from the
  row's ``created_at`` (the time in the outbox is in it; a scheduled event's from its due
  time) to the broker's confirm, a child
  of the event's creation context and linked to it; a failed or unconfirmed publish ends
  it with an error status and the reason.
- a consumer handler (``consume_outbox``, the Celery ``IdempotentTask``): a CONSUMER
  **process** span around the handler, a child of the creation context and linked to it (or,
  when the handler already runs inside a span, a child of that one, linked to the creation
  context); its ``django_outbox.outcome`` says ``processed``, ``duplicate``, ... .

Tracing must never break what it watches: an error inside it is logged and the event goes
on without its span.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from .conf import on_settings_reset, outbox_settings
from .message import is_reserved_header

try:
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import Getter
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError:  # the otel extra is not installed: tracing is off
    trace = None  # type: ignore[assignment]
    Getter = object  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from .backends.base import BaseBackend, PublishResult
    from .message import ReceivedEvent
    from .models import OutboxEvent

logger = logging.getLogger("django_outbox.tracing")

#: Whether opentelemetry-api is installed.
AVAILABLE = trace is not None
#: ``messaging.system``: the outbox relays to RabbitMQ.
SYSTEM = "rabbitmq"
#: Outcomes that are a failure of the processing (the span's status is ERROR).
_FAILED_OUTCOMES = frozenset({"failed", "out_of_order", "undecodable"})

_tracer: Tracer | None = None


def _get_tracer() -> Tracer:
    global _tracer
    if _tracer is None:
        # A proxy until the application sets its tracer provider: cached, it still follows
        # the provider set later.
        _tracer = trace.get_tracer("django_outbox")
    return _tracer


@dataclass(frozen=True)
class _Settings:
    """The settings tracing reads, read once: emit() is on every request's path, and a
    setting read costs microseconds (a missing one raises inside Django's settings)."""

    on: bool
    create_spans: bool
    exchange: str
    routing_keys: dict[str, str]
    routing_func: bool


_settings: _Settings | None = None


def _read_settings() -> _Settings:
    global _settings
    if _settings is None:
        _settings = _Settings(
            on=bool(outbox_settings.TRACING),
            create_spans=bool(outbox_settings.TRACING_CREATE_SPANS),
            exchange=outbox_settings.EXCHANGE,
            routing_keys=outbox_settings.ROUTING_KEYS,
            routing_func=bool(outbox_settings.ROUTING_KEY_FUNC),
        )
    return _settings


@on_settings_reset
def _forget_settings() -> None:
    global _settings
    _settings = None


def destination(exchange: str, routing_key: str = "", queue: str = "") -> str:
    """``messaging.destination.name`` as the RabbitMQ conventions spell it: the non-empty
    ones of ``{exchange}:{routing key}:{queue}``, the queue left out when it is the routing
    key; ``""`` when all are empty (an in-process consumer: no destination)."""
    parts = [exchange, routing_key]
    if queue and queue != routing_key:
        parts.append(queue)
    return ":".join(p for p in parts if p)


def _name(operation: str, where: str) -> str:
    """The span name: ``{operation} {destination}``, or the operation alone."""
    return f"{operation} {where}" if where else operation


def _attributes(
    operation: str, kind: str, where: str, event_id: str, routing_key: str, **more: Any
) -> dict[str, Any]:
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": operation,
        "messaging.operation.type": kind,
        "messaging.message.id": event_id,
    }
    if where:
        attributes["messaging.destination.name"] = where
    if routing_key:
        attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
    attributes.update((k, v) for k, v in more.items() if v not in (None, ""))
    return attributes


def _event_attributes(event: OutboxEvent | ReceivedEvent) -> dict[str, Any]:
    """The outbox's own attributes: what an operator searches a trace by."""
    return {
        "django_outbox.event_type": event.event_type,
        "django_outbox.aggregate_type": event.aggregate_type,
        "django_outbox.aggregate_id": event.aggregate_id,
    }


# -- extracting a context from headers --------------------------------------------------------
class _HeaderGetter(Getter):  # type: ignore[misc,valid-type]
    """Reads a propagator's fields from AMQP headers: text only (pika may hand a header
    over as bytes; a non-text value is no context)."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, bytes):
            try:
                value = value.decode()
            except UnicodeDecodeError:
                return None
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return list(carrier)


_GETTER: Any = _HeaderGetter() if AVAILABLE else None


def _creation_context(headers: Mapping[str, Any] | None, fields: set[str]) -> Context | None:
    """The context the headers carry, None when they carry none (a quick look at the header
    names first: most untraced events have no header a propagator reads)."""
    if not headers or fields.isdisjoint(headers):
        return None
    context = propagate.extract(headers, getter=_GETTER)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def _fields() -> set[str]:
    return set(propagate.get_global_textmap().fields)


# -- emit(): capture ---------------------------------------------------------------------------
def capture(event: OutboxEvent) -> None:
    """At ``emit()``: store the creation context of ``event`` in its headers.

    Nothing when no span is active (or tracing is off). A context the caller's headers
    carry already is kept, with no create span; otherwise a create span is made (unless
    ``OUTBOX_TRACING_CREATE_SPANS`` is off: then the active span's own context is stored)
    and its context written with the global propagator. A field the propagator writes that
    the caller set too (their own ``baggage``, say) keeps the caller's value.
    """
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return
    try:
        config = _read_settings()
        if not config.on:
            return
        headers = event.headers
        if _creation_context(headers, _fields()) is not None:
            return
        carrier: dict[str, str] = {}
        if config.create_spans:
            span = _create_span(event, config)
            propagate.inject(carrier, context=trace.set_span_in_context(span))
            span.end()
        else:
            propagate.inject(carrier)
        fields = {
            name: value
            for name, value in carrier.items()
            if isinstance(value, str) and not is_reserved_header(name)
        }
        for name, value in fields.items():
            _check_storable(name, value)
        for name, value in fields.items():
            headers.setdefault(name, value)
    except Exception:
        logger.warning(
            "could not capture the trace context of event %s; emitted without it",
            event.event_id,
            exc_info=True,
        )


#: The longest header name AMQP carries (a short string), in bytes of UTF-8.
_MAX_HEADER_NAME = 255


def _check_storable(name: str, value: str) -> None:
    """Raise ValueError for a propagator's field that some database or the broker cannot
    carry: a NUL (PostgreSQL's JSON refuses it, and the failed INSERT would roll the
    caller's transaction back), a lone surrogate (not UTF-8), a name longer than an AMQP
    header's. emit() checked the caller's own headers; these are added after."""
    for text in (name, value):
        if "\x00" in text:
            raise ValueError(f"the propagator's field {name[:40]!r} contains a NUL")
        if not text.isascii():
            try:
                text.encode()
            except UnicodeEncodeError:
                raise ValueError(
                    f"the propagator's field {name[:40]!r} contains a lone surrogate"
                ) from None
    if len(name.encode()) > _MAX_HEADER_NAME:
        raise ValueError(f"the propagator's field {name[:40]!r}... has a name over 255 bytes")


def _create_span(event: OutboxEvent, config: _Settings) -> Span:
    # The routing key the default routing gives; a routing function needs a backend and is
    # left to the publish span.
    routing_key = (
        "" if config.routing_func else config.routing_keys.get(event.event_type, event.event_type)
    )
    where = destination(config.exchange, routing_key)
    # The conventions' attributes only: every attribute costs the SDK time on emit()'s
    # path; the publish and process spans of the same trace carry the outbox's own.
    return _get_tracer().start_span(
        _name("create", where),
        kind=SpanKind.PRODUCER,
        attributes=_attributes("create", "create", where, event.event_id, routing_key),
    )


# -- the relay: publish spans --------------------------------------------------------------------
class PublishSpans:
    """The publish spans of one batch, one per row that carries a creation context (None
    for the others), ended once: at the broker's answer, or when the batch is released."""

    def __init__(self, spans: list[Span | None]) -> None:
        self.spans: list[Span | None] | None = spans

    def confirmed(self, results: Sequence[PublishResult]) -> None:
        """The broker's answer, one result per row: a span ends OK when its row was
        confirmed, else with an error status, ``error.type`` the reason."""
        spans, self.spans = self.spans, None
        if spans is None:
            return
        for span, result in zip(spans, results, strict=False):
            if span is None:
                continue
            if not result.ok:
                reason = result.reason.value if result.reason else "error"
                span.set_attribute("error.type", reason)
                span.set_status(Status(StatusCode.ERROR, f"[{reason}] {result.error}"))
            span.end()

    def released(self, error: str | None) -> None:
        """The batch was given back before the broker answered for it (a stop, an outage,
        an error): its rows will be published again, each span ends with an error."""
        spans, self.spans = self.spans, None
        for span in spans or ():
            if span is not None:
                span.set_attribute("error.type", "released")
                span.set_status(
                    Status(
                        StatusCode.ERROR,
                        f"released unconfirmed: {error or 'the relay stopped'}",
                    )
                )
                span.end()


def start_publish(rows: Sequence[OutboxEvent], backend: BaseBackend) -> PublishSpans | None:
    """The relay's send step: a publish span for each row that carries a creation context.

    Each starts when the row became due (``created_at``, the database's clock, or for a
    scheduled event its due time: waiting for it is not delivery time) and records
    when it was handed to the broker (``sent`` event); :class:`PublishSpans` ends them.
    None when no row carries a context or tracing is off.
    """
    if trace is None or not rows:
        return None
    try:
        if not _read_settings().on:
            return None
        fields = _fields()
        now = time.time_ns()
        spans: list[Span | None] = []
        for row in rows:
            context = _creation_context(row.headers, fields)
            spans.append(None if context is None else _publish_span(row, backend, context, now))
        if not any(spans):
            return None
        return PublishSpans(spans)
    except Exception:
        logger.warning("could not start the publish spans of a batch", exc_info=True)
        return None


def _publish_span(row: OutboxEvent, backend: BaseBackend, context: Context, now: int) -> Span:
    creation = trace.get_current_span(context).get_span_context()
    exchange = str(getattr(backend, "exchange", "") or "")
    routing_key = backend.routing_key(row)
    where = destination(exchange, routing_key)
    span = _get_tracer().start_span(
        _name("publish", where),
        context=context,
        # CLIENT: the creation context is the create span's (the conventions' "send" span
        # when a "create" span exists).
        kind=SpanKind.CLIENT,
        links=[Link(creation)],
        start_time=min(_nanoseconds(row.due_since), now) if row.created_at else now,
        attributes=_attributes(
            "publish",
            "send",
            where,
            row.event_id,
            routing_key,
            **_event_attributes(row),
            **{"django_outbox.attempt": row.retry_count + 1},
        ),
    )
    span.add_event("sent", timestamp=now)
    return span


def _nanoseconds(moment: datetime) -> int:
    if timezone.is_naive(moment):  # USE_TZ = False: local time in TIME_ZONE
        moment = timezone.make_aware(moment)
    return int(moment.timestamp() * 1e9)


# -- consumers: process spans ---------------------------------------------------------------------
@dataclass(frozen=True)
class Delivery:
    """Where a consumer got a message from, for the process span's destination."""

    exchange: str = ""
    routing_key: str = ""
    queue: str = ""
    delivery_tag: int | None = None


_delivery: contextvars.ContextVar[Delivery | None] = contextvars.ContextVar(
    "django_outbox_delivery", default=None
)


@contextlib.contextmanager
def delivery(
    exchange: str = "", routing_key: str = "", queue: str = "", delivery_tag: int | None = None
) -> Iterator[None]:
    """The message being handled came from here: the process spans started inside say so."""
    if trace is None:
        yield
        return
    token = _delivery.set(Delivery(exchange or "", routing_key or "", queue, delivery_tag))
    try:
        yield
    finally:
        _delivery.reset(token)


class ProcessSpan:
    """What a handler's process span records besides its time: the outcome."""

    def __init__(self, span: Span | None) -> None:
        self.span = span
        self.failed = False

    def outcome(self, outcome: str, error: str = "") -> None:
        """``django_outbox.outcome``; a duplicate also as a ``duplicate`` event, a failure
        as the error status with the error text."""
        span = self.span
        if span is None:
            return
        span.set_attribute("django_outbox.outcome", outcome)
        if outcome == "duplicate":
            span.add_event(
                "duplicate",
                {"django_outbox.reason": "already processed: rolled back and acknowledged"},
            )
        elif outcome in _FAILED_OUTCOMES and not self.failed:
            self.failed = True
            span.set_attribute("error.type", _error_type(error, outcome))
            span.set_status(Status(StatusCode.ERROR, error or outcome))

    def exception(self, exc: BaseException) -> None:
        """The handler raised ``exc`` (recorded with its traceback)."""
        if self.span is None:
            return
        self.failed = True
        self.span.record_exception(exc)
        self.span.set_attribute("error.type", type(exc).__qualname__)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


_NO_SPAN = ProcessSpan(None)
_processing: contextvars.ContextVar[ProcessSpan] = contextvars.ContextVar(
    "django_outbox_processing", default=_NO_SPAN
)


def current_exception(exc: BaseException) -> None:
    """A handler running under :func:`processing` raised ``exc`` and it was caught (the
    consumer turns it into a FAILED outcome): record it on the process span."""
    _processing.get().exception(exc)


def _error_type(error: str, outcome: str) -> str:
    """The exception type an error text (``Type: message``) starts with, else the outcome."""
    head = error.split(":", 1)[0]
    return head if head.isidentifier() else outcome


@contextlib.contextmanager
def processing(
    event: ReceivedEvent, handler: str, where: Delivery | None = None
) -> Iterator[ProcessSpan]:
    """Run a handler on ``event`` under a CONSUMER process span (current inside the block).

    Its parent is the creation context the event carries, unless a span is active already
    (a task instrumentation's, a test's): then that one, as the conventions recommend; the
    creation context is linked either way. An exception leaving the block is recorded on
    the span and re-raised.
    """
    if trace is None:
        yield _NO_SPAN
        return
    try:
        span_cm = _process_span(event, handler, where or _delivery.get() or Delivery())
    except Exception:
        logger.warning("could not start the process span of %s", event.event_id, exc_info=True)
        span_cm = None
    if span_cm is None:
        yield _NO_SPAN
        return
    with span_cm as span:
        recorder = ProcessSpan(span)
        token = _processing.set(recorder)
        try:
            yield recorder
        except BaseException as exc:
            if not recorder.failed:
                recorder.exception(exc)
            raise
        finally:
            _processing.reset(token)


def _process_span(
    event: ReceivedEvent, handler: str, where: Delivery
) -> contextlib.AbstractContextManager[Span] | None:
    if not _read_settings().on:
        return None
    creation = _creation_context(event.headers, _fields())
    links = []
    parent = None
    if creation is not None:
        links.append(Link(trace.get_current_span(creation).get_span_context()))
        if not trace.get_current_span().get_span_context().is_valid:
            parent = creation
    name = destination(where.exchange, where.routing_key, where.queue)
    return _get_tracer().start_as_current_span(
        _name("process", name),
        context=parent,
        kind=SpanKind.CONSUMER,
        links=links,
        attributes=_attributes(
            "process",
            "process",
            name,
            event.event_id,
            where.routing_key,
            **_event_attributes(event),
            **{
                "messaging.rabbitmq.message.delivery_tag": where.delivery_tag,
                "django_outbox.handler": handler,
                "django_outbox.attempt": event.attempt,
            },
        ),
        # processing() records an exception itself, once, with the handler's own error.
        record_exception=False,
        set_status_on_exception=False,
    )
