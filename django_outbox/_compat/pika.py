"""pika internals the RabbitMQ backend relies on (pika>=1.3,<2, pinned in pyproject.toml).

* :class:`HandTurnedLoop`: pika's select ``IOLoop`` turned on the calling thread with the
  methods its docstrings mark "[Extension] ... Internal use only" (``activate_poller()``,
  ``poll()``, ``process_timeouts()``) instead of ``start()``/``stop()``, which build and
  register a new epoll object on every call and write to a wake-up socket to stop: a handful
  of system calls per turn, and the backend turns the loop several times per batch.
* :class:`CoalescingConnection`: a ``SelectConnection`` that overrides the private
  ``_adapter_emit_data()``, through which pika hands every frame to the socket on its own
  (three per message), to write a batch's frames in one piece.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pika.adapters.select_connection import IOLoop, SelectConnection

#: The pika releases these internals are known to behave as assumed (tests/test_compat.py).
PINNED = "pika>=1.3,<2"


class HandTurnedLoop:
    """One pika ``IOLoop`` for the life of a backend, turned by hand: poll, then the due
    timers and callbacks. Connections are created with ``custom_ioloop=loop.ioloop``."""

    def __init__(self) -> None:
        self.ioloop = IOLoop()
        # Once, for as long as the loop lives: start() would do it on every turn. A socket
        # registered later (the connection's) is added to the active poller.
        self.ioloop.activate_poller()

    def run_until(self, done: Callable[[], bool], timeout: float) -> bool:
        """Turn the loop until ``done()`` or ``timeout`` seconds; return ``done()``."""
        ioloop = self.ioloop
        deadline = time.monotonic() + timeout
        # Bounds each poll's wait: without a timer due sooner, pika polls for up to 5 s.
        timer = ioloop.call_later(max(timeout, 0.0), _nothing)
        try:
            while not done():
                if time.monotonic() >= deadline:
                    return False
                ioloop.poll()
                ioloop.process_timeouts()
        finally:
            ioloop.remove_timeout(timer)
        return True

    def poll(self) -> None:
        """Handle whatever has arrived, without waiting."""
        ioloop = self.ioloop
        timer = ioloop.call_later(0, _nothing)  # a poll that does not wait
        try:
            ioloop.poll()
            ioloop.process_timeouts()
        finally:
            ioloop.remove_timeout(timer)

    def close(self) -> None:
        self.ioloop.close()


class CoalescingConnection(SelectConnection):
    """A SelectConnection that, between :meth:`coalesce` and :meth:`flush`, gathers the
    frames it would write and hands them to the socket as one write.

    pika writes each frame on its own (three per message: method, header, body), one
    ``send()`` system call each; a batch written in one piece costs the relay, and the
    broker reading it, a fraction of that. Frames keep their order; anything pika writes
    meanwhile (a heartbeat, a channel method) joins the same buffer in turn.
    """

    _gathered: list[bytes] | None = None

    def coalesce(self) -> None:
        if self._gathered is None:
            self._gathered = []

    def flush(self) -> None:
        gathered, self._gathered = self._gathered, None
        # Closed meanwhile: what was gathered is never confirmed, like any unsent message.
        if gathered and not (self.is_closed or self.is_closing):
            super()._adapter_emit_data(b"".join(gathered))

    def _adapter_emit_data(self, data: bytes) -> None:
        if self._gathered is not None:
            self._gathered.append(data)
        else:
            super()._adapter_emit_data(data)


def _nothing() -> None:
    """A timer's callback that only bounds how long the I/O loop waits."""
