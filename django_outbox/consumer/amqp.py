"""The RabbitMQ transport of the consumer (pika): reads a durable queue bound to the outbox
exchange and settles each message with ``basic.ack``, ``basic.reject`` or a copy published
to the dead-letter queue, from the dispatcher's decision.

:class:`Consumer` is :class:`~django_outbox.consumer.base.BaseConsumer` on RabbitMQ: the loop,
the reconnects and the database outages are the base's; what is here is the queue's
declaration (:func:`queue_arguments`), where the delivery count is kept (a quorum queue's
``x-delivery-count``, or this consumer's own :data:`DELIVERY_HEADER` on a classic queue) and
how each decision becomes AMQP. ``manage.py consume_outbox`` is a thin command over it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Generator, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import pika
import pika.exceptions

from .. import tracing
from .._compat.pika import ConnectionFailure, connection_failure
from ..conf import outbox_settings
from ..message import Delivery
from .base import (
    LOST_CONNECTION_RETRIES,
    BaseConsumer,
    ImproperlyConfiguredConsumer,
    dead_letter_queue_name,
    default_queue_name,
)
from .dispatch import REASON_HEADER, Action, Decision

__all__ = [
    "DELIVERY_HEADER",
    "LOST_CONNECTION_RETRIES",
    "REASON_HEADER",
    "Consumer",
    "dead_letter_queue_name",
    "default_queue_name",
    "queue_arguments",
]

logger = logging.getLogger("django_outbox.consumer")

# Header a classic queue's consumer keeps its own delivery count in (quorum queues count
# redeliveries themselves in x-delivery-count).
DELIVERY_HEADER = "x-outbox-delivery"


class AmqpMessage(NamedTuple):
    """One message as pika delivers it."""

    method: Any
    properties: Any
    body: bytes


def queue_arguments(
    queue: str, *, queue_type: str, max_retries: int, max_priority: int | None = None
) -> dict[str, Any]:
    """Arguments of the consumer queue: dead-letter to ``<queue>.dlq`` via the default
    exchange; ``max_priority``: a classic priority queue of priorities 0..max_priority."""
    arguments: dict[str, Any] = {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead_letter_queue_name(queue),
    }
    if queue_type == "quorum":
        # The broker counts redeliveries and dead-letters past the limit: a consumer that
        # crashes on a message (and so never nacks it) cannot loop on it forever either.
        arguments.update({"x-queue-type": "quorum", "x-delivery-limit": max_retries})
    elif queue_type != "classic":
        raise ImproperlyConfiguredConsumer(
            f"OUTBOX_CONSUMER_QUEUE_TYPE is {queue_type!r}; use 'quorum' or 'classic'."
        )
    if max_priority is not None:
        if queue_type != "classic":
            raise ImproperlyConfiguredConsumer(
                f"queue {queue!r}: a priority queue (x-max-priority) is a classic queue; "
                f"RabbitMQ refuses x-max-priority on a {queue_type} queue."
            )
        arguments["x-max-priority"] = max_priority
    return arguments


def _declare(channel: Any, queue: str, arguments: dict[str, Any]) -> None:
    """Declare ``queue``; one that exists with other arguments is a configuration error
    that no reconnect mends (RabbitMQ closes the channel with PRECONDITION_FAILED)."""
    try:
        channel.queue_declare(queue, durable=True, arguments=arguments)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 406:
            raise
        wanted = ", ".join(f"{k}={v}" for k, v in sorted(arguments.items())) or "none"
        raise ImproperlyConfiguredConsumer(
            f"queue {queue!r} exists with other arguments than these ({wanted}): "
            f"{exc.reply_text}. A queue's arguments cannot change: stop its consumers, move "
            "or drain its messages, delete it (rabbitmqctl delete_queue) and start again to "
            "declare it anew, or use another queue name."
        ) from exc


def _hand_back(channel: Any, deliveries: Iterator[Any]) -> None:
    """Stop the consumer of ``channel`` and return every message it holds unacknowledged
    (prefetched, or held through a database outage) to the queue, each once.

    pika's ``cancel()`` rejects the prefetched messages before it cancels the consumer, so
    RabbitMQ hands them straight back and they are rejected a second time: on a quorum queue
    two deliveries of the limit per stop. Here the consumer is cancelled first, with nothing
    left to reject, and one ``basic.nack`` returns what it held: a return counted once before
    RabbitMQ 4.3, not at all from 4.3 (only ``basic.reject`` counts there).
    """
    # Take what pika has buffered off its hands (still unacknowledged at the broker), so
    # that its cancel() has nothing to reject.
    for _held in range(channel.get_waiting_message_count()):
        next(deliveries)
    channel.cancel()  # whatever arrives until the broker confirms is rejected by pika
    # multiple=True with tag 0: every delivery of the channel not yet settled.
    channel.basic_nack(delivery_tag=0, multiple=True, requeue=True)


class Consumer(BaseConsumer[AmqpMessage]):
    """Reads a durable queue bound to the outbox exchange and runs the handlers.

    One message at a time, in delivery order, within a prefetch window. A message is
    acknowledged only after its handlers committed (or were duplicates). A failure is
    retried ``max_retries`` times, then dead-lettered; an undecodable message at once.
    """

    transport = "amqp"
    connection_errors = (pika.exceptions.AMQPError,)

    def __init__(
        self,
        *,
        exchange_type: str | None = None,
        queue_type: str | None = None,
        max_priority: int | None = None,
        **options: Any,
    ) -> None:
        """``max_priority``: declare a classic priority queue (``x-max-priority``);
        ``options``: :class:`BaseConsumer`'s."""
        super().__init__(**options)
        self.exchange_type = exchange_type or outbox_settings.EXCHANGE_TYPE
        self.queue_type = queue_type or outbox_settings.CONSUMER_QUEUE_TYPE
        self.arguments = queue_arguments(
            self.queue,
            queue_type=self.queue_type,
            max_retries=self.max_retries,
            max_priority=max_priority,
        )
        self._connection: Any = None
        self._channel: Any = None

    # -- connection --------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect to the first broker node that answers, from the current one on, declare
        the queue, its dead-letter queue and the bindings. Raises :class:`CannotConnect` when
        every node has failed in this round."""

        def describe(exc: BaseException, url: str) -> tuple[ConnectionFailure, bool]:
            failure = connection_failure(exc, url)
            return failure, failure.permanent

        self._connection = self.connect_first_node(
            "RabbitMQ",
            lambda url: pika.BlockingConnection(pika.URLParameters(url)),
            # OSError: BlockingConnection lets a failed name lookup through bare.
            (pika.exceptions.AMQPConnectionError, OSError),
            describe,
        )
        self._node = self.nodes.name()
        channel = self._connection.channel()
        channel.confirm_delivery()  # classic-queue requeues are published: confirm them
        if not outbox_settings.EXCHANGE_PASSIVE and self.exchange:
            channel.exchange_declare(self.exchange, self.exchange_type, durable=True)
        dlq_args = {"x-queue-type": "quorum"} if self.queue_type == "quorum" else {}
        _declare(channel, self.dead_letter_queue, dlq_args)
        _declare(channel, self.queue, self.arguments)
        for key in self.dispatcher.routing_keys():
            channel.queue_bind(self.queue, self.exchange, routing_key=key)
        channel.basic_qos(prefetch_count=self.prefetch)
        self._channel = channel
        logger.info(
            "consuming %s (%s, dead letters to %s) bound to %s on exchange %s at %s",
            self.queue,
            self.queue_type,
            self.dead_letter_queue,
            self.dispatcher.routing_keys(),
            self.exchange,
            self._node,
        )

    @property
    def ready(self) -> bool:
        return self._channel is not None

    def disconnect(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # already broken: unacked messages are requeued anyway
                logger.debug("error closing the consumer connection", exc_info=True)

    def sleep(self, seconds: float) -> None:
        self._connection.sleep(seconds)

    # -- messages ----------------------------------------------------------------------------
    def messages(self) -> Generator[AmqpMessage | None, None, None]:
        channel = self._channel
        deliveries = channel.consume(self.queue, inactivity_timeout=self.idle_timeout)
        try:
            for method, properties, body in deliveries:
                yield None if method is None else AmqpMessage(method, properties, body)
        finally:
            if channel.is_open:
                _hand_back(channel, deliveries)

    def delivery(self, message: AmqpMessage) -> Delivery:
        properties = message.properties
        headers = dict(properties.headers or {})
        number, count_error = self._delivery_number(headers)
        return Delivery(
            message.body,
            message_id=properties.message_id,
            message_type=properties.type,
            headers=headers,
            content_type=properties.content_type,
            redelivered=message.method.redelivered,
            number=number,
            count_error=count_error,
            transport=self.transport,
        )

    def tracing(self, message: AmqpMessage) -> AbstractContextManager[Any]:
        method = message.method
        return tracing.delivery(
            method.exchange, method.routing_key, self.queue, method.delivery_tag
        )

    def _delivery_number(self, headers: Mapping[str, Any]) -> tuple[int, str]:
        """Which delivery of the message this is (1 for the first), from the count the
        broker (quorum) or this consumer (classic) keeps in a header, and ``""``; or 1 and
        why the count is not one (a publisher set the header)."""
        if self.queue_type == "quorum":
            name, value, first = "x-delivery-count", headers.get("x-delivery-count"), 0
        else:
            name, value, first = DELIVERY_HEADER, headers.get(DELIVERY_HEADER), 1
        if value is None:
            return 1, ""
        if isinstance(value, bool) or not isinstance(value, int) or value < first:
            return 1, f"header {name} is {value!r:.80}, not a delivery count"
        return value + 1 - first, ""

    # -- settling ----------------------------------------------------------------------------
    def settle(self, message: AmqpMessage, delivery: Delivery, decision: Decision) -> None:
        channel, tag = self._channel, message.method.delivery_tag
        if decision.action is Action.ACKNOWLEDGE:
            channel.basic_ack(tag)
        elif decision.action is Action.DEAD_LETTER:
            self._dead_letter(message, decision.reason)
        elif decision.action is Action.RETRY:
            if decision.delay:
                self.sleep(decision.delay)
            if self.queue_type == "quorum":
                # basic.reject, not basic.nack: from RabbitMQ 4.3 only a reject counts a
                # delivery (x-delivery-count); before 4.3 every return did.
                channel.basic_reject(tag, requeue=True)
                return
            # Classic queues do not count redeliveries: publish a copy with the count, then
            # ack the original (confirmed first, so the message is never lost in between).
            headers = {**(message.properties.headers or {}), DELIVERY_HEADER: delivery.number + 1}
            props = _copy_properties(message.properties, headers)
            channel.basic_publish("", self.queue, message.body, props, mandatory=True)
            channel.basic_ack(tag)
        else:
            raise ValueError(f"a transport cannot settle a {decision.action.value} decision")

    def _dead_letter(self, message: AmqpMessage, reason: str) -> None:
        """Move the message to the dead-letter queue with ``reason`` in :data:`REASON_HEADER`.

        A copy goes to the dead-letter queue (published with confirms), then the original is
        acked: a crash in between leaves a duplicate there, never a loss. Only if the copy
        cannot be placed (the dead-letter queue was deleted) is the original rejected to the
        queue's dead-letter exchange, without the reason.
        """
        channel, properties = self._channel, message.properties
        headers = {**(properties.headers or {}), REASON_HEADER: reason}
        try:
            channel.basic_publish(
                "",
                self.dead_letter_queue,
                message.body,
                _copy_properties(properties, headers),
                mandatory=True,
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            logger.error(
                "message %r: the copy for %s was refused (%s); rejected to the dead-letter "
                "exchange without its reason",
                properties.message_id,
                self.dead_letter_queue,
                type(exc).__name__,
            )
            channel.basic_reject(message.method.delivery_tag, requeue=False)
            return
        channel.basic_ack(message.method.delivery_tag)


def _copy_properties(properties: Any, headers: dict[str, Any]) -> Any:
    """The message's properties (all of them: correlation_id, reply_to, ... too) with other
    headers, persistent: for a copy the consumer publishes (a retry, a dead letter)."""
    props = copy.copy(properties)
    props.headers = headers
    props.delivery_mode = 2
    return props
