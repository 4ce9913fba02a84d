"""Redis Streams through redis-py: every event ``XADD``ed to the stream of its routing key,
a row SENT only once Redis has answered that ``XADD`` with the entry's id.

The relay's batches are pipelined on one connection: :meth:`RedisBackend.send` writes a
batch's ``XADD`` commands in one piece and returns, :meth:`RedisBackend.wait` reads their
answers, one per command, in order. Several batches are in flight at once, as with RabbitMQ;
Redis answers the commands of a connection in the order it received them.

What each answer means:

* an entry id: sent (Redis has applied it; whether it survives a crash of Redis is its
  persistence settings' business: docs/transports.md, "Redis Streams");
* an error reply (``WRONGTYPE``: the key holds something else; ``OOM``: maxmemory reached):
  NACKED with Redis's text, that row only;
* ``READONLY``, ``LOADING``, ``MASTERDOWN`` and the like: the node cannot take writes now
  (a replica, a restart): CONNECTION_LOST, not the event's fault; with several URLs the
  relay moves on to the next node;
* nothing within ``confirm_timeout``: TIMEOUT, and the connection is dropped (the answers
  still to come could no longer be told apart);
* the connection went away first: CONNECTION_LOST for every row whose answer was not read.

An entry's fields (the layout a consumer in another language reads):

================  ==================================================================
``message_id``    the event_id
``type``          the event_type
``content_type``  the message format's (``application/json``; structured CloudEvents:
                  ``application/cloudevents+json``)
``headers``       the format's headers as one JSON object (native: aggregate_type, ...,
                  the event's own headers, trace context among them; CloudEvents binary
                  mode: ``ce-`` attributes, as the NATS and Kafka bindings name them)
``body``          the message body (the payload as JSON; structured mode: the CloudEvent)
================  ==================================================================

Redis keeps no message id of its own: an event published twice (a relay killed between
the answer and its settle) is two entries, and consumers de-duplicate by ``message_id``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.core.checks import CheckMessage, Error

from ..conf import BROKER_URL_EMPTY, BROKER_URL_EMPTY_HINT, outbox_settings
from ..formats import NATS_BINDING, get_format
from ..message import encode_json
from ..transports import REDIS
from .base import (
    BrokerUnavailable,
    PublishResult,
    Reason,
    Route,
    RouteCheck,
    describe_error,
)
from .nodes import NodeProblem, NodesBackend

if REDIS.missing():
    raise ImportError(REDIS.missing())

import redis.exceptions

from .._compat.redis import (
    CONNECTION_ERRORS,
    describe,
    open_connection,
    pack_words,
    read_answer,
    stream_for,
    write_commands,
    write_packed,
)

if TYPE_CHECKING:
    from ..models import OutboxEvent

__all__ = ["RedisBackend"]

logger = logging.getLogger("django_outbox.backends.redis")

#: Error replies that say the node cannot take writes now, whatever the command: the
#: event is not at fault (a replica, a node loading its data, a cluster without quorum).
_NODE_ERRORS = ("READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY")


def _settings_problems() -> list[CheckMessage]:
    """E032: OUTBOX_REDIS_* settings the transport cannot work with."""
    errors = []
    streams = outbox_settings.REDIS_STREAMS
    if not isinstance(streams, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in streams.items()
    ):
        errors.append(_redis_error("OUTBOX_REDIS_STREAMS", streams, "not a map of names"))
    maxlen = outbox_settings.REDIS_MAXLEN
    if maxlen is not None and not (type(maxlen) is int and maxlen > 0):
        errors.append(_redis_error("OUTBOX_REDIS_MAXLEN", maxlen, "not None or a positive int"))
    timeout = outbox_settings.REDIS_VISIBILITY_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        errors.append(
            _redis_error("OUTBOX_REDIS_VISIBILITY_TIMEOUT", timeout, "not a positive number")
        )
    return errors


def _redis_error(name: str, value: Any, problem: str) -> CheckMessage:
    from ..checks import Codes, Hints, Messages

    return Error(
        Messages.REDIS_SETTING.format(name=name, value=value, problem=problem),
        hint=Hints.REDIS_SETTING,
        id=Codes.REDIS_SETTING,
    )


class RedisBackend(NodesBackend):
    """Append outbox events to Redis streams, each answered by Redis.

    Options (``OUTBOX_BACKEND_OPTIONS``), each defaulting to its setting: ``broker_url``
    (``OUTBOX_BROKER_URL``: one ``redis://`` URL, or several nodes: a replica answers
    ``READONLY`` and the relay moves on to the next), ``streams``
    (``OUTBOX_REDIS_STREAMS``), ``maxlen`` (``OUTBOX_REDIS_MAXLEN``), ``confirm_timeout``
    (``OUTBOX_CONFIRM_TIMEOUT``), ``connect_timeout`` (``OUTBOX_CONNECT_TIMEOUT``); plus the
    base class's ``exchange`` (the streams' prefix), ``routing_keys`` and
    ``routing_key_func``.
    """

    broker_name = "Redis"
    transport = REDIS
    url_hint = (
        "Use the URL of a Redis server, e.g. 'redis://:password@redis:6379/0' (rediss:// for TLS)."
    )

    def __init__(
        self,
        *,
        streams: dict[str, str] | None = None,
        maxlen: int | None = None,
        **options: Any,  # broker_url, confirm_timeout, connect_timeout: see NodesBackend
    ) -> None:
        super().__init__(**options)
        # Binary-mode CloudEvents carry their attributes as ce- headers, datacontenttype
        # among them, as the bindings of transports without AMQP properties do.
        self.message_format = get_format(binding=NATS_BINDING)
        self.streams = dict(outbox_settings.REDIS_STREAMS if streams is None else streams)
        self.maxlen = outbox_settings.REDIS_MAXLEN if maxlen is None else maxlen
        self._connection: Any = None
        self._inflight: deque[_Batch] = deque()
        self._lost = ""  # why the connection went away under batches in flight
        # The XADD's first words per routing key, packed: XADD <stream> [MAXLEN ~ n] *.
        self._heads: dict[str, bytes] = {}
        self._fields = _fields_template(self.message_format.content_type)

    def __repr__(self) -> str:
        return f"<RedisBackend {self.nodes}>"

    # -- configuration checks --------------------------------------------------------------
    @classmethod
    def settings_problems(cls) -> list[CheckMessage]:
        return _settings_problems()

    # -- connection ------------------------------------------------------------------------
    def open(self) -> None:
        """Connect to the first node that answers and takes writes, from the current one
        on. Raises BrokerUnavailable."""
        if self._connection is not None:
            return
        if not self.nodes:
            raise BrokerUnavailable(f"{BROKER_URL_EMPTY} {BROKER_URL_EMPTY_HINT}")

        def attempt() -> None:
            self._connection = self._connect(self.nodes.current)
            logger.info("connected to Redis at %s", self.nodes.name())

        self.connect_to_a_node(
            attempt,
            check=f"Check that the server runs and {self.url_setting} (host, port, password, "
            "database) is right; the relay retries with backoff.",
        )
        self._lost = ""

    def _connect(self, url: str) -> Any:
        try:
            connection = open_connection(
                url, connect_timeout=self.connect_timeout, timeout=self.confirm_timeout
            )
        except (redis.exceptions.RedisError, OSError, ValueError) as exc:
            raise NodeProblem(describe(exc)) from None
        try:
            # A replica (after a failover, the old primary) would refuse every XADD.
            write_commands(connection, [["ROLE"]])
            role = read_answer(connection)
        except (redis.exceptions.RedisError, OSError) as exc:
            connection.disconnect()
            raise NodeProblem(describe(exc)) from None
        kind = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
        if kind != "master":
            connection.disconnect()
            raise NodeProblem(f"the node is a {kind}, which takes no writes")
        return connection

    def close(self) -> None:
        self.abandon()
        self._drop()

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.disconnect()
            except Exception:  # closing a broken connection: nothing is waited for on it
                logger.debug("error closing the Redis connection", exc_info=True)

    def _lose(self, reason: str) -> None:
        """The connection is gone (or out of step): every batch in flight is lost."""
        self._lost = self._lost or reason
        for batch in self._inflight:
            batch.lost = batch.lost or reason
        self._drop()
        logger.warning("%s", reason)

    def check_routes(self, routing_keys: Sequence[str]) -> RouteCheck:
        """For ``manage.py outbox_check``: connect, and say for each routing key which
        stream takes its events and which consumer groups read it. Redis has no routing:
        an entry no group reads yet stays in the stream for a group created later."""
        self.open()
        assert self._connection is not None
        connection = self._connection
        routes = []
        try:
            for key in routing_keys:
                stream = stream_for(self.streams, self.exchange, key)
                write_commands(connection, [["XINFO", "GROUPS", stream]])
                try:
                    groups = read_answer(connection)
                except redis.exceptions.ResponseError:  # no such stream yet
                    groups = []
                names = [_group_name(group) for group in groups]
                where = f"stream {stream!r}"
                if names:
                    where += f" (read by group {', '.join(names)})"
                else:
                    where += " (no consumer group yet: entries wait in the stream)"
                routes.append(Route(key, (where,)))
        except CONNECTION_ERRORS as exc:
            raise BrokerUnavailable(f"Redis at {self.masked_url}: {describe(exc)}") from exc
        finally:
            self.close()
        return RouteCheck(f"Redis at {self.masked_url}", routes)

    # -- publishing ------------------------------------------------------------------------
    def send(self, events: Sequence[OutboxEvent]) -> None:
        """Write the batch's ``XADD`` commands in one piece; :meth:`wait` reads the answers.
        Batches sent earlier may still be in flight."""
        if self._connection is None and not self._inflight:
            self.open()
        batch = _Batch(events)
        self._inflight.append(batch)
        if self._connection is None or self._lost:
            # Gone under an earlier batch: nothing more is written until wait() has collected
            # every batch and the next send connects again.
            batch.lost = self._lost or "the connection to Redis was lost"
            return
        packed = self._packed(batch)
        if not packed:
            return
        connection = self._connection
        try:
            write_packed(connection, packed)
        except CONNECTION_ERRORS as exc:
            self._lose(f"connection to Redis at {self.masked_url} lost: {describe(exc)}")

    def wait(self) -> list[PublishResult]:
        """Read the answers of the oldest batch in flight, one per ``XADD``, until each is
        read or the confirm timeout (counted from its :meth:`send`) has passed."""
        if not self._inflight:
            return []
        batch = self._inflight.popleft()
        results = batch.results
        for index, result in enumerate(results):
            if result is not None:
                continue
            if batch.lost:
                results[index] = PublishResult.failed(Reason.CONNECTION_LOST, batch.lost)
                continue
            if not batch.timed_out and time.monotonic() - batch.sent_at > self.confirm_timeout:
                batch.timed_out = True
                self._lose(self._no_answer())
            if batch.timed_out:
                results[index] = _timed_out(self.confirm_timeout)
                continue
            assert self._connection is not None
            try:
                read_answer(self._connection)
            except redis.exceptions.ResponseError as exc:
                results[index] = _refused(exc)
            except redis.exceptions.TimeoutError:
                # The answers still to come could no longer be told apart: the connection
                # goes, with every later batch on it.
                batch.timed_out = True
                self._lose(self._no_answer())
                results[index] = _timed_out(self.confirm_timeout)
            except CONNECTION_ERRORS as exc:
                batch.lost = f"connection to Redis at {self.masked_url} lost: {describe(exc)}"
                self._lose(batch.lost)
                results[index] = PublishResult.failed(Reason.CONNECTION_LOST, batch.lost)
            else:
                results[index] = PublishResult.sent()
        return results  # type: ignore[return-value]  # every slot is filled above

    def _no_answer(self) -> str:
        return (
            f"no answer from Redis at {self.masked_url} within {self.confirm_timeout:g} s; "
            "the connection is dropped"
        )

    def abandon(self) -> None:
        # Answers still to come for them would be read as a later batch's: the connection
        # goes with them.
        if self._inflight:
            self._inflight.clear()
            self._drop()

    def _packed(self, batch: _Batch) -> bytes:
        """The batch's ``XADD`` commands in the protocol's form, one per row; a row that
        cannot be one is failed in place.

        Packed here rather than by redis-py's ``pack_commands``, which checks and encodes
        each of a command's 13 words on its own: the relay's main thread spent more time
        there than on anything else of the Redis transport (:func:`pack_words`)."""
        parts: list[bytes] = []
        append = parts.append
        results = batch.results
        message_format = self.message_format
        fields = self._fields
        heads = self._heads
        for index, event in enumerate(batch.events):
            try:
                key = self.routing_key(event)
                head = heads.get(key)
                if head is None:
                    head = heads[key] = self._head(key)
                event_id = event.event_id.encode()
                event_type = event.event_type.encode()
                headers = encode_json(message_format.encode_headers(event)).encode()
                body = message_format.encode_body(event)
                append(
                    head
                    + fields
                    % (
                        len(event_id),
                        event_id,
                        len(event_type),
                        event_type,
                        len(headers),
                        headers,
                        len(body),
                        body,
                    )
                )
            except Exception as exc:
                results[index] = PublishResult.failed(
                    Reason.SERIALISATION, f"cannot build the message: {describe_error(exc)}"
                )
        return b"".join(parts)

    def _head(self, key: str) -> bytes:
        """The packed first words of the routing key's ``XADD``s, the array's length
        first: ``XADD <stream> [MAXLEN ~ n] *``."""
        stream = stream_for(self.streams, self.exchange, key)
        if not key or not stream:
            raise ValueError(f"routing key {key!r} names no stream")
        words: list[bytes | str | int] = [b"XADD", stream]
        if self.maxlen:
            words += [b"MAXLEN", b"~", self.maxlen]
        words.append(b"*")
        return b"*%d\r\n%b" % (len(words) + 2 * len(_FIELDS), pack_words(words))


#: The fields of an entry, in the order written (the module's docstring describes them).
_FIELDS = ("message_id", "type", "content_type", "headers", "body")


def _fields_template(content_type: str) -> bytes:
    """The packed fields of an entry, a ``%``-template: the content type (the same for
    every entry) in place, ``%d`` and ``%b`` for each other value's length and bytes."""
    template = []
    for name in _FIELDS:
        template.append(pack_words([name]))
        if name == "content_type":
            template.append(pack_words([content_type]).replace(b"%", b"%%"))
        else:
            template.append(b"$%d\r\n%b\r\n")
    return b"".join(template)


