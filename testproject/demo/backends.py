"""The backend of the demo's relay processes: the real one, plus a pause to be killed in.

``manage.py demo`` starts real ``publish_outbox`` children with
``OUTBOX_BACKEND=demo.backends.DemoRelayBackend``. It publishes through the backend named
by ``DEMO_INNER_BACKEND`` (``PikaBackend`` for RabbitMQ, ``InProcessBrokerBackend`` for the
embedded broker) on the exchange ``DEMO_EXCHANGE``. When ``DEMO_PAUSE_AFTER_BATCH`` is N,
it stops right after the broker confirmed batch N, writes what was confirmed to
``DEMO_PAUSE_FILE`` and waits there: the demo then kills the process with SIGKILL. The
pause only makes the kill land, every time, in the window that produces duplicates
(confirmed by the broker, not yet marked SENT in the database); the kill and what follows
(the lease, the restarted relay publishing the rows again) are the real thing.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django_outbox.backends import get_backend
from django_outbox.backends.base import PublishResult, SyncBackend

if TYPE_CHECKING:
    from django_outbox.models import OutboxEvent

INNER_ENV = "DEMO_INNER_BACKEND"
EXCHANGE_ENV = "DEMO_EXCHANGE"
PAUSE_AFTER_ENV = "DEMO_PAUSE_AFTER_BATCH"
PAUSE_FILE_ENV = "DEMO_PAUSE_FILE"
PAUSE_LIMIT = 120.0  # seconds; the demo kills the process long before


class DemoRelayBackend(SyncBackend):
    def __init__(self, **options: Any) -> None:
        inner_path = os.environ.get(INNER_ENV) or "demo.broker.InProcessBrokerBackend"
        if os.environ.get(EXCHANGE_ENV):
            options["exchange"] = os.environ[EXCHANGE_ENV]
        self.inner = get_backend(inner_path, **options)
        super().__init__(exchange=self.inner.exchange)
        self.pause_after = int(os.environ.get(PAUSE_AFTER_ENV) or 0)
        self.pause_file = os.environ.get(PAUSE_FILE_ENV, "")
        self.batches = 0

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        results = self.inner.publish(events)
        self.batches += 1
        if self.batches == self.pause_after and self.pause_file:
            confirmed = [e.event_id for e, r in zip(events, results, strict=True) if r.ok]
            report = {"batch": self.batches, "pid": os.getpid(), "confirmed": confirmed}
            path = Path(self.pause_file)
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(report))
            partial.replace(path)  # the demo never reads a half-written file
            threading.Event().wait(PAUSE_LIMIT)
        return results
