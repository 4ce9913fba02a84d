"""Dead-letter alerts: every configured channel hears about rows that became DEAD.

Channels are configured in ``OUTBOX_ALERTS`` as ``{"BACKEND": dotted path, "OPTIONS": {}}``.
The relay calls :func:`notify_dead` after the DEAD state is committed, once per pass with
all the rows that died in it, so a channel gets one message per pass, not one per row. A
channel that fails is logged and skipped: it can neither block the relay nor undo the DEAD.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.utils.module_loading import import_string

from .conf import outbox_settings

logger = logging.getLogger("django_outbox.alerts")


@dataclass(frozen=True)
class DeadLetter:
    """What an alert says about one dead row."""

    event_id: str
    event_type: str
    aggregate_type: str
    aggregate_id: str
    retry_count: int
    last_error: str

    @classmethod
    def from_event(cls, event: Any) -> DeadLetter:
        return cls(
            event_id=event.event_id,
            event_type=event.event_type,
            aggregate_type=event.aggregate_type,
            aggregate_id=event.aggregate_id,
            retry_count=event.retry_count,
            last_error=event.last_error,
        )

    def summary(self) -> str:
        return (
            f"event_id={self.event_id} event_type={self.event_type} "
            f"aggregate={self.aggregate_type}:{self.aggregate_id} "
            f"retry_count={self.retry_count} last_error={self.last_error}"
        )


class BaseChannel:
    """An alert channel; subclasses implement :meth:`send`."""

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} got unknown options {sorted(options)}")

    def send(self, dead: Sequence[DeadLetter]) -> None:
        raise NotImplementedError


class LoggingChannel(BaseChannel):
    """Logs dead letters at ERROR on the ``django_outbox.alerts`` logger (the default)."""

    def send(self, dead: Sequence[DeadLetter]) -> None:
        lines = "\n".join(f"  {d.summary()}" for d in dead)
        logger.error("%d outbox event(s) became DEAD:\n%s", len(dead), lines)


def get_channels() -> list[BaseChannel]:
    return [
        import_string(entry["BACKEND"])(**entry.get("OPTIONS", {}))
        for entry in outbox_settings.ALERTS
    ]


def notify_dead(events: Sequence[Any]) -> None:
    """Tell every channel about rows that just became DEAD; never raises."""
    if not events:
        return
    dead = [e if isinstance(e, DeadLetter) else DeadLetter.from_event(e) for e in events]
    try:
        channels = get_channels()
    except Exception:
        logger.exception(
            "OUTBOX_ALERTS is misconfigured; dead letters: %s", [d.event_id for d in dead]
        )
        return
    for channel in channels:
        try:
            channel.send(dead)
        except Exception:
            logger.exception(
                "Alert channel %s failed for %d dead letter(s): %s",
                type(channel).__name__,
                len(dead),
                ", ".join(d.event_id for d in dead),
            )
