"""A batch of claimed rows on its way through the relay, and what batches add up to."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..backends.base import Reason

if TYPE_CHECKING:
    from ..backends.base import PublishResult
    from ..models import OutboxEvent
    from ..tracing import PublishSpans
    from .runs import Runs


class Stage(enum.Enum):
    """Where a batch is. Every batch ends SETTLED or RELEASED.

    CLAIMED -> IN_FLIGHT -> COLLECTED -> SETTLED is the way of a batch the broker answered for;
    a batch the relay stops holding before it is settled (a stop, an outage, an error, a
    lease too short to send it on) is RELEASED: its rows are due again at once.
    """

    CLAIMED = "claimed"  # leased under the batch's token, not handed to the broker
    IN_FLIGHT = "in_flight"  # handed to the backend; confirms not collected yet (rows PENDING)
    COLLECTED = "collected"  # one result per row
    SETTLED = "settled"  # the results are recorded on the rows
    RELEASED = "released"  # given back unsettled, due again at once


@dataclass(eq=False)
class Batch:
    """Rows leased under one lease token, and what became of them."""

    token: str
    rows: list[OutboxEvent]
    limit: int  # how many rows the claim asked for
    claimed_at: float  # time.monotonic()
    stage: Stage = Stage.CLAIMED
    results: list[PublishResult] | None = None
    spans: PublishSpans | None = None  # tracing: ended at collect() or release()
    #: The ordered runs among the rows, which go out in waves (:mod:`.runs`); None: no
    #: row follows another (always, outside ordered mode), the batch is sent whole.
    runs: Runs | None = field(default=None, repr=False)

    @classmethod
    def empty(cls) -> Batch:
        """No rows: what a claim returns when nothing is due (or nothing may be claimed)."""
        return cls("", [], 0, 0.0, stage=Stage.SETTLED)

    @property
    def full(self) -> bool:
        """As many rows as asked for: more may be due behind them."""
        return bool(self.rows) and len(self.rows) >= self.limit

    @property
    def held(self) -> bool:
        """Rows still leased by this relay and not settled: someone must release them."""
        return bool(self.rows) and self.stage in (Stage.CLAIMED, Stage.IN_FLIGHT, Stage.COLLECTED)

    @property
    def connection_lost(self) -> bool:
        """Some results say the connection to the broker went away under this batch."""
        return any(
            r.reason is not None and r.reason.is_connection_level for r in self.results or ()
        )


class BrokerOutage(Exception):
    """The broker went away; the batch's rows were released. The caller backs off.

    ``result`` holds what the interrupted pass did settle (confirmed or dead rows);
    ``permanent``: the broker could not be reached for a reason that does not clear by
    itself (see :class:`~django_outbox.backends.base.BrokerUnavailable`).
    """

    def __init__(
        self, message: str, result: PassResult | None = None, *, permanent: bool = False
    ) -> None:
        super().__init__(message)
        self.result = result if result is not None else PassResult()
        self.permanent = permanent


@dataclass
class PassResult:
    """Totals of one or more settled batches.

    Each row found ends sent, failed (``dead`` of them went DEAD) or released: given back
    without an attempt counted, either held back (the rest of an ordered run behind an event
    that was not confirmed) or lost (the connection to the broker went away before its
    confirm). A row another relay took over (this one outlived its lease) is none of these.
    """

    found: int = 0
    sent: int = 0
    failed: int = 0
    dead: int = 0
    released: int = 0  # every row given back: held back or lost
    held_back: int = 0  # of which events of ordered runs, unsent behind a failed one
    batches: int = 0
    dead_events: list[OutboxEvent] = field(default_factory=list, repr=False)
    #: The failed attempts by (reason, error): what the commands say went wrong, and the fix.
    failures: Counter[tuple[str, str]] = field(default_factory=Counter, repr=False)

    def add(self, other: PassResult) -> None:
        self.found += other.found
        self.sent += other.sent
        self.failed += other.failed
        self.dead += other.dead
        self.released += other.released
        self.held_back += other.held_back
        self.batches += other.batches
        self.dead_events.extend(other.dead_events)
        self.failures.update(other.failures)

    @property
    def lost(self) -> int:
        """Rows released because the connection went away under them."""
        return self.released - self.held_back

    def summary(self) -> str:
        return f"found={self.found} sent={self.sent} failed={self.failed} dead={self.dead}"

    def failure_report(self) -> str:
        """``2 events failed (1 went DEAD):`` and a line per kind of failure."""
        dead = f" ({self.dead} went DEAD)" if self.dead else ""
        lines = "".join(f"\n  {line}" for line in self.failure_lines())
        return f"{self.failed} events failed{dead}" + (f":{lines}" if lines else "")

    def failure_lines(self, limit: int = 5) -> list[str]:
        """One line per kind of failure, most frequent first: how many, the reason, the
        broker's words and what to do (an unroutable event: which exchange and routing
        key, and that a queue must be bound)."""
        lines = [
            failure_line(n, reason, error)
            for (reason, error), n in self.failures.most_common(limit)
        ]
        rest = sum(self.failures.values()) - sum(n for _, n in self.failures.most_common(limit))
        if rest:
            lines.append(f"{rest} more with other errors (see last_error in the admin)")
        return lines


def failure_line(count: int, reason: str, error: str) -> str:
    """``3 unroutable: returned by RabbitMQ: 312 NO_ROUTE (...); start the consumer ...``"""
    known = {r.value: r for r in Reason}
    fix = known[reason].fix if reason in known else ""
    return f"{count} {reason}: {error}" + (f"; {fix}" if fix else "")
