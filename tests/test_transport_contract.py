"""The same cases on every transport (docs/transports.md): the relay's backend and the
consumer against the real RabbitMQ, NATS JetStream and Redis, and locmem where a case
applies to it.

- publish N: every row answered ok, each event in the broker;
- a broker error fails that row, and only that row, with a reason;
- a connection cut mid-batch: every row of the batch released (CONNECTION_LOST, never
  SENT without the broker's answer) and, published again, nothing lost;
- consumer dedupe: an event delivered twice is processed once;
- dead-letter after the limit: a handler that always fails is tried max_retries + 1 times,
  then its message goes to the dead-letter queue with the reason.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from django_outbox.backends.base import BaseBackend, Reason
from django_outbox.backends.locmem import LocmemBackend
from django_outbox.backends.locmem import outbox as locmem_outbox
from django_outbox.consumer import Outcome
from points.models import PointsLedger
from tests.utils.proxy import TcpProxy
from tests.utils.rows import unsaved_event, wire_rows

FAILING = "tests.consumer_handlers.FailingHandler"
AWARD = "points.handlers.AwardPointsHandler"
BROKERS = ["amqp", "nats", "redis"]


class Amqp:
    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.url = broker.url

    def prepare(self, handlers: list[str], **options: Any) -> None:
        """The queue and its bindings are the consumer's: declared before anything is
        published (the relay publishes with mandatory)."""
        self.consumer(handlers, **options).close()

    def backend(self, url: str | None = None, **options: Any) -> BaseBackend:
        from django_outbox.backends.pika import PikaBackend

        return PikaBackend(broker_url=url or self.url, exchange=self.broker.exchange, **options)

    def stored(self) -> Counter[str]:
        return self.broker.collect()

    def refuse_order_paid(self) -> Reason:
        return Reason.UNROUTABLE  # no queue is bound to ORDER_PAID

    def consumer(self, handlers: list[str], **options: Any) -> Any:
        from tests.utils.amqp import make_consumer

        return make_consumer(self.broker, handlers, **options)

    def publish(self, *events: Any) -> None:
        for event in events:
            self.broker.publish(event)

    def dead_reasons(self) -> list[str]:
        return [props.headers["x-outbox-reason"] for props, _ in self.broker.drain(self.broker.dlq)]


class Nats:
    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.url = broker.url

    def prepare(self, handlers: list[str], **options: Any) -> None:
        """Nothing: the relay's backend makes the stream, the consumer its reader."""

    def backend(self, url: str | None = None, **options: Any) -> BaseBackend:
        from django_outbox.backends.nats import NatsBackend

        return NatsBackend(**self.broker.backend_options(broker_url=url or self.url, **options))

    def stored(self) -> Counter[str]:
        return self.broker.collect()

    def refuse_order_paid(self) -> Reason:
        self.broker.declare_stream(subjects=[f"{self.broker.prefix}.ORDER_CREATED"])
        return Reason.UNROUTABLE

    def consumer(self, handlers: list[str], **options: Any) -> Any:
        from tests.utils.nats import make_nats_consumer

        return make_nats_consumer(self.broker, handlers, **options)

    def publish(self, *events: Any) -> None:
        from tests.utils.nats import publish_events

        for event in events:
            publish_events(self.broker, event)

    def dead_reasons(self) -> list[str]:
        from urllib.parse import unquote

        from django_outbox.consumer.nats import durable_name

        stream = f"{durable_name(self.broker.queue)}_dlq"
        return [unquote(m.headers["x-outbox-reason"]) for m in self.broker.messages(stream)]


