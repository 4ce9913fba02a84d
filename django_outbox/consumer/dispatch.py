"""From a delivered message to one decision: the seam between a transport and the handlers.

A transport's consumer loop (``amqp.py``; one module per broker) hands each message over as
a :class:`~django_outbox.message.Delivery` (body, headers, message id, type, which delivery
it is, the transport's name) and gets back one :class:`Decision`: acknowledge it, retry it
later (after ``delay``), dead-letter it (with a ``reason``), or hold it because the
consumer's own database failed (no delivery counted). :class:`Dispatcher` makes the
decision: it decodes the message, runs the handlers of its type, each idempotently
(:meth:`IdempotentHandler.attempt`), and applies the retry limit. Nothing here knows a
broker. :func:`process_messages` feeds locmem messages through the handlers in-process
(tests).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import tracing
from ..conf import outbox_settings
from ..exceptions import error_text
from ..message import FORMATS, Delivery, ReceivedEvent, UndecodableMessage, decode
from ..worker import Backoff
from .handlers import HandlerResult, IdempotentHandler, Outcome, get_handlers

if TYPE_CHECKING:
    from ..backends.locmem import Message

logger = logging.getLogger("django_outbox.consumer")

#: Where a dead-lettered message carries why (the outcome and the error), on every transport.
REASON_HEADER = "x-outbox-reason"
#: The longest pause before a failed message is delivered again.
MAX_RETRY_DELAY = 30.0


class Action(str, enum.Enum):
    """What a transport does with a message (:attr:`Decision.action`)."""

    ACKNOWLEDGE = "acknowledge"  # done: processed, a duplicate, or no handler for its type
    RETRY = "retry"  # its handler failed: deliver it again after Decision.delay (counted)
    DEAD_LETTER = "dead_letter"  # poison, or out of retries: park it with Decision.reason
    HOLD = "hold"  # the consumer's database failed, not the message: keep it, count nothing


@dataclass(frozen=True)
class Decision:
    """What became of one delivered message, and what its transport must do with it."""

    action: Action
    outcome: Outcome
    results: tuple[HandlerResult, ...] = ()
    #: DEAD_LETTER: why, for the dead-letter copy's :data:`REASON_HEADER`.
    reason: str = ""
    #: RETRY: the pause before the message is delivered again, in seconds.
    delay: float = 0.0
    #: HOLD: the alias of the database that failed.
    database: str = ""
    #: HOLD: the connection to it was lost (else the database failed while answering: a
    #: missing table, a lock timeout).
    connection_lost: bool = False
    #: The first handler's error (``""`` when none failed).
    error: str = ""

    @property
    def message_format(self) -> str:
        """The format the message came in (``ReceivedEvent.format``); ``""`` if undecodable."""
        return self.results[0].message_format if self.results else ""


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


class Dispatcher:
    """Routes a delivered message to the handlers of its event type, runs each one
    idempotently, and decides what the transport does with the message (:meth:`receive`).

    ``max_retries``: deliveries of a failing message after the first before it is
    dead-lettered (default OUTBOX_CONSUMER_MAX_RETRIES). ``retry_delay``: the pause before
    the second delivery, doubled for each one after it, at most :data:`MAX_RETRY_DELAY`
    (0: none).
    """

    def __init__(
        self,
        *,
        handlers: Iterable[str | type[IdempotentHandler]] | None = None,
        max_retries: int | None = None,
        retry_delay: float = 1.0,
    ) -> None:
        self.handler_classes = get_handlers(handlers)
        self.handlers = [cls() for cls in self.handler_classes]
        self.max_retries = (
            outbox_settings.CONSUMER_MAX_RETRIES if max_retries is None else max_retries
        )
        self.retry_backoff = Backoff(initial=retry_delay, maximum=MAX_RETRY_DELAY)
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
                result = handler.attempt(event)
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

    def process_message(self, delivery: Delivery) -> list[HandlerResult]:
        """Decode the message and run its handlers: each handler's result (one UNDECODABLE
        result for a message that is not a well-formed outbox event)."""
        try:
            event = decode(delivery)
        except UndecodableMessage as exc:
            logger.error("undecodable message %r: %s", delivery.message_id, exc)
            return [
                HandlerResult(
                    Outcome.UNDECODABLE,
                    event_id=_shown_id(delivery.message_id),
                    event_type=_shown_id(delivery.message_type),
                    error=error_text(str(exc)),
                )
            ]
        return self.process(event)

    def receive(self, delivery: Delivery, *, hold_lost_connection: bool = True) -> Decision:
        """Process one delivered message and decide what its transport does with it.

        A handler whose database failed (a lost connection, a missing table, a lock
        timeout) is the consumer's fault, not the message's: the decision is HOLD (the
        transport keeps the message unsettled and counts no delivery). A lost connection is
        held only with ``hold_lost_connection``; without it, it is a failure like any other.
        A failure is RETRY, or DEAD_LETTER once the message has been delivered
        ``max_retries`` times after the first, or at once when the transport could not
        count deliveries.
        """
        results = tuple(self.process_message(delivery))
        outcome = message_outcome(results)
        error = next((r.error for r in results if r.error), "")
        lost = next((r for r in results if r.lost_database), None)
        if lost is not None and hold_lost_connection:
            return Decision(
                Action.HOLD,
                outcome,
                results,
                database=lost.lost_database,
                connection_lost=True,
                error=lost.error,
            )
        fault = next((r for r in results if r.database_fault), None)
        if fault is not None:
            return Decision(
                Action.HOLD, outcome, results, database=fault.database_fault, error=fault.error
            )
        if outcome.acknowledge:
            return Decision(Action.ACKNOWLEDGE, outcome, results)
        if outcome in (Outcome.UNDECODABLE, Outcome.OUT_OF_ORDER):
            reason = next((r.error for r in results if r.outcome is outcome), "")
            return self._dead_letter(outcome, results, f"{outcome.value}: {reason}", error)
        if delivery.count_error:
            # The count cannot be kept: retrying could loop for good.
            reason = f"failed: {error}; {delivery.count_error}"
            return self._dead_letter(outcome, results, reason, error)
        if delivery.number > self.max_retries:
            # Not left to a broker's own limit (a quorum queue's): that would lose the reason.
            reason = f"failed {delivery.number} time(s): {error}"
            return self._dead_letter(outcome, results, reason, error)
        delay = self.retry_backoff.pause(delivery.number)
        return Decision(Action.RETRY, outcome, results, delay=delay, error=error)

    @staticmethod
    def _dead_letter(
        outcome: Outcome, results: tuple[HandlerResult, ...], reason: str, error: str
    ) -> Decision:
        return Decision(
            Action.DEAD_LETTER, outcome, results, reason=error_text(reason), error=error
        )


def _shown_id(value: Any) -> str:
    """A message's id or type as the publisher sent it, shown even when it is not text."""
    return value if isinstance(value, str) else "" if value is None else repr(value)


@dataclass
class ConsumeResult:
    """Totals of one :meth:`BaseConsumer.serve`, per message (not per handler)."""

    messages: int = 0
    counts: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(Outcome, 0))
    dead_lettered: int = 0
    #: Decoded messages per format (ReceivedEvent.format); undecodable ones are in none.
    formats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FORMATS, 0))

    def add(self, decision: Decision) -> None:
        self.messages += 1
        self.counts[decision.outcome] += 1
        if decision.action is Action.DEAD_LETTER:
            self.dead_lettered += 1
        if decision.message_format:
            self.formats[decision.message_format] = self.formats.get(decision.message_format, 0) + 1

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
    return [dispatcher.process_message(m.delivery()) for m in messages]
