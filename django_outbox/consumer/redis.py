"""The Redis Streams transport of the consumer (redis-py): a consumer group on the streams
of the handlers' routing keys, each entry settled from the dispatcher's decision.

:class:`Consumer` is :class:`~django_outbox.consumer.base.BaseConsumer` on Redis: the loop,
the reconnects and the database outages are the base's. The group is the queue
(``OUTBOX_CONSUMER_QUEUE`` or ``--queue``), created at the start of each stream when missing
(``XGROUP CREATE ... 0 MKSTREAM``: a new group reads what the stream already holds).

What Redis does with each decision:

* ACKNOWLEDGE: ``XACK``, after the handler's transaction committed;
* RETRY: the entry stays pending; its idle time is set so that it can be claimed again
  (``XAUTOCLAIM``) after the decision's delay, at most the visibility timeout; the claim
  counts the delivery;
* DEAD_LETTER: in one ``MULTI``, a copy with
  :data:`~django_outbox.consumer.dispatch.REASON_HEADER` (and ``x-outbox-stream``, where it
  came from) is added to the dead-letter stream ``<queue>.dlq`` and the original is acked;
* HOLD: nothing; while the consumer holds entries (a handler running, a database outage)
  a thread of its own claims them again for itself every third of the visibility timeout
  (``XCLAIM ... JUSTID``: no delivery counted), so no other consumer takes them over; a
  stop leaves each held entry claimable at once (its next claim counts a delivery).

Which delivery an entry is comes from the group's pending list: 1 for an entry read new
(``XREADGROUP ... >``), the pending entry's delivery count for one claimed
(``XPENDING``). An entry pending longer than the visibility timeout on a consumer that died
is claimed by a live one (``XAUTOCLAIM``, checked about every second).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .. import tracing
from ..conf import outbox_settings
from ..message import TYPE_HEADER, Delivery
from ..transports import REDIS
from .base import BaseConsumer, ImproperlyConfiguredConsumer
from .dispatch import REASON_HEADER, Action, Decision

if REDIS.missing():
    raise ImportError(REDIS.missing())

import redis
import redis.exceptions

from .._compat.redis import CONNECTION_ERRORS, connection_pool, describe, stream_for

__all__ = ["STREAM_FIELD", "Consumer", "streams_for"]

logger = logging.getLogger("django_outbox.consumer")

#: How long a call on the connection (an ack, a claim) may take, past a read's own wait.
CALL_TIMEOUT = 10.0
#: How often (seconds) the consumer looks for entries to claim: dead consumers' and retries.
CLAIM_EVERY = 1.0
#: The dead-letter copy's field naming the stream the entry came from.
STREAM_FIELD = "x-outbox-stream"


def streams_for(streams: dict[str, str], prefix: str, keys: Sequence[str]) -> list[str]:
    """The streams the consumer reads for the handlers' bindings (routing keys). Redis has
    no wildcards: a binding with ``*`` or ``#`` is refused, saying what to do."""
    found: list[str] = []
    for key in keys:
        if "*" in key.split(".") or "#" in key.split("."):
            raise ImproperlyConfiguredConsumer(
                f"a handler binds {key!r}: Redis streams have no wildcards, so the consumer "
                "reads one stream per routing key. Bind the handler to the event types it "
                "takes (IdempotentHandler.event_types)."
            )
        stream = stream_for(streams, prefix, key)
        if stream not in found:
            found.append(stream)
    return found


@dataclass
class Entry:
    """One stream entry delivered to this consumer: where, its id, its fields, and which
    delivery of it this is."""

    stream: str
    id: bytes
    fields: dict[bytes, bytes]
    number: int = 1


