"""What the per-transport test helpers (amqp.py, nats.py, redis.py) share: a connected
consumer on the test broker's queue, and events published as the relay does."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from django_outbox.backends.base import BaseBackend
from django_outbox.models import OutboxEvent

C = TypeVar("C")


def connected_consumer(
    consumer_class: type[C], broker: Any, handlers: Sequence[str], **options: Any
) -> C:
    """A ``consumer_class`` of ``handlers`` on ``broker.queue`` (its url unless ``url=``),
    connected: what it declares is there. No pause before a retry; idle after 0.5 s."""
    options.setdefault("retry_delay", 0)
    options.setdefault("url", broker.url)
    consumer = consumer_class(  # type: ignore[call-arg]
        handlers=list(handlers), queue=broker.queue, idle_timeout=0.5, **options
    )
    consumer.connect()  # type: ignore[attr-defined]
    return consumer


def publish_all(backend: BaseBackend, events: Iterable[OutboxEvent]) -> None:
    """Publish ``events`` through ``backend`` in one batch; every one must be confirmed."""
    with backend:
        results = backend.publish(list(events))
    assert all(r.ok for r in results), results


def relay_settings_for(backend: str, broker: Any, **settings: Any) -> dict[str, Any]:
    """OUTBOX_* settings (without the prefix) of a relay process publishing through
    ``backend`` (a dotted path) to the broker's prefix (tests.faults.harness.Processes)."""
    return {"BACKEND": backend, "BROKER_URL": broker.url, "EXCHANGE": broker.prefix, **settings}


def delivery_numbers(consumer: Any) -> list[int]:
    """The delivery number of each message ``consumer`` takes from now on, in order (the
    list fills as it runs)."""
    numbers: list[int] = []
    original = consumer.delivery

    def spy(message: Any) -> Any:
        delivery = original(message)
        numbers.append(delivery.number)
        return delivery

    consumer.delivery = spy
    return numbers
