"""An in-memory backend for tests and the demo: every publish is "confirmed" at once.

Published messages are appended to the module-level :data:`outbox` list (like Django's
``mail.outbox``); :func:`django_outbox.testing.captured_events` resets it. A test can make
the next publishes fail by putting results in :data:`fail_next` (e.g.
``[Reason.NACKED]``) or by setting :data:`unavailable` to simulate a broker outage.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..message import Delivery
from .base import BrokerUnavailable, PublishResult, Reason, SyncBackend

if TYPE_CHECKING:
    from ..models import OutboxEvent


@dataclass(frozen=True)
class Message:
    """What would have reached the broker."""

    exchange: str
    routing_key: str
    body: bytes
    message_id: str
    type: str
    content_type: str
    headers: dict[str, Any] = field(default_factory=dict)

    def delivery(self) -> Delivery:
        """The message as a consumer's transport would hand it over (a first delivery)."""
        return Delivery(
            self.body,
            message_id=self.message_id,
            message_type=self.type,
            headers=self.headers,
            content_type=self.content_type,
            transport="locmem",
        )


outbox: list[Message] = []
# Reasons for the next publishes to fail with, consumed one per event in order.
fail_next: list[Reason] = []
unavailable = False
_lock = threading.Lock()


def reset() -> None:
    global unavailable
    with _lock:
        outbox.clear()
        fail_next.clear()
        unavailable = False


class LocmemBackend(SyncBackend):
    def open(self) -> None:
        if unavailable:
            raise BrokerUnavailable("locmem broker marked unavailable")

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        self.open()
        results = []
        message_format = self.message_format
        with _lock:
            for event in events:
                if fail_next:
                    reason = fail_next.pop(0)
                    results.append(PublishResult.failed(reason, f"locmem: injected {reason.value}"))
                    continue
                outbox.append(
                    Message(
                        exchange=self.exchange,
                        routing_key=self.routing_key(event),
                        body=message_format.encode_body(event),
                        message_id=event.event_id,
                        type=event.event_type,
                        content_type=message_format.content_type,
                        headers=message_format.encode_headers(event),
                    )
                )
                results.append(PublishResult.sent())
        return results
