"""When a failed row is due again, and when it is dead instead.

A policy answers one question: the row has now failed ``failures`` times; how many seconds
until it is due again, or ``None`` for DEAD. The relay uses the backoff schedule; the
compensator uses the article's fixed policy (60 s, DEAD after more than 10 failures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .conf import outbox_settings


class RetryPolicy:
    def delay_after(self, failures: int) -> float | None:
        raise NotImplementedError


@dataclass(frozen=True)
class ScheduleRetryPolicy(RetryPolicy):
    """1 s, 5 s, 30 s, 2 min, 15 min, 1 h, 6 h by default; a failure past the last step is DEAD."""

    schedule: Sequence[float]

    @classmethod
    def from_settings(cls) -> ScheduleRetryPolicy:
        return cls(tuple(outbox_settings.RETRY_SCHEDULE))

    def delay_after(self, failures: int) -> float | None:
        if failures <= len(self.schedule):
            return float(self.schedule[failures - 1])
        return None


@dataclass(frozen=True)
class FixedRetryPolicy(RetryPolicy):
    """Due again after ``delay`` seconds; DEAD once failed more than ``max_attempts`` times."""

    delay: float
    max_attempts: int

    @classmethod
    def compensation(cls) -> FixedRetryPolicy:
        return cls(
            delay=outbox_settings.COMPENSATE_RETRY_DELAY,
            max_attempts=outbox_settings.COMPENSATE_MAX_ATTEMPTS,
        )

    def delay_after(self, failures: int) -> float | None:
        return None if failures > self.max_attempts else float(self.delay)
