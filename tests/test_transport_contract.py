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

import re
import time
from collections import Counter
from importlib import import_module
from typing import Any

import pytest
from django.test import override_settings

from django_outbox.backends import get_backend_class
from django_outbox.backends.base import BaseBackend, BrokerUnavailable, Reason
from django_outbox.backends.locmem import LocmemBackend
from django_outbox.backends.locmem import outbox as locmem_outbox
from django_outbox.checks import Codes, check_backend
from django_outbox.consumer import Outcome
from django_outbox.consumer.base import BrokerUnreachable, ImproperlyConfiguredConsumer
from django_outbox.message import CLOUDEVENTS, CLOUDEVENTS_STRUCTURED, NATIVE
from django_outbox.transports import consumer_class
from points.models import PointsLedger
from tests.utils.amqp import serving
from tests.utils.proxy import TcpProxy
from tests.utils.rows import unsaved_event, wire_rows
from tests.utils.transport import delivery_numbers
from tests.utils.waiting import wait_for

FAILING = "tests.consumer_handlers.FailingHandler"
AWARD = "points.handlers.AwardPointsHandler"
BROKERS = ["amqp", "nats", "redis"]


class Amqp:
    #: Whether the broker drops a second copy of an event itself (by its id).
    dedupes = False

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
    #: What a backend or a consumer that cannot connect says first.
    unreachable = "cannot connect to NATS at nats://127.0.0.1"
    dedupes = True  # the stream's duplicate window, by Nats-Msg-Id
    #: A consumer's options that keep it from taking another's messages for a long time.
    patient: dict[str, Any] = {}

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

    def unconnected_consumer(self, url: str) -> Any:
        from django_outbox.consumer.nats import Consumer

        return Consumer(
            handlers=[AWARD], url=url, queue=self.broker.queue, stream=self.broker.stream
        )

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
    unreachable = "cannot connect to Redis at redis://127.0.0.1"
    dedupes = False
    patient: dict[str, Any] = {"visibility_timeout": 30}

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

    def unconnected_consumer(self, url: str) -> Any:
        from django_outbox.consumer.redis import Consumer

        return Consumer(handlers=[AWARD], url=url, queue=self.broker.queue, connect_timeout=1)

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


@pytest.fixture(params=["nats", "redis"])
def stream_side(request: pytest.FixtureRequest) -> Any:
    """The transports whose backend is a stream client of ours (RabbitMQ's own cases of
    these are in test_backend_pika.py, with pika's particulars)."""
    if request.param == "nats":
        return Nats(request.getfixturevalue("nats_broker"))
    return Redis(request.getfixturevalue("redis_broker"))


@pytest.mark.once
@pytest.mark.parametrize(
    "urls, backend",
    [
        (["nats://127.0.0.1:4222", "tls://nats.example:4222"], "NatsBackend"),
        (["redis://127.0.0.1:6379/0", "rediss://redis.example:6380"], "RedisBackend"),
    ],
)
def test_a_transport_url_picks_its_backend(urls, backend):
    for url in urls:
        with override_settings(OUTBOX_BACKEND="", OUTBOX_BROKER_URL=url):
            assert get_backend_class().__name__ == backend


@pytest.mark.once
@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222", "redis://127.0.0.1:6379/0"])
def test_the_default_settings_pass_the_checks(url):
    """NATS: the default duplicate window is longer than the default lease (E030)."""
    with override_settings(OUTBOX_BACKEND="", OUTBOX_BROKER_URL=url):
        assert check_backend() == []


@pytest.mark.once
@pytest.mark.parametrize("backend", ["nats.NatsBackend", "redis.RedisBackend"])
def test_a_stream_backend_with_an_amqp_url_is_e005(backend):
    with override_settings(
        OUTBOX_BACKEND=f"django_outbox.backends.{backend}",
        OUTBOX_BROKER_URL="amqp://guest:guest@127.0.0.1/%2F",
    ):
        assert [e.id for e in check_backend()] == [Codes.BROKER_URL]


@pytest.mark.once
@pytest.mark.parametrize(
    "urls, module",
    [
        (["nats://127.0.0.1:4222"], "nats"),
        (["redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0"], "redis"),
    ],
)
def test_a_transport_url_picks_its_consumer(urls, module):
    for url in urls:
        assert consumer_class(url) is import_module(f"django_outbox.consumer.{module}").Consumer


