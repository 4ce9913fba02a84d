"""The consumer's Redis Streams transport against the real server and the test database."""

from __future__ import annotations

import time

import pytest
from django.test import override_settings

from django_outbox.consumer import Outcome
from django_outbox.consumer.base import ImproperlyConfiguredConsumer
from django_outbox.consumer.redis import streams_for
from points.models import PointsLedger
from tests.utils.amqp import serving
from tests.utils.redis import AWARD, make_redis_consumer, publish_events
from tests.utils.rows import unsaved_event
from tests.utils.transport import delivery_numbers
from tests.utils.waiting import wait_for

pytestmark = [pytest.mark.transport, pytest.mark.django_db(transaction=True)]

FAILING = "tests.consumer_handlers.FailingHandler"


def consume(broker, *events, handlers=(AWARD,), **options):
    """Publish ``events`` as the relay does, then consume until the streams are idle."""
    publish_events(broker, *events)
    return make_redis_consumer(broker, handlers, **options).serve(until_idle=True)


def pending(broker, stream=None):
    return broker.client.xpending(stream or broker.stream(), broker.queue)["pending"]


def test_streams_of_the_bindings_and_no_wildcards():
    assert streams_for({}, "outbox", ["ORDER_CREATED", "ORDER_CREATED"]) == ["outbox.ORDER_CREATED"]
    assert streams_for({"ORDER_CREATED": "orders"}, "outbox", ["ORDER_CREATED"]) == ["orders"]
    assert streams_for({}, "", ["a.b"]) == ["a.b"]
    with pytest.raises(ImproperlyConfiguredConsumer, match="no wildcards"):
        streams_for({}, "outbox", ["orders.*"])


def test_an_event_in_the_stream_twice_one_row_both_acked(redis_broker):
    event = unsaved_event()
    publish_events(redis_broker, event)
    publish_events(redis_broker, event)  # a relay killed before its settle publishes again
    result = make_redis_consumer(redis_broker).serve(until_idle=True)
    assert result.messages == 2
    assert result.counts[Outcome.DUPLICATE] == 1
    assert PointsLedger.objects.filter(source_event_id=event.event_id).count() == 1
    assert pending(redis_broker) == 0  # both acked
    assert make_redis_consumer(redis_broker).serve(until_idle=True).messages == 0


def test_failing_handler_is_retried_then_dead_lettered_with_the_reason(redis_broker):
    event = unsaved_event()
    result = consume(redis_broker, event, handlers=[FAILING], max_retries=2, visibility_timeout=0.4)
    # 1 delivery + 2 retries (claims, counted by the pending list); then the dead letters.
    assert result.counts[Outcome.FAILED] == 3
    assert result.dead_lettered == 1
    assert PointsLedger.objects.count() == 0
    (dead,) = redis_broker.dead_letters()
    assert dead[b"x-outbox-reason"] == b"failed 3 time(s): RuntimeError: boom after the write"
    assert dead[b"x-outbox-stream"] == redis_broker.stream().encode()
    assert dead[b"message_id"] == event.event_id.encode()
    assert pending(redis_broker) == 0  # acked with the copy, in one MULTI
    again = make_redis_consumer(redis_broker, [FAILING], visibility_timeout=0.4)
    assert again.serve(until_idle=True).messages == 0


def test_undecodable_goes_to_the_dead_letter_stream_at_once(redis_broker):
    publish_events(redis_broker, unsaved_event())
    redis_broker.client.xadd(redis_broker.stream(), {"body": b"{not json"})
    result = make_redis_consumer(redis_broker).serve(until_idle=True)
    assert result.counts[Outcome.UNDECODABLE] == 1
    assert result.counts[Outcome.PROCESSED] == 1
    (dead,) = redis_broker.dead_letters()
    assert dead[b"body"] == b"{not json"
    assert b"not an outbox event" in dead[b"x-outbox-reason"]


def test_failure_then_success_on_redelivery(redis_broker):
    event = unsaved_event()
    publish_events(redis_broker, event)
    result = make_redis_consumer(redis_broker, [FAILING]).serve(max_messages=1)
    assert result.counts[Outcome.FAILED] == 1
    result = make_redis_consumer(redis_broker, visibility_timeout=0.4).serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 1
    assert PointsLedger.objects.get().source_event_id == event.event_id


def test_a_dead_consumers_entries_are_claimed_after_the_visibility_timeout(redis_broker):
    events = [unsaved_event(pk=n) for n in range(1, 4)]
    publish_events(redis_broker, *events)
    dead = make_redis_consumer(redis_broker, prefetch=3)
    assert dead._read()  # delivered to it, then it dies without a word
    dead._client = None
    assert pending(redis_broker) == 3
    live = make_redis_consumer(redis_broker, visibility_timeout=0.5)
    numbers = delivery_numbers(live)
    started = time.monotonic()
    with serving(live) as results:
        assert wait_for(lambda: PointsLedger.objects.count() == 3, timeout=20)
    assert time.monotonic() - started >= 0.5
    assert results[0].counts[Outcome.PROCESSED] == 3
    assert numbers == [2, 2, 2]  # counted from the pending list
    assert pending(redis_broker) == 0


def test_held_entries_stay_claimed_past_the_visibility_timeout(redis_broker):
    """An entry held through a long handler (or a database outage) is claimed again for
    its consumer, so another consumer does not take it over."""
    publish_events(redis_broker, unsaved_event())
    holder = make_redis_consumer(redis_broker, visibility_timeout=0.6)
    (entry,) = holder._read()
    holder._held[(entry.stream, entry.id)] = entry
    other = make_redis_consumer(redis_broker, visibility_timeout=0.6)
    time.sleep(1.5)
    assert other._claim() == []
    holder.close()
    other.close()


def test_consume_outbox_on_a_redis_url(redis_broker):
    from io import StringIO

    from django.core.management import call_command

    publish_events(redis_broker, unsaved_event(pk=1), unsaved_event(pk=2))
    out = StringIO()
    with override_settings(OUTBOX_BROKER_URL=redis_broker.url, OUTBOX_EXCHANGE=redis_broker.prefix):
        call_command(
            "consume_outbox",
            "--handler",
            AWARD,
            "--queue",
            redis_broker.queue,
            "--prefetch",
            "1",
            "--once",
            "--json",
            stdout=out,
            stderr=StringIO(),
        )
    assert '"messages": 2' in out.getvalue()
    assert PointsLedger.objects.count() == 2
