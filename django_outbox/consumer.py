"""The consumer side: idempotent handlers and the loop that feeds them.

A handler subclasses :class:`IdempotentHandler`, lists its ``event_types`` and implements
``handle(event)``. :class:`Dispatcher` runs each handler in its own ``transaction.atomic()``
and de-duplicates by a unique ``source_event_id`` committed in that same transaction, in
one of two styles:

- **business row** (``dedup_model = MyLedger``): the handler's own row carries a unique
  ``source_event_id`` (subclass :class:`SourceEventModel`). A duplicate delivery violates
  it, the transaction rolls back and the outcome is DUPLICATE. To tell this violation from
  any other ``IntegrityError`` on every database, the dispatcher looks, after the rollback,
  for a committed row with this ``source_event_id``: if there is one, the event was already
  processed (whichever constraint fired); if not, the error is a real failure.
- **inbox** (the default): a :class:`~django_outbox.models.InboxMessage` row
  (handler, source_event_id) is inserted first, before ``handle()``; a duplicate fails on
  that insert, before the handler ran, so any later ``IntegrityError`` is the handler's own.

Both are insert-first: there is no check-then-insert race, and a concurrent delivery of the
same event waits on the row lock of the first and then fails as a duplicate.

:class:`Consumer` (RabbitMQ, pika) acknowledges a message only after every handler for it
committed or reported a duplicate; ``manage.py consume_outbox`` is a thin command over it.
:func:`process_messages` feeds locmem messages through the handlers in-process (tests).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from django.apps import apps
from django.db import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    models,
    router,
    transaction,
)
from django.utils.module_loading import import_string
from django.utils.translation import gettext_lazy as _

from . import tracing
from .conf import BROKER_URL_EMPTY, BROKER_URL_EMPTY_HINT, outbox_settings
from .db import database_answers, tidy_connections
from .exceptions import OutboxError, error_text
from .message import FORMATS, ReceivedEvent, UndecodableMessage, decode
from .worker import Backoff, BrokerNodes, keep_running

if TYPE_CHECKING:
    from .backends.locmem import Message

logger = logging.getLogger("django_outbox.consumer")

# Header a classic queue's consumer keeps its own delivery count in (quorum queues count
# redeliveries themselves in x-delivery-count).
DELIVERY_HEADER = "x-outbox-delivery"
# Header of a message the consumer dead-lettered: why (the outcome and the error).
REASON_HEADER = "x-outbox-reason"
# A message whose handler loses its database connection while the database itself answers
# (a killed session, a failover) is tried again at once, uncounted, this many times; after
# that the loss counts as a failure: a handler that breaks its own connection every time
# must not hold the queue for good.
LOST_CONNECTION_RETRIES = 3


class ImproperlyConfiguredHandler(OutboxError):
    """A handler path cannot be imported or is not an IdempotentHandler subclass."""


class Outcome(str, enum.Enum):
    """What became of one event in one handler (or of a message with no handler)."""

    PROCESSED = "processed"  # handle() committed
    DUPLICATE = "duplicate"  # already processed: rolled back, acknowledged
    FAILED = "failed"  # handle() raised: rolled back, to be retried
    UNKNOWN_TYPE = "unknown_type"  # no handler for the event type: acknowledged, logged
    UNDECODABLE = "undecodable"  # not an outbox event: dead-lettered at once
    EARLY = "early"  # ordered: its predecessor is not processed yet: parked (retried later)
    OUT_OF_ORDER = "out_of_order"  # ordered: cannot be applied in order: dead-lettered

    @property
    def acknowledge(self) -> bool:
        return self in {Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.UNKNOWN_TYPE}


@dataclass(frozen=True)
class HandlerResult:
    outcome: Outcome
    handler: str = ""
    event_id: str = ""
    event_type: str = ""
    error: str = ""
    #: FAILED because the connection to this database was lost (or could not be opened):
    #: nothing in the message is to blame. The alias; "" for any other outcome or failure.
    lost_database: str = ""
    #: The format the message came in (``ReceivedEvent.format``); "" if undecodable.
    message_format: str = ""


class DatabaseUnavailable(OutboxError):
    """A handler's database connection was lost: the delivery was not settled."""

    def __init__(self, using: str, error: str) -> None:
        super().__init__(f"database {using!r}: {error}")
        self.using, self.error = using, error


def message_outcome(results: Sequence[HandlerResult]) -> Outcome:
    """The outcome of a message: FAILED (or UNDECODABLE) if any handler's was, else the rest."""
    outcomes = {r.outcome for r in results}
    for worst in (
        Outcome.UNDECODABLE,
        Outcome.OUT_OF_ORDER,
        Outcome.FAILED,
        Outcome.EARLY,
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
    ):
        if worst in outcomes:
            return worst
    return Outcome.UNKNOWN_TYPE


