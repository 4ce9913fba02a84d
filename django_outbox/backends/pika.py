"""The production backend: RabbitMQ through pika, with pipelined publisher confirms.

Every message of a batch is written to the socket before any confirm is awaited, and the
broker's ``basic.ack``/``basic.nack`` frames (``multiple=True`` included) are matched back
to the rows by delivery tag. pika's ``BlockingConnection`` cannot do that (with
``confirm_delivery()`` each ``basic_publish`` waits for its own confirm, one round trip per
message), so this backend uses the asynchronous ``SelectConnection`` and drives its I/O
loop from the calling thread: :meth:`PikaBackend.send` writes a batch, and
:meth:`PikaBackend.wait` runs the loop until every message of it is settled or the confirm
timeout passes, and stops it again. No thread is started; between batches the connection
simply waits.

Outcome of each message (see ``docs/relay.md``, "The RabbitMQ backend"):

* ``basic.ack``: sent, unless a ``basic.return`` came first (``mandatory=True`` and no
  queue bound): then UNROUTABLE, although the broker acks a returned message too;
* ``basic.nack``: NACKED (e.g. a queue with ``x-overflow: reject-publish`` is full);
* nothing within ``confirm_timeout``: TIMEOUT;
* the connection or channel went away first: CONNECTION_LOST, and the next
  :meth:`~PikaBackend.send` reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
from django.core.checks import CheckMessage, Error
from pika import spec
from pika.adapters.select_connection import SelectConnection

from .._compat.pika import (
    CoalescingConnection,
    ConnectionFailure,
    HandTurnedLoop,
    connection_failure,
)
from ..conf import BROKER_URL_EMPTY, BROKER_URL_EMPTY_HINT, outbox_settings
from ..masking import mask_url, mask_urls_in, password_overruns
from ..message import PRIORITY_HEADER
from ..worker import BrokerNodes
from . import bindings
from .base import (
    AmqpBackend,
    BrokerUnavailable,
    PublishResult,
    Reason,
    RouteCheck,
    describe_error,
)

if TYPE_CHECKING:
    from pika.channel import Channel
    from pika.frame import Method

    from ..models import OutboxEvent

__all__ = ["PikaBackend", "Unsendable", "mask_url"]

logger = logging.getLogger("django_outbox.backends.pika")

SCHEMES = ("amqp", "amqps")
# How long close() waits for the broker's close-ok before dropping the socket anyway.
CLOSE_TIMEOUT = 2.0
# Messages written between two turns of the I/O loop while a batch is being sent: the
# socket is written (and the broker starts confirming) before the whole batch is built.
FLUSH_EVERY = 50


class Unsendable(Exception):
    """Raised by :meth:`PikaBackend._message` for a row that cannot be published: the row
    gets ``result``; with ``rest`` (why), the rows after it in the batch are not written
    and fail CONNECTION_LOST (the broker stopped answering: do not wait once per row)."""

    def __init__(self, result: PublishResult, rest: str = "") -> None:
        super().__init__(result.error)
        self.result = result
        self.rest = rest


class _NodeProblem(Exception):
    """One broker node could not be connected to; the text says why."""


class PikaBackend(AmqpBackend):
    """Publish outbox events to a RabbitMQ exchange with confirms, ``mandatory`` and
    persistent delivery.

    Options (``OUTBOX_BACKEND_OPTIONS``), each defaulting to its setting:
    ``broker_url`` (``OUTBOX_BROKER_URL``), ``exchange_type`` (``OUTBOX_EXCHANGE_TYPE``),
    ``exchange_passive`` (``OUTBOX_EXCHANGE_PASSIVE``), ``confirm_timeout``
    (``OUTBOX_CONFIRM_TIMEOUT``), ``connect_timeout`` (``OUTBOX_CONNECT_TIMEOUT``, also
    the blocked-connection timeout); plus the base class's ``exchange``,
    ``routing_keys`` and ``routing_key_func``; and ``management_url``, the RabbitMQ
    management HTTP API that :meth:`check_routes` reads (default: the node's host, port
    15672, or 15671 over TLS).
    """

    #: Where the broker URLs come from, for the error that says what to check.
    url_setting = "OUTBOX_BROKER_URL"

    def __init__(
        self,
        *,
        broker_url: str | Sequence[str] | None = None,
        management_url: str = "",
        **options: Any,  # exchange_type, exchange_passive, ...: see AmqpBackend
    ) -> None:
        super().__init__(**options)
        self.broker_url = outbox_settings.BROKER_URL if broker_url is None else broker_url
        # Where outbox_check reads the bindings (default: the node's host, port 15672).
        self.management_url = management_url
        # One URL, or the nodes of a cluster: connect to the first that answers.
        self.nodes = BrokerNodes(self.broker_url)

        self._loop: HandTurnedLoop | None = None
        self._connection: CoalescingConnection | None = None
        self._channel: Channel | None = None
        self._ready = False  # channel open, in confirm mode, exchange declared
        self._open_error: str = ""  # why the connection/channel could not be opened
        self._open_failure: ConnectionFailure | None = None  # ... when it was the connection
        self._blocked = False  # connection.blocked received (memory or disk alarm)
        self._next_tag = 1  # delivery tag of the next publish on this channel

        # Batches written and not yet collected by wait(), oldest first (see _Batch).
        self._inflight: deque[_Batch] = deque()

    @property
    def masked_url(self) -> str:
        """The URL of the node connected to (or to connect to next), password masked."""
        return self.nodes.masked

    def __repr__(self) -> str:
        return f"<PikaBackend {self.nodes} exchange={self.exchange!r}>"

    # -- configuration checks --------------------------------------------------------------
    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        from ..checks import Codes, Hints, Messages, problem, relay_broker_urls

        urls = relay_broker_urls()
        if not isinstance(urls, list):
            return [urls]
        errors: list[CheckMessage] = []
        vhosts: dict[str, None] = {}  # in the order of the URLs
        for number, url in enumerate(urls, 1):
            which = f"OUTBOX_BROKER_URL {mask_url(url)!r}"
            if len(urls) > 1:
                which = f"OUTBOX_BROKER_URL entry {number} of {len(urls)}, {mask_url(url)!r},"
            if password_overruns(url):
                # Before pika parses it: its errors would quote pieces of the password.
                errors.append(problem("BROKER_URL_ENCODING", which=which))
                continue
            what, vhost = _url_problem(url)
            if what:
                errors.append(
                    Error(
                        f"{which} {what}.",
                        hint="Use the AMQP URL of RabbitMQ, e.g. "
                        "'amqp://user:password@rabbitmq:5672/%2F' (amqps:// for TLS; the "
                        "vhost '/' is written %2F).",
                        id=Codes.BROKER_URL,
                    )
                )
            else:
                vhosts[vhost] = None
        if len(vhosts) > 1:
            errors.append(
                Error(
                    Messages.BROKER_VHOSTS.format(vhosts=", ".join(map(repr, vhosts))),
                    hint=Hints.BROKER_VHOSTS,
                    id=Codes.BROKER_VHOSTS,
                )
            )
        return errors

    # -- connection ------------------------------------------------------------------------
    def _parameters(self) -> pika.ConnectionParameters:
        """The current node's connection parameters; raises what pika raises for a bad URL."""
        params = self._node_parameters()
        # One attempt, bounded: the relay does the retrying and the backoff sleeping.
        params.connection_attempts = 1
        params.retry_delay = 0
        params.socket_timeout = self.connect_timeout
        params.stack_timeout = self.connect_timeout
        # Without it a connection blocked by a memory or disk alarm waits forever.
        params.blocked_connection_timeout = self.connect_timeout
        return params

    def _node_parameters(self) -> pika.ConnectionParameters:
        """Where and how to connect to the current node (host, credentials, vhost, TLS):
        its URL. A subclass that takes its brokers from elsewhere builds them itself."""
        return pika.URLParameters(self.nodes.current)

    def open(self) -> None:
        """Connect to the first broker node that answers, from the current one on, open a
        confirm-mode channel and declare the exchange (idempotent)."""
        if self._ready and self._usable():
            return
        if not self.nodes:
            raise BrokerUnavailable(f"{BROKER_URL_EMPTY} {BROKER_URL_EMPTY_HINT}")
        if self._loop is None:
            self._loop = HandTurnedLoop()
        # The connection survived, only the channel was closed (a channel error): the node
        # answers, so a new channel on it is all there is to try.
        reopen = self._connection is not None and self._connection.is_open
        problems: list[str] = []
        permanent = True  # every node failed for a reason that does not clear by itself

        def attempt() -> None:
            nonlocal permanent
            node = self.nodes.name()
            started = time.monotonic()
            problem = self._connect(reopen)
            if problem:
                problems.append(f"{node}: {problem}")
                permanent &= self._open_failure is not None and self._open_failure.permanent
                raise _NodeProblem(problem)
            logger.info(
                "connected to %s (exchange %r, %.0f ms)",
                node,
                self.exchange,
                (time.monotonic() - started) * 1000,
            )

        def on_next(node: str, problem: Exception) -> None:
            logger.warning(
                "cannot connect to RabbitMQ at %s: %s; trying the next node, %s",
                node,
                problem,
                self.nodes.name(),
            )

        try:
            if reopen:
                attempt()
            else:
                self.nodes.connect(attempt, errors=_NodeProblem, on_next=on_next)
        except _NodeProblem:
            where = (
                "RabbitMQ at "
                if len(problems) == 1
                else f"any RabbitMQ node of {self.url_setting}: "
            )
            # A permanent failure's hint says what to fix; anything else may be the broker
            # down.
            check = (
                ""
                if permanent
                else f" Check that the broker is running and {self.url_setting} (host, port, "
                "vhost, credentials) is right."
            )
            raise BrokerUnavailable(
                f"cannot connect to {where}{'; '.join(problems)}.{check}", permanent=permanent
            ) from None

    def _connect(self, reopen: bool) -> str:
        """Open a connection to the current node (or, with ``reopen``, a new channel on the
        connection that is open), a confirm-mode channel, the exchange; ``""`` once ready,
        else why not."""
        self._ready = False
        self._open_error = ""
        self._open_failure = None
        assert self._loop is not None
        if reopen:
            assert self._connection is not None
            self._open_channel(self._connection)
        else:
            self._teardown()
            try:
                params = self._parameters()
            except Exception as exc:  # pika raises several types for bad URLs
                self._open_failure = ConnectionFailure(
                    f"invalid URL ({mask_urls_in(str(exc))})",
                    True,
                    "run `manage.py check` for the expected form",
                )
                return str(self._open_failure)
            self._blocked = False
            self._connection = CoalescingConnection(
                parameters=params,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_open_error,
                on_close_callback=self._on_connection_closed,
                custom_ioloop=self._loop.ioloop,
            )
        self._run(lambda: self._ready or bool(self._open_error), self.connect_timeout)
        if self._ready:
            return ""
        self._teardown()
        return (
            self._open_error
            or f"no answer within {self.connect_timeout:g} s (OUTBOX_CONNECT_TIMEOUT)"
        )

    def check_routes(self, routing_keys: Sequence[str]) -> RouteCheck:
        """Connect, declaring the exchange (verifying it, with ``exchange_passive``), and
        read which queues each routing key reaches from the management HTTP API
        (:mod:`.bindings`): AMQP itself cannot list bindings without publishing."""
        self.open()
        try:
            params = self._node_parameters()
        finally:
            self.close()
        done = "verified" if self.exchange_passive else "declared"
        target = f"exchange {self.exchange!r} ({self.exchange_type}, {done}) at {self.masked_url}"
        if not self.exchange:
            return RouteCheck(
                f"the default exchange at {self.masked_url}",
                None,
                "the default exchange takes a routing key to the queue of that name",
            )
        credentials = params.credentials
        api = bindings.ManagementApi.for_broker(
            params.host,
            tls=params.ssl_options is not None,
            user=getattr(credentials, "username", ""),
            password=getattr(credentials, "password", ""),
            url=self.management_url,
            timeout=self.connect_timeout,
        )
        try:
            found = bindings.routes(api, params.virtual_host, self.exchange, routing_keys)
        except bindings.BindingsUnknown as exc:
            return RouteCheck(target, None, str(exc))
        return RouteCheck(f"{target}, bindings from {api.where}", found)

    def next_node(self) -> bool:
        """The relay lost this node: the next connection goes to the next one."""
        lost = self.nodes.name()
        at_once = self.nodes.failed()
        if at_once:
            logger.warning("RabbitMQ at %s is lost; failing over to %s", lost, self.nodes.name())
        return at_once

    def close(self) -> None:
        self.abandon()
        connection, self._connection = self._connection, None
        self._channel = None
        self._ready = False
        if connection is not None and not (connection.is_closed or connection.is_closing):
            try:
                connection.close()
            except pika.exceptions.AMQPError:
                pass
            else:
                self._connection = connection
                self._run(lambda: connection.is_closed, CLOSE_TIMEOUT)
                self._connection = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _usable(self) -> bool:
        return (
            self._connection is not None
            and self._connection.is_open
            and self._channel is not None
            and self._channel.is_open
        )

    def _teardown(self) -> None:
        """Forget a half-open or broken connection; the next open() starts over."""
        connection, self._connection = self._connection, None
        self._channel = None
        self._ready = False
        if connection is not None and not (connection.is_closed or connection.is_closing):
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()

    def _open_channel(self, connection: SelectConnection) -> None:
        connection.channel(on_open_callback=self._on_channel_open)

    # pika callbacks: they run inside _run(), on the calling thread.
    def _on_connection_open(self, connection: SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        self._open_channel(connection)

    def _on_connection_open_error(self, connection: SelectConnection, error: Any) -> None:
        self._open_failure = connection_failure(error, connection.params)
        self._open_error = str(self._open_failure)

    def _on_connection_closed(self, connection: SelectConnection, error: Exception) -> None:
        if connection is not self._connection:
            return
        self._channel = None
        self._ready = False
        if isinstance(error, pika.exceptions.ConnectionClosedByClient):
            return
        reason = _describe(error)
        if not self._inflight and not self._open_error:
            self._open_error = f"connection closed: {reason}"
        logger.warning("connection to %s lost: %s", self.masked_url, reason)
        self._connection_lost(f"connection lost: {reason}")

    def _on_channel_open(self, channel: Channel) -> None:
        self._channel = channel
        self._next_tag = 1
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_ok)

    def _on_confirm_ok(self, frame: Method) -> None:
        if self._channel is None:
            return
        if not self.exchange:  # the default exchange exists and cannot be declared
            return self._on_exchange_ok(frame)
        self._channel.exchange_declare(
            exchange=self.exchange,
            exchange_type=self.exchange_type,
            passive=self.exchange_passive,
            durable=True,
            callback=self._on_exchange_ok,
        )

    def _on_exchange_ok(self, frame: Method) -> None:
        self._ready = True

    def _on_channel_closed(self, channel: Channel, error: Exception) -> None:
        if channel is not self._channel:
            return
        self._channel = None
        self._ready = False
        reason = _describe(error)
        if not self._open_error and not self._inflight:
            # Closed while opening: e.g. a passive declare of a missing exchange.
            self._open_error = f"channel closed: {reason}" + _exchange_hint(
                error, self.exchange, self.exchange_passive
            )
        if not isinstance(error, pika.exceptions.ChannelClosedByClient):
            logger.warning("channel to %s closed: %s", self.masked_url, reason)
        self._connection_lost(f"channel closed: {reason}")

    def _on_blocked(self, connection: SelectConnection, frame: Method) -> None:
        self._blocked = True
        reason = getattr(frame.method, "reason", "")
        logger.warning(
            "RabbitMQ blocked the connection to %s (%s); it is closed after %g s if the "
            "alarm does not clear",
            self.masked_url,
            reason or "memory or disk alarm",
            self.connect_timeout,
        )

    def _on_unblocked(self, connection: SelectConnection, frame: Method) -> None:
        self._blocked = False
        logger.info("RabbitMQ unblocked the connection to %s", self.masked_url)

    # -- running the I/O loop ---------------------------------------------------------------
    # By hand, on this thread (see django_outbox._compat.pika.HandTurnedLoop).
    def _run(self, done: Callable[[], bool], timeout: float) -> bool:
        """Run pika's I/O loop on this thread until ``done()`` or ``timeout`` seconds."""
        if self._loop is None:
            return done()
        return self._loop.run_until(done, timeout)

    def _poll(self) -> None:
        """Handle whatever has arrived (confirms, a close, a blocked notice, heartbeats)
        without waiting."""
        if self._loop is not None and self._connection is not None:
            self._loop.poll()

    # -- publishing ------------------------------------------------------------------------
    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        if not events:
            return []
        if self._inflight:
            raise RuntimeError("publish() called while batches sent with send() are in flight")
        self.send(events)
        return self.wait()

    def send(self, events: Sequence[OutboxEvent]) -> None:
        """Write the whole batch to the socket; :meth:`wait` collects its confirms.

        Batches sent earlier may still be in flight: the broker keeps working on them while
        this one is written.
        """
        if not events:
            self._inflight.append(_Batch(events, self._next_tag))
            return
        if not self._inflight:
            self._poll()
            self.open()  # a new channel numbers its deliveries from 1 again
        batch = _Batch(events, self._next_tag)
        if self._blocked:
            raise BrokerUnavailable(
                f"RabbitMQ at {self.masked_url} has blocked publishing (a memory or disk "
                "alarm); see `rabbitmqctl status` and docs/operations.md. Nothing was sent."
            )
        if self._inflight and self._inflight[-1].lost:
            # The connection went away under an earlier batch: nothing more can be written
            # until wait() has collected every batch and open() connects again. The loss is
            # this batch's too, so a batch sent after it is failed the same way.
            batch.lost = self._inflight[-1].lost
            batch.fail_from(0, Reason.CONNECTION_LOST, batch.lost)
            self._inflight.append(batch)
            return
        self._inflight.append(batch)
        try:
            self._send(batch)
        except BaseException:
            self._inflight.remove(batch)
            raise

    def wait(self) -> list[PublishResult]:
        """Run the I/O loop until every message of the oldest batch in flight is settled or
        timed out; return its results.

        The confirm timeout counts from its :meth:`send`; what arrived meanwhile is read
        first, so a relay slowed down between the two calls does not time out confirms it
        has.
        """
        if not self._inflight:
            return []
        batch = self._inflight[0]
        try:
            while not batch.done:
                unsettled = batch.unsettled
                self._poll()
                if batch.unsettled == unsettled:
                    break
            timeout = self.confirm_timeout - (time.monotonic() - batch.sent_at)
            self._run(lambda: batch.done, max(timeout, 0.0))
            if batch.unsettled:
                if batch.lost:
                    failure = PublishResult.failed(Reason.CONNECTION_LOST, batch.lost)
                elif self._blocked:
                    # A broker alarm is not the events' fault: let the relay back off.
                    failure = PublishResult.failed(
                        Reason.CONNECTION_LOST,
                        "RabbitMQ blocked the connection (memory or disk alarm) before confirming",
                    )
                else:
                    failure = PublishResult.failed(
                        Reason.TIMEOUT,
                        f"no publisher confirm from RabbitMQ within {self.confirm_timeout:g} s "
                        "(OUTBOX_CONFIRM_TIMEOUT)",
                    )
                batch.fail_unsettled(failure)
        finally:
            self._inflight.popleft()
        return batch.results  # type: ignore[return-value]  # every slot is filled above

    def abandon(self) -> None:
        # Confirms and returns still to come for them match no batch and are ignored.
        self._inflight.clear()

    def _send(self, batch: _Batch) -> None:
        connection = self._connection
        assert connection is not None
        connection.coalesce()
        try:
            self._write(batch)
        finally:
            connection.flush()

    def _write(self, batch: _Batch) -> None:
        channel = self._channel
        connection = self._connection
        assert channel is not None and connection is not None
        build = self._message
        publish = channel.basic_publish
        results = batch.results
        events = batch.events
        append = batch.positions.append
        flush_every = FLUSH_EVERY
        for index, event in enumerate(events):
            try:
                exchange, key, body, props = build(event)
            except Unsendable as exc:
                results[index] = exc.result
                if exc.rest:
                    batch.fail_from(index + 1, Reason.CONNECTION_LOST, exc.rest)
                    break
                continue
            except Exception as exc:
                results[index] = PublishResult.failed(
                    Reason.SERIALISATION, f"cannot build the message: {type(exc).__name__}: {exc}"
                )
                continue
            try:
                publish(exchange, key, body, props, mandatory=True)
            except Exception as exc:
                if channel.is_open and self._connection is not None and self._connection.is_open:
                    # pika builds the whole frame before writing any of it, so on an open
                    # channel this is the message's fault (a float or 2**64 header, a key
                    # over 255 bytes) and nothing of it went out: fail this row only.
                    results[index] = PublishResult.failed(Reason.SERIALISATION, _encode_error(exc))
                    continue
                # The channel went away under us (only possible if a callback ran).
                batch.fail_from(index, Reason.CONNECTION_LOST, f"publish failed: {_describe(exc)}")
                break
            append(index)
            self._next_tag += 1
            batch.unsettled += 1
            if not len(batch.positions) % flush_every:
                # Let the broker start on what is written while the rest is being built.
                connection.flush()
                self._poll()
                connection.coalesce()
                if batch.lost:
                    batch.fail_from(index + 1, Reason.CONNECTION_LOST, batch.lost)
                    break

    def _message(self, event: OutboxEvent) -> tuple[str, str, bytes, spec.BasicProperties]:
        """The exchange, routing key, body and properties ``event`` is published with; a
        subclass may publish other messages (the Celery backend: task messages). Raise
        :class:`Unsendable` to fail the row (and possibly the rest of the batch) with a
        reason of its own; any other exception fails the row as SERIALISATION."""
        message_format = self.message_format
        properties = spec.BasicProperties(
            content_type=message_format.content_type,
            delivery_mode=2,
            message_id=event.event_id,
            type=event.event_type,
            timestamp=int(event.occurred_at.timestamp()),
            headers=message_format.encode_headers(event),
            # None (no priority) unless the event asks for one: a task's (tasks_backend.py).
            priority=event.headers.get(PRIORITY_HEADER) if event.headers else None,
        )
        return self.exchange, self.routing_key(event), message_format.encode_body(event), properties

    def _connection_lost(self, reason: str) -> None:
        for batch in self._inflight:
            if not batch.lost:
                batch.lost = reason

    def _on_confirm(self, frame: Method) -> None:
        method = frame.method
        tag = method.delivery_tag
        nacked = isinstance(method, spec.Basic.Nack)
        for batch in self._inflight:
            if batch.base_tag > tag:
                break
            if method.multiple:
                batch.confirm_up_to(tag, nacked)
            elif tag < batch.base_tag + len(batch.positions):
                batch.confirm_up_to(tag, nacked, only=True)
                break

    def _on_return(
        self,
        channel: Channel,
        method: spec.Basic.Return,
        properties: spec.BasicProperties,
        body: bytes,
    ) -> None:
        message_id = properties.message_id or ""
        error = (
            f"returned by RabbitMQ: {method.reply_code} {method.reply_text} (no queue bound "
            f"to exchange {method.exchange!r} for routing key {method.routing_key!r})"
        )
        for batch in self._inflight:
            if batch.mark_returned(message_id, error):
                return


