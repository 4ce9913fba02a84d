"""The NATS JetStream transport of the consumer (nats-py): a durable pull consumer on the
outbox stream, each message settled from the dispatcher's decision.

:class:`Consumer` is :class:`~django_outbox.consumer.base.BaseConsumer` on JetStream: the
loop, the reconnects and the database outages are the base's. nats-py is asyncio only, so
the connection lives on an event loop on a thread of the consumer's own
(:class:`~django_outbox._compat.nats.LoopThread`); the consumer's thread fetches messages
and settles them through it, and while it holds fetched messages unsettled (a handler
running, a database outage) the loop tells JetStream they are in progress, every third of
the ack wait, so that none is delivered again meanwhile.

What JetStream does with each decision:

* ACKNOWLEDGE: ``+ACK``, after the handler's transaction committed;
* RETRY: ``-NAK`` with the decision's delay: JetStream delivers it again after the delay
  and counts the delivery (``num_delivered``, the consumer's ``max_deliver`` bounds it);
* DEAD_LETTER: a copy with :data:`~django_outbox.consumer.dispatch.REASON_HEADER` is
  published, acked by JetStream, to the dead-letter subject ``<queue>.dlq`` (a stream of
  its own, ``<durable>_dlq``, declared when no stream takes the subject), then the
  original is acked;
* HOLD: nothing (in progress, as above); a stop hands every held message back with one
  ``-NAK`` each.

The stream is the relay's (``OUTBOX_NATS_STREAM``): the consumer waits for it to exist.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from .. import tracing
from .._compat.nats import LoopThread
from ..conf import outbox_settings
from ..exceptions import error_text
from ..masking import mask_urls_in
from ..message import TYPE_HEADER, Delivery, decode_text_headers, escape_header_value
from ..transports import NATS
from .base import (
    BaseConsumer,
    ImproperlyConfiguredConsumer,
    dead_letter_queue_name,
)
from .dispatch import REASON_HEADER, Action, Decision

if NATS.missing():
    raise ImportError(NATS.missing())

import nats
import nats.errors
import nats.js.errors
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    StorageType,
    StreamConfig,
)

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["ACK_WAIT", "Consumer", "durable_name", "filter_subjects"]

logger = logging.getLogger("django_outbox.consumer")

#: Seconds JetStream waits for a delivered message's ack before it delivers it again. The
#: consumer reports the messages it holds in progress every third of it, so only a
#: consumer that stopped answering (a crash, a frozen process) has them delivered again.
ACK_WAIT = 30.0
#: How long a call on the connection (an ack, a fetch past its own wait) may take.
CALL_TIMEOUT = 10.0


class StreamMissing(nats.errors.Error):
    """The relay's stream does not exist yet: the consumer waits for it, as for a broker."""


def durable_name(queue: str) -> str:
    """The JetStream durable name for queue ``queue``: a durable name has no ``.``,
    ``*``, ``>`` or whitespace (``points.outbox`` is ``points_outbox``)."""
    return "".join("_" if c in ".*>/\\" or c.isspace() else c for c in queue)


def filter_subjects(prefix: str, keys: Sequence[str]) -> list[str]:
    """The subjects the consumer reads for the handlers' bindings (routing keys with AMQP's
    topic wildcards: ``*`` one word, ``#`` any words). ``[]``: every subject of the stream,
    for a binding NATS cannot express (a ``#`` before the last word)."""
    subjects: list[str] = []
    for key in keys:
        words = key.split(".")
        if "#" in words[:-1]:
            return []
        if words[-1] == "#":
            words[-1] = ">"
        subject = ".".join([prefix, *words] if prefix else words)
        if subject not in subjects:
            subjects.append(subject)
    return subjects