@pytest.mark.parametrize(
    "url, module", [("nats://127.0.0.1:4222", "nats"), ("redis://127.0.0.1:6379/0", "redis")]
)
def test_a_queue_type_is_refused_saying_why(url, module):
    consumer = import_module(f"django_outbox.consumer.{module}").Consumer
    with pytest.raises(ImproperlyConfiguredConsumer, match="RabbitMQ's"):
        consumer(handlers=[AWARD], url=url, queue_type="quorum")


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
def test_batches_in_flight_are_collected_in_order(side):
    side.prepare([AWARD])
    rows = wire_rows(300)
    with side.backend() as b:
        for start in range(0, 300, 100):
            b.send(rows[start : start + 100])
        results = [b.wait() for _ in range(3)]
        assert b.wait() == []
    assert [len(r) for r in results] == [100, 100, 100]
    assert all(r.ok for batch in results for r in batch)
    stored = side.stored()
    assert list(stored) == [r.event_id for r in rows]
    assert set(stored.values()) == {1}


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
            started = time.monotonic()
            proxy.cut()
            proxy.resume()
            results = b.wait()
            assert time.monotonic() - started < 5  # at once, not at the confirm timeout
            assert {r.reason for r in results} == {Reason.CONNECTION_LOST}
            assert not any(r.ok for r in results)  # nothing SENT without the answer
            b.close()  # as the relay does after a lost connection
            assert all(r.ok for r in b.publish(rows))
    finally:
        proxy.close()
    stored = side.stored()
    assert all(stored[r.event_id] >= 1 for r in rows)  # 0 lost
    if side.dedupes:
        assert all(stored[r.event_id] == 1 for r in rows)


@pytest.mark.once
def test_a_lost_connection_fails_every_batch_in_flight(side):
    side.prepare([AWARD])
    with TcpProxy.in_front_of(side.url) as (proxy, url), side.backend(url) as b:
        b.publish(wire_rows(1, start=1000))
        proxy.pause()
        b.send(wire_rows(10))
        b.send(wire_rows(10, start=11))
        proxy.cut()
        proxy.resume()
        first, second = b.wait(), b.wait()
    assert {r.reason for r in first + second} == {Reason.CONNECTION_LOST}


@pytest.mark.once
def test_no_server_is_broker_unavailable(stream_side):
    with TcpProxy.in_front_of(stream_side.url) as (proxy, url):
        proxy.refuse()
        b = stream_side.backend(url, connect_timeout=1)
        with pytest.raises(BrokerUnavailable, match=re.escape(stream_side.unreachable)):
            b.send(wire_rows(1))
        b.close()


@pytest.mark.once
def test_no_answer_within_the_confirm_timeout_is_a_timeout(stream_side):
    with (
        TcpProxy.in_front_of(stream_side.url) as (proxy, url),
        stream_side.backend(url, confirm_timeout=0.5) as b,
    ):
        proxy.pause()  # the answers are held back
        started = time.monotonic()
        results = b.publish(wire_rows(10))
        assert time.monotonic() - started < 3
    assert {r.reason for r in results} == {Reason.TIMEOUT}


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


@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("message_format", [NATIVE, CLOUDEVENTS, CLOUDEVENTS_STRUCTURED])
def test_each_format_the_relay_writes_is_read(stream_side, message_format):
    traceparent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    event = unsaved_event(headers={"tenant": 5, "note": "ä b", "traceparent": traceparent})
    with override_settings(OUTBOX_MESSAGE_FORMAT=message_format):
        stream_side.publish(event)
    consumer = stream_side.consumer([AWARD])
    seen = []
    original = consumer.dispatcher.process

    def spy(received):
        seen.append(received)
        return original(received)

    consumer.dispatcher.process = spy
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 1
    assert result.formats[message_format] == 1
    (received,) = seen
    assert received.event_id == event.event_id
    assert received.headers["tenant"] == 5
    assert received.headers["note"] == "ä b"
    assert received.headers["traceparent"] == traceparent
    assert received.aggregate_id == event.aggregate_id
    assert received.sequence == event.pk
    if message_format == CLOUDEVENTS:
        assert received.cloudevent["datacontenttype"] == "application/json"


@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
def test_a_stop_hands_each_fetched_message_back_once(stream_side):
    stream_side.publish(*[unsaved_event(pk=n) for n in range(1, 6)])
    consumer = stream_side.consumer([AWARD], prefetch=5, **stream_side.patient)
    assert consumer.serve(max_messages=1).messages == 1
    # Four were fetched with it and handed back: each is delivered again at once (Redis:
    # claimable now, not after the visibility timeout), and counted once.
    consumer = stream_side.consumer([AWARD], **stream_side.patient)
    numbers = delivery_numbers(consumer)
    assert consumer.serve(until_idle=True).counts[Outcome.PROCESSED] == 4
    assert numbers == [2, 2, 2, 2]


@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
def test_the_consumer_reconnects_after_the_connection_is_lost(stream_side):
    stream_side.publish(unsaved_event(pk=1))
    with TcpProxy.in_front_of(stream_side.url) as (proxy, url):
        consumer = stream_side.consumer([AWARD], url=url, reconnect_max=0.2)
        with serving(consumer) as results:
            assert wait_for(lambda: PointsLedger.objects.count() == 1, timeout=20)
            proxy.cut()
            stream_side.publish(unsaved_event(pk=2))
            assert wait_for(lambda: PointsLedger.objects.count() == 2, timeout=20)
    assert results[0].counts[Outcome.PROCESSED] == 2


@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
def test_a_one_pass_run_that_cannot_connect_gives_up_saying_why(stream_side):
    with TcpProxy.in_front_of(stream_side.url) as (proxy, url):
        proxy.refuse()
        consumer = stream_side.unconnected_consumer(url)
        with pytest.raises(BrokerUnreachable, match=re.escape(stream_side.unreachable)):
            consumer.serve(until_idle=True)
