"""The contract between the relay and a broker.

The relay hands a backend batches of claimed rows with :meth:`BaseBackend.send` and
collects, with :meth:`BaseBackend.wait`, one :class:`PublishResult` per row in the same
order. ``ok`` means *the broker confirmed it*: a backend must never report success for a
message it has not seen acknowledged. Everything else is a failure with a :class:`Reason`,
which the relay turns into a retry or, for connection-level reasons, into a pause of the
whole relay that does not count against the row.

A backend that can only publish a batch and wait for it in one call derives from
:class:`SyncBackend` and implements :meth:`SyncBackend.publish`; the adapter gives the relay
``send``/``wait``/``abandon`` on top of it.
"""

from __future__ import annotations

import abc
import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.checks import CheckMessage
from django.utils.module_loading import import_string

from ..conf import outbox_settings
from ..exceptions import OutboxError
from ..formats import MessageFormat, get_format

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

    @property
    def fix(self) -> str:
        """What to do about a failure of this kind, for the commands' output ("" when it
        depends on the error)."""
        return _FIXES.get(self, "")


_FIXES = {
    Reason.UNROUTABLE: (
        "start the consumer (consume_outbox declares and binds its queue) or bind a queue "
        "for the routing key, then requeue: `manage.py outbox_requeue --status pending` "
        "(the relay also retries on its backoff; once DEAD, `manage.py outbox_requeue`)"
    ),
    Reason.NACKED: (
        "a queue refused the message (full, with x-overflow reject-publish): drain it or "
        "raise its limit; the relay retries on its backoff"
    ),
    Reason.TIMEOUT: (
        "the broker did not confirm within OUTBOX_CONFIRM_TIMEOUT: check it for memory or "
        "disk alarms and load; the relay retries on its backoff"
    ),
}


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


@dataclass(frozen=True)
class Route:
    """Where a message published with ``routing_key`` goes: what receives it, in words
    (``"queue 'points'"``); none, and the broker returns it (unroutable)."""

    routing_key: str
    destinations: tuple[str, ...]


@dataclass(frozen=True)
class RouteCheck:
    """What :meth:`BaseBackend.check_routes` found: where events are published, in words,
    and each routing key's :class:`Route`; ``routes`` is None when the backend cannot tell,
    and ``unknown`` says why."""

    target: str
    routes: list[Route] | None
    unknown: str = ""


