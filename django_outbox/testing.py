"""Helpers for your own tests: see what your code emitted and what the relay would send.

from django_outbox.testing import captured_messages, relay_now

def test_order_is_announced(settings):
    settings.OUTBOX_BACKEND = "django_outbox.backends.locmem.LocmemBackend"
    with captured_messages() as messages:
        create_order(user_id=1, amount=Decimal("5"))
        relay_now()
    assert [m.type for m in messages] == ["ORDER_CREATED"]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .backends import locmem
from .models import OutboxEvent


@contextmanager
def captured_messages() -> Iterator[list[locmem.Message]]:
    """Reset the in-memory broker and yield its list of published messages.

    The list stays readable after the block; the next ``captured_messages()`` resets it.
    """
    locmem.reset()
    yield locmem.outbox


def relay_now(**relay_options: Any) -> Any:
    """Drain every due event through the in-memory backend; returns the PassResult."""
    from .relay import Relay

    return Relay(backend=locmem.LocmemBackend(), **relay_options).drain()


def assert_emitted(event_type: str, *, count: int = 1, **fields: Any) -> list[OutboxEvent]:
    """Assert that ``count`` PENDING or SENT events of this type (and fields) exist."""
    events = list(OutboxEvent.objects.filter(event_type=event_type, **fields).order_by("id"))
    if len(events) != count:
        found = list(OutboxEvent.objects.values_list("event_type", flat=True)[:20])
        raise AssertionError(
            f"expected {count} {event_type} event(s) matching {fields}, found {len(events)}; "
            f"events in the outbox: {found}"
        )
    return events
