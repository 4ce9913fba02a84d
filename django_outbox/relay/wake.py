"""How a relay waits between passes (polling, or LISTEN/NOTIFY on PostgreSQL), and how
``emit()`` wakes it: :func:`request_wake`, a NOTIFY sent right after the commit, never
inside the business transaction, and at most one per :data:`NOTIFY_WINDOW` from a process.

The window's promise, kept by both sides: a commit that sends no NOTIFY because this
process sent one less than ``NOTIFY_WINDOW`` ago is found by a relay within about that
long. Each relay that the NOTIFY woke (or that found events) looks again
``NOTIFY_WINDOW`` after its pass (:attr:`Waker.recheck`, ``Relay.run``), and that is after
the skipped commit: the NOTIFY was sent before it, and the relay received it after.
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
        return NOTIFY_WINDOW

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


# -- the emitting side ----------------------------------------------------------------------
#: A transaction of its own that commits asynchronously (``is_local``: the setting ends with
#: it): the NOTIFY carries no data to make durable.
NOTIFY_SQL = "SELECT set_config('synchronous_commit', 'off', true), pg_notify(%s, '')"

#: Seconds after a NOTIFY during which the commits of the same process send none: the
#: relays it woke look again this long after their pass (the module's docstring). A busy
#: process pays one round trip per window instead of one per commit (bench.emit_bench);
#: what a skipped commit may wait for a relay is about this long.
NOTIFY_WINDOW = 0.01

# Database alias -> time.monotonic() when this process last sent a NOTIFY there. Shared by
# the process's threads: a NOTIFY from any of them wakes the relays for all.
_last_notify: dict[str, float] = {}


def request_wake(using: str) -> None:
    """Wake the relays of database ``using``: ``emit()``'s ``on_commit`` hook, run once per
    transaction that emitted, right after its commit, on the same connection.

    Why not ``NOTIFY`` inside the business transaction, as PostgreSQL intends: a
    transaction that issued NOTIFY takes a lock that every other notifying transaction
    waits for at commit, and holds it until its commit record is flushed to disk, so with
    a NOTIFY in every business transaction concurrent writers commit one at a time
    (docs/benchmarks.md, "What an event costs"). Sent after the commit, the NOTIFY is a
    transaction of its own that commits asynchronously, holding that lock for
    microseconds; it costs the request one round trip, and no thread nor connection
    beside the request's own.

    Sent at most once per :data:`NOTIFY_WINDOW` by a process: a commit less than that after
    the last NOTIFY sends none, and a relay finds it within about that long all the same.

    Never raises: the events are committed whatever happens here. A failed NOTIFY is
    logged and the relays find the events at their next poll (``OUTBOX_POLL_INTERVAL``).
    """
    sending = time.monotonic()
    if sending - _last_notify.get(using, -math.inf) < NOTIFY_WINDOW:
        return
    connection = connections[using]
    try:
        # The driver's cursor, not Django's: none of its wrapping (query logging, error
        # translation) is of use here, and this runs after every commit that emitted.
        cursor = connection.connection.cursor()
        try:
            cursor.execute(NOTIFY_SQL, [outbox_settings.NOTIFY_CHANNEL])
        finally:
            cursor.close()
        _last_notify[using] = sending
    except Exception:
        logger.warning(
            "The NOTIFY that wakes the relays failed on database %r; they will find the "
            "committed events at their next poll (OUTBOX_POLL_INTERVAL).",
            using,
            exc_info=True,
        )


def make_waker(using: str, stop: threading.Event) -> Waker:
    if connections[using].vendor == "postgresql" and outbox_settings.NOTIFY:
        channel = outbox_settings.NOTIFY_CHANNEL
        if channel.replace("_", "").isalnum():
            return PostgresNotifyWaker(stop, using, channel)
        logger.warning("OUTBOX_NOTIFY_CHANNEL %r is not a plain identifier; polling", channel)
    return Waker(stop)