class SourceEventModel(models.Model):
    """Abstract base of a business row that records the event which caused it.

    ``source_event_id`` is unique: a second delivery of the event cannot write a second row.
    Set ``dedup_model`` on the handler to this model.
    """

    source_event_id = models.CharField(
        _("source event id"),
        max_length=64,
        unique=True,
        editable=False,
        help_text=_("event_id of the outbox event this row was written for."),
    )

    class Meta:
        abstract = True


class IdempotentHandler:
    """Base class of a consumer handler; one subclass per event type (or a few).

    ``handle(event)`` runs inside ``transaction.atomic()`` on the database of
    ``dedup_model`` (or of the inbox). Raise to roll back and have the message retried.
    """

    #: Event types (the AMQP ``type``) this handler handles.
    event_types: ClassVar[Sequence[str]] = ()
    #: Routing keys to bind; default: the event types mapped through OUTBOX_ROUTING_KEYS.
    routing_keys: ClassVar[Sequence[str] | None] = None
    #: Business-row style: the model whose unique ``dedup_field`` records the event.
    #: ``None``: inbox style (django_outbox.InboxMessage).
    dedup_model: ClassVar[type[models.Model] | None] = None
    dedup_field: ClassVar[str] = "source_event_id"
    #: Stored in the inbox; defaults to the dotted path. Keep it stable once deployed.
    name: ClassVar[str] = ""
    #: Ordered events (sent with a ``previous_sequence`` header, see docs/ordered.md): what
    #: to do with one that arrives before its predecessor was processed here. "park": roll
    #: back and retry it later (outcome EARLY), "reject": dead-letter it (OUT_OF_ORDER);
    #: None: no check. An event older than one already processed is always OUT_OF_ORDER.
    out_of_order: ClassVar[str | None] = None
    #: With the check on, an aggregate this handler has no record of is taken up at its
    #: first event (``previous_sequence`` 0). True also takes it up mid-stream, at whatever
    #: event comes first: set it while switching the check on for a running stream.
    adopt_running_aggregates: ClassVar[bool] = False

    def handle(self, event: ReceivedEvent) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement handle(event)")

    @classmethod
    def handler_name(cls) -> str:
        return cls.name or f"{cls.__module__}.{cls.__qualname__}"

    @classmethod
    def bindings(cls) -> list[str]:
        if cls.routing_keys is not None:
            return list(cls.routing_keys)
        mapping = outbox_settings.ROUTING_KEYS
        return [mapping.get(t, t) for t in cls.event_types]

    @classmethod
    def describe(cls) -> str:
        """One line of ``consume_outbox --list``: event types, bindings, de-duplication."""
        style = (
            f"dedup by {cls.dedup_model._meta.label}.{cls.dedup_field}"
            if cls.dedup_model is not None
            else "dedup by inbox"
        )
        return (
            f"{cls.handler_name()}: {', '.join(cls.event_types)} "
            f"(binds {', '.join(cls.bindings())}; {style})"
        )

    def database(self) -> str:
        model = self.dedup_model
        if model is None:
            from .models import InboxMessage

            model = InboxMessage
        return router.db_for_write(model)

    def process(self, event: ReceivedEvent) -> Outcome:
        """Handle the event once: PROCESSED, or DUPLICATE if it was handled before.

        ``handle()`` and the record of ``source_event_id`` commit in one transaction; if
        ``handle()`` raises, that transaction is rolled back and the exception propagates
        (a Celery task retries on it, :meth:`run` turns it into FAILED). With
        ``out_of_order`` set, an event that cannot be applied in order now rolls back and
        raises ``_OutOfOrder`` (its ``outcome`` is EARLY or OUT_OF_ORDER).
        """
        using = self.database()
        try:
            with transaction.atomic(using=using):
                if self.dedup_model is None:
                    from .models import InboxMessage

                    try:
                        # Its own savepoint: an IntegrityError here can only be the inbox's.
                        with transaction.atomic(using=using):
                            InboxMessage.objects.using(using).create(
                                handler=self.handler_name(),
                                source_event_id=event.event_id,
                                event_type=event.event_type,
                            )
                    except IntegrityError:
                        raise _Duplicate() from None
                if self.out_of_order and event.previous_sequence is not None:
                    self._check_order(event, using)
                self.handle(event)
        except _Duplicate:
            return Outcome.DUPLICATE
        except IntegrityError:
            if self.dedup_model is not None and self._already_recorded(event, using):
                return Outcome.DUPLICATE
            raise
        return Outcome.PROCESSED

    def run(self, event: ReceivedEvent) -> HandlerResult:
        """Handle the event once, idempotently; never raises for a handler failure."""
        result = {
            "handler": self.handler_name(),
            "event_id": event.event_id,
            "event_type": event.event_type,
            "message_format": event.format,
        }
        using = self.database()
        connection = connections[using]
        opened = None  # the driver's connection the handler ran on
        try:
            connection.ensure_connection()
            opened = connection.connection
            outcome = self.process(event)
        except _OutOfOrder as exc:
            logger.warning(
                "handler %s: %s %s %s",
                result["handler"],
                event.event_type,
                event.event_id,
                exc.reason,
            )
            return HandlerResult(exc.outcome, error=exc.reason, **result)
        except Exception as exc:
            if connection_lost(exc, connection, opened):
                logger.warning(
                    "handler %s: the connection to database %r was lost on %s %s; rolled back: %s",
                    result["handler"],
                    using,
                    event.event_type,
                    event.event_id,
                    error_text(exc),
                )
                return HandlerResult(
                    Outcome.FAILED, error=error_text(exc), lost_database=using, **result
                )
            return self._failed(event, exc, result)
        return HandlerResult(outcome, **result)

    def _check_order(self, event: ReceivedEvent, using: str) -> None:
        """Compare the event with the last one of its aggregate processed by this handler.

        The aggregate's row is locked for the rest of the transaction, so two consumers
        given successive events of one aggregate take them one after the other.
        """
        from .models import AggregateSequence

        if event.sequence is None:
            return
        sequence, previous = event.sequence, event.previous_sequence or 0
        key = {
            "handler": self.handler_name(),
            "aggregate_type": event.aggregate_type,
            "aggregate_id": event.aggregate_id,
        }
        manager = AggregateSequence.objects.using(using)
        state = manager.select_for_update().filter(**key).first()
        if state is None:
            if previous and not self.adopt_running_aggregates:
                self._early(f"waits for sequence {previous}; none of its aggregate processed")
            try:
                with transaction.atomic(using=using):
                    manager.create(last_sequence=sequence, **key)
                return
            except IntegrityError:
                # Another consumer recorded this aggregate meanwhile: decide against that.
                state = manager.select_for_update().filter(**key).first()
                if state is None:
                    raise
        last = state.last_sequence
        if sequence <= last:
            if self.dedup_model is not None and self._already_recorded(event, using):
                raise _Duplicate()
            raise _OutOfOrder(
                Outcome.OUT_OF_ORDER,
                f"arrived after sequence {last} of its aggregate was processed; "
                "it cannot be applied in order",
            )
        if previous > last:
            self._early(f"waits for sequence {previous}; the last processed is {last}")
        state.last_sequence = sequence
        state.save(update_fields=["last_sequence", "updated_at"])

    def _early(self, reason: str) -> None:
        outcome = Outcome.EARLY if self.out_of_order == "park" else Outcome.OUT_OF_ORDER
        raise _OutOfOrder(outcome, f"came before its predecessor: {reason}")

    def _already_recorded(self, event: ReceivedEvent, using: str) -> bool:
        # After the rollback: a committed row for this event means the violation was ours
        # (or, if another constraint fired, that the event was processed anyway).
        assert self.dedup_model is not None
        manager = self.dedup_model._default_manager.using(using)
        return bool(manager.filter(**{self.dedup_field: event.event_id}).exists())

    def _failed(
        self, event: ReceivedEvent, exc: Exception, result: dict[str, str]
    ) -> HandlerResult:
        logger.exception(
            "handler %s failed on %s %s (attempt %s); rolled back",
            result["handler"],
            event.event_type,
            event.event_id,
            event.attempt,
        )
        tracing.current_exception(exc)
        error = error_text(exc)
        return HandlerResult(Outcome.FAILED, error=error, **result)


