"""OpenTelemetry tracing: the context captured at emit(), the relay's publish spans, the
consumers' process spans (docs/tracing.md), recorded by the SDK's in-memory exporter."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from opentelemetry import baggage, context, propagate, trace
from opentelemetry.trace import SpanKind, StatusCode

from django_outbox import outbox, tracing
from django_outbox.backends import locmem
from django_outbox.backends.pika import PikaBackend
from django_outbox.checks import Codes, check_tracing
from django_outbox.consumer import Dispatcher, Outcome, process_messages
from django_outbox.message import encode_task_envelope
from django_outbox.models import OutboxEvent
from django_outbox.relay import Relay
from orders.services import create_order
from points.models import PointsLedger
from points.tasks import award_points
from tests import celery_tasks
from tests.utils.amqp import make_consumer
from tests.utils.relay import make_relay
from tests.utils.tracing import named, one, recorder, traceparent, tracer

pytestmark = pytest.mark.django_db(transaction=True)

AWARD = "points.handlers.AwardPointsHandler"
FAILING = "tests.consumer_handlers.FailingHandler"


@pytest.fixture
def spans():
    return recorder()


def emit_order(number: str | None = None, **headers: str) -> OutboxEvent:
    """An ORDER_CREATED event as the demo's orders service writes it (one transaction)."""
    with outbox.atomic() as box:
        event = box.emit(
            "ORDER_CREATED",
            aggregate_type="ORDER",
            aggregate_id=number or uuid.uuid4().hex[:8],
            payload={"user_id": 1, "amount": "3.00", "number": number or "N"},
            headers=headers or None,
        )
    return event


def stored_headers(event: OutboxEvent) -> dict:
    return OutboxEvent.objects.get(event_id=event.event_id).headers


# -- emit() ----------------------------------------------------------------------------------
def test_outside_any_span_emit_stores_no_context_and_records_nothing(spans):
    event = emit_order()
    assert stored_headers(event) == {}
    assert spans.get_finished_spans() == ()


def test_emit_stores_the_context_of_a_create_span_child_of_the_active_one(spans):
    with tracer().start_as_current_span("POST /orders") as request:
        event = emit_order("N-1")
    create = one(spans.get_finished_spans(), "create")
    assert stored_headers(event) == {"traceparent": traceparent(create)}
    assert create.parent.span_id == request.get_span_context().span_id
    assert create.context.trace_id == request.get_span_context().trace_id
    assert create.kind is SpanKind.PRODUCER
    assert create.name == "create outbox:ORDER_CREATED"
    assert dict(create.attributes) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "create",
        "messaging.operation.type": "create",
        "messaging.destination.name": "outbox:ORDER_CREATED",
        "messaging.rabbitmq.destination.routing_key": "ORDER_CREATED",
        "messaging.message.id": event.event_id,
    }


def test_tracestate_and_baggage_travel_with_the_context(spans, settings):
    settings.OUTBOX_ROUTING_KEYS = {"ORDER_CREATED": "orders.created"}
    incoming = propagate.extract(
        {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "vendor=opaque",
        }
    )
    incoming = baggage.set_baggage("tenant", "acme", incoming)
    token = context.attach(incoming)
    try:
        with tracer().start_as_current_span("POST /orders"):
            event = emit_order()
    finally:
        context.detach(token)
    headers = stored_headers(event)
    create = one(spans.get_finished_spans(), "create")
    assert headers == {
        "traceparent": traceparent(create),
        "tracestate": "vendor=opaque",
        "baggage": "tenant=acme",
    }
    assert f"{create.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert create.attributes["messaging.destination.name"] == "outbox:orders.created"


def test_a_context_the_caller_set_is_kept_and_no_create_span_is_made(spans):
    theirs = "00-11111111111111111111111111111111-2222222222222222-01"
    with tracer().start_as_current_span("POST /orders"):
        event = emit_order(traceparent=theirs, baggage="mine=1")
    assert stored_headers(event) == {"traceparent": theirs, "baggage": "mine=1"}
    assert named(spans.get_finished_spans(), "create") == []


