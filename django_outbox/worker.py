"""What every long-running command shares: the run loop, its backoff, signals, heartbeat.

``publish_outbox`` (the relay) and ``consume_outbox`` (the consumer) are both a loop that
must never die on a transient failure (a broker restart, a database failover) and must stop
cleanly when Kubernetes sends SIGTERM. The loop is :func:`keep_running`: it calls one step
after another, and after a failure waits a growing pause (:class:`Backoff`) before the next.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: ``manage.py <command> -v N`` -> the level of the ``django_outbox`` loggers.
VERBOSITY_LEVELS = {0: logging.ERROR, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def configure_logging(verbosity: int) -> None:
    """Set the ``django_outbox`` loggers' level from a command's ``--verbosity``."""
    logging.getLogger("django_outbox").setLevel(VERBOSITY_LEVELS.get(verbosity, logging.INFO))


class Backoff:
    """Exponential pause after a failure: 0.5 s, 1 s, 2 s, ... up to ``maximum``."""

    def __init__(self, *, initial: float = 0.5, maximum: float = 30.0) -> None:
        self.initial, self.maximum = initial, maximum
        self.current = 0.0

    def next(self) -> float:
        self.current = min(self.maximum, self.current * 2 if self.current else self.initial)
        return self.current

    def reset(self) -> None:
        self.current = 0.0


def keep_running(
    stop: threading.Event,
    step: Callable[[], bool],
    *,
    backoff: Backoff,
    on_error: Callable[[Exception, float], None],
    recoverable: type[Exception] | tuple[type[Exception], ...] = Exception,
) -> None:
    """Call ``step()`` until it returns True (the run is over) or ``stop`` is set.

    A step that raises a ``recoverable`` error is reported with ``on_error(exc, pause)``
    (log it, close what it broke), then tried again after ``pause`` seconds, the backoff's
    next; ``stop`` cuts the pause short. A step that returns resets the backoff. Any other
    error propagates.
    """
    while not stop.is_set():
        try:
            if step():
                return
        except recoverable as exc:
            if stop.is_set():
                return
            pause = backoff.next()
            on_error(exc, pause)
            stop.wait(pause)
            continue
        backoff.reset()


class Heartbeat:
    """Touches a file on every loop, for a liveness probe (``OUTBOX_HEARTBEAT_FILE``)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None

    def beat(self) -> None:
        if self.path is None:
            return
        try:
            self.path.touch()
        except FileNotFoundError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()


@contextmanager
def stop_on_signals(stop: threading.Event, log: Callable[[str], None]) -> Iterator[None]:
    """First SIGTERM/SIGINT: set ``stop`` (the loop finishes what it holds, then exits 0).
    Second: exit 1 at once."""

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log(f"{name} again: exiting at once")
            raise SystemExit(1)
        log(f"{name} received: finishing the batch in flight, then exiting")
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
