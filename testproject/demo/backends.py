"""The backend of the demo's relay processes: the real one, plus a pause to be killed in.

``manage.py demo`` starts real ``publish_outbox`` children with
``OUTBOX_BACKEND=demo.backends.DemoRelayBackend``. It hands every batch to the backend named
by ``DEMO_INNER_BACKEND`` (``PikaBackend`` for RabbitMQ, ``InProcessBrokerBackend`` for the
embedded broker) on the exchange ``DEMO_EXCHANGE``, through the relay's own contract
(``send``/``wait``/``abandon``), so the relay drives RabbitMQ with pipelined confirms as in
production. When ``DEMO_PAUSE_AFTER_BATCH`` is N, it stops as soon as the broker has
confirmed batch N and before anything after it is sent, writes what was confirmed to
``DEMO_PAUSE_FILE`` and waits there: the demo then kills the process with SIGKILL. The
pause only makes the kill land, every time, in the window that produces duplicates
(confirmed by the broker, not yet marked SENT in the database); the kill and what follows
(the lease, the restarted relay publishing the rows again) are the real thing.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django_outbox.backends import get_backend
from django_outbox.backends.base import BaseBackend, PublishResult

if TYPE_CHECKING:
    from django_outbox.models import OutboxEvent

INNER_ENV = "DEMO_INNER_BACKEND"
EXCHANGE_ENV = "DEMO_EXCHANGE"
PAUSE_AFTER_ENV = "DEMO_PAUSE_AFTER_BATCH"
PAUSE_FILE_ENV = "DEMO_PAUSE_FILE"
PAUSE_LIMIT = 120.0  # seconds; the demo kills the process long before


class DemoRelayBackend(BaseBackend):
    def __init__(self, **options: Any) -> None:
        inner_path = os.environ.get(INNER_ENV) or "demo.broker.InProcessBrokerBackend"
        if os.environ.get(EXCHANGE_ENV):
            options["exchange"] = os.environ[EXCHANGE_ENV]
        self.inner = get_backend(inner_path, **options)
        super().__init__(exchange=self.inner.exchange)
        self.confirm_timeout = self.inner.confirm_timeout
        self.pause_after = int(os.environ.get(PAUSE_AFTER_ENV) or 0)
        self.pause_file = os.environ.get(PAUSE_FILE_ENV, "")
        self.paused = False
        self._sent = 0  # batches handed to the inner backend
        # Sent and not yet waited for, by number; and results the pause waited for early.
        self._inflight: deque[tuple[int, Sequence[OutboxEvent]]] = deque()
        self._collected: deque[list[PublishResult]] = deque()

    def open(self) -> None:
        self.inner.open()

    def close(self) -> None:
        self.inner.close()

    def send(self, events: Sequence[OutboxEvent]) -> None:
        if self._pause_due() and self._sent == self.pause_after:
            # The relay sends the batch after N before it waits for N: wait for N here and
            # stop, so that the broker holds nothing beyond batch N when the kill comes.
            confirmed: list[str] = []
            while self._inflight:
                _, batch = self._inflight.popleft()
                results = self.inner.wait()
                self._collected.append(results)
                confirmed += _confirmed(batch, results)
            self._pause(confirmed)
        self.inner.send(events)
        self._sent += 1
        self._inflight.append((self._sent, events))

    def wait(self) -> list[PublishResult]:
        if self._collected:
            return self._collected.popleft()
        if not self._inflight:
            return self.inner.wait()
        number, events = self._inflight.popleft()
        results = self.inner.wait()
        if self._pause_due() and number == self.pause_after and not self._inflight:
            self._pause(_confirmed(events, results))  # batch N was the last one
        return results

    def abandon(self) -> None:
        self.inner.abandon()
        self._inflight.clear()
        self._collected.clear()

    def _pause_due(self) -> bool:
        return bool(self.pause_after and self.pause_file) and not self.paused

    def _pause(self, confirmed: list[str]) -> None:
        self.paused = True
        report = {"batch": self.pause_after, "pid": os.getpid(), "confirmed": confirmed}
        path = Path(self.pause_file)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(report))
        partial.replace(path)  # the demo never reads a half-written file
        threading.Event().wait(PAUSE_LIMIT)


def _confirmed(events: Sequence[OutboxEvent], results: list[PublishResult]) -> list[str]:
    return [e.event_id for e, r in zip(events, results, strict=True) if r.ok]
