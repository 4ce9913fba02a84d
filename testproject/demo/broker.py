"""The demo's embedded broker: it lives in the ``manage.py demo`` process.

The relay runs in child processes (real ``publish_outbox`` commands, so that one can be
killed), which the locmem backend cannot serve: its list dies with the process. So the
demo process hosts a small broker instead and the relay children reach it over a local,
authenticated socket with :class:`InProcessBrokerBackend`:

- a publish is **confirmed** only once the messages are in the broker's queue, so a relay
  that dies after the confirm leaves the broker holding messages its outbox rows do not
  say were sent, exactly as with RabbitMQ;
- a consumer takes a message with :meth:`InProcessBroker.get` and settles it with
  :meth:`~InProcessBroker.ack`; what it holds unacknowledged when its connection drops
  (:meth:`~InProcessBroker.recover`) goes back to the queue, flagged redelivered;
- Django tasks (routing key ``django.tasks.<queue>``) go to a queue of their own,
  :data:`TASKS`, as they go to the task worker's queue on RabbitMQ: the points consumer
  never sees them.

Nothing is persisted: the broker is gone when the demo exits. It is the demo's, not a
backend to deploy (use ``PikaBackend``).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import socket
import threading
from collections import deque
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

from django_outbox import message
from django_outbox.backends.base import BrokerUnavailable, PublishResult, Reason, SyncBackend
from django_outbox.conf import outbox_settings
from django_outbox.formats import MessageFormat

if TYPE_CHECKING:
    from django_outbox.models import OutboxEvent

# Where the relay children find the broker (set by the demo in their environment).
ADDRESS_ENV = "DEMO_BROKER_ADDRESS"  # host:port
AUTHKEY_ENV = "DEMO_BROKER_AUTHKEY"  # hex

#: The broker's two queues: the events (the points consumer's) and the Django tasks.
EVENTS = "events"
TASKS = "tasks"
# tasks_backend.EVENT_TYPE_PREFIX, written out: the relay children import this module, and
# tasks_backend cannot be imported where the Tasks API is missing (Django 5.2 alone).
_TASK_ROUTING_PREFIX = "django.tasks."


def queue_of(routing_key: str) -> str:
    """The queue a message of ``routing_key`` is routed to."""
    return TASKS if routing_key.startswith(_TASK_ROUTING_PREFIX) else EVENTS


@dataclass
class Delivery:
    """A message as the broker holds it; ``tag`` identifies one delivery of it."""

    body: bytes
    message_id: str
    type: str
    routing_key: str
    headers: dict[str, Any] = field(default_factory=dict)
    redelivered: bool = False
    tag: int = 0
    content_type: str = "application/json"

    def received(self) -> message.Delivery:
        """What a consumer's transport hands the dispatcher."""
        return message.Delivery(
            self.body,
            message_id=self.message_id,
            message_type=self.type,
            headers=self.headers,
            content_type=self.content_type,
            redelivered=self.redelivered,
            transport="demo",
        )