class BrokerUnavailable(OutboxError):
    """The broker cannot be reached at all; nothing of the batch is in flight.

    ``permanent``: trying again as configured fails the same way (a host name that does
    not resolve, a refused port, a missing vhost, refused credentials): a one-pass run
    gives up at once; a long-running relay keeps retrying and logging the cause.
    """

    def __init__(self, message: str = "", *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of a broker library's error, for logs and ``last_error``; the type
    is not repeated when the message already starts with it (py-amqp's do)."""
    name = type(exc).__name__
    text = str(exc) or name
    return text if text.startswith(name) else f"{name}: {text}"


_Backend = TypeVar("_Backend", bound="BaseBackend")


class BaseBackend(abc.ABC):
    """The one contract of broker backends: :meth:`send`, :meth:`wait`, :meth:`abandon`
    and :attr:`confirm_timeout`.

    The relay may send the next batch before it waits for the previous one, and between
    the calls it settles earlier batches and claims the next, so its database work and the
    broker's overlap. :meth:`open` and :meth:`close` manage the connection and must be safe
    to call more than once; a backend that knows several broker nodes (a cluster) moves on
    to the next when the relay calls :meth:`next_node`. A backend is used by one thread.

    A backend that publishes a batch and waits for it in one call derives from
    :class:`SyncBackend` instead and implements :meth:`SyncBackend.publish` only.
    """

    #: The longest :meth:`wait` may take for one batch, in seconds from its :meth:`send`.
    #: A batch claimed ahead is sent only while its lease still covers this (plus a
    #: margin), so no other relay takes its rows over while its confirms are on the way.
    #: 0.0 for a backend whose results are ready as soon as they are asked for.
    confirm_timeout: float = 0.0

    def __new__(cls: type[_Backend], *args: Any, **kwargs: Any) -> _Backend:
        # Before object.__new__ refuses an abstract class with Python's generic message:
        # say which methods are missing and which base class provides them.
        problem = contract_problem(cls)
        if problem:
            raise TypeError(problem)
        return super().__new__(cls)

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
        #: OUTBOX_MESSAGE_FORMAT, chosen once: a backend builds each message with its
        #: ``content_type``, ``encode_body`` and ``encode_headers``.
        self.message_format: MessageFormat = get_format()

    # -- connection ------------------------------------------------------------------------
    # Optional, unlike the methods below: a backend with no connection has nothing to do.
    def open(self) -> None:  # noqa: B027
        """Connect; raise BrokerUnavailable if the broker cannot be reached."""

    def close(self) -> None:  # noqa: B027
        """Disconnect, waiting for nothing; safe to call when not open."""

    def next_node(self) -> bool:
        """The relay lost the broker (a connection lost under a batch, or none could be
        opened): move on to the next broker node, if the backend knows several.

        True: connect to that node at once, it has not failed since the relay last paused.
        False: pause with the relay's backoff first (every node has failed in turn, or there
        is one). Called after the relay has settled what the lost connection confirmed and
        before it closes the backend. The default, False, suits a backend with one broker or
        whose client library fails over by itself (Celery's kombu).
        """
        return False

    def __enter__(self: _Backend) -> _Backend:
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
    @abc.abstractmethod
    def send(self, events: Sequence[OutboxEvent]) -> None:
        """Start publishing a batch; :meth:`wait` returns its results.

        Raise BrokerUnavailable only when nothing of the batch could be sent (e.g. cannot
        connect); once messages are in flight, report the unconfirmed ones as
        CONNECTION_LOST from :meth:`wait` instead.
        """

    @abc.abstractmethod
    def wait(self) -> list[PublishResult]:
        """The results of the oldest batch given to :meth:`send` and not yet waited for:
        one per event, in its order (``[]`` when none is in flight). Blocks until each is
        confirmed or failed, at most :attr:`confirm_timeout` after that batch's send.
        May raise what :meth:`send` raises."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """Forget the batches sent and not yet waited for: the relay stopped on an error
        with batches in flight. Their rows stay claimed until their lease runs out, and
        confirms still to come for them must not be taken for a later batch's."""

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        """One batch from start to end, :meth:`send` then :meth:`wait`, with no other batch
        in flight: for tests and scripts. The relay never calls it."""
        if not events:
            return []
        self.send(events)
        return self.wait()

    def check_routes(self, routing_keys: Sequence[str]) -> RouteCheck:
        """For ``manage.py outbox_check``: connect, declare (or verify) where events are
        published, and say for each routing key what receives its messages. Raises
        :class:`BrokerUnavailable` when the broker cannot be reached. This default connects
        and cannot tell where messages go; a backend that can overrides it."""
        with self:
            pass
        return RouteCheck(
            f"{type(self).__name__}",
            None,
            f"{type(self).__name__} cannot tell which routing keys reach a consumer",
        )

    def routing_key(self, event: OutboxEvent) -> str:
        if self._routing_key_func is not None:
            return self._routing_key_func(event)
        return self.routing_keys.get(event.event_type, event.event_type)

    # -- system checks ---------------------------------------------------------------------
    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        """Configuration problems of this backend, reported by ``manage.py check``."""
        return []


class SyncBackend(BaseBackend):
    """The adapter for a backend that publishes a batch and waits for its confirms in one
    call: implement :meth:`publish` and the relay gets the contract on top of it.

    :meth:`send` only queues the batch and :meth:`wait` publishes the oldest queued one, so
    nothing reaches the broker before the relay asks for the results: the broker does not
    work while the relay settles and claims, as it does with a pipelined backend. Set
    :attr:`confirm_timeout` to the longest :meth:`publish` waits for a broker (it is 0.0,
    for backends that answer at once such as locmem and console).
    """

    _sent: deque[list[OutboxEvent]] | None = None  # batches given to send(), for wait()

    @abc.abstractmethod
    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        """Publish a batch and wait for its confirms; one result per event, same order.

        Raise BrokerUnavailable only when nothing could be sent (e.g. cannot connect); once
        messages are in flight, report the unconfirmed ones as CONNECTION_LOST instead.
        """

    def send(self, events: Sequence[OutboxEvent]) -> None:
        if self._sent is None:
            self._sent = deque()
        self._sent.append(list(events))

    def wait(self) -> list[PublishResult]:
        if not self._sent:
            return []
        return self.publish(self._sent.popleft())

    def abandon(self) -> None:
        self._sent = None


def contract_problem(cls: type[BaseBackend]) -> str:
    """Why ``cls`` cannot serve the relay, saying what to change; ``""`` when it can."""
    name = cls.__qualname__
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        if missing == ["abandon", "send", "wait"] and _owner(cls, "publish") is not BaseBackend:
            return (
                f"{name} implements publish() only, but the relay calls send(), wait() and "
                "abandon(). Derive it from django_outbox.backends.base.SyncBackend instead of "
                "BaseBackend: SyncBackend implements them on top of publish()."
            )
        return (
            f"{name} does not implement {', '.join(f'{m}()' for m in missing)} of the backend "
            "contract. Derive a backend from django_outbox.backends.base.SyncBackend and "
            "implement publish() (send a batch, return its results), or from BaseBackend and "
            "implement send(), wait() and abandon() (docs/relay.md, 'Writing a backend')."
        )
    if issubclass(cls, SyncBackend):
        return ""
    publisher = _owner(cls, "publish")
    for method in ("send", "wait"):
        owner = _owner(cls, method)
        if publisher is not owner and issubclass(publisher, owner):
            return (
                f"{name} overrides publish(), but the relay never calls it: it sends batches "
                f"with {owner.__qualname__}.send() and collects them with wait(), so the "
                "override would be skipped. Override send(), wait() and abandon() instead (a "
                "wrapper delegates them to the backend it wraps), or derive from "
                "django_outbox.backends.base.SyncBackend if publishing a batch in one call is "
                "all it does."
            )
    return ""


def _owner(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose body defines ``name``."""
    return next(klass for klass in cls.__mro__ if name in vars(klass))


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
        self.confirm_timeout, self.connect_timeout = timeouts(confirm_timeout, connect_timeout)


def timeouts(confirm_timeout: float | None, connect_timeout: float | None) -> tuple[float, float]:
    """A backend's ``confirm_timeout`` and ``connect_timeout`` in seconds, each defaulting
    to its setting (OUTBOX_CONFIRM_TIMEOUT, OUTBOX_CONNECT_TIMEOUT)."""
    return (
        float(outbox_settings.CONFIRM_TIMEOUT if confirm_timeout is None else confirm_timeout),
        float(outbox_settings.CONNECT_TIMEOUT if connect_timeout is None else connect_timeout),
    )
