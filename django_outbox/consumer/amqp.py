"""The RabbitMQ consumer: reads a durable queue bound to the outbox exchange (pika) and
settles each message with the broker from the dispatcher's outcome.

:class:`Consumer` acknowledges a message only after every handler for it committed or
reported a duplicate; ``manage.py consume_outbox`` is a thin command over it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from django.apps import apps

from .. import tracing
from ..conf import BROKER_URL_EMPTY, BROKER_URL_EMPTY_HINT, outbox_settings
from ..db import database_answers, tidy_connections
from ..exceptions import error_text
from ..worker import Backoff, BrokerNodes, keep_running
from .dispatch import ConsumeResult, DatabaseUnavailable, Dispatcher
from .handlers import HandlerResult, IdempotentHandler, ImproperlyConfiguredHandler, Outcome

logger = logging.getLogger("django_outbox.consumer")

# Header a classic queue's consumer keeps its own delivery count in (quorum queues count
# redeliveries themselves in x-delivery-count).
DELIVERY_HEADER = "x-outbox-delivery"
# Header of a message the consumer dead-lettered: why (the outcome and the error).
REASON_HEADER = "x-outbox-reason"
# A message whose handler loses its database connection while the database itself answers
# (a killed session, a failover) is tried again at once, uncounted, this many times; after
# that the loss counts as a failure: a handler that breaks its own connection every time
# must not hold the queue for good.
LOST_CONNECTION_RETRIES = 3


def dead_letter_queue_name(queue: str) -> str:
    return f"{queue}.dlq"


def default_queue_name(handlers: Sequence[type[IdempotentHandler]] = ()) -> str:
    """OUTBOX_CONSUMER_QUEUE, else ``<app label>.outbox`` of the first handler's app."""
    if outbox_settings.CONSUMER_QUEUE:
        return outbox_settings.CONSUMER_QUEUE
    for cls in handlers:
        config = apps.get_containing_app_config(cls.__module__)
        if config is not None:
            return f"{config.label}.outbox"
    return "outbox.consumer"


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


def queue_arguments(queue: str, *, queue_type: str, max_retries: int) -> dict[str, Any]:
    """Arguments of the consumer queue: dead-letter to ``<queue>.dlq`` via the default exchange."""
    arguments: dict[str, Any] = {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead_letter_queue_name(queue),
    }
    if queue_type == "quorum":
        # The broker counts redeliveries and dead-letters past the limit: a consumer that
        # crashes on a message (and so never nacks it) cannot loop on it forever either.
        arguments.update({"x-queue-type": "quorum", "x-delivery-limit": max_retries})
    elif queue_type != "classic":
        raise ImproperlyConfiguredHandler(
            f"OUTBOX_CONSUMER_QUEUE_TYPE is {queue_type!r}; use 'quorum' or 'classic'."
        )
    return arguments


