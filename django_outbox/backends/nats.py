"""NATS JetStream through nats-py: every event published with ``Nats-Msg-Id`` = its
event_id, the JetStream publish ack taken as the confirm, a batch's acks awaited together.

nats-py is asyncio only and the relay is not: the connection lives on an event loop of the
backend's own, on a thread of its own (:class:`~django_outbox._compat.nats.LoopThread`).
:meth:`NatsBackend.send` builds a batch's ``HPUB`` frames on the relay's thread and hands
them to the loop in one piece; the acks come back on the loop's thread into the batch, and
:meth:`NatsBackend.wait` blocks on the batch until each message is acked or failed or the
confirm timeout passes. Several batches are in flight at once, as with RabbitMQ.

Each message carries a reply subject of its own (``<inbox>.<n>``), where JetStream answers
once it has stored it (on a majority of the stream's replicas):

* an ack (``{"stream": ..., "seq": ...}``, ``"duplicate": true`` included: the event is in
  the stream already): sent;
* no stream takes the subject (the ``503`` no-responders status): UNROUTABLE;
* an error from JetStream: NACKED with its description (``503``, JetStream unavailable, is
  CONNECTION_LOST: not the event's fault);
* nothing within ``confirm_timeout``: TIMEOUT;
* the connection went away first: CONNECTION_LOST; the next :meth:`~NatsBackend.send`
  connects again (to the next node, when the relay says so).

The duplicate window (``OUTBOX_NATS_DUPLICATE_WINDOW``) is why a republish is harmless:
a relay killed between the ack and its settle leaves the rows PENDING, another relay takes
them once their lease is over and publishes them again with the same ``Nats-Msg-Id``, and
JetStream acks them as duplicates without storing them twice (check E030: the window must
be longer than the lease).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.core.checks import CheckMessage, Error

from .._compat.nats import LoopThread, take_replies, write_frames
from ..conf import BROKER_URL_EMPTY, BROKER_URL_EMPTY_HINT, outbox_settings
from ..formats import NATS_BINDING, get_format
from ..masking import mask_urls_in
from ..message import TYPE_HEADER, encode_text_headers, escape_header_value
from ..transports import NATS
from .base import (
    BrokerUnavailable,
    PublishResult,
    Reason,
    Route,
    RouteCheck,
    describe_error,
)
from .nodes import NodeProblem, NodesBackend

if NATS.missing():
    raise ImportError(NATS.missing())

import nats
import nats.errors
import nats.js.errors
from nats.js.api import StorageType, StreamConfig

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

    from ..models import OutboxEvent

__all__ = ["NatsBackend", "declare_stream", "stream_config", "subject_for"]

logger = logging.getLogger("django_outbox.backends.nats")

#: How long close() waits for the connection to close.
CLOSE_TIMEOUT = 2.0
#: The characters of a header name (RFC 7230 tokens, as nats-py checks them).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# What a subject token may not contain: whitespace, and the wildcards of a subscription.
_BAD_SUBJECT = re.compile(r"\s|(^|\.)[*>](\.|$)|^\.|\.$|\.\.")


def _stream_problems() -> list[CheckMessage]:
    """E030 (the duplicate window against the lease) and E031 (the stream's settings)."""
    from ..checks import Codes, Hints, Messages, _positive

    errors: list[CheckMessage] = []
    window, lease = outbox_settings.NATS_DUPLICATE_WINDOW, outbox_settings.LEASE_SECONDS
    if _positive(window) and _positive(lease) and window <= lease:
        errors.append(
            Error(
                Messages.NATS_DUPLICATE_WINDOW.format(window=window, lease=lease),
                hint=Hints.NATS_DUPLICATE_WINDOW.format(window=2 * lease),
                id=Codes.NATS_DUPLICATE_WINDOW,
            )
        )
    elif not _positive(window):
        errors.append(
            _stream_error("OUTBOX_NATS_DUPLICATE_WINDOW", window, "not a positive number")
        )
    stream = outbox_settings.NATS_STREAM
    if not isinstance(stream, str) or not stream or re.search(r"[\s.*>/\\]", stream):
        errors.append(
            _stream_error(
                "OUTBOX_NATS_STREAM",
                stream,
                "a stream name has no spaces, '.', '*', '>' or slashes",
            )
        )
    subjects = outbox_settings.NATS_SUBJECTS
    if not isinstance(subjects, (list, tuple)) or not all(
        isinstance(s, str) and s and not re.search(r"\s", s) for s in subjects
    ):
        errors.append(_stream_error("OUTBOX_NATS_SUBJECTS", subjects, "not a list of subjects"))
    replicas = outbox_settings.NATS_REPLICAS
    if not (type(replicas) is int and 1 <= replicas <= 5):
        errors.append(_stream_error("OUTBOX_NATS_REPLICAS", replicas, "not a number from 1 to 5"))
    return errors


def _stream_error(name: str, value: Any, problem: str) -> CheckMessage:
    from ..checks import Codes, Hints, Messages

    return Error(
        Messages.NATS_STREAM.format(name=name, value=value, problem=problem),
        hint=Hints.NATS_STREAM,
        id=Codes.NATS_STREAM,
    )


def subject_for(prefix: str, key: str) -> str:
    """The subject of an event with routing key ``key``: ``<prefix>.<key>``, or ``key``
    when the prefix (``OUTBOX_EXCHANGE``) is empty."""
    return f"{prefix}.{key}" if prefix else key


def stream_config(
    *, stream: str, subjects: Sequence[str], replicas: int, duplicate_window: float
) -> StreamConfig:
    """The stream the relay declares when it is missing: file storage, the limits policy
    (a message stays for every consumer until the stream's own limits remove it)."""
    return StreamConfig(
        name=stream,
        subjects=list(subjects),
        num_replicas=replicas,
        duplicate_window=duplicate_window,
        storage=StorageType.FILE,
    )


async def declare_stream(js: JetStreamContext, config: StreamConfig) -> str:
    """Declare the stream of ``config`` when it is missing, else verify it: the duplicate
    window must be at least the configured one (a shorter one would let a republished event
    in twice). Returns what was done, for the log; raises ``ValueError`` saying what to
    change."""
    try:
        assert config.name
        info = await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(config)
        return (
            f"declared stream {config.name!r} (subjects {', '.join(config.subjects or [])}, "
            f"{config.num_replicas} replica(s), duplicate window {config.duplicate_window:g} s)"
        )
    existing = info.config
    window = existing.duplicate_window or 0.0
    if window + 1e-6 < config.duplicate_window:
        raise ValueError(
            f"stream {config.name!r} exists with a duplicate window of {window:g} s, shorter "
            f"than OUTBOX_NATS_DUPLICATE_WINDOW ({config.duplicate_window:g} s): a republished "
            "event could be stored twice. Raise the stream's window (`nats stream edit "
            f"{config.name} --dupe-window {config.duplicate_window:g}s`) or lower the setting"
        )
    if existing.num_replicas and config.num_replicas != existing.num_replicas:
        logger.warning(
            "stream %r has %d replica(s), OUTBOX_NATS_REPLICAS says %d; the stream is "
            "used as it is",
            config.name,
            existing.num_replicas,
            config.num_replicas,
        )
    return f"using stream {config.name!r} (subjects {', '.join(existing.subjects or [])})"


class NatsBackend(NodesBackend):
    """Publish outbox events into a JetStream stream, each acked by the stream.

    Options (``OUTBOX_BACKEND_OPTIONS``), each defaulting to its setting: ``broker_url``
    (``OUTBOX_BROKER_URL``), ``stream`` (``OUTBOX_NATS_STREAM``), ``subjects``
    (``OUTBOX_NATS_SUBJECTS``), ``replicas`` (``OUTBOX_NATS_REPLICAS``),
    ``duplicate_window`` (``OUTBOX_NATS_DUPLICATE_WINDOW``), ``confirm_timeout``
    (``OUTBOX_CONFIRM_TIMEOUT``), ``connect_timeout`` (``OUTBOX_CONNECT_TIMEOUT``); plus the
    base class's ``exchange`` (the subjects' first token), ``routing_keys`` and
    ``routing_key_func``.
    """

    broker_name = "NATS"
    transport = NATS
    url_hint = (
        "Use the URL of a NATS server with JetStream, e.g. "
        "'nats://user:password@nats:4222' (tls:// for TLS)."
    )

    def __init__(
        self,
        *,
        stream: str | None = None,
        subjects: Sequence[str] | None = None,
        replicas: int | None = None,
        duplicate_window: float | None = None,
        **options: Any,  # broker_url, confirm_timeout, connect_timeout: see NodesBackend
    ) -> None:
        super().__init__(**options)
        self.message_format = get_format(binding=NATS_BINDING)
        self.stream = outbox_settings.NATS_STREAM if stream is None else stream
        subjects = outbox_settings.NATS_SUBJECTS if subjects is None else subjects
        self.subjects = list(subjects) or [subject_for(self.exchange, ">")]
        self.replicas = int(outbox_settings.NATS_REPLICAS if replicas is None else replicas)
        self.duplicate_window = float(
            outbox_settings.NATS_DUPLICATE_WINDOW if duplicate_window is None else duplicate_window
        )

        self._loop: LoopThread | None = None
        self._client: Client | None = None
        self._reply = ""  # "<inbox>.": each message's reply subject is this and its number
        self._max_payload = 1024 * 1024
        self._lock = threading.Lock()  # the batches in flight, shared with the loop's thread
        self._inflight: deque[_Batch] = deque()
        self._next = 0  # the reply number of the next message
        self._lost = ""  # why the connection went away ("" while it is up)
        self._error = ""  # the last error nats-py reported, for the loss's reason
        # Per routing key its subject's bytes, or why it is none; per header name whether
        # NATS can carry it: each is checked once.
        self._subjects: dict[str, bytes | str] = {}
        self._names: dict[str, bool] = {}
        fixed = [b"NATS/1.0"]
        if self.stream:
            # The server refuses a message its subject would store in another stream.
            fixed.append(b"Nats-Expected-Stream: " + self.stream.encode())
        fixed.append(b"Content-Type: " + self.message_format.content_type.encode())
        self._fixed = b"\r\n".join(fixed) + b"\r\n"

    def __repr__(self) -> str:
        return f"<NatsBackend {self.nodes} stream={self.stream!r}>"

    # -- configuration checks --------------------------------------------------------------
    @classmethod
    def settings_problems(cls) -> list[CheckMessage]:
        return _stream_problems()

    # -- connection ------------------------------------------------------------------------
    def open(self) -> None:
        """Connect to the first node that answers, from the current one on, declare or
        verify the stream and subscribe to the acks' inbox. Raises BrokerUnavailable."""
        if self._client is not None and self._client.is_connected and not self._lost:
            return
        if not self.nodes:
            raise BrokerUnavailable(f"{BROKER_URL_EMPTY} {BROKER_URL_EMPTY_HINT}")
        self._teardown()
        if self._loop is None or not self._loop.alive:
            self._loop = LoopThread("django-outbox-nats")
        loop = self._loop

        def attempt() -> None:
            started = time.monotonic()
            try:
                done = loop.run(self._connect(self.nodes.current), self.connect_timeout * 2)
            except Exception as exc:
                raise NodeProblem(_describe(exc)) from None
            logger.info(
                "connected to %s, %s (%.0f ms)",
                self.nodes.name(),
                done,
                (time.monotonic() - started) * 1000,
            )

        self.connect_to_a_node(
            attempt,
            check=f"Check that the server runs with JetStream enabled and {self.url_setting} "
            "(host, port, credentials) is right; the relay retries with backoff.",
        )

    async def _connect(self, url: str) -> str:
        client = nats.NATS()

        async def on_error(exc: Exception) -> None:
            self._error = _describe(exc)
            logger.debug("nats-py reports: %s", self._error)

        async def on_gone() -> None:
            self._connection_lost(client)

        await client.connect(
            servers=[url],
            name="django-outbox relay",
            connect_timeout=math.ceil(self.connect_timeout),
            # The relay does the reconnecting (to the next node) once it has settled what
            # the lost connection had acked: nats-py must not queue publishes meanwhile.
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=on_error,
            disconnected_cb=on_gone,
            closed_cb=on_gone,
        )
        try:
            js = client.jetstream(timeout=self.connect_timeout)
            config = stream_config(
                stream=self.stream,
                subjects=self.subjects,
                replicas=self.replicas,
                duplicate_window=self.duplicate_window,
            )
            done = await declare_stream(js, config)
            inbox = client.new_inbox()
            acks = await client.subscribe(f"{inbox}.*", cb=_never_called)
            take_replies(client, acks, self._on_ack)
            await client.flush(math.ceil(self.connect_timeout))
        except BaseException:
            await client.close()
            raise
        self._client = client
        self._reply = f"{inbox}."
        self._max_payload = client.max_payload or self._max_payload
        self._lost = self._error = ""
        return done

    def check_routes(self, routing_keys: Sequence[str]) -> RouteCheck:
        """For ``manage.py outbox_check``: connect, declare (or verify) the stream, and say
        for each routing key whether the stream takes its subject (else its events come
        back unroutable) and which durable consumers read it."""
        self.open()
        try:
            assert self._loop is not None and self._client is not None
            found = self._loop.run(self._routes(routing_keys), self.connect_timeout * 2)
        finally:
            self.close()
        return RouteCheck(f"stream {self.stream!r} at {self.masked_url}", found)

    async def _routes(self, routing_keys: Sequence[str]) -> list[Route]:
        assert self._client is not None
        js = self._client.jetstream(timeout=self.connect_timeout)
        readers = [info async for info in _consumers(js, self.stream)]
        routes = []
        for key in routing_keys:
            subject = subject_for(self.exchange, key)
            try:
                owner = await js.find_stream_name_by_subject(subject)
            except nats.js.errors.NotFoundError:
                owner = ""
            if owner != self.stream:
                routes.append(Route(key, ()))
                continue
            names = [
                info.name
                for info in readers
                if _matches(subject, info.config.filter_subject, info.config.filter_subjects)
            ]
            where = f"stream {self.stream!r}"
            if names:
                where += f" (read by {', '.join(names)})"
            routes.append(Route(key, (where,)))
        return routes

    def close(self) -> None:
        self.abandon()
        self._teardown()
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.stop()

    def _teardown(self) -> None:
        """Close the connection (a broken one too); the next open() starts over."""
        client, self._client = self._client, None
        if client is None or client.is_closed or self._loop is None or not self._loop.alive:
            return
        try:
            self._loop.run(client.close(), CLOSE_TIMEOUT)
        except Exception:  # closing a broken connection: nothing is waited for on it
            logger.debug("error closing the NATS connection", exc_info=True)

    def _connection_lost(self, client: Client) -> None:
        """On the loop's thread: the connection is gone; every batch in flight is failed
        CONNECTION_LOST now, not at the confirm timeout."""
        if client is not self._client:
            return
        reason = f"connection to NATS at {self.masked_url} lost"
        if self._error:
            reason += f": {self._error}"
        with self._lock:
            if self._lost:
                return
            self._lost = reason
            for batch in self._inflight:
                batch.lose(reason)
        logger.warning("%s", reason)

    # -- publishing ------------------------------------------------------------------------
    def send(self, events: Sequence[OutboxEvent]) -> None:
        """Build the batch's frames and hand them to the connection in one piece;
        :meth:`wait` collects the acks. Batches sent earlier may still be in flight."""
        if not self._inflight:
            self.open()
        batch = _Batch(events, self._next)
        self._next += len(events)
        if not events:
            with self._lock:
                self._inflight.append(batch)
            return
        if self._lost:
            # Gone under an earlier batch: nothing more is written until wait() has collected
            # every batch and open() connects again.
            batch.lose(self._lost)
            with self._lock:
                self._inflight.append(batch)
            return
        frames = self._frames(batch)
        with self._lock:
            self._inflight.append(batch)
            if self._lost:
                batch.lose(self._lost)
                return
        if batch.unsettled:
            assert self._loop is not None and self._client is not None
            client = self._client
            future = self._loop.submit(write_frames(client, frames))
            future.add_done_callback(functools.partial(self._written, client=client))

    def _written(self, done: Any, *, client: Client) -> None:
        if not done.cancelled() and done.exception() is not None:
            self._error = _describe(done.exception())
            self._connection_lost(client)

    def wait(self) -> list[PublishResult]:
        """Block until every message of the oldest batch in flight is acked or failed, or
        the confirm timeout (counted from its :meth:`send`) has passed."""
        if not self._inflight:
            return []
        batch = self._inflight[0]
        remaining = self.confirm_timeout - (time.monotonic() - batch.sent_at)
        batch.done.wait(max(remaining, 0.0))
        with self._lock:
            self._inflight.popleft()
            if batch.unsettled:
                if batch.lost:
                    failure = PublishResult.failed(Reason.CONNECTION_LOST, batch.lost)
                else:
                    failure = PublishResult.failed(
                        Reason.TIMEOUT,
                        f"no ack from JetStream within {self.confirm_timeout:g} s "
                        "(OUTBOX_CONFIRM_TIMEOUT)",
                    )
                batch.fail_unsettled(failure)
        return batch.results  # type: ignore[return-value]  # every slot is filled above

    def abandon(self) -> None:
        # Acks still to come for them match no batch and are ignored.
        with self._lock:
            self._inflight.clear()

    def _frames(self, batch: _Batch) -> bytes:
        """The batch's ``HPUB`` frames; a row that cannot be one is failed in place."""
        parts: list[bytes] = []
        append = parts.append
        build = self._frame
        results = batch.results
        reply = self._reply.encode()
        for index, event in enumerate(batch.events):
            try:
                append(build(event, reply + str(batch.base + index).encode()))
            except _Unsendable as exc:
                results[index] = PublishResult.failed(exc.reason, str(exc))
            except Exception as exc:
                results[index] = PublishResult.failed(
                    Reason.SERIALISATION, f"cannot build the message: {describe_error(exc)}"
                )
            else:
                batch.unsettled += 1
        return b"".join(parts)

    def _frame(self, event: OutboxEvent, reply: bytes) -> bytes:
        """One ``HPUB`` frame: the event's subject, its reply subject, the headers (the
        format's, as text) and the body."""
        message_format = self.message_format
        key = self.routing_key(event)
        subject = self._subjects.get(key)
        if subject is None:
            subject = self._subjects[key] = self._subject(key)
        if isinstance(subject, str):
            raise _Unsendable(Reason.SERIALISATION, subject)
        body = message_format.encode_body(event)
        names = self._names
        lines = [
            self._fixed,
            b"Nats-Msg-Id: ",
            escape_header_value(event.event_id).encode(),
            f"\r\n{TYPE_HEADER}: ".encode(),
            escape_header_value(event.event_type).encode(),
            b"\r\n",
        ]
        for name, value in encode_text_headers(message_format.encode_headers(event)):
            ok = names.get(name)
            if ok is None:
                ok = names[name] = _HEADER_NAME.fullmatch(name) is not None
            if not ok:
                raise _Unsendable(
                    Reason.SERIALISATION,
                    f"NATS cannot carry header {name!r}: a header name is printable US-ASCII "
                    "without spaces or ':'",
                )
            lines.append(f"{name}: {value}\r\n".encode())
        lines.append(b"\r\n")
        headers = b"".join(lines)
        size = len(headers) + len(body)
        if size > self._max_payload:
            raise _Unsendable(
                Reason.SERIALISATION,
                f"the message is {size} bytes, more than the NATS server's max_payload "
                f"({self._max_payload} bytes)",
            )
        return b"HPUB %b %b %d %d\r\n%b%b\r\n" % (subject, reply, len(headers), size, headers, body)

    def _subject(self, key: str) -> bytes | str:
        """The subject's bytes for routing key ``key``, or why it cannot be one."""
        subject = subject_for(self.exchange, key)
        if not key or _BAD_SUBJECT.search(subject):
            return (
                f"routing key {key!r} makes subject {subject!r}, which NATS cannot publish to "
                "(no spaces, no empty tokens, no * or > tokens)"
            )
        return subject.encode()

    # -- acks, on the loop's thread ------------------------------------------------------------
    def _on_ack(self, subject: bytes, data: bytes, headers: bytes | None) -> None:
        try:
            number = int(subject[len(self._reply) :])
        except ValueError:
            return
        result = _ack_result(data, headers)
        with self._lock:
            for batch in self._inflight:
                if batch.base <= number < batch.base + len(batch.events):
                    index = number - batch.base
                    if result is None:
                        key = self.routing_key(batch.events[index])
                        result = PublishResult.failed(
                            Reason.UNROUTABLE,
                            f"no JetStream stream takes subject "
                            f"{subject_for(self.exchange, key)!r} (no responders); add it to "
                            f"the subjects of stream {self.stream!r}",
                        )
                    batch.settle(index, result)
                    return


async def _consumers(js: JetStreamContext, stream: str) -> Any:
    for info in await js.consumers_info(stream):
        yield info


def _matches(subject: str, one: str | None, several: Sequence[str] | None) -> bool:
    """Whether a consumer with these filter subjects reads ``subject`` (none: every one)."""
    filters = [f for f in [one, *(several or [])] if f]
    return not filters or any(_subject_match(f, subject) for f in filters)


def _subject_match(pattern: str, subject: str) -> bool:
    words, tokens = pattern.split("."), subject.split(".")
    for index, word in enumerate(words):
        if word == ">":
            return len(tokens) > index
        if index >= len(tokens) or (word != "*" and word != tokens[index]):
            return False
    return len(words) == len(tokens)


async def _never_called(msg: Msg) -> None:
    """The acks' subscription's callback: take_replies() hands them over before it."""


def _ack_result(data: bytes, headers: bytes | None) -> PublishResult | None:
    """What JetStream's answer to one publish says; None: no stream took the subject."""
    if data[:10] == b'{"stream":' and b'"error"' not in data:
        return PublishResult.sent()
    if headers is not None and headers[:12] == b"NATS/1.0 503" and not data:
        return None
    try:
        answer = json.loads(data)
    except ValueError:
        answer = {"error": {"description": data[:200].decode(errors="replace")}}
    error = answer.get("error") if isinstance(answer, dict) else None
    if not error:
        return PublishResult.sent()
    code = error.get("code")
    text = f"JetStream refused the message: {error.get('description', error)}"
    if error.get("err_code"):
        text += f" (error {error['err_code']})"
    if code == 503:
        # JetStream itself is unavailable (no quorum, no leader): not the event's fault.
        return PublishResult.failed(Reason.CONNECTION_LOST, text)
    return PublishResult.failed(Reason.NACKED, text)


class _Unsendable(Exception):
    def __init__(self, reason: Reason, error: str) -> None:
        super().__init__(error)
        self.reason = reason


class _Batch:
    """One batch handed to the connection and not yet collected by ``wait()``: message k of
    it has reply number ``base + k``. Its results are written on the loop's thread (acks)
    and read on the relay's, under the backend's lock."""

    def __init__(self, events: Sequence[OutboxEvent], base: int) -> None:
        self.events = events
        self.base = base
        self.results: list[PublishResult | None] = [None] * len(events)
        self.unsettled = 0
        self.lost = ""
        self.done = threading.Event()
        self.sent_at = time.monotonic()

    def settle(self, index: int, result: PublishResult) -> None:
        if self.results[index] is None:
            self.results[index] = result
            self.unsettled -= 1
            if not self.unsettled:
                self.done.set()

    def lose(self, reason: str) -> None:
        self.lost = self.lost or reason
        self.done.set()

    def fail_unsettled(self, failure: PublishResult) -> None:
        for index, result in enumerate(self.results):
            if result is None:
                self.results[index] = failure
        self.unsettled = 0


def _describe(error: BaseException) -> str:
    """A short, password-free description of a nats-py error."""
    if isinstance(error, (TimeoutError, nats.errors.TimeoutError)):
        return "no answer in time"
    if isinstance(error, nats.errors.NoServersError):
        return "the server does not answer (connection refused or timed out)"
    if isinstance(error, nats.js.errors.ServiceUnavailableError):
        return "JetStream is not enabled or not available on the server (start it with -js)"
    return mask_urls_in(describe_error(error))
