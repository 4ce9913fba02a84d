"""The handler API: :class:`IdempotentHandler`, its de-duplication and ordered check, and
how handlers are found (:func:`get_handlers`).

A handler subclasses :class:`IdempotentHandler`, lists its ``event_types`` and implements
``handle(event)``. It runs in its own ``transaction.atomic()`` and de-duplicates by a unique
``source_event_id`` committed in that same transaction, in one of two styles:

- **business row** (``dedup_model = MyLedger``): the handler's own row carries a unique
  ``source_event_id`` (subclass :class:`SourceEventModel`). A duplicate delivery violates
  it, the transaction rolls back and the outcome is DUPLICATE. To tell this violation from
  any other ``IntegrityError`` on every database, the handler looks, after the rollback,
  for a committed row with this ``source_event_id``: if there is one, the event was already
  processed (whichever constraint fired); if not, the error is a real failure.
- **inbox** (the default): a :class:`~django_outbox.models.InboxMessage` row
  (handler, source_event_id) is inserted first, before ``handle()``; a duplicate fails on
  that insert, before the handler ran, so any later ``IntegrityError`` is the handler's own.

Both are insert-first: there is no check-then-insert race, and a concurrent delivery of the
same event waits on the row lock of the first and then fails as a duplicate.

Nothing here knows a broker: Celery's ``IdempotentTask`` runs its function through this
module alone.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from django.apps import apps
from django.db import (
    IntegrityError,
    InterfaceError,
    InternalError,
    OperationalError,
    ProgrammingError,
    connections,
    models,
    router,
    transaction,
)
from django.utils.module_loading import import_string
from django.utils.translation import gettext_lazy as _

from .. import tracing
from ..conf import outbox_settings
from ..exceptions import OutboxError, error_text
from ..message import ReceivedEvent

logger = logging.getLogger("django_outbox.consumer")


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
    #: FAILED because this database failed under the handler (a missing table, a lock
    #: timeout, a deadlock): the consumer's infrastructure, not the message. The alias.
    database_fault: str = ""
    #: The format the message came in (``ReceivedEvent.format``); "" if undecodable.
    message_format: str = ""


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

    @classmethod
    def models(cls) -> list[type[models.Model]]:
        """The models this handler records events in: its ``dedup_model`` or the inbox, and
        the aggregates' last sequences when it checks the order. Their tables must exist on
        :meth:`database` before it takes a message (``consume_outbox`` checks at start)."""
        from ..models import AggregateSequence, InboxMessage

        used: list[type[models.Model]] = [cls.dedup_model or InboxMessage]
        if cls.out_of_order:
            used.append(AggregateSequence)
        return used

    def database(self) -> str:
        return router.db_for_write(self.models()[0])

    def process(self, event: ReceivedEvent) -> Outcome:
        """Handle the event once: PROCESSED, or DUPLICATE if it was handled before.

        ``handle()`` and the record of ``source_event_id`` commit in one transaction; if
        ``handle()`` raises, that transaction is rolled back and the exception propagates
        (a Celery task retries on it, :meth:`attempt` turns it into FAILED). With
        ``out_of_order`` set, an event that cannot be applied in order now rolls back and
        raises ``_OutOfOrder`` (its ``outcome`` is EARLY or OUT_OF_ORDER).
        """
        using = self.database()
        try:
            with transaction.atomic(using=using):
                if self.dedup_model is None:
                    from ..models import InboxMessage

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

    def attempt(self, event: ReceivedEvent) -> HandlerResult:
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
            # The database's fault, not the message's: said, and marked for the dispatcher.
            if connection_lost(exc, connection, opened):
                log, what, fault = (
                    logger.warning,
                    "the connection to database %r was lost",
                    {"lost_database": using},
                )
            elif database_fault(exc):
                log, what, fault = logger.error, "database %r failed", {"database_fault": using}
            else:
                return self._failed(event, exc, result)
            error = error_text(exc)
            log(
                f"handler %s: {what} on %s %s; rolled back: %s",
                result["handler"],
                using,
                event.event_type,
                event.event_id,
                error,
            )
            return HandlerResult(Outcome.FAILED, error=error, **fault, **result)
        return HandlerResult(outcome, **result)

    def _check_order(self, event: ReceivedEvent, using: str) -> None:
        """Compare the event with the last one of its aggregate processed by this handler.

        The aggregate's row is locked for the rest of the transaction, so two consumers
        given successive events of one aggregate take them one after the other.
        """
        from ..models import AggregateSequence

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


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or while handling (a handler may wrap
    a database error in its own)."""
    seen: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


#: Database errors that are the database's or the schema's, never the message's: a missing
#: table or column (ProgrammingError), a lock timeout, a deadlock, a connection error
#: (OperationalError, InterfaceError), an aborted transaction (InternalError). An
#: IntegrityError or a DataError is about the values the handler wrote: the message's.
DATABASE_FAULTS = (OperationalError, InterfaceError, ProgrammingError, InternalError)


def database_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a database failing under the handler (anywhere in its chain),
    which no delivery of the message can cure: the consumer holds the message and backs
    off instead of counting the failure against it."""
    return any(isinstance(e, DATABASE_FAULTS) for e in _chain(exc))


def connection_lost(exc: BaseException, connection: Any, opened: Any) -> bool:
    """Whether ``exc`` means the handler's database connection is gone, not a handler bug.

    A database error of the kind drivers raise for a dropped or refused connection
    (``OperationalError``, ``InterfaceError``; anywhere in the exception's chain, as a
    handler may wrap it) *and* the driver's connection ``opened`` before the handler ran is
    gone: it could not be opened (None), ``atomic()`` dropped it because even the rollback
    failed (Django may already have opened a new one by then), or it no longer answers.
    A deadlock or a lock timeout is an ``OperationalError`` on a connection that still
    works: not a lost connection, but a database fault all the same (:func:`database_fault`).
    """
    if not any(isinstance(e, (OperationalError, InterfaceError)) for e in _chain(exc)):
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
