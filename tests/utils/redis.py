"""The test's own corner of the real Redis server, and a consumer on it.

:class:`RedisBroker` names a streams' prefix and a queue (the consumer group) for one test
and deletes every key under its names at the end, so tests never touch anything shared
(the ``redis_broker`` fixture of tests/conftest.py); other runs on the same server use
other names.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from django_outbox.consumer.redis import Consumer
from django_outbox.models import OutboxEvent
from tests.utils.transport import connected_consumer, publish_all, relay_settings_for

AWARD = "points.handlers.AwardPointsHandler"


class RedisBroker:
    """Events are added to ``<prefix>.<routing key>``; ``queue`` is the consumer group,
    ``dlq`` its dead-letter stream."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.suffix = uuid.uuid4().hex[:10]
        self.prefix = f"test-{self.suffix}"
        self.exchange = self.prefix  # what the fault harness names the streams' prefix
        self.queue = f"q-{self.suffix}.consumer"
        self.dlq = f"{self.queue}.dlq"
        self.client = redis.Redis.from_url(url)

    def stream(self, key: str = "ORDER_CREATED") -> str:
        return f"{self.prefix}.{key}"

    def backend_options(self, **options: Any) -> dict[str, Any]:
        """RedisBackend options for this test's streams."""
        return {"broker_url": self.url, "exchange": self.prefix, **options}

    def entries(self, stream: str | None = None) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Every entry of ``stream`` (default the ORDER_CREATED one), oldest first."""
        return [(i, f) for i, f in self.client.xrange(stream or self.stream())]

    def count(self, stream: str | None = None) -> int:
        return int(self.client.xlen(stream or self.stream()))

    def collect(self, stream: str | None = None) -> Counter[str]:
        """How often each event_id (the message_id field) is in ``stream``, or (None) in
        every stream of the test's prefix."""
        streams = (
            [stream]
            if stream
            else [key.decode() for key in self.client.scan_iter(f"{self.prefix}.*", _type="stream")]
        )
        return Counter(f[b"message_id"].decode() for s in streams for _, f in self.entries(s))

    def dead_letters(self) -> list[dict[bytes, bytes]]:
        return [f for _, f in self.entries(self.dlq)]

    def close(self) -> None:
        keys = [*self.client.scan_iter(f"{self.prefix}*"), *self.client.scan_iter(f"{self.queue}*")]
        if keys:
            self.client.delete(*keys)
        self.client.close()


def relay_settings(broker: RedisBroker, **settings: Any) -> dict[str, Any]:
    """OUTBOX_* settings (without the prefix) of a relay process on the broker's streams
    (tests.faults.harness.Processes)."""
    return relay_settings_for("django_outbox.backends.redis.RedisBackend", broker, **settings)


def make_redis_consumer(
    broker: RedisBroker, handlers: Sequence[str] = (AWARD,), **options: Any
) -> Consumer:
    """A Redis Consumer of ``handlers`` on the broker's streams and group, connected. No
    pause before a retry."""
    return connected_consumer(Consumer, broker, handlers, exchange=broker.prefix, **options)


def publish_events(broker: RedisBroker, *events: OutboxEvent, **options: Any) -> None:
    """Publish ``events`` as the relay does (through the Redis backend)."""
    from django_outbox.backends.redis import RedisBackend

    publish_all(RedisBackend(**broker.backend_options(**options)), events)


REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@contextlib.contextmanager
def primary_and_replica() -> Iterator[tuple[str, str]]:
    """Two redis-servers of the test's own on free loopback ports, nothing kept on disk:
    a primary and its replica. Yields their URLs (primary, replica); stopped afterwards."""
    import pytest

    from tests.utils.proxy import closed_port

    if not shutil.which(REDIS_SERVER):
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    ports = [closed_port(), closed_port()]
    while ports[1] == ports[0]:
        ports[1] = closed_port()
    servers = []
    try:
        for index, port in enumerate(ports):
            args = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
            args += ["--appendonly", "no", "--daemonize", "no", "--dir", "/tmp"]
            if index:
                args += ["--replicaof", "127.0.0.1", str(ports[0])]
            servers.append(subprocess.Popen(args, stdout=subprocess.DEVNULL))
        urls = [f"redis://127.0.0.1:{port}/0" for port in ports]
        deadline = time.monotonic() + 20
        while True:
            try:
                role = redis.Redis.from_url(urls[1]).info("replication")
                if role.get("master_link_status") == "up":
                    break
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the test's redis replica did not come up")
            time.sleep(0.1)
        yield urls[0], urls[1]
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(10)
