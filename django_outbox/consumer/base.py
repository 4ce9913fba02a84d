"""The consumer loop every transport shares, and the small contract a transport implements.

A transport (``amqp.py`` for RabbitMQ; one module per broker) subclasses
:class:`BaseConsumer` and implements how to connect, read messages, turn one into a
:class:`~django_outbox.message.Delivery` and settle it with its broker from the
:class:`~django_outbox.consumer.dispatch.Decision`. The loop here does the rest, the same on
every broker:

- :meth:`BaseConsumer.serve`: consume until stopped, reconnecting after a lost connection
  (to the next broker node at once while one is left in this round, else after a growing
  pause; :class:`~django_outbox.worker.BrokerNodes`);
- each message is decided by the :class:`~django_outbox.consumer.dispatch.Dispatcher`; a
  message whose handler's database failed (a lost connection, a missing table, a lock
  timeout) is *held*: neither settled nor counted, the consumer takes no other one
  meanwhile and tries it again after a growing pause, once the database answers
  (:meth:`BaseConsumer._decide`).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Generic, TypeVar

from django.apps import apps

from ..conf import BROKER_URL_EMPTY, BROKER_URL_EMPTY_HINT, outbox_settings
from ..db import database_answers, tidy_connections
from ..exceptions import OutboxError
from ..message import Delivery
from ..worker import Backoff, BrokerNodes, keep_running
from .dispatch import Action, ConsumeResult, Decision, Dispatcher
from .handlers import IdempotentHandler, ImproperlyConfiguredHandler

logger = logging.getLogger("django_outbox.consumer")

# A message whose handler loses its database connection while the database itself answers
# (a killed session, a failover) is tried again at once, uncounted, this many times; after
# that the loss counts as a failure: a handler that breaks its own connection every time
# must not hold the queue for good.
LOST_CONNECTION_RETRIES = 3

#: The transport's own message object (pika's method, properties and body for RabbitMQ).
M = TypeVar("M")
T = TypeVar("T")


class ImproperlyConfiguredConsumer(OutboxError):
    """The consumer's own settings cannot work (the broker URL, the queue type): not a
    handler's fault. ``consume_outbox`` exits 2 with the text."""