class Consumer(BaseConsumer["Msg"]):
    """Reads a durable pull consumer on the outbox stream and runs the handlers.

    Up to ``prefetch`` messages per fetch, handled one at a time in stream order. A message
    is acked only after its handlers committed (or were duplicates). A failure is retried
    ``max_retries`` times (``max_deliver`` is ``max_retries + 1``), then dead-lettered; an
    undecodable message at once.
    """

    transport = "nats"
    connection_errors = (nats.errors.Error, OSError)

    def __init__(
        self,
        *,
        queue_type: str | None = None,
        stream: str | None = None,
        connect_timeout: float | None = None,
        ack_wait: float = ACK_WAIT,
        **options: Any,
    ) -> None:
        """``options``: :class:`BaseConsumer`'s."""
        if queue_type is not None:
            raise ImproperlyConfiguredConsumer(
                f"--queue-type {queue_type} is RabbitMQ's: a NATS consumer is a durable "
                "JetStream consumer, replicated as its stream is (OUTBOX_NATS_REPLICAS)."
            )
        super().__init__(**options)
        self.stream = stream or outbox_settings.NATS_STREAM
        self.durable = durable_name(self.queue)
        self.dead_letter_queue = dead_letter_queue_name(self.queue)
        self.dead_letter_stream = f"{self.durable}_dlq"
        self.connect_timeout = float(
            outbox_settings.CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
        )
        self.subjects = filter_subjects(self.exchange, self.dispatcher.routing_keys())
        #: The durable consumer's ack wait, when this consumer creates it.
        self.ack_wait = ack_wait
        self._loop: LoopThread | None = None
        self._client: Client | None = None
        self._js: JetStreamContext | None = None
        self._subscription: Any = None
        # Fetched and not settled yet, by id(): reported in progress, handed back at a stop.
        self._held: dict[int, Msg] = {}
        self._held_lock = threading.Lock()
        self._keeper: Any = None

    # -- connection --------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect to the first node that answers, from the current one on, wait for the
        stream, declare the durable consumer and the dead-letter stream."""
        if self._loop is None or not self._loop.alive:
            self._loop = LoopThread("django-outbox-nats-consumer")
        loop = self._loop

        self.connect_first_node(
            "NATS",
            lambda url: loop.run(self._connect(url), self.connect_timeout * 3),
            self.connection_errors,
            lambda exc, _url: (_describe(exc), False),
        )
        self._node = self.nodes.name()
        logger.info(
            "consuming %s on stream %s (durable %s, subjects %s, dead letters to %s) at %s",
            self.queue,
            self.stream,
            self.durable,
            ", ".join(self.subjects) or "all",
            self.dead_letter_queue,
            self._node,
        )

    async def _connect(self, url: str) -> None:
        client = nats.NATS()

        async def on_error(exc: Exception) -> None:
            logger.debug("nats-py reports: %s", exc)

        await client.connect(
            servers=[url],
            name=f"django-outbox consumer {self.durable}",
            connect_timeout=math.ceil(self.connect_timeout),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=on_error,
        )
        try:
            js = client.jetstream(timeout=self.connect_timeout)
            try:
                await js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:
                raise StreamMissing(
                    f"stream {self.stream!r} does not exist yet: publish_outbox declares it "
                    "(OUTBOX_NATS_STREAM), or create it"
                ) from None
            await self._declare_dead_letters(js)
            await self._declare_consumer(js, client)
            self._subscription = await js.pull_subscribe_bind(self.durable, stream=self.stream)
        except BaseException:
            await client.close()
            raise
        self._client, self._js = client, js
        self._keeper = asyncio.get_running_loop().create_task(self._keep_in_progress())

    async def _declare_consumer(self, js: JetStreamContext, client: Client) -> None:
        config = ConsumerConfig(
            durable_name=self.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            # The dispatcher dead-letters on delivery max_retries + 1 with the reason; the
            # limit stops a message that crashes the consumer before it can decide.
            max_deliver=self.max_retries + 1,
        )
        if len(self.subjects) == 1:
            config.filter_subject = self.subjects[0]
        elif self.subjects and client.connected_server_version.minor >= 10:
            config.filter_subjects = list(self.subjects)
        # else: every subject of the stream; a message no handler takes is acked unhandled.
        try:
            await js.add_consumer(self.stream, config)
        except nats.js.errors.BadRequestError as exc:
            # It exists with another configuration (set elsewhere, or by an older run):
            # it is used as it is.
            logger.warning(
                "durable consumer %s on stream %s exists with another configuration (%s); "
                "using it as it is",
                self.durable,
                self.stream,
                exc.description,
            )

    async def _declare_dead_letters(self, js: JetStreamContext) -> None:
        try:
            owner = await js.find_stream_name_by_subject(self.dead_letter_queue)
        except nats.js.errors.NotFoundError:
            await js.add_stream(
                StreamConfig(
                    name=self.dead_letter_stream,
                    subjects=[self.dead_letter_queue],
                    storage=StorageType.FILE,
                    num_replicas=outbox_settings.NATS_REPLICAS,
                )
            )
            return
        if owner == self.stream:
            raise ImproperlyConfiguredConsumer(
                f"the dead-letter subject {self.dead_letter_queue!r} is one of stream "
                f"{self.stream!r}'s subjects: dead letters would be read again. Set "
                "OUTBOX_CONSUMER_QUEUE (or --queue) to a name outside the stream's subjects."
            )

    @property
    def ready(self) -> bool:
        return self._subscription is not None

    def disconnect(self) -> None:
        client, self._client = self._client, None
        self._js = self._subscription = None
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if client is not None and not client.is_closed:
            try:
                loop.run(client.close(), CALL_TIMEOUT)
            except Exception:  # already broken: unacked messages are delivered again
                logger.debug("error closing the consumer connection", exc_info=True)
        loop.stop()

    def sleep(self, seconds: float) -> None:
        # The loop's thread keeps the connection alive (PING/PONG) and the held messages
        # in progress meanwhile.
        time.sleep(seconds)

    # -- messages ----------------------------------------------------------------------------
    def messages(self) -> Generator[Msg | None, None, None]:
        try:
            while True:
                batch = self._call(self._fetch(), self.idle_timeout + CALL_TIMEOUT)
                if not batch:
                    yield None
                    continue
                with self._held_lock:
                    self._held.update((id(msg), msg) for msg in batch)
                yield from batch
        finally:
            self._hand_back()

    async def _fetch(self) -> list[Msg]:
        try:
            return await self._subscription.fetch(self.prefetch, timeout=self.idle_timeout)
        except nats.errors.TimeoutError:
            return []

    def _hand_back(self) -> None:
        """Return every held message with one ``-NAK`` (delivered again at once)."""
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        if not held or self._client is None or not self._client.is_connected:
            return

        client = self._client

        async def nak_all() -> None:
            for msg in held:
                await msg.nak()
            await client.flush(math.ceil(CALL_TIMEOUT))

        try:
            self._call(nak_all(), CALL_TIMEOUT)
        except Exception:  # lost meanwhile: JetStream delivers them again after ack_wait
            logger.debug("could not hand back %d message(s)", len(held), exc_info=True)

    async def _keep_in_progress(self) -> None:
        """While messages are held, tell JetStream every third of the ack wait."""
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            with self._held_lock:
                held = list(self._held.values())
            for msg in held:
                try:
                    await msg.in_progress()
                except Exception:  # settled or lost meanwhile
                    logger.debug("in-progress report failed", exc_info=True)

    def delivery(self, message: Msg) -> Delivery:
        raw = dict(message.headers or {})
        message_id = _pop(raw, "Nats-Msg-Id")
        content_type = _pop(raw, "Content-Type")
        message_type = _pop(raw, TYPE_HEADER)
        for name in [n for n in raw if n.lower().startswith("nats-")]:
            del raw[name]
        headers = decode_text_headers(raw)
        if content_type is None:
            # A binary-mode CloudEvent (the NATS binding) carries its datacontenttype in
            # a header of its own.
            content_type = headers.get("ce-datacontenttype")
        metadata = message.metadata
        number = max(int(metadata.num_delivered or 1), 1)
        return Delivery(
            message.data,
            message_id=message_id,
            message_type=message_type,
            headers=headers,
            content_type=content_type,
            redelivered=number > 1,
            number=number,
            transport=self.transport,
        )

    def tracing(self, message: Msg) -> AbstractContextManager[Any]:
        sequence = message.metadata.sequence
        return tracing.delivery(
            self.stream, message.subject, self.durable, sequence.stream if sequence else None
        )

    # -- settling ----------------------------------------------------------------------------
    def settle(self, message: Msg, delivery: Delivery, decision: Decision) -> None:
        if decision.action is Action.ACKNOWLEDGE:
            self._call(message.ack(), CALL_TIMEOUT)
        elif decision.action is Action.RETRY:
            self._call(message.nak(delay=decision.delay or None), CALL_TIMEOUT)
        elif decision.action is Action.DEAD_LETTER:
            self._call(self._dead_letter(message, decision.reason), CALL_TIMEOUT * 2)
        else:
            raise ValueError(f"a transport cannot settle a {decision.action.value} decision")
        with self._held_lock:
            self._held.pop(id(message), None)

    async def _dead_letter(self, message: Msg, reason: str) -> None:
        """A copy with ``reason`` to the dead-letter subject, acked by JetStream (a crash
        in between leaves a duplicate there, never a loss), then the original is acked."""
        assert self._js is not None
        headers = {
            name: value
            for name, value in (message.headers or {}).items()
            if name.lower() not in ("nats-msg-id", "nats-expected-stream")
        }
        headers[REASON_HEADER] = escape_header_value(reason)
        await self._js.publish(
            self.dead_letter_queue, message.data, headers=headers, timeout=CALL_TIMEOUT
        )
        await message.ack()

    def _call(self, coroutine: Any, timeout: float) -> Any:
        if self._loop is None:
            coroutine.close()
            raise nats.errors.ConnectionClosedError
        return self._loop.run(coroutine, timeout)

    def close(self) -> None:
        super().close()
        self._keeper = None


def _pop(headers: dict[str, Any], name: str) -> Any:
    """Remove and return header ``name``, matched without case (NATS header names are
    case-insensitive); None when absent."""
    lowered = name.lower()
    for key in list(headers):
        if key.lower() == lowered:
            return headers.pop(key)
    return None


def _describe(exc: BaseException) -> str:
    """Why a connection attempt failed, in words, without a password."""
    if isinstance(exc, StreamMissing):
        return str(exc)
    if isinstance(exc, nats.errors.NoServersError):
        return "the server does not answer (connection refused or timed out)"
    if isinstance(exc, TimeoutError):
        return "no answer in time (JetStream may be electing a leader)"
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return "JetStream is not enabled or not available on the server (start it with -js)"
    return mask_urls_in(error_text(str(exc) or type(exc).__name__))