def test_the_callers_own_baggage_header_is_kept_beside_the_captured_context(spans):
    token = context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with tracer().start_as_current_span("POST /orders"):
            event = emit_order(baggage="mine=1")
    finally:
        context.detach(token)
    create = one(spans.get_finished_spans(), "create")
    assert stored_headers(event) == {"traceparent": traceparent(create), "baggage": "mine=1"}


def test_without_create_spans_the_active_spans_context_is_stored(spans, settings):
    settings.OUTBOX_TRACING_CREATE_SPANS = False
    with tracer().start_as_current_span("POST /orders") as request:
        event = emit_order()
    assert stored_headers(event) == {"traceparent": traceparent(request)}
    assert named(spans.get_finished_spans(), "create") == []


def test_tracing_off_captures_nothing(spans, settings):
    settings.OUTBOX_TRACING = False
    with tracer().start_as_current_span("POST /orders"):
        event = emit_order()
    make_relay().drain()
    process_messages(locmem.outbox, dispatcher=Dispatcher(handlers=[AWARD]))
    assert stored_headers(event) == {}
    assert [s.name for s in spans.get_finished_spans()] == ["POST /orders"]


def test_a_propagator_field_the_outbox_reserves_is_not_stored(spans):
    class Reserved(propagate.textmap.TextMapPropagator):
        def inject(self, carrier, context=None, setter=propagate.textmap.default_setter):
            setter.set(carrier, "x-outbox-delivery", "7")
            setter.set(carrier, "attempt", "9")

        def extract(self, carrier, context=None, getter=None):
            return context

        @property
        def fields(self):
            return {"x-outbox-delivery", "attempt"}

    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(propagate.composite.CompositePropagator([previous, Reserved()]))
    try:
        with tracer().start_as_current_span("POST /orders"):
            event = emit_order()
    finally:
        propagate.set_global_textmap(previous)
    assert set(stored_headers(event)) == {"traceparent"}