def connection_lost(exc: BaseException, connection: Any, opened: Any) -> bool:
    """Whether ``exc`` means the handler's database connection is gone, not a handler bug.

    A database error of the kind drivers raise for a dropped or refused connection
    (``OperationalError``, ``InterfaceError``; anywhere in the exception's chain, as a
    handler may wrap it) *and* the driver's connection ``opened`` before the handler ran is
    gone: it could not be opened (None), ``atomic()`` dropped it because even the rollback
    failed (Django may already have opened a new one by then), or it no longer answers.
    A deadlock or a lock timeout is an ``OperationalError`` on a connection that still
    works: a failure of the handler.
    """
    seen: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    if not any(isinstance(e, (OperationalError, InterfaceError)) for e in seen):
        return False
    if opened is None or connection.connection is not opened:
        return True
    try:
        return not connection.is_usable()
    except Exception:  # a driver that cannot even tell
        return True


class _Duplicate(Exception):
    """Raised inside the atomic block so that it rolls back."""


class _OutOfOrder(Exception):
    """Raised inside the atomic block: the event cannot be applied in order now."""

    def __init__(self, outcome: Outcome, reason: str) -> None:
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason


def load_handler(path: str | type[IdempotentHandler]) -> type[IdempotentHandler]:
    try:
        cls = import_string(path) if isinstance(path, str) else path
    except ImportError as exc:
        raise ImproperlyConfiguredHandler(
            f"Handler {path!r} cannot be imported ({exc}); check OUTBOX_CONSUMER_HANDLERS "
            "or --handler (a dotted path to an IdempotentHandler subclass)."
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, IdempotentHandler)):
        raise ImproperlyConfiguredHandler(
            f"Handler {path!r} is not a subclass of django_outbox.consumer.IdempotentHandler."
        )
    if not cls.event_types:
        raise ImproperlyConfiguredHandler(f"Handler {path!r} has no event_types.")
    if cls.out_of_order not in (None, "park", "reject"):
        raise ImproperlyConfiguredHandler(
            f"Handler {path!r} has out_of_order = {cls.out_of_order!r}; use 'park', 'reject' "
            "or None."
        )
    return cls


