"""From a delivered message to an outcome: decode it, run its handlers, total the results.

:class:`Dispatcher` routes a received event to the handlers of its type and runs each one
idempotently (:meth:`IdempotentHandler.run`); :func:`message_outcome` says what the whole
message came to. Nothing here knows a broker: a transport's consumer loop (``amqp.py``)
settles the message with its broker from the outcome. :func:`process_messages` feeds locmem
messages through the handlers in-process (tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import tracing
from ..exceptions import OutboxError, error_text
from ..message import FORMATS, ReceivedEvent, UndecodableMessage, decode
from .handlers import HandlerResult, IdempotentHandler, Outcome, get_handlers

if TYPE_CHECKING:
    from ..backends.locmem import Message

logger = logging.getLogger("django_outbox.consumer")


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