class Consumer(BaseConsumer[Entry]):
    """Reads the consumer group ``queue`` on the streams of the handlers' routing keys.

    Up to ``prefetch`` entries per read, handled one at a time. An entry is acked only
    after its handlers committed (or were duplicates). A failure is retried
    ``max_retries`` times, then dead-lettered; an undecodable entry at once.
    """

    transport = "redis"
    connection_errors = CONNECTION_ERRORS

    def __init__(
        self,
        *,
        queue_type: str | None = None,
        streams: dict[str, str] | None = None,
        visibility_timeout: float | None = None,
        connect_timeout: float | None = None,
        **options: Any,
    ) -> None:
        """``options``: :class:`BaseConsumer`'s."""
        if queue_type is not None:
            raise ImproperlyConfiguredConsumer(
                f"--queue-type {queue_type} is RabbitMQ's: a Redis consumer is a consumer "
                "group on a stream."
            )
        super().__init__(**options)
        self.group = self.queue
        self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        mapping = outbox_settings.REDIS_STREAMS if streams is None else streams
        self.streams = streams_for(mapping, self.exchange, self.dispatcher.routing_keys())
        if self.dead_letter_queue in self.streams:
            raise ImproperlyConfiguredConsumer(
                f"the dead-letter stream {self.dead_letter_queue!r} is one the consumer "
                "reads: dead letters would be read again. Set OUTBOX_CONSUMER_QUEUE (or "
                "--queue) to another name."
            )
        self.visibility_timeout = float(
            outbox_settings.REDIS_VISIBILITY_TIMEOUT
            if visibility_timeout is None
            else visibility_timeout
        )
        self.connect_timeout = float(
            outbox_settings.CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
        )
        self._client: redis.Redis | None = None
        # Delivered and not settled yet, by (stream, id): kept claimed, left at a stop.
        self._held: dict[tuple[str, bytes], Entry] = {}
        self._held_lock = threading.Lock()
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()
        self._cursors: dict[str, bytes] = {}
        self._claimed_at = 0.0

    # -- connection --------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect to the first node that answers, from the current one on, and create the
        group on each stream where it is missing."""
        self.connect_first_node(
            "Redis",
            self._connect,
            (OSError, redis.exceptions.RedisError, ValueError),
            lambda exc, _url: (describe(exc), False),
        )
        self._node = self.nodes.name()
        logger.info(
            "consuming %s as group %s (consumer %s, dead letters to %s) at %s",
            ", ".join(self.streams),
            self.group,
            self.name,
            self.dead_letter_queue,
            self._node,
        )

    def _connect(self, url: str) -> None:
        pool = connection_pool(
            url,
            connect_timeout=self.connect_timeout,
            # A read waits up to idle_timeout on the server (BLOCK) before it answers.
            timeout=self.idle_timeout + CALL_TIMEOUT,
        )
        client = redis.Redis(connection_pool=pool)
        try:
            for stream in self.streams:
                try:
                    client.xgroup_create(stream, self.group, id="0", mkstream=True)
                except redis.exceptions.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        except BaseException:
            pool.disconnect()
            raise
        self._client = client
        self._cursors = dict.fromkeys(self.streams, b"0-0")
        self._claimed_at = 0.0
        self._keeper_stop = threading.Event()
        self._keeper = threading.Thread(
            target=self._keep_claimed,
            args=(client, self._keeper_stop),
            name="django-outbox-redis-keeper",
            daemon=True,
        )
        self._keeper.start()

    @property
    def ready(self) -> bool:
        return self._client is not None

    def disconnect(self) -> None:
        client, self._client = self._client, None
        self._keeper_stop.set()
        keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(CALL_TIMEOUT)
        if client is not None:
            try:
                client.connection_pool.disconnect()
            except Exception:  # already broken: pending entries are claimed again later
                logger.debug("error closing the consumer connection", exc_info=True)

    def sleep(self, seconds: float) -> None:
        # The keeper thread keeps the held entries claimed meanwhile.
        time.sleep(seconds)

    # -- messages ----------------------------------------------------------------------------
    def messages(self) -> Generator[Entry | None, None, None]:
        try:
            while True:
                batch = self._claim() or self._read()
                if not batch:
                    yield None
                    continue
                with self._held_lock:
                    self._held.update(((e.stream, e.id), e) for e in batch)
                yield from batch
        finally:
            self._hand_back()

    def _read(self) -> list[Entry]:
        """New entries (``XREADGROUP ... >``), waiting up to ``idle_timeout`` for some."""
        client = self._connected()
        answer: Any = client.xreadgroup(
            self.group,
            self.name,
            dict.fromkeys(self.streams, ">"),
            count=self.prefetch,
            block=max(int(self.idle_timeout * 1000), 1),
        )
        entries: list[Entry] = []
        for stream, items in answer or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            entries.extend(Entry(name, _id(i), f) for i, f in items if f is not None)
        return entries

    def _claim(self) -> list[Entry]:
        """Entries pending longer than the visibility timeout, on any consumer of the group
        (one that died, or a retry whose delay is over), claimed for this one; about every
        :data:`CLAIM_EVERY` seconds. Each with its delivery count from the pending list."""
        now = time.monotonic()
        if now - self._claimed_at < min(CLAIM_EVERY, self.visibility_timeout / 4):
            return []
        self._claimed_at = now
        client = self._connected()
        idle = int(self.visibility_timeout * 1000)
        entries: list[Entry] = []
        for stream in self.streams:
            answer = client.xautoclaim(
                stream, self.group, self.name, idle, self._cursors[stream], count=self.prefetch
            )
            self._cursors[stream] = _id(answer[0])
            for item in answer[1]:
                entry_id, fields = item[0], item[1]
                if fields is not None:
                    entries.append(Entry(stream, _id(entry_id), fields))
            if len(answer) > 2 and answer[2]:
                logger.warning(
                    "%d pending entr(ies) of stream %s were trimmed (OUTBOX_REDIS_MAXLEN) "
                    "before they were handled: %s",
                    len(answer[2]),
                    stream,
                    ", ".join(_id(i).decode() for i in answer[2]),
                )
            if len(entries) >= self.prefetch:
                break
        if entries:
            pipe = client.pipeline(transaction=False)
            for entry in entries:
                pipe.xpending_range(entry.stream, self.group, entry.id, entry.id, 1)
            for entry, pending in zip(entries, pipe.execute(), strict=True):
                if pending:
                    entry.number = max(int(pending[0]["times_delivered"]), 1)
        return entries

    def _keep_claimed(self, client: redis.Redis, stop: threading.Event) -> None:
        """While entries are held, claim them again for this consumer every third of the
        visibility timeout (their idle time starts over; no delivery is counted)."""
        while not stop.wait(self.visibility_timeout / 3):
            with self._held_lock:
                held = list(self._held.values())
                try:
                    for entry in held:
                        client.xclaim(
                            entry.stream, self.group, self.name, 0, [entry.id], justid=True
                        )
                except Exception:  # lost meanwhile: the main loop reconnects
                    logger.debug("could not keep held entries claimed", exc_info=True)

    def _hand_back(self) -> None:
        """Leave every held entry claimable at once (its next claim counts a delivery)."""
        with self._held_lock:
            held, self._held = list(self._held.values()), {}
        if not held or self._client is None:
            return
        idle = int(self.visibility_timeout * 1000)
        try:
            pipe = self._client.pipeline(transaction=False)
            for entry in held:
                pipe.xclaim(
                    entry.stream, self.group, self.name, 0, [entry.id], idle=idle, justid=True
                )
            pipe.execute()
            self._claimed_at = 0.0
        except Exception:  # lost: they are claimed after the visibility timeout
            logger.debug("could not hand back %d entries", len(held), exc_info=True)

    def delivery(self, message: Entry) -> Delivery:
        fields = {k.decode(errors="replace"): v for k, v in message.fields.items()}
        message_id = _text(fields.get("message_id"))
        content_type = _text(fields.get("content_type"))
        raw = fields.get("headers")
        headers: Any = None
        if raw is not None:
            try:
                headers = json.loads(raw)
            except ValueError:
                headers = _text(raw)  # not a table: the dispatcher dead-letters it, saying so
        if content_type is None and isinstance(headers, dict):
            # A binary-mode CloudEvent carries its datacontenttype as an attribute.
            content_type = headers.get("ce-datacontenttype")
        return Delivery(
            fields.get("body", b""),
            message_id=message_id,
            message_type=_text(fields.get("type", fields.get(TYPE_HEADER))),
            headers=headers,
            content_type=content_type,
            redelivered=message.number > 1,
            number=message.number,
            transport=self.transport,
        )

    def tracing(self, message: Entry) -> AbstractContextManager[Any]:
        return tracing.delivery(message.stream, message.stream, self.group, None)

    # -- settling ----------------------------------------------------------------------------
    def settle(self, message: Entry, delivery: Delivery, decision: Decision) -> None:
        with self._held_lock:
            self._held.pop((message.stream, message.id), None)
        client = self._connected()
        if decision.action is Action.ACKNOWLEDGE:
            client.xack(message.stream, self.group, message.id)
        elif decision.action is Action.RETRY:
            # Claimable again once the delay is over: its idle time is set that far short
            # of the visibility timeout.
            delay = min(max(decision.delay or 0.0, 0.0), self.visibility_timeout)
            idle = int((self.visibility_timeout - delay) * 1000)
            client.xclaim(
                message.stream, self.group, self.name, 0, [message.id], idle=idle, justid=True
            )
            self._claimed_at = 0.0 if not delay else self._claimed_at
        elif decision.action is Action.DEAD_LETTER:
            fields = dict(message.fields)
            fields[REASON_HEADER.encode()] = decision.reason.encode()
            fields[STREAM_FIELD.encode()] = message.stream.encode()
            pipe = client.pipeline(transaction=True)
            pipe.xadd(self.dead_letter_queue, fields)  # type: ignore[arg-type]
            pipe.xack(message.stream, self.group, message.id)
            pipe.execute()
        else:
            raise ValueError(f"a transport cannot settle a {decision.action.value} decision")

    def _connected(self) -> redis.Redis:
        if self._client is None:
            raise redis.exceptions.ConnectionError("not connected")
        return self._client


def _id(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return value