class InProcessBroker:
    """Two queues (:data:`EVENTS`, :data:`TASKS`) with publisher confirms,
    acknowledgements and redelivery, in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[str, deque[Delivery]] = {EVENTS: deque(), TASKS: deque()}
        self._unacked: dict[int, Delivery] = {}
        self._tags = itertools.count(1)
        self.published = 0
        self.rejected: list[Delivery] = []
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        host, port = self._listener.address
        self.address = f"{host}:{port}"
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="demo-broker", daemon=True)
        self._thread.start()

    def client_env(self) -> dict[str, str]:
        """Environment variables that point an InProcessBrokerBackend at this broker."""
        return {ADDRESS_ENV: self.address, AUTHKEY_ENV: self.authkey.hex()}

    # -- the publisher side ----------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError):
                continue  # closed, or a client that failed the handshake
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    batch = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    return  # the publisher went away (or was killed)
                self.publish([_from_wire(m) for m in batch])
                try:
                    conn.send_bytes(json.dumps({"confirmed": len(batch)}).encode())
                except OSError:
                    return

    def publish(self, deliveries: Sequence[Delivery]) -> None:
        with self._lock:
            for delivery in deliveries:
                self._ready[queue_of(delivery.routing_key)].append(delivery)
            self.published += len(deliveries)

    # -- the consumer side -----------------------------------------------------------------
    def get(self, queue: str = EVENTS) -> Delivery | None:
        """The next message of ``queue``, now held unacknowledged, or None when it is
        empty."""
        with self._lock:
            if not self._ready[queue]:
                return None
            delivery = self._ready[queue].popleft()
            delivery.tag = next(self._tags)
            self._unacked[delivery.tag] = delivery
            return delivery

    def ack(self, tag: int) -> None:
        with self._lock:
            del self._unacked[tag]

    def reject(self, tag: int) -> None:
        """Dead-letter: the message leaves the queue without being redelivered."""
        with self._lock:
            self.rejected.append(self._unacked.pop(tag))

    def recover(self) -> int:
        """The consumer's connection dropped: unacknowledged messages go back, first."""
        with self._lock:
            held = sorted(self._unacked.values(), key=lambda d: d.tag, reverse=True)
            self._unacked.clear()
            for delivery in held:
                delivery.redelivered = True
                self._ready[queue_of(delivery.routing_key)].appendleft(delivery)
            return len(held)

    def waiting(self, queue: str = EVENTS) -> int:
        """Messages ready in ``queue``."""
        with self._lock:
            return len(self._ready[queue])

    def __len__(self) -> int:
        return self.waiting(EVENTS)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Closing a listening socket does not wake a thread blocked in accept(): a
        # connection does, and the loop then sees the flag.
        host, _, port = self.address.rpartition(":")
        with suppress(OSError):
            socket.create_connection((host, int(port)), timeout=1).close()
        self._thread.join(timeout=5)
        self._listener.close()


def _to_wire(
    exchange: str, routing_key: str, event: OutboxEvent, message_format: MessageFormat
) -> dict[str, Any]:
    return {
        "exchange": exchange,
        "routing_key": routing_key,
        "body": message_format.encode_body(event).decode(),
        "message_id": event.event_id,
        "type": event.event_type,
        "content_type": message_format.content_type,
        "headers": message_format.encode_headers(event),
    }


def _from_wire(message: dict[str, Any]) -> Delivery:
    return Delivery(
        body=message["body"].encode(),
        message_id=message["message_id"],
        type=message["type"],
        routing_key=message["routing_key"],
        headers=message["headers"],
        content_type=message["content_type"],
    )


class InProcessBrokerBackend(SyncBackend):
    """Publishes to the demo's :class:`InProcessBroker` and waits for its confirm.

    ``address`` (host:port) and ``authkey`` (hex) default to the environment variables the
    demo sets for its relay children.
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        authkey: str | None = None,
        confirm_timeout: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.address = address or os.environ.get(ADDRESS_ENV, "")
        self.authkey = authkey or os.environ.get(AUTHKEY_ENV, "")
        self.confirm_timeout = float(
            outbox_settings.CONFIRM_TIMEOUT if confirm_timeout is None else confirm_timeout
        )
        self._conn: Connection | None = None

    def open(self) -> None:
        if self._conn is not None:
            return
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise BrokerUnavailable(
                f"no demo broker address ({ADDRESS_ENV}={self.address!r}); this backend only "
                "works in the relay processes started by `manage.py demo`."
            )
        try:
            self._conn = Client((host, int(port)), authkey=bytes.fromhex(self.authkey))
        except (OSError, EOFError, ValueError, AuthenticationError) as exc:
            raise BrokerUnavailable(
                f"cannot reach the demo broker at {self.address}: {exc}"
            ) from exc

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        self.open()
        assert self._conn is not None
        wire = [
            _to_wire(self.exchange, self.routing_key(e), e, self.message_format) for e in events
        ]
        try:
            self._conn.send_bytes(json.dumps(wire).encode())
            if not self._conn.poll(self.confirm_timeout):
                self.close()
                error = f"no confirm from the demo broker within {self.confirm_timeout:g} s"
                return [PublishResult.failed(Reason.TIMEOUT, error)] * len(events)
            reply = json.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self.close()
            error = f"demo broker connection lost: {exc or type(exc).__name__}"
            return [PublishResult.failed(Reason.CONNECTION_LOST, error)] * len(events)
        if reply.get("confirmed") != len(events):
            return [PublishResult.failed(Reason.NACKED, f"demo broker replied {reply}")] * len(
                events
            )
        return [PublishResult.sent()] * len(events)
