"""How a relay waits between passes (polling, or LISTEN/NOTIFY on PostgreSQL), and how
``emit()`` wakes it: :func:`request_wake`, a NOTIFY sent after the commit by a thread of the
emitting process, never inside the business transaction."""

from __future__ import annotations

import logging
import os
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

    def wait(self, timeout: float) -> None:
        self.stop.wait(timeout)

    def close(self) -> None:
        pass


class PostgresNotifyWaker(Waker):
    """Wakes as soon as a transaction that emitted events commits (LISTEN/NOTIFY).

    Uses a dedicated connection so ``tidy_connections()`` never drops the LISTEN; if
    that connection fails, it falls back to polling and reconnects on the next wait.
    """

    SLICE = 0.2  # how often a wait looks at ``stop``; a NOTIFY interrupts it at once

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

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            raw = self._listen()
            while not self.stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if self._received(raw, min(left, self.SLICE)):
                    return
        except Exception:
            logger.warning("LISTEN connection failed; polling until it is back", exc_info=True)
            self.close()
            self.stop.wait(max(0.0, deadline - time.monotonic()))

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
class Notifier:
    """Sends the NOTIFY that wakes the relays of one database, from a daemon thread of
    this process with a connection of its own, after the commits that ask for it.

    Why not ``NOTIFY`` inside the business transaction, as PostgreSQL intends: a
    transaction that issued NOTIFY takes a lock that every other notifying transaction
    waits for at commit, and holds it until its commit record is flushed to disk, so with
    a NOTIFY in every business transaction, concurrent writers commit one at a time
    (docs/benchmarks.md, "What an event costs"). Here the business transaction only
    writes its rows; its commit then calls :meth:`request`, which costs the request a
    ``threading.Event.set()``. The thread sends one NOTIFY for all the requests made
    before it cleared the flag, and at most one every ``SPACING`` seconds, so commits close
    together share one and a busy process does not keep the relays passing for each
    event; each NOTIFY is a transaction of its own that commits asynchronously (there is
    no data in it to make durable), holding the lock for microseconds.

    Never lost for good: a commit is always followed by a NOTIFY sent after it, unless
    the process dies first or the NOTIFY fails (logged); then the relays find the events
    at their next poll (``OUTBOX_POLL_INTERVAL``).
    """

    SQL = "SELECT set_config('synchronous_commit', 'off', false), pg_notify(%s, '')"
    #: The least time between two NOTIFYs of one process to one database: what a wake-up
    #: may lag its commit by at most, besides the NOTIFY's own round trip.
    SPACING = 0.02
    #: Seconds without a request after which the connection is closed: a process that
    #: emits now and then holds no connection meanwhile, and a test database can be
    #: dropped soon after the last commit (see :func:`close_notifiers`).
    LINGER = 1.0

    def __init__(self, using: str) -> None:
        self.using = using
        self.pending = threading.Event()
        self._wrapper: Any = None
        self._lock = threading.Lock()  # the connection, between this thread and close()
        self._thread = threading.Thread(
            target=self._run, name=f"django_outbox notify {using}", daemon=True
        )
        self._thread.start()

    def request(self) -> None:
        """Ask for a NOTIFY after now (called after a commit that wrote events)."""
        self.pending.set()

    def _run(self) -> None:
        while True:
            if not self.pending.wait(self.LINGER if self._wrapper is not None else None):
                with self._lock:
                    self._close()
                continue
            try:
                with self._lock:
                    # Cleared before sending: a request made from now on gets a NOTIFY of
                    # its own. Under the lock, so close() finds no request half-served.
                    self.pending.clear()
                    self._notify()
            except Exception:
                logger.warning(
                    "The NOTIFY that wakes the relays failed on database %r; they will "
                    "find the committed events at their next poll (OUTBOX_POLL_INTERVAL).",
                    self.using,
                    exc_info=True,
                )
                with self._lock:
                    self._close()
            time.sleep(self.SPACING)

    def _notify(self) -> None:
        if self._wrapper is None:
            wrapper = connections.create_connection(self.using)
            # close_notifiers() closes it from another thread.
            wrapper.inc_thread_sharing()
            wrapper.ensure_connection()
            wrapper.set_autocommit(True)
            self._wrapper = wrapper
        # The driver's cursor, not Django's: none of its wrapping (query logging, error
        # translation) is of use here, and this runs for most commits of a busy process.
        cursor = self._wrapper.connection.cursor()
        try:
            cursor.execute(self.SQL, [outbox_settings.NOTIFY_CHANNEL])
        finally:
            cursor.close()

    def _close(self) -> None:
        if self._wrapper is not None:
            with suppress(Exception):
                self._wrapper.close()
            self._wrapper = None

    def close(self, timeout: float = 5.0) -> None:
        """Close the connection once the requests made so far are served (the thread opens
        another at the next request)."""
        deadline = time.monotonic() + timeout
        while self.pending.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        with self._lock:
            self._close()


_notifiers: dict[str, Notifier] = {}
_notifiers_lock = threading.Lock()
#: The notifiers of a parent process, kept after a fork so that the child never closes
#: (garbage-collects) the parent's connection: it shares the socket.
_inherited: list[Notifier] = []


def _forget_notifiers_after_fork() -> None:
    """In a forked child (a pre-forking web server's worker): the parent's threads did not
    follow, so the child starts its own notifiers."""
    global _notifiers_lock
    _inherited.extend(_notifiers.values())
    _notifiers.clear()
    _notifiers_lock = threading.Lock()  # it may have been held by a thread of the parent


os.register_at_fork(after_in_child=_forget_notifiers_after_fork)


def request_wake(using: str) -> None:
    """Wake the relays of database ``using`` soon after now: ``emit()``'s ``on_commit``."""
    notifier = _notifiers.get(using)
    if notifier is None:
        with _notifiers_lock:
            notifier = _notifiers.get(using)
            if notifier is None:
                notifier = _notifiers[using] = Notifier(using)
    notifier.request()


def close_notifiers() -> None:
    """Close the connections the wake-ups of this process hold, at once.

    Each closes by itself a second (``Notifier.LINGER``) after its last request; call this
    before dropping a database that a commit woke the relays of less than a second ago,
    as a test run does at its end (``django_outbox.testing.close_wake_connections``).
    """
    for notifier in list(_notifiers.values()):
        notifier.close()


def make_waker(using: str, stop: threading.Event) -> Waker:
    if connections[using].vendor == "postgresql" and outbox_settings.NOTIFY:
        channel = outbox_settings.NOTIFY_CHANNEL
        if channel.replace("_", "").isalnum():
            return PostgresNotifyWaker(stop, using, channel)
        logger.warning("OUTBOX_NOTIFY_CHANNEL %r is not a plain identifier; polling", channel)
    return Waker(stop)
