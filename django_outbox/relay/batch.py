"""A batch of claimed rows on its way through the relay, and what batches add up to."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..backends.base import PublishResult, Reason

if TYPE_CHECKING:
    from ..models import OutboxEvent
    from ..tracing import PublishSpans

#: The result of a run's event that was not published because an earlier event of its run
#: was not confirmed (or the lease ran short): given back without an attempt counted, so
#: nothing of its aggregate reaches the broker before the failed event does.
HELD_BACK = PublishResult(
    ok=False, error="not published: an earlier event of its aggregate was not confirmed"
)


class Stage(enum.Enum):
    """Where a batch is. Every batch ends SETTLED or RELEASED.

    CLAIMED -> SENT -> COLLECTED -> SETTLED is the way of a batch the broker answered for;
    a batch the relay stops holding before it is settled (a stop, an outage, an error, a
    lease too short to send it on) is RELEASED: its rows are due again at once.
    """

    CLAIMED = "claimed"  # leased under the batch's token, not handed to the broker
    SENT = "sent"  # handed to the backend; confirms not collected yet
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
    # Ordered runs (see plan_runs): row index -> the index of the row that follows it in
    # its run, and the results known so far while the run's events go out one by one.
    next_in_run: dict[int, int] = field(default_factory=dict, repr=False)
    partial: list[PublishResult | None] | None = field(default=None, repr=False)
    # Ids of rows of the batch before, that rows of this one were claimed behind (the
    # claim's ``after``), and those of them the broker confirmed (set before the send):
    # their followers go out in the first wave, those of the others are held back.
    after: frozenset[int] = field(default=frozenset(), repr=False)
    after_ok: frozenset[int] = field(default=frozenset(), repr=False)

    # -- ordered runs ------------------------------------------------------------------------
    def plan_runs(self) -> list[int] | None:
        """The rows to send first, or None when the batch has no run (send it whole).

        A row claimed as a *follower* (``run_follows``: the id of the row before it in its
        aggregate's run, see :meth:`OutboxEventQuerySet._claim_runs`) is sent only after
        that row's confirm: the first wave is every other row (heads, unordered rows), and
        each confirm lets the next row of its run go (:meth:`take`).
        """
        position = {row.pk: index for index, row in enumerate(self.rows)}
        firsts: list[int] = []
        orphans: list[int] = []
        for index, row in enumerate(self.rows):
            before = getattr(row, "run_follows", 0)
            if not before or before in self.after_ok:
                firsts.append(index)
            elif before in position:
                self.next_in_run[position[before]] = index
            else:  # its predecessor was not confirmed (or is not ours): not sent
                orphans.append(index)
        if not self.next_in_run and not orphans:
            return None
        self.partial = [None] * len(self.rows)
        for index in orphans:
            self.resolve([index], HELD_BACK)
        return firsts

    def take(self, indices: Sequence[int] | None, results: Sequence[PublishResult]) -> list[int]:
        """Record the backend's ``results`` for the rows ``indices`` (None: the whole batch,
        sent without runs). Returns the rows to send next: the followers of the confirmed
        ones; the followers of a failed row are resolved with it (:meth:`resolve`)."""
        if indices is None:
            self.results = list(results)
            return []
        assert self.partial is not None
        if len(results) != len(indices):
            raise RuntimeError(
                f"a backend returned {len(results)} results for {len(indices)} events; a "
                "backend must return one result per event."
            )
        following = []
        for index, result in zip(indices, results, strict=True):
            if result.ok:
                self.partial[index] = result
                if index in self.next_in_run:
                    following.append(self.next_in_run[index])
            else:
                self.resolve([index], result)
        self._complete()
        return following

    def resolve(self, indices: Sequence[int], result: PublishResult) -> None:
        """The rows ``indices`` end with ``result`` (not confirmed), and the rest of each
        one's run is not sent: HELD_BACK, or ``result`` itself when the connection went away
        (so the batch is settled as a lost one and the relay backs off)."""
        assert self.partial is not None
        rest = (
            result if result.reason is not None and result.reason.is_connection_level else HELD_BACK
        )
        for index in indices:
            self.partial[index] = result
            follower = self.next_in_run.get(index)
            while follower is not None:
                self.partial[follower] = rest
                follower = self.next_in_run.get(follower)
        self._complete()

    def _complete(self) -> None:
        assert self.partial is not None
        if all(result is not None for result in self.partial):
            self.results = self.partial  # type: ignore[assignment]  # no None left

    @classmethod
    def empty(cls) -> Batch:
        """No rows: what a claim returns when nothing is due (or nothing may be claimed)."""
        return cls("", [], 0, 0.0, stage=Stage.SETTLED)

    @property
    def full(self) -> bool:
        """As many rows as asked for: more may be due behind them."""
        return bool(self.rows) and len(self.rows) >= self.limit

    def run_tails(self) -> list[OutboxEvent]:
        """The last row of each ordered run of this batch (after :meth:`plan_runs`): the
        rows the next claim continues from (``claim(after=)``) while this batch is out."""
        followed = set(self.next_in_run.values())
        return [
            row
            for index, row in enumerate(self.rows)
            if index not in self.next_in_run
            and (index in followed or bool(getattr(row, "run_follows", 0)))
        ]

    @property
    def has_runs(self) -> bool:
        """Some rows were claimed as followers of an ordered run (``run_follows``). A claim
        adds followers only while its heads leave room, so every row that could be claimed
        then was: a claim ahead would find only what became due since."""
        return any(getattr(row, "run_follows", 0) for row in self.rows)

    @property
    def held(self) -> bool:
        """Rows still leased by this relay and not settled: someone must release them."""
        return bool(self.rows) and self.stage in (Stage.CLAIMED, Stage.SENT, Stage.COLLECTED)

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
    """Totals of one or more batches."""

    found: int = 0
    sent: int = 0
    failed: int = 0
    dead: int = 0
    released: int = 0
    held_back: int = 0  # events of ordered runs given back unsent behind a failed one
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