def test_a_failing_propagator_never_fails_emit(spans, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("propagator bug")

    monkeypatch.setattr(propagate, "inject", broken)
    with (
        caplog.at_level(logging.WARNING, logger="django_outbox.tracing"),
        tracer().start_as_current_span("POST /orders"),
    ):
        event = emit_order()
    assert stored_headers(event) == {}
    assert "could not capture the trace context" in caplog.text


@pytest.mark.parametrize(
    ("name", "value"),
    [("baggage", "a\x00b"), ("baggage", "a\udc80b"), ("x\x00y", "1"), ("k" * 256, "1")],
    ids=["nul", "lone-surrogate", "nul-in-name", "name-over-255-bytes"],
)
def test_a_context_no_database_or_broker_can_carry_is_dropped_with_a_warning(
    spans, caplog, name, value
):
    """A propagator's field with a NUL (PostgreSQL refuses it: the INSERT failed and the
    business transaction rolled back), a lone surrogate (not UTF-8) or a name longer than
    an AMQP header's: the whole context is dropped, as when the propagator raises, and the
    event goes out without it, on every database."""

    class Hostile(propagate.textmap.TextMapPropagator):
        def inject(self, carrier, context=None, setter=propagate.textmap.default_setter):
            setter.set(carrier, name, value)

        def extract(self, carrier, context=None, getter=None):
            return context

        @property
        def fields(self):
            return {name}

    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(propagate.composite.CompositePropagator([previous, Hostile()]))
    try:
        with (
            caplog.at_level(logging.WARNING, logger="django_outbox.tracing"),
            tracer().start_as_current_span("POST /orders"),
        ):
            event = emit_order()
    finally:
        propagate.set_global_textmap(previous)
    assert stored_headers(event) == {}
    assert "could not capture the trace context" in caplog.text


# -- the relay -------------------------------------------------------------------------------
def test_the_publish_span_covers_the_time_in_the_outbox_until_the_confirm(spans):
    with tracer().start_as_current_span("POST /orders"):
        event = emit_order("N-2")
    untraced = emit_order()
    make_relay().drain()
    finished = spans.get_finished_spans()
    create, publish = one(finished, "create"), one(finished, "publish")  # none for untraced
    row = OutboxEvent.objects.get(event_id=event.event_id)
    assert publish.kind is SpanKind.CLIENT
    assert publish.parent.span_id == create.context.span_id
    assert [link.context.span_id for link in publish.links] == [create.context.span_id]
    assert publish.context.trace_id == create.context.trace_id
    # From the row's insert (the database clock) to the confirm; "sent" when handed over.
    assert publish.start_time == int(row.created_at.timestamp() * 1e9)
    (sent,) = publish.events
    assert sent.name == "sent"
    assert publish.start_time <= sent.timestamp <= publish.end_time
    assert publish.status.status_code is StatusCode.UNSET
    assert publish.name == "publish outbox:ORDER_CREATED"
    assert publish.attributes["messaging.operation.type"] == "send"
    assert publish.attributes["messaging.message.id"] == event.event_id
    assert publish.attributes["django_outbox.attempt"] == 1
    assert untraced.event_id not in {
        s.attributes.get("messaging.message.id") for s in spans.get_finished_spans()
    }


def test_a_failed_publish_ends_its_span_with_the_reason(spans):
    with tracer().start_as_current_span("POST /orders"):
        emit_order()
    locmem.fail_next.append(locmem.Reason.UNROUTABLE)
    make_relay().drain()
    publish = one(spans.get_finished_spans(), "publish")
    assert publish.status.status_code is StatusCode.ERROR
    assert publish.status.description == "[unroutable] locmem: injected unroutable"
    assert publish.attributes["error.type"] == "unroutable"
    # The retry is a span of its own, attempt 2.
    OutboxEvent.objects.update(next_retry_time=OutboxEvent.objects.get().created_at)
    spans.clear()
    make_relay().drain()
    retry = one(spans.get_finished_spans(), "publish")
    assert retry.status.status_code is StatusCode.UNSET
    assert retry.attributes["django_outbox.attempt"] == 2


def test_a_batch_released_unconfirmed_ends_its_spans_with_an_error(spans):
    with tracer().start_as_current_span("POST /orders"):
        emit_order()
    locmem.unavailable = True
    with pytest.raises(Exception, match="unavailable"):
        make_relay().drain()
    publish = one(spans.get_finished_spans(), "publish")
    assert publish.status.status_code is StatusCode.ERROR
    assert publish.status.description.startswith("released unconfirmed: broker unavailable")
    assert publish.attributes["error.type"] == "released"


# -- consumers -------------------------------------------------------------------------------
def test_the_handler_runs_under_a_process_span_continuing_the_creation_context(spans):
    seen = []
    with tracer().start_as_current_span("POST /orders"):
        emit_order("N-3")
    make_relay().drain()
    dispatcher = Dispatcher(handlers=[AWARD])
    original = dispatcher.handlers[0].handle

    def handle(event):
        seen.append(trace.get_current_span().get_span_context())
        original(event)

    dispatcher.handlers[0].handle = handle
    process_messages(locmem.outbox, dispatcher=dispatcher)
    finished = spans.get_finished_spans()
    create, process = one(finished, "create"), one(finished, "process")
    assert process.kind is SpanKind.CONSUMER
    assert process.parent.span_id == create.context.span_id
    assert [link.context.span_id for link in process.links] == [create.context.span_id]
    assert seen == [process.context]  # the handler's own spans are children of it
    assert process.attributes["django_outbox.outcome"] == "processed"
    assert process.attributes["django_outbox.handler"] == "points.award"
    assert process.attributes["messaging.operation.type"] == "process"
    assert process.status.status_code is StatusCode.UNSET


def test_a_duplicate_is_visible_on_its_span(spans):
    with tracer().start_as_current_span("POST /orders"):
        emit_order()
    make_relay().drain()
    dispatcher = Dispatcher(handlers=[AWARD])
    process_messages(locmem.outbox * 2, dispatcher=dispatcher)
    first, second = named(spans.get_finished_spans(), "process")
    assert first.attributes["django_outbox.outcome"] == "processed"
    assert second.attributes["django_outbox.outcome"] == "duplicate"
    assert [e.name for e in second.events] == ["duplicate"]
    assert PointsLedger.objects.count() == 1


def test_a_failing_handler_records_its_exception(spans):
    with tracer().start_as_current_span("POST /orders"):
        emit_order()
    make_relay().drain()
    process_messages(locmem.outbox, dispatcher=Dispatcher(handlers=[FAILING]))
    process = one(spans.get_finished_spans(), "process")
    assert process.status.status_code is StatusCode.ERROR
    assert process.status.description == "RuntimeError: boom after the write"
    assert process.attributes["error.type"] == "RuntimeError"
    assert process.attributes["django_outbox.outcome"] == "failed"
    (exception,) = process.events
    assert exception.name == "exception"
    assert exception.attributes["exception.message"] == "boom after the write"


def test_inside_another_span_the_handler_is_its_child_linked_to_the_creation_context(spans):
    with tracer().start_as_current_span("POST /orders"):
        emit_order()
    make_relay().drain()
    with tracer().start_as_current_span("worker job") as job:
        process_messages(locmem.outbox, dispatcher=Dispatcher(handlers=[AWARD]))
    finished = spans.get_finished_spans()
    create, process = one(finished, "create"), one(finished, "process")
    assert process.parent.span_id == job.get_span_context().span_id
    assert [link.context.span_id for link in process.links] == [create.context.span_id]


def test_an_untraced_event_is_processed_under_a_root_span(spans):
    emit_order()
    make_relay().drain()
    process_messages(locmem.outbox, dispatcher=Dispatcher(handlers=[AWARD]))
    process = one(spans.get_finished_spans(), "process")
    assert process.parent is None and process.links == ()


def test_the_celery_task_runs_under_a_process_span(spans):
    with tracer().start_as_current_span("POST /orders"):
        order = create_order(user_id=7, amount=Decimal("12.50"))
    envelope = encode_task_envelope(OutboxEvent.objects.get(aggregate_id=order.number))
    assert award_points.apply(args=[envelope]).successful()
    assert award_points.apply(args=[envelope]).successful()
    finished = spans.get_finished_spans()
    create = one(finished, "create")
    first, second = named(finished, "process")
    for process in (first, second):
        assert process.parent.span_id == create.context.span_id
        assert process.kind is SpanKind.CONSUMER
        assert process.attributes["django_outbox.handler"] == "points.award_points"
    assert first.attributes["django_outbox.outcome"] == "processed"
    assert second.attributes["django_outbox.outcome"] == "duplicate"


def test_a_failing_celery_task_records_the_handlers_error_on_each_attempt(spans):
    with tracer().start_as_current_span("POST /orders"):
        event = emit_order()
    envelope = encode_task_envelope(OutboxEvent.objects.get(event_id=event.event_id))
    assert celery_tasks.failing_award.apply(args=[envelope]).failed()
    attempts = named(spans.get_finished_spans(), "process")
    assert len(attempts) == 3  # max_retries=2
    for process in attempts:
        assert process.status.status_code is StatusCode.ERROR
        assert process.attributes["error.type"] == "RuntimeError"
        assert [e.name for e in process.events] == ["exception"]


# -- settings --------------------------------------------------------------------------------
def test_tracing_asked_for_without_the_library_is_an_error(settings, monkeypatch):
    assert check_tracing() == []
    settings.OUTBOX_TRACING = True
    assert check_tracing() == []
    monkeypatch.setattr(tracing, "AVAILABLE", False)
    (error,) = check_tracing()
    assert error.id == Codes.TRACING_NO_API
    assert "pip install 'django-transactional-outbox[otel]'" in error.hint
    settings.OUTBOX_TRACING = False
    assert check_tracing() == []


# -- end to end over RabbitMQ ------------------------------------------------------------------
@pytest.mark.amqp
def test_one_trace_from_the_span_around_emit_to_the_consumers_process_span(spans, broker):
    consumer = make_consumer(broker)
    with tracer().start_as_current_span("POST /orders") as request:
        order = create_order(user_id=3, amount=Decimal("5.00"))
    backend = PikaBackend(broker_url=broker.url, exchange=broker.exchange)
    assert Relay(backend=backend).drain().sent == 1
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 1
    assert PointsLedger.objects.get().order_number == order.number

    finished = spans.get_finished_spans()
    create, publish = one(finished, "create"), one(finished, "publish")
    process = one(finished, "process")
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in (create, publish, process)} == {trace_id}
    assert create.parent.span_id == request.get_span_context().span_id
    assert publish.parent.span_id == create.context.span_id
    assert process.parent.span_id == create.context.span_id
    where = f"{broker.exchange}:ORDER_CREATED"
    assert publish.name == f"publish {where}"
    assert process.name == f"process {where}:{broker.queue}"
    assert process.attributes["messaging.destination.name"] == f"{where}:{broker.queue}"
    assert process.attributes["messaging.rabbitmq.destination.routing_key"] == "ORDER_CREATED"
    assert isinstance(process.attributes["messaging.rabbitmq.message.delivery_tag"], int)
    # In order: emitted, published (confirmed), then processed.
    assert create.end_time <= publish.end_time <= process.start_time


