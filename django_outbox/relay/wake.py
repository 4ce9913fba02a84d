"""How a relay waits between passes: polling, or LISTEN/NOTIFY on PostgreSQL, where
``emit()`` wakes it with the NOTIFY of :mod:`django_outbox.notify`.

The NOTIFY window's promise, kept by both sides: a commit that sends no NOTIFY because its
process sent one less than :data:`~django_outbox.notify.NOTIFY_WINDOW` ago is found by a
relay within about that long. Each relay that the NOTIFY woke (or that found events) looks
again ``NOTIFY_WINDOW`` after its pass (:attr:`Waker.recheck`, ``Relay.serve``), and that is
after the skipped commit: the NOTIFY was sent before it, and the relay received it after.
"""

from __future__ import annotations

import logging
import math
import select
import threading
import time
from contextlib import suppress
from typing import Any

from django.db import connections

from .. import notify
from ..conf import outbox_settings

logger = logging.getLogger("django_outbox.relay")


class Waker:
    """Sleeps between passes; ``stop`` cuts any sleep short."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    @property
    def recheck(self) -> float:
        """How soon after a pass that was woken or found events the relay must look again,
        at most (see the module's docstring); polling promises nothing."""
        return math.inf

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds; True if a wake-up (a NOTIFY) ended the sleep."""
        self.stop.wait(timeout)
        return False

    def close(self) -> None:
        pass


class PostgresNotifyWaker(Waker):
    """Wakes as soon as a transaction that emitted events commits (LISTEN/NOTIFY).

    Uses a dedicated connection so ``tidy_connections()`` never drops the LISTEN; if
    that connection fails, it falls back to polling and reconnects on the next wait.
    """

    SLICE = 0.2  # how often a wait looks at ``stop``; a NOTIFY interrupts it at once

    @property
    def recheck(self) -> float:
        return notify.NOTIFY_WINDOW

    def __init__(self, stop: threading.Event, using: str, channel: str) -> None:
        super().__init__(stop)
        self.using, self.channel = using, channel
        self._wrapper: Any = None

    def _listen(self) -> Any:
        if self._wrapper is None:
            wrapper = connections.create_connection(self.using)
            wrapper.ensure_connection()
            wrapper.set_autocommit(True)
            with wrapper.cursor() as cursor:
                cursor.execute(f'LISTEN "{self.channel}"')
            self._wrapper = wrapper
        return self._wrapper.connection

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            raw = self._listen()
            while not self.stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._received(raw, min(left, self.SLICE)):
                    return True
        except Exception:
            logger.warning("LISTEN connection failed; polling until it is back", exc_info=True)
            self.close()
            self.stop.wait(max(0.0, deadline - time.monotonic()))
        return False

    @staticmethod
    def _received(raw: Any, timeout: float) -> bool:
        if hasattr(raw, "notifies") and callable(raw.notifies):  # psycopg 3
            return any(True for _ in raw.notifies(timeout=timeout, stop_after=1))
        # psycopg2
        if select.select([raw], [], [], timeout)[0]:
            raw.poll()
            got = bool(raw.notifies)
            raw.notifies.clear()
            return got
        return False

    def close(self) -> None:
        if self._wrapper is not None:
            with suppress(Exception):
                self._wrapper.close()
            self._wrapper = None


def make_waker(using: str, stop: threading.Event) -> Waker:
    if connections[using].vendor == "postgresql" and outbox_settings.NOTIFY:
        channel = outbox_settings.NOTIFY_CHANNEL
        if channel.replace("_", "").isalnum():
            return PostgresNotifyWaker(stop, using, channel)
        logger.warning("OUTBOX_NOTIFY_CHANNEL %r is not a plain identifier; polling", channel)
    return Waker(stop)