def discover_handlers() -> list[type[IdempotentHandler]]:
    """IdempotentHandler subclasses defined in the ``handlers`` module of installed apps."""
    import importlib
    import importlib.util

    found = []
    for config in apps.get_app_configs():
        module_name = f"{config.name}.handlers"
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except ModuleNotFoundError:
            continue
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, IdempotentHandler)
                and value.__module__ == module_name
                and value.event_types
            ):
                found.append(value)
    return found


def get_handlers(
    paths: Iterable[str | type[IdempotentHandler]] | None = None,
) -> list[type[IdempotentHandler]]:
    """The given handlers, else OUTBOX_CONSUMER_HANDLERS, else the discovered ones."""
    chosen = list(paths or []) or list(outbox_settings.CONSUMER_HANDLERS)
    if chosen:
        return [load_handler(p) for p in chosen]
    return discover_handlers()


class Dispatcher:
    """Routes a received event to its handlers and runs each one idempotently."""

    def __init__(self, *, handlers: Iterable[str | type[IdempotentHandler]] | None = None) -> None:
        self.handler_classes = get_handlers(handlers)
        self.handlers = [cls() for cls in self.handler_classes]
        self._warned_types: set[str] = set()
        self._seen_formats: set[str] = set()

    def handlers_for(self, event_type: str) -> list[IdempotentHandler]:
        return [h for h in self.handlers if event_type in h.event_types]

    def routing_keys(self) -> list[str]:
        keys: list[str] = []
        for cls in self.handler_classes:
            keys.extend(k for k in cls.bindings() if k not in keys)
        return keys

    def process(self, event: ReceivedEvent) -> list[HandlerResult]:
        if event.format not in self._seen_formats:
            # Once per format: a producer switching formats shows in the log, with the
            # first event that came in the new one.
            self._seen_formats.add(event.format)
            logger.info(
                "reading %s messages (the first: %s %s)",
                event.format,
                event.event_type,
                event.event_id,
            )
        handlers = self.handlers_for(event.event_type)
        if not handlers:
            if event.event_type not in self._warned_types:
                self._warned_types.add(event.event_type)
                logger.warning(
                    "no handler for event type %s (event %s); acknowledged and ignored",
                    event.event_type,
                    event.event_id,
                )
            return [
                HandlerResult(
                    Outcome.UNKNOWN_TYPE,
                    event_id=event.event_id,
                    event_type=event.event_type,
                    message_format=event.format,
                )
            ]
        results = []
        for handler in handlers:
            with tracing.processing(event, handler.handler_name()) as span:
                result = handler.run(event)
                span.outcome(result.outcome.value, result.error)
            log = logger.info if result.outcome is Outcome.DUPLICATE else logger.debug
            log(
                "%s %s %s (%s): %s",
                result.handler,
                event.event_type,
                event.event_id,
                event.format,
                result.outcome.value,
            )
            results.append(result)
        return results

    def process_message(
        self,
        body: bytes,
        *,
        message_id: str | None,
        message_type: str | None,
        headers: Mapping[str, Any] | None,
        redelivered: bool = False,
        content_type: str | None = None,
    ) -> list[HandlerResult]:
        try:
            event = decode(
                body,
                message_id=message_id,
                message_type=message_type,
                headers=headers,
                redelivered=redelivered,
                content_type=content_type,
            )
        except UndecodableMessage as exc:
            logger.error("undecodable message %r: %s", message_id, exc)
            return [
                HandlerResult(
                    Outcome.UNDECODABLE,
                    event_id=_shown_id(message_id),
                    event_type=_shown_id(message_type),
                    error=error_text(str(exc)),
                )
            ]
        return self.process(event)

    def receive(
        self,
        body: bytes,
        *,
        message_id: str | None,
        message_type: str | None,
        headers: Mapping[str, Any] | None,
        redelivered: bool = False,
        content_type: str | None = None,
    ) -> tuple[Outcome, list[HandlerResult]]:
        """Process one delivered message: the outcome that says how to settle it with the
        broker (:attr:`Outcome.acknowledge`), and each handler's result."""
        results = self.process_message(
            body,
            message_id=message_id,
            message_type=message_type,
            headers=headers,
            redelivered=redelivered,
            content_type=content_type,
        )
        return message_outcome(results), results


