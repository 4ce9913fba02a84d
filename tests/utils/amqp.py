"""The test's own corner of the real RabbitMQ, and a consumer on it.

:class:`Broker` names a topic exchange and queues for one test and deletes them all at the
end, so tests never touch anything shared (the ``broker`` fixture of tests/conftest.py).
Outages are made with tests.utils.proxy.TcpProxy, never by touching the broker itself.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pika

from django_outbox.consumer import Consumer, ConsumeResult
from django_outbox.message import CONTENT_TYPE, encode_body, encode_headers
from django_outbox.models import OutboxEvent
from tests.utils.subprocess import manage_command
from tests.utils.threads import db_thread
from tests.utils.transport import connected_consumer

AWARD = "points.handlers.AwardPointsHandler"


def properties(event: OutboxEvent) -> pika.BasicProperties:
    """The AMQP properties the relay publishes ``event`` with."""
    return pika.BasicProperties(
        content_type=CONTENT_TYPE,
        delivery_mode=2,
        message_id=event.event_id,
        type=event.event_type,
        headers=encode_headers(event),
    )


class Broker:
    """A connection that names objects for one test and deletes them at :meth:`close`.

    ``exchange`` (topic, durable) is declared when a queue is bound to it or a message is
    published through it, so a test may also watch a backend declare it. ``queue`` is the
    test's main queue, declared by whoever reads it (a Consumer, :meth:`bind_all`), and
    ``dlq`` its dead-letter queue. :meth:`collect` counts what ``queue`` received by
    event_id in :attr:`received`.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.suffix = uuid.uuid4().hex[:10]
        self.exchange = f"test.outbox.{self.suffix}"
        self.queue = f"{self.exchange}.q"
        self.received: Counter[str] = Counter()
        self._connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self._connection.channel()
        self._queues: list[str] = [self.queue, self.dlq]
        self._exchanges: list[str] = [self.exchange]
        self._exchange_declared = False

    @property
    def dlq(self) -> str:
        return f"{self.queue}.dlq"

    def delete_at_close(self, *, queues: Sequence[str] = (), exchanges: Sequence[str] = ()) -> None:
        """Objects the code under test declares, to be deleted with the test's own."""
        self._queues.extend(q for q in queues if q not in self._queues)
        self._exchanges.extend(e for e in exchanges if e not in self._exchanges)

    def declare_exchange(self, name: str | None = None) -> str:
        name = name or self.exchange
        self.channel.exchange_declare(name, exchange_type="topic", durable=True)
        self.delete_at_close(exchanges=[name])
        self._exchange_declared |= name == self.exchange
        return name

    def declare_queue(
        self,
        routing_key: str | None = "#",
        *,
        name: str | None = None,
        durable: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> str:
        """Declare a queue (a new name unless given), bound to the exchange with
        ``routing_key`` unless it is None; return its name."""
        name = name or f"test.outbox.q.{uuid.uuid4().hex[:10]}"
        self.channel.queue_declare(name, durable=durable, arguments=arguments)
        self.delete_at_close(queues=[name])
        if routing_key is not None:
            self.declare_exchange()
            self.channel.queue_bind(name, self.exchange, routing_key=routing_key)
        return name

    def bind_all(self, routing_key: str = "#") -> str:
        """Declare ``queue``, bound to ``routing_key`` (every event by default)."""
        return self.declare_queue(routing_key, name=self.queue)

    def publish(self, event: OutboxEvent, routing_key: str | None = None) -> None:
        """Publish ``event`` as the relay would (body, properties, its type as routing key)."""
        self.publish_raw(encode_body(event), properties(event), routing_key or event.event_type)

    def publish_raw(self, body: bytes, props: pika.BasicProperties, routing_key: str) -> None:
        if not self._exchange_declared:
            self.declare_exchange()
        self.channel.basic_publish(self.exchange, routing_key, body, props)

    def count(self, queue: str) -> int:
        return int(self.channel.queue_declare(queue, passive=True).method.message_count)

    def get(self, queue: str) -> tuple[Any, Any, bytes] | None:
        """The next message of ``queue`` (acknowledged), or None when it is empty."""
        method, props, body = self.channel.basic_get(queue, auto_ack=True)
        return None if method is None else (method, props, body)

    def drain(self, queue: str) -> list[tuple[Any, bytes]]:
        """Every message in ``queue`` (properties, body), taken off it."""
        taken = []
        while (got := self.get(queue)) is not None:
            taken.append(got[1:])
        return taken

    def get_all(self, queue: str, expected: int, timeout: float = 5.0) -> list[tuple]:
        """Up to ``expected`` messages of ``queue``, waiting at most ``timeout`` for them."""
        messages: list[tuple] = []
        deadline = time.monotonic() + timeout
        while len(messages) < expected and time.monotonic() < deadline:
            message = self.get(queue)
            if message is None:
                time.sleep(0.05)
                continue
            messages.append(message)
        return messages

    def collect(self) -> Counter[str]:
        """Drain ``queue`` into :attr:`received` (deliveries per event_id) and return it."""
        self.channel.basic_qos(prefetch_count=2000)
        for method, props, _body in self.channel.consume(
            self.queue, auto_ack=True, inactivity_timeout=0.5
        ):
            if method is None:
                break
            self.received[props.message_id] += 1
        self.channel.cancel()
        return self.received

    def close(self) -> None:
        try:
            for queue in self._queues:
                self.channel.queue_delete(queue)
            for exchange in self._exchanges:
                self.channel.exchange_delete(exchange)
        finally:
            self._connection.close()


def make_consumer(broker: Broker, handlers: Sequence[str] = (AWARD,), **options: Any) -> Consumer:
    """A Consumer of ``handlers`` on the broker's queue and exchange, connected: the queue,
    its dead-letter queue and the bindings are declared. No pause before a retry."""
    return connected_consumer(Consumer, broker, handlers, exchange=broker.exchange, **options)


def consume(
    broker: Broker, *events: OutboxEvent, handlers: Sequence[str] = (AWARD,), **options: Any
) -> ConsumeResult:
    """Publish ``events`` as the relay would, to a queue declared first (by a consumer of
    ``handlers``), and consume until the queue is idle."""
    consumer = make_consumer(broker, handlers, **options)
    for event in events:
        broker.publish(event)
    return consumer.serve(until_idle=True)


@contextmanager
def serving(consumer: Consumer) -> Iterator[list[ConsumeResult]]:
    """``consumer.serve()`` in a thread of its own until the block ends (then stopped and
    joined); yields the list its result is appended to."""
    stop, results = threading.Event(), []
    thread = db_thread(lambda: results.append(consumer.serve(stop=stop)))
    thread.start()
    try:
        yield results
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the consumer did not stop"


def consume_outbox_command(broker: Broker, *options: str) -> list[str]:
    """The ``manage.py consume_outbox`` command line on the broker's queue and exchange."""
    return manage_command(
        "consume_outbox", "--queue", broker.queue, "--exchange", broker.exchange, *options
    )