def _refused(exc: redis.exceptions.ResponseError) -> PublishResult:
    # redis-py raises READONLY as ReadOnlyError without the code in its text.
    if isinstance(exc, redis.exceptions.ReadOnlyError) or str(exc).startswith(_NODE_ERRORS):
        return PublishResult.failed(
            Reason.CONNECTION_LOST, f"Redis cannot take writes now: {describe_error(exc)}"
        )
    return PublishResult.failed(Reason.NACKED, f"Redis refused the XADD: {exc!s}")


def _timed_out(timeout: float) -> PublishResult:
    return PublishResult.failed(
        Reason.TIMEOUT, f"no answer from Redis within {timeout:g} s (OUTBOX_CONFIRM_TIMEOUT)"
    )


def _group_name(group: Any) -> str:
    """A group's name from an ``XINFO GROUPS`` entry (a flat list of fields, RESP2)."""
    if isinstance(group, dict):
        name = group.get(b"name", group.get("name", b""))
    else:
        fields = dict(zip(group[::2], group[1::2], strict=False))
        name = fields.get(b"name", fields.get("name", b""))
    return name.decode() if isinstance(name, bytes) else str(name)


class _Batch:
    """One batch handed to the connection and not yet collected by ``wait()``."""

    def __init__(self, events: Sequence[OutboxEvent]) -> None:
        self.events = events
        self.results: list[PublishResult | None] = [None] * len(events)
        self.lost = ""
        self.timed_out = False
        self.sent_at = time.monotonic()