def _shown_id(value: Any) -> str:
    """A message's id or type as the publisher sent it, shown even when it is not text."""
    return value if isinstance(value, str) else "" if value is None else repr(value)


@dataclass
class ConsumeResult:
    """Totals of a consumer run, per message (not per handler)."""

    messages: int = 0
    counts: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(Outcome, 0))
    dead_lettered: int = 0
    #: Decoded messages per format (ReceivedEvent.format); undecodable ones are in none.
    formats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FORMATS, 0))

    def add(self, outcome: Outcome, message_format: str = "") -> None:
        self.messages += 1
        self.counts[outcome] += 1
        if message_format:
            self.formats[message_format] = self.formats.get(message_format, 0) + 1

    def summary(self) -> str:
        parts = ", ".join(f"{o.value} {n}" for o, n in self.counts.items() if n)
        tail = f", dead-lettered {self.dead_lettered}" if self.dead_lettered else ""
        return f"{self.messages} message(s): {parts or 'none'}{tail}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``consume_outbox --json``): every outcome, zeros included."""
        return {
            "messages": self.messages,
            "outcomes": {outcome.value: n for outcome, n in self.counts.items()},
            "dead_lettered": self.dead_lettered,
            "formats": dict(self.formats),
        }


def process_messages(
    messages: Iterable[Message], *, dispatcher: Dispatcher | None = None
) -> list[list[HandlerResult]]:
    """Feed locmem messages (``django_outbox.backends.locmem.outbox``) through the handlers.

    An in-process consumer for tests: one list of results per message.
    """
    dispatcher = dispatcher or Dispatcher()
    return [
        dispatcher.process_message(
            m.body,
            message_id=m.message_id,
            message_type=m.type,
            headers=m.headers,
            content_type=m.content_type,
        )
        for m in messages
    ]


# --- RabbitMQ -------------------------------------------------------------------------------


def dead_letter_queue_name(queue: str) -> str:
    return f"{queue}.dlq"


def default_queue_name(handlers: Sequence[type[IdempotentHandler]] = ()) -> str:
    """OUTBOX_CONSUMER_QUEUE, else ``<app label>.outbox`` of the first handler's app."""
    if outbox_settings.CONSUMER_QUEUE:
        return outbox_settings.CONSUMER_QUEUE
    for cls in handlers:
        config = apps.get_containing_app_config(cls.__module__)
        if config is not None:
            return f"{config.label}.outbox"
    return "outbox.consumer"


def _hand_back(channel: Any, deliveries: Iterator[Any]) -> None:
    """Stop the consumer of ``channel`` and return every message it holds unacknowledged
    (prefetched, or held through a database outage) to the queue, each once.

    pika's ``cancel()`` rejects the prefetched messages before it cancels the consumer, so
    RabbitMQ hands them straight back and they are rejected a second time: on a quorum queue
    two deliveries of the limit per stop. Here the consumer is cancelled first, with nothing
    left to reject, and one ``basic.nack`` returns what it held: a return counted once before
    RabbitMQ 4.3, not at all from 4.3 (only ``basic.reject`` counts there).
    """
    # Take what pika has buffered off its hands (still unacknowledged at the broker), so
    # that its cancel() has nothing to reject.
    for _held in range(channel.get_waiting_message_count()):
        next(deliveries)
    channel.cancel()  # whatever arrives until the broker confirms is rejected by pika
    # multiple=True with tag 0: every delivery of the channel not yet settled.
    channel.basic_nack(delivery_tag=0, multiple=True, requeue=True)


def queue_arguments(queue: str, *, queue_type: str, max_retries: int) -> dict[str, Any]:
    """Arguments of the consumer queue: dead-letter to ``<queue>.dlq`` via the default exchange."""
    arguments: dict[str, Any] = {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead_letter_queue_name(queue),
    }
    if queue_type == "quorum":
        # The broker counts redeliveries and dead-letters past the limit: a consumer that
        # crashes on a message (and so never nacks it) cannot loop on it forever either.
        arguments.update({"x-queue-type": "quorum", "x-delivery-limit": max_retries})
    elif queue_type != "classic":
        raise ImproperlyConfiguredHandler(
            f"OUTBOX_CONSUMER_QUEUE_TYPE is {queue_type!r}; use 'quorum' or 'classic'."
        )
    return arguments