class Redis:
    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.url = broker.url

    def prepare(self, handlers: list[str], **options: Any) -> None:
        """Nothing: the relay's backend makes the stream, the consumer its reader."""

    def backend(self, url: str | None = None, **options: Any) -> BaseBackend:
        from django_outbox.backends.redis import RedisBackend

        return RedisBackend(**self.broker.backend_options(broker_url=url or self.url, **options))

    def stored(self) -> Counter[str]:
        return self.broker.collect()

    def refuse_order_paid(self) -> Reason:
        self.broker.client.set(self.broker.stream("ORDER_PAID"), "not a stream")
        return Reason.NACKED  # WRONGTYPE

    def consumer(self, handlers: list[str], **options: Any) -> Any:
        from tests.utils.redis import make_redis_consumer

        options.setdefault("visibility_timeout", 0.3)
        return make_redis_consumer(self.broker, handlers, **options)

    def publish(self, *events: Any) -> None:
        from tests.utils.redis import publish_events

        publish_events(self.broker, *events)

    def dead_reasons(self) -> list[str]:
        return [f[b"x-outbox-reason"].decode() for f in self.broker.dead_letters()]


@pytest.fixture(params=BROKERS)
def side(request: pytest.FixtureRequest) -> Any:
    kind = request.param
    if kind == "amqp":
        return Amqp(request.getfixturevalue("broker"))
    if kind == "nats":
        return Nats(request.getfixturevalue("nats_broker"))
    return Redis(request.getfixturevalue("redis_broker"))


@pytest.mark.once
def test_publish_n_on_locmem():
    rows = wire_rows(300)
    with LocmemBackend() as b:
        assert all(r.ok for r in b.publish(rows))
    assert [m.message_id for m in locmem_outbox] == [r.event_id for r in rows]


@pytest.mark.once
def test_publish_n(side):
    side.prepare([AWARD])
    rows = wire_rows(300)
    with side.backend() as b:
        for start in range(0, 300, 100):  # three batches in flight
            b.send(rows[start : start + 100])
        results = [r for _ in range(3) for r in b.wait()]
    assert len(results) == 300
    assert all(r.ok for r in results), results[:3]
    stored = side.stored()
    assert all(stored[r.event_id] == 1 for r in rows)


@pytest.mark.once
def test_a_broker_error_fails_that_row_only(side):
    side.prepare([AWARD])
    reason = side.refuse_order_paid()
    rows = wire_rows(2) + wire_rows(1, event_type="ORDER_PAID", start=3) + wire_rows(1, start=4)
    with side.backend() as b:
        results = b.publish(rows)
    assert [r.ok for r in results] == [True, True, False, True]
    assert results[2].reason is reason
    assert results[2].error


@pytest.mark.once
def test_a_connection_cut_mid_batch_loses_nothing_and_sends_nothing_unanswered(side):
    side.prepare([AWARD])
    proxy, url = TcpProxy.for_url(side.url)
    rows = wire_rows(200)
    try:
        with side.backend(url, confirm_timeout=10) as b:
            assert all(r.ok for r in b.publish(wire_rows(1, start=1000)))  # connected
            proxy.pause()
            b.send(rows)
            time.sleep(0.3)
            proxy.cut()
            proxy.resume()
            results = b.wait()
            assert {r.reason for r in results} == {Reason.CONNECTION_LOST}
            assert not any(r.ok for r in results)  # nothing SENT without the answer
            b.close()  # as the relay does after a lost connection
            assert all(r.ok for r in b.publish(rows))
    finally:
        proxy.close()
    stored = side.stored()
    assert all(stored[r.event_id] >= 1 for r in rows)  # 0 lost


@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
def test_the_consumer_processes_an_event_delivered_twice_once(side):
    side.prepare([AWARD])
    event = unsaved_event()
    side.publish(event)
    side.publish(event)
    result = side.consumer([AWARD]).serve(until_idle=True)
    assert PointsLedger.objects.filter(source_event_id=event.event_id).count() == 1
    # JetStream drops the second copy by its Nats-Msg-Id: one delivery there.
    assert result.counts[Outcome.PROCESSED] == 1
    assert result.counts[Outcome.DUPLICATE] == result.messages - 1


@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
def test_dead_letter_after_the_limit(side):
    side.prepare([FAILING], max_retries=1)
    side.publish(unsaved_event())
    result = side.consumer([FAILING], max_retries=1).serve(until_idle=True)
    if not result.dead_lettered:  # a retry delayed past the first idle pass
        result = side.consumer([FAILING], max_retries=1).serve(until_idle=True)
    assert result.dead_lettered == 1
    assert side.dead_reasons() == ["failed 2 time(s): RuntimeError: boom after the write"]
