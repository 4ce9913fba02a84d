"""pika internals the RabbitMQ backend relies on (pika>=1.3,<2, pinned in pyproject.toml).

* :class:`HandTurnedLoop`: pika's select ``IOLoop`` turned on the calling thread with the
  methods its docstrings mark "[Extension] ... Internal use only" (``activate_poller()``,
  ``poll()``, ``process_timeouts()``) instead of ``start()``/``stop()``, which build and
  register a new epoll object on every call and write to a wake-up socket to stop: a handful
  of system calls per turn, and the backend turns the loop several times per batch.
* :class:`CoalescingConnection`: a ``SelectConnection`` that overrides the private
  ``_adapter_emit_data()``, through which pika hands every frame to the socket on its own
  (three per message), to write a batch's frames in one piece.
* :func:`connection_failure`: why a connection could not be opened, in words, read from
  the errors pika wraps its connection workflow's failure in (``AMQPConnectionWorkflowFailed``
  and the connector errors of ``pika.adapters.utils.connection_workflow``, which are not
  part of ``pika.exceptions``, and ``BlockingConnection`` re-raising the last of them).
"""

from __future__ import annotations

import errno
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop, SelectConnection
from pika.adapters.utils.connection_workflow import AMQPConnectorStackTimeout

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


@dataclass(frozen=True)
class ConnectionFailure:
    """Why a connection to RabbitMQ could not be opened.

    ``cause`` says it in words (``vhost 'shop' not found``), with no password; ``hint`` says
    what to change. ``permanent``: trying again as it is will fail the same way (a name that
    does not resolve, a port nobody listens on, a missing vhost, refused credentials), so a
    one-pass run (``--once``, a CronJob) gives up instead of waiting for it; a long-running
    worker keeps retrying, since someone may fix the broker side meanwhile.
    """

    cause: str
    permanent: bool
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.cause}; {self.hint}" if self.hint else self.cause


def connection_failure(
    error: BaseException, target: str | pika.connection.Parameters
) -> ConnectionFailure:
    """What ``error``, raised (``BlockingConnection``) or reported (``SelectConnection``'s
    ``on_open_error_callback``) while connecting to ``target``, means: a broker URL, or
    the connection parameters pika was given.

    pika wraps the cause in one to three layers that depend on the adapter and the stage:
    ``gaierror`` bare, ``AMQPConnectionWorkflowFailed`` (no message of its own) holding a
    connector error holding ``ConnectionRefusedError``, ``ProbableAccessDeniedError`` holding
    the broker's ``530 NOT_ALLOWED`` text. The host, port, vhost and user named are the
    ones pika tried (a URL is parsed as pika parses it).
    """
    where = _Target.of(target)
    for cause in _causes(error):
        text = str(cause)
        if isinstance(cause, socket.gaierror):
            reason = cause.strerror or text
            return ConnectionFailure(
                f"name lookup failed for host {where.host!r} ({reason})",
                True,
                "check the host name in the broker URL",
            )
        if isinstance(cause, ConnectionRefusedError):
            return ConnectionFailure(
                f"connection refused by {where.address}",
                True,
                "check that RabbitMQ runs there and listens on that port",
            )
        if isinstance(cause, ssl.SSLCertVerificationError):
            return ConnectionFailure(
                f"the TLS certificate of {where.address} was not accepted "
                f"({cause.verify_message or text})",
                True,
                "check the host name and the CA certificates",
            )
        code, reply = _broker_reply(cause)
        if isinstance(cause, pika.exceptions.ProbableAccessDeniedError) or code == 530:
            if "not found" in reply:
                return ConnectionFailure(
                    f"vhost {where.vhost!r} not found",
                    True,
                    f"create it (rabbitmqctl add_vhost {where.vhost}) or fix the vhost in "
                    "the broker URL, where '/' is written %2F",
                )
            return ConnectionFailure(
                f"access to vhost {where.vhost!r} refused for user {where.user!r}",
                True,
                f"grant the user permissions on the vhost (rabbitmqctl set_permissions -p "
                f"{where.vhost} {where.user} ...) or fix the broker URL",
            )
        if isinstance(cause, pika.exceptions.ProbableAuthenticationError) or code == 403:
            return ConnectionFailure(
                f"access refused for user {where.user!r}",
                True,
                "check the user name and password in the broker URL, reserved characters "
                "in them percent-encoded",
            )
        if isinstance(cause, TimeoutError | AMQPConnectorStackTimeout):
            return ConnectionFailure(f"no answer from {where.address} in time", False)
        if isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return ConnectionFailure(
                f"no route to {where.address} ({cause.strerror or text})", False
            )
        if isinstance(cause, pika.exceptions.IncompatibleProtocolError):
            return ConnectionFailure(
                f"{where.address} closed the connection before the AMQP handshake ended",
                False,
                "check that this is RabbitMQ's AMQP port (5672, or 5671 for amqps)",
            )
    return ConnectionFailure(_innermost_text(error), False)


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    vhost: str
    user: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def of(cls, target: str | pika.connection.Parameters) -> _Target:
        if isinstance(target, str):
            try:
                target = pika.URLParameters(target)
            except Exception:  # a URL pika cannot parse is reported by whoever tried it
                return cls("?", 0, "?", "?")
        user = getattr(target.credentials, "username", "") or ""
        return cls(target.host, target.port, target.virtual_host, user)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and everything pika wrapped in it, outermost first."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        inner: list[object] = [*getattr(current, "args", ())]
        inner += reversed(getattr(current, "exceptions", ()) or ())  # the last one first
        inner += [getattr(current, "exception", None), current.__cause__]
        todo += [e for e in inner if isinstance(e, BaseException)]


def _broker_reply(error: BaseException) -> tuple[int | None, str]:
    """The broker's close code and text, from ``ConnectionClosed`` or from the message of
    the ``Probable...Error`` that quotes it."""
    if isinstance(error, pika.exceptions.ConnectionClosed):
        return error.reply_code, error.reply_text
    return None, str(error)


def _innermost_text(error: BaseException) -> str:
    """``Type: message`` of the innermost error that has a message (pika's wrappers often
    have none: ``AMQPConnectionWorkflowFailed``)."""
    described = type(error).__name__
    for cause in _causes(error):
        if str(cause):
            described = f"{type(cause).__name__}: {cause}"
    return described