class Consumer:
    """Reads a durable queue bound to the outbox exchange and runs the handlers.

    One message at a time, in delivery order, within a prefetch window. A message is
    acknowledged only after its handlers committed (or were duplicates). A failure is
    retried ``max_retries`` times, then dead-lettered; an undecodable message at once.
    """

    def __init__(
        self,
        *,
        handlers: Iterable[str | type[IdempotentHandler]] | None = None,
        url: str | Sequence[str] | None = None,
        queue: str | None = None,
        exchange: str | None = None,
        exchange_type: str | None = None,
        prefetch: int | None = None,
        max_retries: int | None = None,
        queue_type: str | None = None,
        retry_delay: float = 1.0,
        reconnect_max: float = 30.0,
        idle_timeout: float = 1.0,
    ) -> None:
        self.dispatcher = Dispatcher(handlers=handlers)
        if not self.dispatcher.handlers:
            raise ImproperlyConfiguredHandler(
                "No handlers to run: set OUTBOX_CONSUMER_HANDLERS, pass --handler, or define "
                "IdempotentHandler subclasses in an installed app's handlers.py."
            )
        try:
            # One URL, or the nodes of a cluster: the first that answers is read from.
            self.nodes = BrokerNodes(url or outbox_settings.BROKER_URL)
        except TypeError as exc:
            raise ImproperlyConfiguredHandler(str(exc)) from exc
        if not self.nodes:
            raise ImproperlyConfiguredHandler(f"{BROKER_URL_EMPTY} {BROKER_URL_EMPTY_HINT}")
        self.queue = queue or default_queue_name(self.dispatcher.handler_classes)
        self.dead_letter_queue = dead_letter_queue_name(self.queue)
        self.exchange = outbox_settings.EXCHANGE if exchange is None else exchange
        self.exchange_type = exchange_type or outbox_settings.EXCHANGE_TYPE
        self.prefetch = prefetch or outbox_settings.CONSUMER_PREFETCH
        self.max_retries = (
            outbox_settings.CONSUMER_MAX_RETRIES if max_retries is None else max_retries
        )
        self.queue_type = queue_type or outbox_settings.CONSUMER_QUEUE_TYPE
        self.arguments = queue_arguments(
            self.queue, queue_type=self.queue_type, max_retries=self.max_retries
        )
        self.retry_delay = retry_delay
        self.reconnect_max = reconnect_max
        self.idle_timeout = idle_timeout
        self._connection: Any = None
        self._channel: Any = None
        self._node = ""  # the node connected to, for log lines (password masked)

    @property
    def url(self) -> str:
        """The URL of the broker node connected to, or to be tried next."""
        return self.nodes.current

    # -- connection --------------------------------------------------------------------------
    def connect(self) -> None:
        """Connect to the first broker node that answers, from the current one on, declare
        the queue, its dead-letter queue and the bindings. Raises pika's
        ``AMQPConnectionError`` when every node has failed in this round."""
        import pika
        import pika.exceptions

        self.nodes.start()
        while True:
            node = self.nodes.name()
            try:
                self._connection = pika.BlockingConnection(pika.URLParameters(self.nodes.current))
                break
            except pika.exceptions.AMQPConnectionError as exc:
                if not self.nodes.failed():
                    raise
                logger.warning(
                    "cannot connect to RabbitMQ at %s (%s); trying the next node, %s",
                    node,
                    error_text(exc),
                    self.nodes.name(),
                )
        self._node = node
        channel = self._connection.channel()
        channel.confirm_delivery()  # classic-queue requeues are published: confirm them
        if not outbox_settings.EXCHANGE_PASSIVE and self.exchange:
            channel.exchange_declare(self.exchange, self.exchange_type, durable=True)
        dlq_args = {"x-queue-type": "quorum"} if self.queue_type == "quorum" else {}
        channel.queue_declare(self.dead_letter_queue, durable=True, arguments=dlq_args)
        channel.queue_declare(self.queue, durable=True, arguments=self.arguments)
        for key in self.dispatcher.routing_keys():
            channel.queue_bind(self.queue, self.exchange, routing_key=key)
        channel.basic_qos(prefetch_count=self.prefetch)
        self._channel = channel
        logger.info(
            "consuming %s (%s, dead letters to %s) bound to %s on exchange %s at %s",
            self.queue,
            self.queue_type,
            self.dead_letter_queue,
            self.dispatcher.routing_keys(),
            self.exchange,
            node,
        )

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # already broken: unacked messages are requeued anyway
                logger.debug("error closing the consumer connection", exc_info=True)

    # -- the loop ----------------------------------------------------------------------------
    def run(
        self,
        *,
        stop: threading.Event | None = None,
        max_messages: int | None = None,
        until_idle: bool = False,
    ) -> ConsumeResult:
        """Consume until ``stop`` is set, ``max_messages`` were handled, or (``until_idle``)
        the queue stayed empty for ``idle_timeout`` seconds. Reconnects after a lost
        connection: to the next broker node at once while some node has not failed in this
        round, else after a growing pause (:class:`~django_outbox.worker.BrokerNodes`)."""
        import pika.exceptions

        stop = stop or threading.Event()
        result = ConsumeResult()
        backoff = Backoff(maximum=self.reconnect_max)

        def step() -> bool:
            if self._channel is None:
                self.connect()
                backoff.reset()
            return self._consume(stop, result, max_messages, until_idle)

        def fail_over(exc: Exception) -> bool:
            # A connection that was open is lost: the next one goes to the next node. One
            # that could not be opened: connect() has been through every node already.
            return self._connection is not None and self.nodes.failed()

        def lost(exc: Exception, pause: float) -> None:
            where = f" to {self._node}" if self._connection is not None else ""
            self.close()
            then = (
                f"reconnecting in {pause:.1f}s" if pause else f"failing over to {self.nodes.name()}"
            )
            logger.warning(
                "broker connection%s lost (%s: %s); %s", where, type(exc).__name__, exc, then
            )

        try:
            keep_running(
                stop,
                step,
                backoff=backoff,
                on_error=lost,
                recoverable=pika.exceptions.AMQPError,
                fail_over=fail_over,
            )
        finally:
            self.close()
        return result

    def _consume(
        self,
        stop: threading.Event,
        result: ConsumeResult,
        max_messages: int | None,
        until_idle: bool,
    ) -> bool:
        """Consume on the open channel; True when the run is over."""
        channel = self._channel
        deliveries = channel.consume(self.queue, inactivity_timeout=self.idle_timeout)
        try:
            for method, properties, body in deliveries:
                if method is None:
                    if until_idle or stop.is_set():
                        return True
                    continue
                outcome = self._deliver(stop, channel, method, properties, body)
                if outcome is None:  # stopped during a database outage: handed back
                    return True
                result.add(outcome, self._format_last)
                if self._dead_lettered_last:
                    result.dead_lettered += 1
                if stop.is_set() or (max_messages and result.messages >= max_messages):
                    return True
        finally:
            if channel.is_open:
                _hand_back(channel, deliveries)
        return True

    _dead_lettered_last = False
    _format_last = ""  # the format of the message handle_delivery() settled last

    def _deliver(
        self, stop: threading.Event, channel: Any, method: Any, properties: Any, body: bytes
    ) -> Outcome | None:
        """:meth:`handle_delivery`, holding the message through an outage of the database.

        An outage of the consumer's own database is nobody's fault: the message is neither
        acked nor returned (a return counts a delivery against it on a quorum queue), the
        consumer takes no other one meanwhile, waits with a growing pause until the database
        answers, then handles the same delivery again. A connection lost while the database
        answers at once is retried at once, :data:`LOST_CONNECTION_RETRIES` times. None:
        ``stop`` was set while waiting; the message is still unsettled (closing the channel
        returns it).
        """
        backoff = Backoff(maximum=self.reconnect_max)
        quick_losses = 0
        while True:
            tidy_connections()
            try:
                with tracing.delivery(
                    method.exchange, method.routing_key, self.queue, method.delivery_tag
                ):
                    return self.handle_delivery(
                        channel,
                        method,
                        properties,
                        body,
                        hold_on_lost_connection=quick_losses < LOST_CONNECTION_RETRIES,
                    )
            except DatabaseUnavailable as exc:
                lost = exc
            finally:
                tidy_connections()
            if database_answers(lost.using):
                quick_losses += 1
                logger.warning(
                    "message %r: the connection to database %r was lost and the database "
                    "answers; trying the message again (%d of %d)",
                    properties.message_id,
                    lost.using,
                    quick_losses,
                    LOST_CONNECTION_RETRIES,
                )
                continue
            if not self._wait_for_database(stop, lost, backoff, properties.message_id):
                # Not nacked here: the consumer still listens, the broker would hand the
                # message straight back, and the stop would return it a second time (two
                # deliveries counted). The caller's _hand_back() returns it once.
                return None

    def _wait_for_database(
        self, stop: threading.Event, lost: DatabaseUnavailable, backoff: Backoff, message_id: Any
    ) -> bool:
        """Wait until the database answers (True) or ``stop`` is set (False), keeping the
        broker connection serviced (heartbeats) and the message unacknowledged."""
        while True:
            pause = backoff.next()
            logger.warning(
                "database %r unavailable (%s); holding message %r unacknowledged (no delivery "
                "counted) and taking no other; retrying in %.1fs",
                lost.using,
                lost.error,
                message_id,
                pause,
            )
            deadline = time.monotonic() + pause
            while (remaining := deadline - time.monotonic()) > 0:
                if stop.is_set():
                    return False
                self._connection.sleep(min(remaining, 0.2))
            if stop.is_set():
                return False
            if database_answers(lost.using):
                logger.info(
                    "database %r answers again; handling message %r again", lost.using, message_id
                )
                return True

    def handle_delivery(
        self,
        channel: Any,
        method: Any,
        properties: Any,
        body: bytes,
        *,
        hold_on_lost_connection: bool = False,
    ) -> Outcome:
        """Process one delivery and settle it with the broker (ack, requeue or dead-letter).

        With ``hold_on_lost_connection``, a handler that lost its database connection
        raises :class:`DatabaseUnavailable` instead, and the delivery is left unsettled.
        """
        self._dead_lettered_last = False
        headers = dict(properties.headers or {})
        outcome, results = self.dispatcher.receive(
            body,
            message_id=properties.message_id,
            message_type=properties.type,
            headers=headers,
            redelivered=method.redelivered,
            content_type=properties.content_type,
        )
        self._format_last = results[0].message_format if results else ""
        lost = next((r for r in results if r.lost_database), None)
        if lost is not None and hold_on_lost_connection:
            raise DatabaseUnavailable(lost.lost_database, lost.error)
        if outcome.acknowledge:
            channel.basic_ack(method.delivery_tag)
        elif outcome in (Outcome.UNDECODABLE, Outcome.OUT_OF_ORDER):
            error = next((r.error for r in results if r.outcome is outcome), "")
            self._dead_letter(channel, method, properties, body, f"{outcome.value}: {error}")
        else:
            self._retry(channel, method, properties, body, headers, results)
        return outcome

    def _dead_letter(
        self, channel: Any, method: Any, properties: Any, body: bytes, reason: str
    ) -> None:
        """Move the message to the dead-letter queue with ``reason`` in :data:`REASON_HEADER`.

        A copy goes to the dead-letter queue (published with confirms), then the original is
        acked: a crash in between leaves a duplicate there, never a loss. Only if the copy
        cannot be placed (the dead-letter queue was deleted) is the original rejected to the
        queue's dead-letter exchange, without the reason.
        """
        import pika.exceptions

        reason = error_text(reason)
        logger.error(
            "message %r dead-lettered to %s: %s",
            properties.message_id,
            self.dead_letter_queue,
            reason,
        )
        self._dead_lettered_last = True
        headers = {**(properties.headers or {}), REASON_HEADER: reason}
        try:
            channel.basic_publish(
                "",
                self.dead_letter_queue,
                body,
                _copy_properties(properties, headers),
                mandatory=True,
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            logger.error(
                "message %r: the copy for %s was refused (%s); rejected to the dead-letter "
                "exchange without its reason",
                properties.message_id,
                self.dead_letter_queue,
                type(exc).__name__,
            )
            channel.basic_reject(method.delivery_tag, requeue=False)
            return
        channel.basic_ack(method.delivery_tag)

    def _delivery_number(self, headers: Mapping[str, Any]) -> int:
        """Which delivery of the message this is (1 for the first), from the count the
        broker (quorum) or this consumer (classic) keeps in a header.

        Raises ``ValueError`` for a count that is not one: a publisher set the header.
        """
        if self.queue_type == "quorum":
            name, value, first = "x-delivery-count", headers.get("x-delivery-count"), 0
        else:
            name, value, first = DELIVERY_HEADER, headers.get(DELIVERY_HEADER), 1
        if value is None:
            return 1
        if isinstance(value, bool) or not isinstance(value, int) or value < first:
            raise ValueError(f"header {name} is {value!r:.80}, not a delivery count")
        return value + 1 - first

    def _retry(
        self,
        channel: Any,
        method: Any,
        properties: Any,
        body: bytes,
        headers: dict[str, Any],
        results: Sequence[HandlerResult],
    ) -> None:
        error = next((r.error for r in results if r.error), "")
        try:
            delivery = self._delivery_number(headers)
        except ValueError as exc:
            # The count cannot be kept: retrying could loop for good.
            self._dead_letter(channel, method, properties, body, f"failed: {error}; {exc}")
            return
        if delivery > self.max_retries:
            # Not left to a quorum queue's own limit: that would lose the reason.
            self._dead_letter(
                channel, method, properties, body, f"failed {delivery} time(s): {error}"
            )
            return
        logger.warning(
            "message %s failed (delivery %s of %s); retrying: %s",
            properties.message_id,
            delivery,
            self.max_retries + 1,
            error,
        )
        if self.retry_delay:
            # Keep the connection serviced (heartbeats) while waiting.
            self._connection.sleep(min(self.retry_delay * delivery, 30.0))
        if self.queue_type == "quorum":
            # basic.reject, not basic.nack: from RabbitMQ 4.3 only a reject counts a
            # delivery (x-delivery-count); before 4.3 every return did.
            channel.basic_reject(method.delivery_tag, requeue=True)
            return
        # Classic queues do not count redeliveries: publish a copy with the count, then ack
        # the original (confirmed first, so the message is never lost in between).
        copy_headers = {**headers, DELIVERY_HEADER: delivery + 1}
        props = _copy_properties(properties, copy_headers)
        channel.basic_publish("", self.queue, body, props, mandatory=True)
        channel.basic_ack(method.delivery_tag)


def _copy_properties(properties: Any, headers: dict[str, Any]) -> Any:
    """The message's properties (all of them: correlation_id, reply_to, ... too) with other
    headers, persistent: for a copy the consumer publishes (a retry, a dead letter)."""
    import copy

    props = copy.copy(properties)
    props.headers = headers
    props.delivery_mode = 2
    return props
