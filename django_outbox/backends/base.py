"""The contract between the relay and a broker.

The relay hands a backend a batch of claimed rows and gets back, for each row and in the
same order, a :class:`PublishResult`. ``ok`` means *the broker confirmed it*: a backend
must never report success for a message it has not seen acknowledged. Everything else is a
failure with a :class:`Reason`, which the relay turns into a retry or, for connection-level
reasons, into a pause of the whole relay that does not count against the row.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from django.core.checks import CheckMessage
from django.utils.module_loading import import_string

from ..conf import outbox_settings
from ..exceptions import OutboxError

if TYPE_CHECKING:
    from ..models import OutboxEvent


class Reason(str, enum.Enum):
    """Why a publish failed. The values are the ``reason`` label of the failure metric."""

    UNROUTABLE = "unroutable"  # returned by the broker (mandatory, no queue bound)
    NACKED = "nacked"  # the broker refused it (basic.nack)
    TIMEOUT = "timeout"  # no confirm within the confirm timeout
    CONNECTION_LOST = "connection_lost"  # the connection or channel went away in flight
    SERIALISATION = "serialisation"  # the row could not be turned into a message
    ERROR = "error"  # anything else

    @property
    def is_connection_level(self) -> bool:
        """Not the event's fault: the relay backs off instead of burning its retries."""
        return self is Reason.CONNECTION_LOST


@dataclass(frozen=True)
class PublishResult:
    ok: bool
    reason: Reason | None = None
    error: str = ""

    @classmethod
    def sent(cls) -> PublishResult:
        return _SENT

    @classmethod
    def failed(cls, reason: Reason, error: str) -> PublishResult:
        return cls(ok=False, reason=reason, error=error)


_SENT = PublishResult(ok=True)


class BrokerUnavailable(OutboxError):
    """The broker cannot be reached at all; nothing of the batch is in flight."""


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of a broker library's error, for logs and ``last_error``; the type
    is not repeated when the message already starts with it (py-amqp's do)."""
    name = type(exc).__name__
    text = str(exc) or name
    return text if text.startswith(name) else f"{name}: {text}"


class BaseBackend:
    """Base class of broker backends.

    Subclasses implement :meth:`publish` (and may split it into :meth:`send` and
    :meth:`wait`); :meth:`open` and :meth:`close` manage the
    connection and must be safe to call more than once. A backend is used by one thread.
    """

    _sent: deque[list[OutboxEvent]] | None = None  # batches given to send(), for wait()

    def __init__(
        self,
        *,
        exchange: str | None = None,
        routing_keys: dict[str, str] | None = None,
        routing_key_func: str | Callable[[OutboxEvent], str] | None = None,
        **options: Any,
    ) -> None:
        if options:
            raise TypeError(
                f"{type(self).__name__} got unknown options {sorted(options)}; check "
                "OUTBOX_BACKEND_OPTIONS."
            )
        self.exchange = outbox_settings.EXCHANGE if exchange is None else exchange
        self.routing_keys = (
            outbox_settings.ROUTING_KEYS if routing_keys is None else dict(routing_keys)
        )
        func = outbox_settings.ROUTING_KEY_FUNC if routing_key_func is None else routing_key_func
        self._routing_key_func: Callable[[OutboxEvent], str] | None = (
            import_string(func) if isinstance(func, str) and func else func or None
        )

    # -- connection ------------------------------------------------------------------------
    def open(self) -> None:
        """Connect; raise BrokerUnavailable if the broker cannot be reached."""

    def close(self) -> None:
        """Disconnect, waiting for nothing; safe to call when not open."""

    def __enter__(self) -> BaseBackend:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- publishing ------------------------------------------------------------------------
    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        """Publish a batch and wait for its confirms; one result per event, same order.

        Raise BrokerUnavailable only when nothing could be sent (e.g. cannot connect); once
        messages are in flight, report the unconfirmed ones as CONNECTION_LOST instead.
        """
        raise NotImplementedError

    def send(self, events: Sequence[OutboxEvent]) -> None:
        """Start publishing a batch; :meth:`wait` returns its results.

        The relay may send the next batch before it waits for this one, and between the
        calls it settles earlier batches and claims the next, so its database work and the
        broker's overlap. :meth:`wait` returns the results of the batches in the order they
        were sent. The default defers everything to :meth:`publish` in ``wait``; a backend
        with asynchronous confirms overrides both. Either may raise what :meth:`publish`
        raises.
        """
        if self._sent is None:
            self._sent = deque()
        self._sent.append(list(events))

    def wait(self) -> list[PublishResult]:
        """The results of the oldest batch given to :meth:`send` (as :meth:`publish`)."""
        if not self._sent:
            return []
        return self.publish(self._sent.popleft())

    def abandon(self) -> None:
        """Forget the batches sent and not yet waited for: the relay stopped on an error
        with batches in flight. Their rows stay claimed until their lease runs out."""
        self._sent = None

    def routing_key(self, event: OutboxEvent) -> str:
        if self._routing_key_func is not None:
            return self._routing_key_func(event)
        return self.routing_keys.get(event.event_type, event.event_type)

    # -- system checks ---------------------------------------------------------------------
    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        """Configuration problems of this backend, reported by ``manage.py check``."""
        return []


class AmqpBackend(BaseBackend):
    """Base of the backends that publish to RabbitMQ (pika, Celery): their shared options.

    ``exchange_type`` (``OUTBOX_EXCHANGE_TYPE``), ``exchange_passive``
    (``OUTBOX_EXCHANGE_PASSIVE``), ``confirm_timeout`` (``OUTBOX_CONFIRM_TIMEOUT``) and
    ``connect_timeout`` (``OUTBOX_CONNECT_TIMEOUT``), each defaulting to its setting.
    """

    def __init__(
        self,
        *,
        exchange_type: str | None = None,
        exchange_passive: bool | None = None,
        confirm_timeout: float | None = None,
        connect_timeout: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.exchange_type = (
            outbox_settings.EXCHANGE_TYPE if exchange_type is None else exchange_type
        )
        self.exchange_passive = (
            outbox_settings.EXCHANGE_PASSIVE if exchange_passive is None else exchange_passive
        )
        self.confirm_timeout = float(
            outbox_settings.CONFIRM_TIMEOUT if confirm_timeout is None else confirm_timeout
        )
        self.connect_timeout = float(
            outbox_settings.CONNECT_TIMEOUT if connect_timeout is None else connect_timeout
        )
