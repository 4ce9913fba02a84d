"""What every long-running command shares: the pause after a failure, and signals."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class Backoff:
    """Exponential pause for relay-wide outages: 0.5 s, 1 s, 2 s, ... up to ``maximum``."""

    def __init__(self, *, initial: float = 0.5, maximum: float = 30.0) -> None:
        self.initial, self.maximum = initial, maximum
        self.current = 0.0

    def next(self) -> float:
        self.current = min(self.maximum, self.current * 2 if self.current else self.initial)
        return self.current

    def reset(self) -> None:
        self.current = 0.0


@contextmanager
def relay_signals(stop: threading.Event, log: Callable[[str], None]) -> Iterator[None]:
    """First SIGTERM/SIGINT: finish the batch in flight, then exit 0. Second: exit 1 now."""
    import signal

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
