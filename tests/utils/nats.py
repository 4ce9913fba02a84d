"""The test's own corner of the real NATS server (JetStream), and a consumer on it.

:class:`NatsBroker` names a stream, its subjects' prefix and a queue (the durable consumer)
for one test and deletes every stream it made at the end, so tests never touch anything
shared (the ``nats_broker`` fixture of tests/conftest.py). It talks to the server through
nats-py on an event loop of its own thread, as the transport does.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import nats
import nats.js.errors
from nats.js.api import StreamConfig

from django_outbox._compat.nats import LoopThread
from django_outbox.consumer.nats import Consumer
from django_outbox.models import OutboxEvent
from tests.utils.transport import connected_consumer, publish_all, relay_settings_for

AWARD = "points.handlers.AwardPointsHandler"


class NatsBroker:
    """``stream`` takes ``<prefix>.>``; events are published to ``<prefix>.<routing key>``;
    ``queue`` is the durable consumer's name source, ``dlq`` its dead-letter subject."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.suffix = uuid.uuid4().hex[:10]
        self.stream = f"TEST_{self.suffix}"
        self.prefix = f"test-{self.suffix}"
        self.exchange = self.prefix  # what the fault harness names the subjects' prefix
        self.queue = f"q-{self.suffix}.consumer"
        self.dlq = f"{self.queue}.dlq"
        self._loop = LoopThread("test-nats")
        self._client: Any = self._loop.run(nats.connect(url), 10)
        self.js = self._client.jetstream()
        self._streams: list[str] = [self.stream, f"{self.queue.replace('.', '_')}_dlq"]

    def run(self, coroutine: Any, timeout: float = 10.0) -> Any:
        return self._loop.run(coroutine, timeout)

    def backend_options(self, **options: Any) -> dict[str, Any]:
        """NatsBackend options for this test's stream."""
        return {"broker_url": self.url, "stream": self.stream, "exchange": self.prefix, **options}

    def declare_stream(self, **config: Any) -> None:
        config.setdefault("subjects", [f"{self.prefix}.>"])
        self.run(self.js.add_stream(StreamConfig(name=self.stream, **config)))

    def delete_at_close(self, *streams: str) -> None:
        self._streams.extend(streams)

    def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.run(self.js.publish(subject, body, headers=headers))

    def messages(self, stream: str | None = None) -> list[Any]:
        """Every message in ``stream`` (default the test's), oldest first."""
        stream = stream or self.stream

        async def read() -> list[Any]:
            try:
                info = await self.js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                return []
            found = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    found.append(await self.js.get_msg(stream, seq))
                except nats.js.errors.NotFoundError:
                    continue
            return found

        return self.run(read(), 60)

    def count(self, stream: str | None = None) -> int:
        try:
            info = self.run(self.js.stream_info(stream or self.stream))
        except nats.js.errors.NotFoundError:
            return 0
        return int(info.state.messages)

    def collect(self) -> Counter[str]:
        """How often each event_id (Nats-Msg-Id) is in the stream."""
        return Counter((m.headers or {}).get("Nats-Msg-Id", "") for m in self.messages())

    def close(self) -> None:
        for stream in self._streams:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                self.run(self.js.delete_stream(stream))
        self.run(self._client.close())
        self._loop.stop()


def relay_settings(broker: NatsBroker, **settings: Any) -> dict[str, Any]:
    """OUTBOX_* settings (without the prefix) of a relay process on the broker's stream
    (tests.faults.harness.Processes)."""
    return relay_settings_for(
        "django_outbox.backends.nats.NatsBackend", broker, NATS_STREAM=broker.stream, **settings
    )


def make_nats_consumer(
    broker: NatsBroker, handlers: Sequence[str] = (AWARD,), **options: Any
) -> Consumer:
    """A NATS Consumer of ``handlers`` on the broker's stream and queue, connected (the
    stream must exist). No pause before a retry."""
    return connected_consumer(
        Consumer, broker, handlers, exchange=broker.prefix, stream=broker.stream, **options
    )


def publish_events(broker: NatsBroker, *events: OutboxEvent, **options: Any) -> None:
    """Publish ``events`` as the relay does (through the NATS backend)."""
    from django_outbox.backends.nats import NatsBackend

    publish_all(NatsBackend(**broker.backend_options(**options)), events)
