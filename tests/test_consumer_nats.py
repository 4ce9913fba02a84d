"""The consumer's NATS JetStream transport against the real server and the test database."""

from __future__ import annotations

import pytest

from django_outbox.consumer import Outcome
from django_outbox.consumer.nats import Consumer, durable_name, filter_subjects
from points.models import PointsLedger
from tests.utils.nats import AWARD, make_nats_consumer, publish_events
from tests.utils.rows import unsaved_event
from tests.utils.waiting import wait_for

pytestmark = [pytest.mark.transport, pytest.mark.django_db(transaction=True)]

FAILING = "tests.consumer_handlers.FailingHandler"


def consume(broker, *events, handlers=(AWARD,), **options):
    """Publish ``events`` as the relay does, then consume until the stream is idle."""
    publish_events(broker, *events)
    return make_nats_consumer(broker, handlers, **options).serve(until_idle=True)


def dead_letters(broker):
    return broker.messages(f"{durable_name(broker.queue)}_dlq")


def test_names_and_subjects_nats_can_take():
    assert durable_name("points.outbox") == "points_outbox"
    assert filter_subjects("outbox", ["ORDER_CREATED"]) == ["outbox.ORDER_CREATED"]
    assert filter_subjects("outbox", ["orders.*", "orders.#"]) == [
        "outbox.orders.*",
        "outbox.orders.>",
    ]
    assert filter_subjects("", ["a.b"]) == ["a.b"]
    assert filter_subjects("outbox", ["a.#.b"]) == []  # NATS has no '>' before the end


def test_an_event_in_the_stream_twice_one_row_both_acked(nats_broker):
    event = unsaved_event()
    publish_events(nats_broker, event)
    # A republish after the duplicate window: the stream holds it twice.
    nats_broker.publish(
        f"{nats_broker.prefix}.ORDER_CREATED",
        nats_broker.messages()[0].data,
        headers={k: v for k, v in nats_broker.messages()[0].headers.items() if k != "Nats-Msg-Id"}
        | {"Nats-Msg-Id": event.event_id + "-again"},
    )
    result = make_nats_consumer(nats_broker).serve(until_idle=True)
    assert result.messages == 2
    assert PointsLedger.objects.filter(source_event_id=event.event_id).count() == 1
    # Both acked: a new run finds nothing.
    assert make_nats_consumer(nats_broker).serve(until_idle=True).messages == 0


def test_failing_handler_is_retried_then_dead_lettered_with_the_reason(nats_broker):
    event = unsaved_event()
    result = consume(nats_broker, event, handlers=[FAILING], max_retries=2)
    # 1 delivery + 2 retries (naks), each rolled back; then the dead-letter subject.
    assert result.counts[Outcome.FAILED] == 3
    assert result.dead_lettered == 1
    assert PointsLedger.objects.count() == 0
    (dead,) = dead_letters(nats_broker)
    assert dead.subject == nats_broker.dlq
    assert dead.headers["x-outbox-reason"] == (
        "failed%203%20time(s):%20RuntimeError:%20boom%20after%20the%20write"
    )
    assert dead.headers["x-outbox-type"] == "ORDER_CREATED"
    # Acked: nothing left for the consumer.
    assert make_nats_consumer(nats_broker, [FAILING]).serve(until_idle=True).messages == 0


def test_the_durable_consumer_counts_deliveries_and_bounds_them(nats_broker):
    publish_events(nats_broker, unsaved_event())
    consumer = make_nats_consumer(nats_broker, max_retries=3)
    info = nats_broker.run(nats_broker.js.consumer_info(nats_broker.stream, consumer.durable))
    consumer.close()
    assert info.config.max_deliver == 4
    assert info.config.ack_policy == "explicit"
    assert info.config.filter_subject == f"{nats_broker.prefix}.ORDER_CREATED"


def test_undecodable_goes_to_the_dead_letter_subject_at_once(nats_broker):
    publish_events(nats_broker, unsaved_event())  # the stream
    nats_broker.publish(f"{nats_broker.prefix}.ORDER_CREATED", b"{not json", headers={})
    result = make_nats_consumer(nats_broker).serve(until_idle=True)
    assert result.counts[Outcome.UNDECODABLE] == 1
    assert result.counts[Outcome.PROCESSED] == 1
    (dead,) = dead_letters(nats_broker)
    assert dead.data == b"{not json"
    assert "undecodable" in dead.headers["x-outbox-reason"]


def test_failure_then_success_on_redelivery(nats_broker):
    event = unsaved_event()
    publish_events(nats_broker, event)
    result = make_nats_consumer(nats_broker, [FAILING]).serve(max_messages=1)
    assert result.counts[Outcome.FAILED] == 1
    result = make_nats_consumer(nats_broker).serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 1
    assert PointsLedger.objects.get().source_event_id == event.event_id


def test_the_consumer_waits_for_the_stream(nats_broker):
    consumer = Consumer(
        handlers=[AWARD],
        url=nats_broker.url,
        queue=nats_broker.queue,
        exchange=nats_broker.prefix,
        stream=nats_broker.stream,
        idle_timeout=0.3,
        reconnect_max=0.2,
    )
    from tests.utils.amqp import serving

    with serving(consumer) as results:
        assert not wait_for(lambda: consumer.ready, timeout=1)
        publish_events(nats_broker, unsaved_event())
        assert wait_for(lambda: PointsLedger.objects.count() == 1, timeout=20)
    assert results[0].counts[Outcome.PROCESSED] == 1
