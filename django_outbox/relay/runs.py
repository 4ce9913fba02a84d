"""Ordered runs on the relay: how a batch's runs go out, one confirm after another.

Ordered mode (docs/ordered.md) in five steps, from the claim to the settle; an unordered
batch takes none of them but the claim's:

1. **Claim** (:mod:`django_outbox.ordering`, inside ``OutboxEventQuerySet.claim``): an
   ordered row is claimed only as its aggregate's *head*; behind each head the claim takes
   up to ``OUTBOX_ORDERED_RUN - 1`` of its aggregate's next events, its *followers*,
   leased under the same token: a *run*. Each claimed ordered row carries what comes next
   (``OutboxEvent.run_follows``: the id of the row before it in its run;
   ``previous_sequence``: what the consumers are told).
2. **Plan** (:class:`Runs`, which ``Relay.claim`` builds in ordered mode for a batch with
   followers; a batch without is sent whole): the first *wave* is every row that waits for
   no confirm (heads, unordered rows, followers of a row the broker confirmed in the batch
   before).
3. **Send in waves** (``Relay.send`` and ``Relay.collect``, the engine's "ordered runs"
   section): each confirm sends the next row of its run. A row that is not confirmed ends
   its run: the rest is *held back* (:data:`HELD_BACK`), or lost with it when the
   connection went away; a lease too short for another confirm wait holds the rest back too.
4. **Claim behind** (``Pipeline.fill``): while a batch with runs is out, the next claim
   continues its runs from their *tails* (:meth:`Runs.tails`, ``claim(after=)``), and looks
   for new heads only now and then (:class:`HeadSearch`); that batch goes out once the one
   before it is collected, the followers of its unconfirmed rows held back.
5. **Settle** (``Relay.settle``): the held back rows are *released* (due again at once, no
   attempt counted) behind the failed row, which keeps blocking its aggregate.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..backends.base import PublishResult

if TYPE_CHECKING:
    from ..models import OutboxEvent

#: The result of a run's event that was not published because an earlier event of its run
#: was not confirmed (or the lease ran short): given back without an attempt counted, so
#: nothing of its aggregate reaches the broker before the failed event does.
HELD_BACK = PublishResult(
    ok=False, error="not published: an earlier event of its aggregate was not confirmed"
)


@dataclass(eq=False)
class Runs:
    """The ordered runs among one batch's rows, and the results known so far while their
    rows go out wave by wave."""

    rows: list[OutboxEvent]
    #: Ids of rows of the batch before that rows of this one were claimed behind (the
    #: claim's ``after``), and those of them the broker confirmed (set before the send):
    #: their followers go out in the first wave, those of the others are held back.
    after: frozenset[int] = frozenset()
    after_ok: frozenset[int] = frozenset()
    #: Row index -> the index of the row that follows it in its run.
    next_in_run: dict[int, int] = field(default_factory=dict, repr=False)
    results: list[PublishResult | None] = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, rows: list[OutboxEvent], after: Sequence[OutboxEvent] = ()) -> Runs | None:
        """The runs among ``rows``, claimed behind ``after``; None when no row is a
        follower (the batch is sent whole)."""
        if all(row.run_follows is None for row in rows):
            return None
        return cls(rows, frozenset(row.pk for row in after))

    def first_wave(self) -> list[int] | None:
        """The rows to send first, or None when no row waits for another (send the batch
        whole).

        A row claimed as a *follower* (``run_follows``: the id of the row before it in its
        aggregate's run) is sent only after that row's confirm: the first wave is every
        other row (heads, unordered rows), and each confirm lets the next row of its run go
        (:meth:`take`). A follower of a row of the batch before that was not confirmed is
        held back at once.
        """
        position = {row.pk: index for index, row in enumerate(self.rows)}
        firsts: list[int] = []
        orphans: list[int] = []
        for index, row in enumerate(self.rows):
            before = row.run_follows
            if before is None or before in self.after_ok:
                firsts.append(index)
            elif before in position:
                self.next_in_run[position[before]] = index
            else:  # its predecessor was not confirmed (or is not ours): not sent
                orphans.append(index)
        if not self.next_in_run and not orphans:
            return None
        self.results = [None] * len(self.rows)
        self.resolve(orphans, HELD_BACK)
        return firsts

    def take(self, indices: Sequence[int], results: Sequence[PublishResult]) -> list[int]:
        """Record the backend's ``results`` for the rows ``indices`` (one wave). Returns
        the next wave: the followers of the confirmed ones; the followers of a failed row
        are resolved with it (:meth:`resolve`)."""
        if len(results) != len(indices):
            raise RuntimeError(
                f"a backend returned {len(results)} results for {len(indices)} events; a "
                "backend must return one result per event."
            )
        following = []
        for index, result in zip(indices, results, strict=True):
            if result.ok:
                self.results[index] = result
                if index in self.next_in_run:
                    following.append(self.next_in_run[index])
            else:
                self.resolve([index], result)
        return following

    def resolve(self, indices: Sequence[int], result: PublishResult) -> None:
        """The rows ``indices`` end with ``result`` (not confirmed), and the rest of each
        one's run is not sent: HELD_BACK, or ``result`` itself when the connection went away
        (so the batch is settled as a lost one and the relay backs off)."""
        rest = (
            result if result.reason is not None and result.reason.is_connection_level else HELD_BACK
        )
        for index in indices:
            self.results[index] = result
            follower = self.next_in_run.get(index)
            while follower is not None:
                self.results[follower] = rest
                follower = self.next_in_run.get(follower)

    def done(self) -> list[PublishResult] | None:
        """One result per row, once every row has one."""
        known = [result for result in self.results if result is not None]
        return known if len(known) == len(self.rows) else None

    def tails(self) -> list[OutboxEvent]:
        """The last row of each run (after :meth:`first_wave`): the rows the next claim
        continues from (``claim(after=)``) while this batch is out."""
        followed = set(self.next_in_run.values())
        return [
            row
            for index, row in enumerate(self.rows)
            if index not in self.next_in_run and (index in followed or row.run_follows is not None)
        ]


#: While a drain continues ordered runs, its claims behind them also look for heads (other
#: aggregates' next events, unordered events) at most every HEADS_EVERY seconds, and for
#: at most HEADS_SHARE of the claims lane's time. That search read the whole unsent
#: ordered backlog (before migrations 0012 and 0013; SQLite still does), continuing a run
#: only the run: with a hot aggregate's 50,000 queued, every claim took 54 ms beside runs
#: of 100 events that took 80-100 ms, on the same two cores (bench.ordered_bench,
#: docs/benchmarks.md); it reads an index entry per aggregate now. An event written
#: meanwhile is claimed within about HEADS_EVERY, the busy relay's poll (a tenth of the
#: default interval).
HEADS_EVERY = 0.1
HEADS_SHARE = 0.25


class HeadSearch:
    """When a claim behind runs looks for heads too (:data:`HEADS_EVERY`,
    :data:`HEADS_SHARE`). One per drain, used on its claims lane."""

    def __init__(self) -> None:
        self.searched_at = float("-inf")  # when the last claim that looked for heads ended
        self.cost = 0.0  # how long it took

    def due(self) -> bool:
        """Whether the next claim behind runs looks for heads."""
        wait = max(HEADS_EVERY, self.cost * (1 - HEADS_SHARE) / HEADS_SHARE)
        return time.monotonic() - self.searched_at >= wait

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Around a claim that looks for heads: records when it ended and what it took."""
        started = time.monotonic()
        yield
        self.searched_at = time.monotonic()
        self.cost = self.searched_at - started