class _Batch:
    """One batch written to the channel and not yet collected by ``wait()``.

    Position k of the batch is delivery tag ``base_tag + k``; ``positions[k]`` is the index
    of that message's row (rows that could not be built have no position).
    """

    def __init__(self, events: Sequence[OutboxEvent], base_tag: int) -> None:
        self.events = events
        self.base_tag = base_tag
        self.results: list[PublishResult | None] = [None] * len(events)
        self.positions: list[int] = []
        self.low = 0  # every position below this one is settled
        self.unsettled = 0
        self.returned: dict[int, str] = {}  # row index -> why the broker sent it back
        self.index_by_id: dict[str, int] | None = None
        self.lost = ""  # why the connection or channel went away while in flight
        self.sent_at = time.monotonic()  # the confirm timeout counts from here

    @property
    def done(self) -> bool:
        return not self.unsettled or bool(self.lost)

    def confirm_up_to(self, tag: int, nacked: bool, *, only: bool = False) -> None:
        """Settle the message with delivery ``tag`` (``only``), or every one up to it."""
        last = min(tag - self.base_tag, len(self.positions) - 1)
        first = last if only else self.low
        if last < self.low:
            return
        results, positions = self.results, self.positions
        for k in range(first, last + 1):
            index = positions[k]
            if results[index] is not None:
                continue
            if nacked:
                results[index] = PublishResult.failed(
                    Reason.NACKED, "RabbitMQ refused the message (basic.nack)"
                )
            elif index in self.returned:
                results[index] = PublishResult.failed(Reason.UNROUTABLE, self.returned[index])
            else:
                results[index] = PublishResult.sent()
            self.unsettled -= 1
        low = self.low
        while low < len(positions) and results[positions[low]] is not None:
            low += 1
        self.low = low

    def mark_returned(self, message_id: str, error: str) -> bool:
        if self.index_by_id is None:
            # Returns are rare: build the lookup only when the first one arrives.
            self.index_by_id = {e.event_id: i for i, e in enumerate(self.events)}
        index = self.index_by_id.get(message_id)
        if index is None:
            return False
        self.returned[index] = error
        return True

    def fail_from(self, start: int, reason: Reason, error: str) -> None:
        """Rows from ``start`` on, not written: failed with ``reason``."""
        failure = PublishResult.failed(reason, error)
        results = self.results
        for index in range(start, len(results)):
            if results[index] is None:
                results[index] = failure

    def fail_unsettled(self, failure: PublishResult) -> None:
        for index in self.positions[self.low :]:
            if self.results[index] is None:
                self.results[index] = failure
                self.unsettled -= 1