@pytest.mark.amqp
def test_two_events_of_two_traces_relayed_in_one_batch_each_keep_their_trace(spans, broker):
    consumer = make_consumer(broker)
    requests = []
    for _ in range(2):
        with tracer().start_as_current_span("POST /orders") as request:
            create_order(user_id=3, amount=Decimal("5.00"))
        requests.append(request.get_span_context().trace_id)
    assert requests[0] != requests[1]
    backend = PikaBackend(broker_url=broker.url, exchange=broker.exchange)
    result = Relay(backend=backend, batch_size=10).drain()
    assert (result.sent, result.batches) == (2, 1)
    assert consumer.serve(until_idle=True).counts[Outcome.PROCESSED] == 2

    finished = spans.get_finished_spans()
    for kind in ("create", "publish", "process"):
        assert sorted(s.context.trace_id for s in named(finished, kind)) == sorted(requests)
    creates = {s.context.span_id: s for s in named(finished, "create")}
    for span in named(finished, "publish") + named(finished, "process"):
        parent = creates[span.parent.span_id]
        assert span.context.trace_id == parent.context.trace_id
        assert span.attributes["messaging.message.id"] == parent.attributes["messaging.message.id"]


def test_a_scheduled_events_publish_span_starts_when_it_became_due(spans):
    """Waiting for its time is what the event was asked to do, not time spent delivering it
    (as django_outbox_commit_to_confirm_seconds counts it)."""
    with tracer().start_as_current_span("POST /orders"), outbox.atomic() as box:
        box.emit("REMIND", payload={}, delay=3600)
    row = OutboxEvent.objects.get()
    OutboxEvent.objects.filter(pk=row.pk).update(
        created_at=row.created_at - timedelta(hours=1),
        next_retry_time=row.due_at - timedelta(hours=1),
        due_at=row.due_at - timedelta(hours=1),
    )
    make_relay().drain()
    row.refresh_from_db()
    publish = one(spans.get_finished_spans(), "publish")
    assert publish.start_time == int(row.due_at.timestamp() * 1e9)
    assert publish.start_time > int(row.created_at.timestamp() * 1e9)
