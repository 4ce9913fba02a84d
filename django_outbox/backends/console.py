"""A backend that prints each event instead of publishing it (development)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

from .base import PublishResult, SyncBackend

if TYPE_CHECKING:
    from ..models import OutboxEvent


class ConsoleBackend(SyncBackend):
    def __init__(self, *, stream: IO[str] | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        message_format = self.message_format
        with self._lock:
            for event in events:
                self.stream.write(
                    f"-> {self.exchange} {self.routing_key(event)} message_id={event.event_id} "
                    f"headers={message_format.encode_headers(event)}\n"
                    f"   {message_format.encode_body(event).decode()}\n"
                )
            self.stream.flush()
        return [PublishResult.sent() for _ in events]