class Consumer:
    """Reads a durable queue bound to the outbox exchange and runs the handlers.

    One message at a time, in delivery order, within a prefetch window. A message is
    acknowledged only after its handlers committed (or were duplicates). A failure is
    retried ``max_retries`` times, then dead-lettered; an undecodable message at once.
    """

    def __init__(
        self,
        *,
        handlers: Iterable[str | type[IdempotentHandler]] | None = None,
        url: str | Sequence[str] | None = None,
        queue: str | None = None,
        exchange: str | None = None,
        exchange_type: str | None = None,
        prefetch: int | None = None,
        max_retries: int | None = None,
        queue_type: str | None = None,
        retry_delay: float = 1.0,
        reconnect_max: float = 30.0,
        idle_timeout: float = 1.0,
    ) -> None:
        self.dispatcher = Dispatcher(handlers=handlers)
        if not self.dispatcher.handlers:
            raise ImproperlyConfiguredHandler(
                "No handlers to run: set OUTBOX_CONSUMER_HANDLERS, pass --handler, or define "
                "IdempotentHandler subclasses in an installed app's handlers.py."
            )
        try:
            # One URL, or the nodes of a cluster: the first that answers is read from.
            self.nodes = BrokerNodes(url or outbox_settings.BROKER_URL)
        except TypeError as exc:
            raise ImproperlyConfiguredHandler(str(exc)) from exc
        if not self.nodes:
            raise ImproperlyConfiguredHandler(f"{BROKER_URL_EMPTY} {BROKER_URL_EMPTY_HINT}")
        self.queue = queue or default_queue_name(self.dispatcher.handler_classes)
        self.dead_letter_queue = dead_letter_queue_name(self.queue)
        self.exchange = outbox_settings.EXCHANGE if exchange is None else exchange
        self.exchange_type = exchange_type or outbox_settings.EXCHANGE_TYPE
        self.prefetch = prefetch or outbox_settings.CONSUMER_PREFETCH
        self.max_retries = (
            outbox_settings.CONSUMER_MAX_RETRIES if max_retries is None else max_retries
        )
        self.queue_type = queue_type or outbox_settings.CONSUMER_QUEUE_TYPE
        self.arguments = queue_arguments(
            self.queue, queue_type=self.queue_type, max_retries=self.max_retries
        )
        self.retry_delay = retry_delay
        self.reconnect_max = reconnect_max
        self.idle_timeout = idle_timeout
        self._connection: Any = None
        self._channel: Any = None
        self._node = ""  # the node connected to, for log lines (password masked)

    @property
    def url(self) -> str:
        """The URL of the broker node connected to, or to be tried next."""
        return self.nodes.current

    # -- connection --------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect to the first broker node that answers, from the current one on, declare
        the queue, its dead-letter queue and the bindings. Raises pika's
        ``AMQPConnectionError`` when every node has failed in this round."""
        import pika
        import pika.exceptions

        self.nodes.start()
        while True:
            node = self.nodes.name()
            try:
                self._connection = pika.BlockingConnection(pika.URLParameters(self.nodes.current))
                break
            except pika.exceptions.AMQPConnectionError as exc:
                if not self.nodes.failed():
                    raise
                logger.warning(
                    "cannot connect to RabbitMQ at %s (%s); trying the next node, %s",
                    node,
                    error_text(exc),
                    self.nodes.name(),
                )
        self._node = node
        channel = self._connection.channel()
        channel.confirm_delivery()  # classic-queue requeues are published: confirm them
        if not outbox_settings.EXCHANGE_PASSIVE and self.exchange:
            channel.exchange_declare(self.exchange, self.exchange_type, durable=True)
        dlq_args = {"x-queue-type": "quorum"} if self.queue_type == "quorum" else {}
        channel.queue_declare(self.dead_letter_queue, durable=True, arguments=dlq_args)
        channel.queue_declare(self.queue, durable=True, arguments=self.arguments)
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
            node,
        )

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # already broken: unacked messages are requeued anyway
                logger.debug("error closing the consumer connection", exc_info=True)

    # -- the loop ----------------------------------------------------------------------------
    def run(
        self,
        *,
        stop: threading.Event | None = None,
        max_messages: int | None = None,
        until_idle: bool = False,
    ) -> ConsumeResult:
        """Consume until ``stop`` is set, ``max_messages`` were handled, or (``until_idle``)
        the queue stayed empty for ``idle_timeout`` seconds. Reconnects after a lost
        connection: to the next broker node at once while some node has not failed in this
        round, else after a growing pause (:class:`~django_outbox.worker.BrokerNodes`)."""
        import pika.exceptions

        stop = stop or threading.Event()
        result = ConsumeResult()
        backoff = Backoff(maximum=self.reconnect_max)

        def step() -> bool:
            if self._channel is None:
                self.connect()
                backoff.reset()
            return self._consume(stop, result, max_messages, until_idle)

        def fail_over(exc: Exception) -> bool:
            # A connection that was open is lost: the next one goes to the next node. One
            # that could not be opened: connect() has been through every node already.
            return self._connection is not None and self.nodes.failed()

        def lost(exc: Exception, pause: float) -> None:
            where = f" to {self._node}" if self._connection is not None else ""
            self.close()
            then = (
                f"reconnecting in {pause:.1f}s" if pause else f"failing over to {self.nodes.name()}"
            )
            logger.warning(
                "broker connection%s lost (%s: %s); %s", where, type(exc).__name__, exc, then
            )

        try:
            keep_running(
                stop,
                step,
                backoff=backoff,
                on_error=lost,
                recoverable=pika.exceptions.AMQPError,
                fail_over=fail_over,
            )
        finally:
            self.close()
        return result

    def _consume(
        self,
        stop: threading.Event,
        result: ConsumeResult,
        max_messages: int | None,
        until_idle: bool,
    ) -> bool:
        """Consume on the open channel; True when the run is over."""
        channel = self._channel
        deliveries = channel.consume(self.queue, inactivity_timeout=self.idle_timeout)
        try:
            for method, properties, body in deliveries:
                if method is None:
                    if until_idle or stop.is_set():
                        return True
                    continue
                outcome = self._deliver(stop, channel, method, properties, body)
                if outcome is None:  # stopped during a database outage: handed back
                    return True
                result.add(outcome, self._format_last)
                if self._dead_lettered_last:
                    result.dead_lettered += 1
                if stop.is_set() or (max_messages and result.messages >= max_messages):
                    return True
        finally:
            if channel.is_open:
                _hand_back(channel, deliveries)
        return True

    _dead_lettered_last = False
    _format_last = ""  # the format of the message handle_delivery() settled last

    def _deliver(
        self, stop: threading.Event, channel: Any, method: Any, properties: Any, body: bytes
    ) -> Outcome | None:
        """:meth:`handle_delivery`, holding the message through an outage of the database.

        An outage of the consumer's own database is nobody's fault: the message is neither
        acked nor returned (a return counts a delivery against it on a quorum queue), the
        consumer takes no other one meanwhile, waits with a growing pause until the database
        answers, then handles the same delivery again. A connection lost while the database
        answers at once is retried at once, :data:`LOST_CONNECTION_RETRIES` times. None:
        ``stop`` was set while waiting; the message is still unsettled (closing the channel
        returns it).
        """
        backoff = Backoff(maximum=self.reconnect_max)
        quick_losses = 0
        while True:
            tidy_connections()
            try:
                with tracing.delivery(
                    method.exchange, method.routing_key, self.queue, method.delivery_tag
                ):
                    return self.handle_delivery(
                        channel,
                        method,
                        properties,
                        body,
                        hold_on_lost_connection=quick_losses < LOST_CONNECTION_RETRIES,
                    )
            except DatabaseUnavailable as exc:
                lost = exc
            finally:
                tidy_connections()
            if database_answers(lost.using):
                quick_losses += 1
                logger.warning(
                    "message %r: the connection to database %r was lost and the database "
                    "answers; trying the message again (%d of %d)",
                    properties.message_id,
                    lost.using,
                    quick_losses,
                    LOST_CONNECTION_RETRIES,
                )
                continue
            if not self._wait_for_database(stop, lost, backoff, properties.message_id):
                # Not nacked here: the consumer still listens, the broker would hand the
                # message straight back, and the stop would return it a second time (two
                # deliveries counted). The caller's _hand_back() returns it once.
                return None

    def _wait_for_database(
        self, stop: threading.Event, lost: DatabaseUnavailable, backoff: Backoff, message_id: Any
    ) -> bool:
        """Wait until the database answers (True) or ``stop`` is set (False), keeping the
        broker connection serviced (heartbeats) and the message unacknowledged."""
        while True:
            pause = backoff.next()
            logger.warning(
                "database %r unavailable (%s); holding message %r unacknowledged (no delivery "
                "counted) and taking no other; retrying in %.1fs",
                lost.using,
                lost.error,
                message_id,
                pause,
            )
            deadline = time.monotonic() + pause
            while (remaining := deadline - time.monotonic()) > 0:
                if stop.is_set():
                    return False
                self._connection.sleep(min(remaining, 0.2))
            if stop.is_set():
                return False
            if database_answers(lost.using):
                logger.info(
                    "database %r answers again; handling message %r again", lost.using, message_id
                )
                return True

    def handle_delivery(
        self,
        channel: Any,
        method: Any,
        properties: Any,
        body: bytes,
        *,
        hold_on_lost_connection: bool = False,
    ) -> Outcome:
        """Process one delivery and settle it with the broker (ack, requeue or dead-letter).

        With ``hold_on_lost_connection``, a handler that lost its database connection
        raises :class:`DatabaseUnavailable` instead, and the delivery is left unsettled.
        """
        self._dead_lettered_last = False
        headers = dict(properties.headers or {})
        outcome, results = self.dispatcher.receive(
            body,
            message_id=properties.message_id,
            message_type=properties.type,
            headers=headers,
            redelivered=method.redelivered,
            content_type=properties.content_type,
        )
        self._format_last = results[0].message_format if results else ""
        lost = next((r for r in results if r.lost_database), None)
        if lost is not None and hold_on_lost_connection:
            raise DatabaseUnavailable(lost.lost_database, lost.error)
        if outcome.acknowledge:
            channel.basic_ack(method.delivery_tag)
        elif outcome in (Outcome.UNDECODABLE, Outcome.OUT_OF_ORDER):
            error = next((r.error for r in results if r.outcome is outcome), "")
            self._dead_letter(channel, method, properties, body, f"{outcome.value}: {error}")
        else:
            self._retry(channel, method, properties, body, headers, results)
        return outcome

    def _dead_letter(
        self, channel: Any, method: Any, properties: Any, body: bytes, reason: str
    ) -> None:
        """Move the message to the dead-letter queue with ``reason`` in :data:`REASON_HEADER`.

        A copy goes to the dead-letter queue (published with confirms), then the original is
        acked: a crash in between leaves a duplicate there, never a loss. Only if the copy
        cannot be placed (the dead-letter queue was deleted) is the original rejected to the
        queue's dead-letter exchange, without the reason.
        """
        import pika.exceptions

        reason = error_text(reason)
        logger.error(
            "message %r dead-lettered to %s: %s",
            properties.message_id,
            self.dead_letter_queue,
            reason,
        )
        self._dead_lettered_last = True
        headers = {**(properties.headers or {}), REASON_HEADER: reason}
        try:
            channel.basic_publish(
                "",
                self.dead_letter_queue,
                body,
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
            channel.basic_reject(method.delivery_tag, requeue=False)
            return
        channel.basic_ack(method.delivery_tag)

    def _delivery_number(self, headers: Mapping[str, Any]) -> int:
        """Which delivery of the message this is (1 for the first), from the count the
        broker (quorum) or this consumer (classic) keeps in a header.

        Raises ``ValueError`` for a count that is not one: a publisher set the header.
        """
        if self.queue_type == "quorum":
            name, value, first = "x-delivery-count", headers.get("x-delivery-count"), 0
        else:
            name, value, first = DELIVERY_HEADER, headers.get(DELIVERY_HEADER), 1
        if value is None:
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < first:
            raise ValueError(f"header {name} is {value!r:.80}, not a delivery count")
        return value + 1 - first

    def _retry(
        self,
        channel: Any,
        method: Any,
        properties: Any,
        body: bytes,
        headers: dict[str, Any],
        results: Sequence[HandlerResult],
    ) -> None:
        error = next((r.error for r in results if r.error), "")
        try:
            delivery = self._delivery_number(headers)
        except ValueError as exc:
            # The count cannot be kept: retrying could loop for good.
            self._dead_letter(channel, method, properties, body, f"failed: {error}; {exc}")
            return
        if delivery > self.max_retries:
            # Not left to a quorum queue's own limit: that would lose the reason.
            self._dead_letter(
                channel, method, properties, body, f"failed {delivery} time(s): {error}"
            )
            return
        logger.warning(
            "message %s failed (delivery %s of %s); retrying: %s",
            properties.message_id,
            delivery,
            self.max_retries + 1,
            error,
        )
        if self.retry_delay:
            # Keep the connection serviced (heartbeats) while waiting.
            self._connection.sleep(min(self.retry_delay * delivery, 30.0))
        if self.queue_type == "quorum":
            # basic.reject, not basic.nack: from RabbitMQ 4.3 only a reject counts a
            # delivery (x-delivery-count); before 4.3 every return did.
            channel.basic_reject(method.delivery_tag, requeue=True)
            return
        # Classic queues do not count redeliveries: publish a copy with the count, then ack
        # the original (confirmed first, so the message is never lost in between).
        copy_headers = {**headers, DELIVERY_HEADER: delivery + 1}
        props = _copy_properties(properties, copy_headers)
        channel.basic_publish("", self.queue, body, props, mandatory=True)
        channel.basic_ack(method.delivery_tag)


def _copy_properties(properties: Any, headers: dict[str, Any]) -> Any:
    """The message's properties (all of them: correlation_id, reply_to, ... too) with other
    headers, persistent: for a copy the consumer publishes (a retry, a dead letter)."""
    import copy

    props = copy.copy(properties)
    props.headers = headers
    props.delivery_mode = 2
    return props