class CannotConnect(Exception):
    """No node of the broker could be connected to; the text says why in words (``vhost
    'shop' not found``), no password. ``permanent``: trying again as configured fails the
    same way (a name that does not resolve, a refused port, a missing vhost, refused
    credentials). A transport's :meth:`BaseConsumer.connect` raises it."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class BrokerUnreachable(OutboxError):
    """A one-pass run (``consume_outbox --once``) could not connect to any broker node:
    it gives up (exit 2) instead of waiting. The text says why."""


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


class BaseConsumer(ABC, Generic[M]):
    """Reads a queue of one broker and runs the handlers on each message, in delivery order.

    A message is settled only after its handlers committed (or were duplicates): a failure
    is retried ``max_retries`` times, then dead-lettered with its reason; an undecodable
    message at once (:class:`~django_outbox.consumer.dispatch.Dispatcher`).
    """

    #: The transport's name: :attr:`Delivery.transport` and log lines.
    transport: ClassVar[str] = ""
    #: What the broker client raises when the connection is lost or refused: the loop
    #: reconnects on these and lets every other error through.
    connection_errors: ClassVar[tuple[type[Exception], ...]] = ()

    def __init__(
        self,
        *,
        handlers: Iterable[str | type[IdempotentHandler]] | None = None,
        url: str | Sequence[str] | None = None,
        queue: str | None = None,
        exchange: str | None = None,
        prefetch: int | None = None,
        max_retries: int | None = None,
        retry_delay: float = 1.0,
        reconnect_max: float = 30.0,
        idle_timeout: float = 1.0,
    ) -> None:
        self.dispatcher = Dispatcher(
            handlers=handlers, max_retries=max_retries, retry_delay=retry_delay
        )
        if not self.dispatcher.handlers:
            raise ImproperlyConfiguredHandler(
                "No handlers to run: set OUTBOX_CONSUMER_HANDLERS, pass --handler, or define "
                "IdempotentHandler subclasses in an installed app's handlers.py."
            )
        try:
            # One URL, or the nodes of a cluster: the first that answers is read from.
            self.nodes = BrokerNodes(url or outbox_settings.BROKER_URL)
        except TypeError as exc:
            raise ImproperlyConfiguredConsumer(str(exc)) from exc
        if not self.nodes:
            raise ImproperlyConfiguredConsumer(f"{BROKER_URL_EMPTY} {BROKER_URL_EMPTY_HINT}")
        self.queue = queue or default_queue_name(self.dispatcher.handler_classes)
        self.dead_letter_queue = dead_letter_queue_name(self.queue)
        #: Where the relay publishes (RabbitMQ's exchange; the subjects' prefix elsewhere).
        self.exchange = outbox_settings.EXCHANGE if exchange is None else exchange
        #: How many messages the broker hands over before the first is settled.
        self.prefetch = prefetch or outbox_settings.CONSUMER_PREFETCH
        self.reconnect_max = reconnect_max
        self.idle_timeout = idle_timeout
        #: The node connected to (password masked), "" while not connected: log lines.
        self._node = ""

    @property
    def max_retries(self) -> int:
        return self.dispatcher.max_retries

    @property
    def url(self) -> str:
        """The URL of the broker node connected to, or to be tried next."""
        return self.nodes.current

    def connect_first_node(
        self,
        broker: str,
        open_node: Callable[[str], T],
        errors: tuple[type[BaseException], ...],
        describe: Callable[[BaseException, str], tuple[object, bool]],
    ) -> T:
        """``open_node(url)`` on the first node that answers, from the current one on
        (:meth:`BrokerNodes.connect`), and what it returned. ``describe(error, url)`` says
        why a node failed with one of ``errors``, and whether that is permanent; once every
        node has failed in this round, :class:`CannotConnect` names each node's cause and is
        permanent when every cause is (``broker``: the broker's name in those words)."""
        failures: list[tuple[str, object, bool]] = []  # node, why, permanent: this round

        def attempt() -> T:
            url = self.nodes.current
            try:
                return open_node(url)
            except errors as exc:
                why, permanent = describe(exc, url)
                failures.append((self.nodes.name(), why, permanent))
                where = f"{broker} at " if len(failures) == 1 else f"any {broker} node: "
                raise CannotConnect(
                    f"cannot connect to {where}{'; '.join(f'{n}: {w}' for n, w, _ in failures)}",
                    permanent=all(p for _n, _w, p in failures),
                ) from exc

        def on_next(node: str, exc: Exception) -> None:
            logger.warning(
                "cannot connect to %s at %s (%s); trying the next node, %s",
                broker,
                node,
                failures[-1][1],
                self.nodes.name(),
            )

        return self.nodes.connect(attempt, errors=CannotConnect, on_next=on_next)

    # -- the contract ------------------------------------------------------------------------
    @abstractmethod
    def connect(self) -> None:
        """Connect to the first node that answers (``self.nodes.connect()``), set
        ``self._node`` to its name as soon as a connection is open, and declare what is read.
        Raises :class:`CannotConnect` (the cause in words) when every node has failed in
        this round to open a connection, one of :attr:`connection_errors` when one that
        opened was lost."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """Connected and declared: :meth:`messages` can read."""

    @abstractmethod
    def disconnect(self) -> None:
        """Close the connection (already broken: do nothing); messages not settled go back
        to the broker."""

    @abstractmethod
    def messages(self) -> Generator[M | None, None, None]:
        """The queue's messages in delivery order; None after ``idle_timeout`` seconds
        without one. Closing the iterator hands every message it holds unsettled back to
        the broker, each once."""

    @abstractmethod
    def delivery(self, message: M) -> Delivery:
        """What the dispatcher needs of ``message``, with which delivery of it this is."""

    @abstractmethod
    def settle(self, message: M, delivery: Delivery, decision: Decision) -> None:
        """Acknowledge, retry after ``decision.delay``, or dead-letter with
        ``decision.reason`` (in :data:`~django_outbox.consumer.dispatch.REASON_HEADER`).
        A HOLD never reaches here."""

    @abstractmethod
    def sleep(self, seconds: float) -> None:
        """Wait, keeping the broker connection serviced (heartbeats)."""

    def tracing(self, message: M) -> AbstractContextManager[Any]:
        """Where ``message`` came from, for the spans of its handlers (tracing.py)."""
        return nullcontext()

    def close(self) -> None:
        self._node = ""
        self.disconnect()

    # -- the loop ----------------------------------------------------------------------------
    def serve(
        self,
        *,
        stop: threading.Event | None = None,
        max_messages: int | None = None,
        until_idle: bool = False,
    ) -> ConsumeResult:
        """Consume until ``stop`` is set, ``max_messages`` were handled, or (``until_idle``)
        the queue stayed empty for ``idle_timeout`` seconds. Reconnects after a lost
        connection: to the next broker node at once while some node has not failed in this
        round, else after a growing pause (:class:`~django_outbox.worker.BrokerNodes`).

        A run ``until_idle`` (one pass) that cannot connect to any node raises
        :class:`BrokerUnreachable` instead of waiting; a long-running one retries and logs
        the cause each time."""
        stop = stop or threading.Event()
        result = ConsumeResult()
        backoff = Backoff(maximum=self.reconnect_max)

        def step() -> bool:
            if not self.ready:
                try:
                    self.connect()
                except CannotConnect as exc:
                    if until_idle:
                        raise BrokerUnreachable(str(exc)) from exc
                    raise
                backoff.reset()
            return self._consume(stop, result, max_messages, until_idle)

        def fail_over(exc: Exception) -> bool:
            # A connection that was open is lost: the next one goes to the next node. One
            # that could not be opened: connect() has been through every node already.
            return bool(self._node) and self.nodes.failed()

        def lost(exc: Exception, pause: float) -> None:
            where = f" to {self._node}" if self._node else ""
            self.close()
            then = (
                f"reconnecting in {pause:.1f}s" if pause else f"failing over to {self.nodes.name()}"
            )
            if isinstance(exc, CannotConnect):
                logger.warning("%s; %s", exc, then)
                return
            logger.warning(
                "broker connection%s lost (%s: %s); %s", where, type(exc).__name__, exc, then
            )

        try:
            keep_running(
                stop,
                step,
                backoff=backoff,
                on_error=lost,
                recoverable=(CannotConnect, *self.connection_errors),
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
        """Consume on the open connection; True when serving is over."""
        messages = self.messages()
        try:
            for message in messages:
                if message is None:
                    if until_idle or stop.is_set():
                        return True
                    continue
                decision = self._decide(stop, message)
                if decision is None:  # stopped during a database outage: handed back
                    return True
                result.add(decision)
                if stop.is_set() or (max_messages and result.messages >= max_messages):
                    return True
        finally:
            messages.close()
        return True

    def _decide(self, stop: threading.Event, message: M) -> Decision | None:
        """Decide ``message`` and settle it, holding it through a fault of the database.

        An outage of the consumer's own database, or a fault of it (a missing table, a lock
        timeout) is not the message's: the message is neither acked nor returned (a return
        counts a delivery against it on some brokers), the consumer takes no other one
        meanwhile, waits with a growing pause until the database answers, then handles the
        same delivery again. A connection lost while the database answers at once is
        retried at once, :data:`LOST_CONNECTION_RETRIES` times; after that it counts. None:
        ``stop`` was set while waiting; the message is still unsettled (closing the
        iterator of :meth:`messages` returns it, once).
        """
        delivery = self.delivery(message)
        backoff = Backoff(maximum=self.reconnect_max)
        quick_losses = 0
        while True:
            tidy_connections()
            try:
                with self.tracing(message):
                    decision = self.dispatcher.receive(
                        delivery, hold_lost_connection=quick_losses < LOST_CONNECTION_RETRIES
                    )
                    if decision.action is not Action.HOLD:
                        self._settle(message, delivery, decision)
                        return decision
            finally:
                tidy_connections()
            if decision.connection_lost and database_answers(decision.database):
                quick_losses += 1
                logger.warning(
                    "message %r: the connection to database %r was lost and the database "
                    "answers; trying the message again (%d of %d)",
                    delivery.message_id,
                    decision.database,
                    quick_losses,
                    LOST_CONNECTION_RETRIES,
                )
                continue
            if not self._wait_for_database(stop, decision, backoff, delivery.message_id):
                # Not returned here: the consumer still listens, the broker would hand the
                # message straight back, and the stop would return it a second time (two
                # deliveries counted). Closing the iterator returns it once.
                return None

    def _settle(self, message: M, delivery: Delivery, decision: Decision) -> None:
        if decision.action is Action.DEAD_LETTER:
            logger.error(
                "message %r dead-lettered to %s: %s",
                delivery.message_id,
                self.dead_letter_queue,
                decision.reason,
            )
        elif decision.action is Action.RETRY:
            logger.warning(
                "message %s failed (delivery %s of %s); retrying: %s",
                delivery.message_id,
                delivery.number,
                self.max_retries + 1,
                decision.error,
            )
        self.settle(message, delivery, decision)

    def _wait_for_database(
        self, stop: threading.Event, held: Decision, backoff: Backoff, message_id: Any
    ) -> bool:
        """Wait until the database answers (True) or ``stop`` is set (False), keeping the
        broker connection serviced (heartbeats) and the message unsettled."""
        state = "unavailable" if held.connection_lost else "failed"
        while True:
            pause = backoff.next()
            logger.warning(
                "database %r %s (%s); holding message %r unacknowledged (no delivery counted) "
                "and taking no other; retrying in %.1fs",
                held.database,
                state,
                held.error,
                message_id,
                pause,
            )
            deadline = time.monotonic() + pause
            while (remaining := deadline - time.monotonic()) > 0:
                if stop.is_set():
                    return False
                self.sleep(min(remaining, 0.2))
            if stop.is_set():
                return False
            if database_answers(held.database):
                logger.info(
                    "database %r answers again; handling message %r again",
                    held.database,
                    message_id,
                )
                return True
