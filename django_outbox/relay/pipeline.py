"""A drain, pipelined: the relay, the database and the broker work at the same time.

Two batches are kept in flight, written to the broker (``MAX_IN_FLIGHT``); while their
confirms come back, the batch before them is settled and the one after them claimed, each in
its own short transaction, on the claims lane and the settles lane (:mod:`.lanes`)::

    claim N+1 (claims lane)   send N, N+1 ... collect N   settle N-1 (settles lane)

A batch whose connection was lost is settled at once with every batch in flight behind it
(their unconfirmed rows released), and the outage raised. However the drain ends, every
batch it still holds is released (:meth:`Pipeline.release_all`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .. import ordering
from ..alerts import notify_dead
from .batch import Batch, BrokerOutage, PassResult
from .lanes import Lanes, done
from .runs import HeadSearch

if TYPE_CHECKING:
    from ..models import OutboxEvent
    from .engine import Relay

logger = logging.getLogger("django_outbox.relay")

#: Batches a draining relay keeps written to the broker and not yet confirmed: the broker
#: works on one while the relay writes the next.
MAX_IN_FLIGHT = 2


class Pipeline:
    """One drain of ``relay``: batches until nothing is due, ``max_events`` were claimed,
    or ``should_stop()``."""

    def __init__(
        self,
        relay: Relay,
        lanes: Lanes,
        *,
        max_events: int | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.relay, self.lanes = relay, lanes
        self.max_events, self.should_stop = max_events, should_stop
        self.ordered = ordering.is_enabled()
        self.total = PassResult()
        self.claimed = 0  # rows claimed so far, for max_events
        self.ahead: Future[Batch] = done(Batch.empty())  # claimed, not sent yet
        self.in_flight: deque[Batch] = deque()  # Stage.IN_FLIGHT, oldest first
        self.settling: Future[PassResult] | None = None  # the last batch collected
        # Ids the broker confirmed in the last batch with ordered runs collected: the next
        # batch, claimed behind its runs, sends only the followers of these.
        self.confirmed: frozenset[int] = frozenset()
        self.heads = HeadSearch()  # when claims behind runs look for heads (claims lane)

    def drain(self) -> PassResult:
        self.ahead = self.lanes.claim(self.claim)
        try:
            while self.turn():
                pass
        finally:
            self.release_all()
        return self.total

    def turn(self) -> bool:
        """Fill the window, collect the oldest batch, settle it. False: the drain is over."""
        self.fill()
        if not self.in_flight:
            return self.after_the_last()
        batch = self.relay.collect(self.in_flight.popleft())
        self.wait_for_settling()
        if batch.connection_lost:
            self.settle_lost(batch)
            return True
        if batch.runs is not None:
            self.confirmed = frozenset(
                row.pk
                for row, result in zip(batch.rows, batch.results or (), strict=True)
                if result.ok
            )
        self.settling = self.lanes.settle(self.relay.settle, batch)
        return True

    def fill(self) -> None:
        """Send batches while the window has room and rows are due."""
        while len(self.in_flight) < MAX_IN_FLIGHT:
            batch, self.ahead = self.ahead.result(), done(Batch.empty())
            if batch.rows and self.should_stop():
                self.ahead = done(batch)  # released on the way out
                return
            if batch.runs is not None and batch.runs.after and self.in_flight:
                # Claimed behind runs still in flight: it goes out once they are collected,
                # and only behind the events the broker confirmed.
                self.ahead = done(batch)
                return
            batch = self.fresh(batch)
            if not batch.rows:
                return
            if batch.runs is not None:
                batch.runs.after_ok = batch.runs.after & self.confirmed
            claim_next = batch.full and batch.runs is None  # more may be due
            if claim_next and self.relay.claim_before_send:
                self.ahead = self.lanes.claim(self.claim)
            self.in_flight.append(self.relay.send(batch))
            if batch.runs is not None:
                # Ordered runs: claim what follows them (and the heads due meanwhile) while
                # their events go out one by one, so the next batch is ready when they are
                # confirmed: a hot aggregate does not wait for a settle and a claim.
                self.ahead = self.lanes.claim(self.claim, batch.runs.tails())
                return
            if not batch.full:
                return
            if claim_next and not self.relay.claim_before_send:
                self.ahead = self.lanes.claim(self.claim)

    def after_the_last(self) -> bool:
        """Nothing in flight: settle the last batch; True if the drain goes on."""
        result = self.wait_for_settling()
        # In ordered mode what a batch settled lets the next events of its aggregates
        # become heads.
        if result and self.ordered and (result.sent or result.dead) and not self.should_stop():
            self.ahead = self.lanes.claim(self.claim)
            return True
        return False

    def settle_lost(self, batch: Batch) -> None:
        """The connection went away under every batch in flight: settle them all (what
        was not confirmed is released), then raise the outage for the caller to back off."""
        lost = [batch, *(self.relay.collect(each) for each in self.in_flight)]
        self.in_flight.clear()
        outages = []
        for each in lost:
            try:
                self.count(self.lanes.settle(self.relay.settle, each))
            except BrokerOutage as exc:
                outages.append(exc)
        if outages:
            raise outages[0]

    # -- claims ------------------------------------------------------------------------------
    def claim(self, after: Sequence[OutboxEvent] = ()) -> Batch:
        """The next batch, within max_events; runs on the claims lane."""
        limit = self.relay.batch_size
        if self.max_events is not None:
            limit = min(limit, self.max_events - self.claimed)
        if limit <= 0 or self.should_stop():
            return Batch.empty()
        if after and not self.heads.due():
            batch = self.relay.claim(limit, after, heads=False)
        else:
            with self.heads.timed():
                batch = self.relay.claim(limit, after) if after else self.relay.claim(limit)
        self.claimed += len(batch.rows)
        return batch

    def fresh(self, batch: Batch) -> Batch:
        """``batch``, or, if its lease no longer covers a send, a batch claimed in its place
        (``batch`` released)."""
        if not batch.rows or self.relay.lease_covers_a_send(batch):
            return batch
        self.relay.release(batch)
        self.claimed -= len(batch.rows)
        return self.claim()

    # -- settles -----------------------------------------------------------------------------
    def wait_for_settling(self) -> PassResult | None:
        if self.settling is None:
            return None
        settling, self.settling = self.settling, None
        return self.count(settling)

    def count(self, settled: Future[PassResult]) -> PassResult:
        try:
            result = settled.result()
        except BrokerOutage as exc:
            self.total.add(exc.result)
            raise
        self.total.add(result)
        self.relay.beat()
        return result

    # -- the way out -------------------------------------------------------------------------
    def release_all(self) -> None:
        """However the drain ends, give back every batch it holds, then alert on the dead."""
        if self.in_flight:
            # Stopped on an error with batches written and not collected: the backend
            # forgets them and their rows are due again at once (published again, once more
            # if the broker had them: an error allows duplicates, never loss).
            self.relay.abandon()
            for batch in self.in_flight:
                self.relay.release(batch)
            self.in_flight.clear()
        if self.settling is not None:
            # Stopped on an error (an outage while sending the next batch) with a confirmed
            # batch still being settled: record what the broker has.
            try:
                self.wait_for_settling()
            except Exception:
                logger.warning(
                    "[%s] could not settle a confirmed batch; its events are published "
                    "again when their lease runs out",
                    self.relay.job,
                    exc_info=True,
                )
        try:
            ahead = self.ahead.result()
        except Exception:
            ahead = Batch.empty()  # the claim failed: nothing to give back
        self.relay.release(ahead)
        if self.total.dead_events:
            notify_dead(self.total.dead_events)