def _url_problem(url: str) -> tuple[str, str]:
    """What is wrong with one broker URL (``""`` if nothing), and the vhost it names."""
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:
        scheme = ""
    if scheme not in SCHEMES:
        return "is not an amqp:// or amqps:// URL", ""
    try:
        return "", pika.URLParameters(url).virtual_host
    except Exception as exc:  # pika raises several types for bad URLs
        return f"cannot be parsed ({type(exc).__name__}: {mask_urls_in(str(exc))})", ""


def _describe(error: Any) -> str:
    """A short, password-free description of a pika error."""
    if isinstance(error, pika.exceptions.ConnectionClosed | pika.exceptions.ChannelClosed):
        return f"{error.reply_code} {error.reply_text}"
    return describe_error(error)


def _encode_error(exc: Exception) -> str:
    """Why pika could not encode a message, without its bytes or the header's value."""
    if isinstance(exc, pika.exceptions.UnsupportedAMQPFieldException) and exc.args:
        kind = type(exc.args[-1]).__name__
        return (
            f"AMQP cannot encode the message: a header value of type {kind} has no AMQP "
            "field type (use str, int, bool, Decimal, list, dict or None; e.g. a string for "
            "a float)"
        )
    return f"AMQP cannot encode the message (headers or routing key): {type(exc).__name__}: {exc}"


def _exchange_hint(error: Any, exchange: str, passive: bool) -> str:
    code = getattr(error, "reply_code", None)
    if code == 404 and passive:
        return (
            f" (exchange {exchange!r} does not exist; create it, or set "
            "OUTBOX_EXCHANGE_PASSIVE = False to let the relay declare it)"
        )
    if code == 406:
        return (
            f" (exchange {exchange!r} exists with other settings; make OUTBOX_EXCHANGE_TYPE "
            "match it, or set OUTBOX_EXCHANGE_PASSIVE = True)"
        )
    return ""
