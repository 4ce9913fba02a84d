"""The relay: claim -> publish -> settle. One engine for publish_outbox and compensate_outbox.

1. **Claim** a batch of due rows in a short transaction (``SELECT ... FOR UPDATE SKIP
   LOCKED``) that pushes their ``next_retry_time`` forward as a lease and stamps a lease
   token. The transaction commits before anything is sent.
2. **Publish** the batch through the backend, outside any transaction, and wait for the
   broker's confirms.
3. **Settle** in one short transaction: confirmed rows become SENT; failed ones get
   ``retry_count + 1``, ``last_error`` and their next due time from the retry policy, or
   DEAD past it. Every update is fenced on the lease token, so a relay that was frozen past
   its lease cannot overwrite what another relay settled since.

A relay killed anywhere leaves rows that are due again once their lease runs out:
duplicates are possible, loss is not. A broker that cannot be reached is not the events'
fault: their claim is released without counting an attempt and the relay backs off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, router, transaction

from .. import metrics, ordering
from ..alerts import notify_dead
from ..backends import get_backend
from ..backends.base import BaseBackend, BrokerUnavailable, PublishResult, Reason
from ..conf import outbox_settings
from ..db import tidy_connections
from ..models import OutboxEvent, Status
from ..querysets import OutboxEventQuerySet
from ..retry import FixedRetryPolicy, RetryPolicy, ScheduleRetryPolicy
from ..worker import Backoff
from .lanes import INLINE, DbWorker, ThreadDbWorker, _done
from .wake import Waker, make_waker

logger = logging.getLogger("django_outbox.relay")

# Seconds of lease a batch claimed ahead must have beyond a full confirm wait when it is sent.
LEASE_MARGIN = 5.0
# Batches a draining relay keeps written to the broker and not yet confirmed: the broker
# works on one while the relay writes the next.
IN_FLIGHT = 2


class BrokerOutage(Exception):
    """The broker went away; the batch's claims were released. The caller backs off.

    ``result`` holds what the interrupted batch did settle (confirmed or dead rows).
    """

    def __init__(self, message: str, result: PassResult | None = None) -> None:
        super().__init__(message)
        self.result = result if result is not None else PassResult()


@dataclass
class PassResult:
    """Totals of one or more batches."""

    found: int = 0
    sent: int = 0
    failed: int = 0
    dead: int = 0
    released: int = 0
    batches: int = 0
    dead_events: list[OutboxEvent] = field(default_factory=list, repr=False)

    def add(self, other: PassResult) -> None:
        self.found += other.found
        self.sent += other.sent
        self.failed += other.failed
        self.dead += other.dead
        self.released += other.released
        self.batches += other.batches
        self.dead_events.extend(other.dead_events)

    def summary(self) -> str:
        return f"found={self.found} sent={self.sent} failed={self.failed} dead={self.dead}"


@dataclass
class _Claim:
    """Rows leased under one token, for one batch."""

    token: str
    rows: list[OutboxEvent]
    limit: int
    at: float  # time.monotonic() of the claim

    @property
    def full(self) -> bool:
        """As many rows as asked for: more may be due behind them."""
        return bool(self.rows) and len(self.rows) >= self.limit


_NOTHING = _Claim("", [], 0, 0.0)


@dataclass
class _Published:
    """A claim handed to the backend, and its results once collected."""

    claim: _Claim
    results: list[PublishResult] | None = None

    @property
    def connection_lost(self) -> bool:
        return any(
            r.reason is not None and r.reason.is_connection_level for r in self.results or ()
        )


def _attempt_error(result: PublishResult) -> str:
    """What a failed attempt records in ``last_error``: ``[reason] error``."""
    return f"[{result.reason.value if result.reason else 'error'}] {result.error}"


def due_source(queryset: OutboxEventQuerySet) -> OutboxEventQuerySet:
    """What publish_outbox claims: every due row."""
    return queryset.due()


def stale_source(stale_after: float) -> Callable[[OutboxEventQuerySet], OutboxEventQuerySet]:
    """What compensate_outbox claims: due rows created at least ``stale_after`` s ago."""

    def source(queryset: OutboxEventQuerySet) -> OutboxEventQuerySet:
        # due() leaves out rows a live relay holds: their lease keeps them in the future.
        return queryset.due().stale(stale_after)

    return source


class Relay:
    """Moves committed outbox rows to the broker. Used by one thread.

    ``source`` narrows what is claimed (the compensator passes stale rows only);
    ``policy`` decides retries; ``job`` labels logs and metrics.
    """

    def __init__(
        self,
        *,
        backend: BaseBackend | None = None,
        batch_size: int | None = None,
        lease_seconds: float | None = None,
        policy: RetryPolicy | None = None,
        source: Callable[[OutboxEventQuerySet], OutboxEventQuerySet] = due_source,
        job: str = "publish",
        using: str | None = None,
        heartbeat_file: str | None = None,
        db_thread: bool | None = None,
    ) -> None:
        self.backend = backend if backend is not None else get_backend()
        self.batch_size = batch_size or outbox_settings.BATCH_SIZE
        self.lease_seconds = lease_seconds or outbox_settings.LEASE_SECONDS
        self.policy = policy or ScheduleRetryPolicy.from_settings()
        self.source = source
        self.job = job
        self.using = using or router.db_for_write(OutboxEvent) or DEFAULT_DB_ALIAS
        heartbeat = outbox_settings.HEARTBEAT_FILE if heartbeat_file is None else heartbeat_file
        self.heartbeat_path = Path(heartbeat) if heartbeat else None
        self.db_thread = db_thread  # None: OUTBOX_DB_THREAD
        self._opened = False
        self._worker: ThreadDbWorker | None = None  # run()'s, for all its drains

    @classmethod
    def compensator(
        cls,
        *,
        stale_after: float | None = None,
        max_batch: int | None = None,
        backend: BaseBackend | None = None,
    ) -> Relay:
        """The relay of one compensation pass (compensate_outbox, the Celery task): stale
        PENDING rows only, the compensation retry policy. Drain it with
        ``max_events=relay.batch_size``."""
        stale_after = stale_after or outbox_settings.COMPENSATE_STALE_AFTER
        max_batch = max_batch or outbox_settings.COMPENSATE_MAX_BATCH
        return cls(
            backend=backend if backend is not None else get_backend(),
            batch_size=max_batch,
            policy=FixedRetryPolicy.compensation(),
            source=stale_source(stale_after),
            job="compensate",
        )

    # -- one batch -------------------------------------------------------------------------
    def queryset(self) -> OutboxEventQuerySet:
        return OutboxEvent.objects.using(self.using).all()

    def claim(self, limit: int) -> tuple[str, list[OutboxEvent]]:
        return self.source(self.queryset()).claim(limit, lease_seconds=self.lease_seconds)

    def run_batch(self, limit: int | None = None) -> PassResult:
        """Claim, publish and settle one batch. Raises BrokerOutage after releasing it."""
        claim = self._claim(limit or self.batch_size)
        if not claim.rows:
            return PassResult()
        return self._settle_published(self._collect(self._send(claim)))

    # The steps of a batch. drain() interleaves them across batches; run_batch() does one.
    def _claim(self, limit: int) -> _Claim:
        token, rows = self.claim(limit)
        return _Claim(token, rows, limit, time.monotonic())

    def _send(self, claim: _Claim) -> _Published:
        """Hand the batch to the backend (``send``); its confirms are collected later."""
        published = _Published(claim)
        published.results = self._call_backend(claim, self._send_rows, claim.rows)
        return published

    def _send_rows(self, rows: list[OutboxEvent]) -> None:
        self._ensure_open()
        self.backend.send(rows)

    def _collect(self, published: _Published) -> _Published:
        """Wait for the batch's confirms (``wait``): one result per row."""
        claim = published.claim
        if published.results is None:
            published.results = self._call_backend(claim, self.backend.wait)
        assert published.results is not None
        if len(published.results) != len(claim.rows):
            raise RuntimeError(
                f"{type(self.backend).__name__}.publish() returned {len(published.results)} "
                f"results for {len(claim.rows)} events; a backend must return one result per "
                "event."
            )
        return published

    def _call_backend(
        self, claim: _Claim, call: Callable[..., list[PublishResult] | None], *args: Any
    ) -> list[PublishResult] | None:
        """``call(*args)``; a broker that cannot be reached: the claim is released and
        BrokerOutage raised; any other error fails every row of the claim."""
        try:
            return call(*args)
        except BrokerUnavailable as exc:
            self.release(claim.token, claim.rows, f"broker unavailable: {exc}")
            raise BrokerOutage(str(exc)) from exc
        except Exception as exc:
            return self._backend_error(claim, exc)

    def _backend_error(self, claim: _Claim, exc: Exception) -> list[PublishResult]:
        # A bug or an unexpected library error: count it against the rows (they may be what
        # triggers it) rather than loop on them forever.
        logger.error(
            "[%s] backend raised while publishing %d events",
            self.job,
            len(claim.rows),
            exc_info=exc,
        )
        return [PublishResult.failed(Reason.ERROR, f"{type(exc).__name__}: {exc}")] * len(
            claim.rows
        )

    def _settle_published(self, published: _Published) -> PassResult:
        claim = published.claim
        assert published.results is not None
        result = self.settle(claim.token, claim.rows, published.results)
        result.batches = 1
        metrics.batch_duration(time.monotonic() - claim.at, self.job)
        if result.released:
            raise BrokerOutage(f"connection lost with {result.released} events unconfirmed", result)
        return result

    def settle(
        self, token: str, rows: Sequence[OutboxEvent], results: Sequence[PublishResult]
    ) -> PassResult:
        """Record the outcome of a publish in one short transaction, fenced on the token."""
        confirmed_at = time.time()
        sent = [row for row, res in zip(rows, results, strict=True) if res.ok]
        lost = [
            (row, res)
            for row, res in zip(rows, results, strict=True)
            if not res.ok and res.reason is not None and res.reason.is_connection_level
        ]
        failed = [
            (row, res)
            for row, res in zip(rows, results, strict=True)
            if not res.ok and not (res.reason is not None and res.reason.is_connection_level)
        ]
        result = PassResult(found=len(rows))
        events = self.queryset()
        with transaction.atomic(using=self.using):
            if sent:
                result.sent = events.mark_sent(token, [r.pk for r in sent])
                if result.sent < len(sent):
                    logger.warning(
                        "[%s] %d of %d confirmed events had been taken over by another relay "
                        "(this relay outlived its lease); they may be delivered twice",
                        self.job,
                        len(sent) - result.sent,
                        len(sent),
                    )
            if failed:
                changed = events.mark_failed(
                    token, [(r, _attempt_error(res)) for r, res in failed], self.policy
                )
                result.failed = len(changed)
                result.dead_events = [r for r in changed if r.status == Status.DEAD]
                result.dead = len(result.dead_events)
            if lost:
                result.released = events.release(
                    token, [r.pk for r, _ in lost], f"connection lost: {lost[0][1].error}"
                )
            taken = len(failed) - result.failed + len(lost) - result.released
            if taken:
                logger.warning(
                    "[%s] %d of %d failed or unconfirmed events had been taken over by "
                    "another relay (this relay outlived its lease); left as it settled them",
                    self.job,
                    taken,
                    len(failed) + len(lost),
                )
        metrics.published((r.event_type for r in sent), self.job)
        metrics.confirm_latencies(confirmed_at - r.created_at.timestamp() for r in sent)
        for reason in Reason:
            metrics.failed(
                reason.value, sum(1 for _, res in failed + lost if res.reason is reason), self.job
            )
        metrics.dead(result.dead, self.job)
        if failed:
            logger.warning(
                "[%s] %d events failed: %s",
                self.job,
                len(failed),
                ", ".join(
                    f"{r.event_id} ({res.reason and res.reason.value})" for r, res in failed[:10]
                ),
            )
        logger.debug("[%s] batch %s", self.job, result.summary())
        return result

    def release(self, token: str, rows: Sequence[OutboxEvent], error: str) -> int:
        """Give claimed rows back, due at once, without counting an attempt."""
        n = self.queryset().release(token, [r.pk for r in rows], error)
        metrics.failed(Reason.CONNECTION_LOST.value, len(rows), self.job)
        return n

    def give_back(self, claim: _Claim) -> None:
        """Release a claim that was never published (claimed ahead, then not needed).

        Best effort: if the database is gone too, the lease runs out by itself.
        """
        if not claim.rows:
            return
        try:
            given = self.queryset().release(claim.token, [r.pk for r in claim.rows])
            if given < len(claim.rows):
                logger.warning(
                    "[%s] %d of %d events claimed ahead had been taken over by another relay "
                    "(this relay outlived its lease); left to it",
                    self.job,
                    len(claim.rows) - given,
                    len(claim.rows),
                )
        except Exception:
            logger.warning(
                "[%s] could not give back %d claimed events; they are due again when their "
                "lease runs out",
                self.job,
                len(claim.rows),
                exc_info=True,
            )

    # -- passes ----------------------------------------------------------------------------
    def drain(
        self,
        *,
        max_events: int | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> PassResult:
        """Run batches until nothing is due (or ``max_events``), then alert on dead rows.

        Pipelined, so the relay, the database and the broker work at the same time: two
        batches are kept written to the broker (``IN_FLIGHT``); while their confirms come
        back, the batch before them is settled and the one after them claimed, each in its
        own short transaction, on a claims thread and a settles thread with a database
        connection each (``OUTBOX_DB_THREAD``; on this thread, in turn, on SQLite or
        inside a transaction). A batch with a lost connection among its results is settled
        at once with every batch in flight behind it, and the outage raised. A claim made
        ahead and not published (a stop, an outage, an error) is given back: due again, no
        attempt counted.

        Raises BrokerOutage when the broker went away (after alerting on what died).
        """
        total = PassResult()
        ordered = ordering.is_enabled()
        claimed = 0  # rows claimed so far, for max_events

        def claim() -> _Claim:
            nonlocal claimed
            limit = (
                self.batch_size
                if max_events is None
                else min(self.batch_size, max_events - claimed)
            )
            if limit <= 0 or should_stop():
                return _NOTHING
            batch = self._claim(limit)
            claimed += len(batch.rows)
            return batch

        def again(stale: _Claim) -> _Claim:
            """Claim afresh in place of ``stale`` (given back): within max_events too."""
            nonlocal claimed
            claimed -= len(stale.rows)
            return claim()

        def settled(future: Future[PassResult]) -> PassResult:
            try:
                result = future.result()
            except BrokerOutage as exc:
                total.add(exc.result)
                raise
            total.add(result)
            self.beat()
            return result

        with self._db_worker() as db:
            ahead = db.claim(claim)  # the next batch, claimed while others are published
            inflight: deque[_Published] = deque()  # written to the broker, oldest first
            settling: Future[PassResult] | None = None  # the last batch collected
            try:
                while True:
                    # Keep the broker busy: write batches while the window has room.
                    while len(inflight) < IN_FLIGHT:
                        batch = ahead.result()
                        ahead = _done(_NOTHING)
                        if batch.rows and should_stop():
                            ahead = _done(batch)  # given back below
                            break
                        if batch.rows:
                            batch = self._fresh(batch, again)
                        if not batch.rows:
                            break
                        if batch.full:
                            ahead = db.claim(claim)
                        inflight.append(self._send(batch))
                        if not batch.full:
                            break
                    if not inflight:
                        if settling is None:
                            break
                        last, settling = settling, None
                        result = settled(last)
                        # In ordered mode a batch holds one event per aggregate: what it
                        # settled lets the next events of those aggregates become heads.
                        if ordered and (result.sent or result.dead) and not should_stop():
                            ahead = db.claim(claim)
                            continue
                        break
                    published = self._collect(inflight.popleft())
                    if settling is not None:
                        last, settling = settling, None
                        settled(last)
                    if published.connection_lost:
                        # Gone under every batch in flight: settle them all (what was not
                        # confirmed is released), then let the caller back off.
                        lost = [published, *(self._collect(p) for p in list(inflight))]
                        inflight.clear()
                        outages = []
                        for each in lost:
                            try:
                                settled(db.settle(self._settle_published, each))
                            except BrokerOutage as exc:
                                outages.append(exc)
                        if outages:
                            raise outages[0]
                        continue
                    settling = db.settle(self._settle_published, published)
                if settling is not None:  # stopped with the last batch still settling
                    last, settling = settling, None
                    settled(last)
            finally:
                if inflight:
                    # Stopped on an error with batches written and not collected: forget
                    # them and give their rows back, due at once (published again, once
                    # more if the broker had them: an error allows duplicates, never loss).
                    self.backend.abandon()
                    for each in inflight:
                        self.give_back(each.claim)
                if settling is not None:
                    # The loop stopped on an error (an outage while sending the next batch)
                    # with a confirmed batch still being settled: record what the broker has.
                    try:
                        settled(settling)
                    except Exception:
                        logger.warning(
                            "[%s] could not settle a confirmed batch; its events are "
                            "published again when their lease runs out",
                            self.job,
                            exc_info=True,
                        )
                try:
                    leftover = ahead.result()
                except Exception:
                    leftover = _NOTHING  # the claim failed: nothing to give back
                self.give_back(leftover)
                if total.dead_events:
                    notify_dead(total.dead_events)
        return total

    def _fresh(self, claim: _Claim, again: Callable[[_Claim], _Claim]) -> _Claim:
        """``claim`` if its lease still covers a full confirm wait, else it is given back
        and ``again(claim)`` claims in its place.

        A batch claimed ahead waits for the previous batch's confirms before it is sent;
        sent with too little lease left, another relay could take it over while its own
        confirms are still coming back.
        """
        timeout = float(getattr(self.backend, "confirm_timeout", 0.0))
        if time.monotonic() - claim.at < self.lease_seconds - timeout - LEASE_MARGIN:
            return claim
        self.give_back(claim)
        return again(claim)

    def run(
        self,
        *,
        stop: threading.Event,
        interval: float | None = None,
        waker: Waker | None = None,
        max_events: int | None = None,
    ) -> PassResult:
        """Relay until ``stop`` is set: drain, then sleep until woken or ``interval``."""
        interval = outbox_settings.POLL_INTERVAL if interval is None else interval
        waker = waker or make_waker(self.using, stop)
        backoff = Backoff(maximum=outbox_settings.BROKER_BACKOFF_MAX)
        total = PassResult()
        if self._worker is None and self._can_use_a_thread():
            # One worker (and database connection) for every drain of this run, not one each.
            self._worker = self._new_worker()
        logger.info(
            "[%s] relay started: backend=%s batch_size=%d interval=%ss wake=%s",
            self.job,
            type(self.backend).__name__,
            self.batch_size,
            interval,
            type(waker).__name__,
        )
        try:
            while not stop.is_set():
                self._tidy()
                self.beat()
                remaining = None if max_events is None else max_events - total.found
                if remaining is not None and remaining <= 0:
                    break
                try:
                    result = self.drain(max_events=remaining, should_stop=stop.is_set)
                except BrokerOutage as exc:
                    self._close_backend()
                    pause = backoff.next()
                    logger.warning(
                        "[%s] broker unavailable (%s); retrying in %.1fs", self.job, exc, pause
                    )
                    stop.wait(pause)
                    continue
                except Exception:
                    # The database went away or similar: never die on a transient error;
                    # the liveness probe catches a relay that stops making progress.
                    pause = backoff.next()
                    logger.exception("[%s] relay pass failed; retrying in %.1fs", self.job, pause)
                    self._tidy()
                    stop.wait(pause)
                    continue
                backoff.reset()
                total.add(result)
                if result.found:
                    logger.info("[%s] %s", self.job, result.summary())
                self._tidy()
                waker.wait(interval)
        finally:
            waker.close()
            self._close_backend()
            if self._worker is not None:
                self._worker.close()
                self._worker = None
            tidy_connections()
        return total

    # -- plumbing --------------------------------------------------------------------------
    @contextmanager
    def _db_worker(self) -> Iterator[DbWorker]:
        """Where drain() does its database work: the relay's worker thread when run() has
        started one, else one for this drain, else (SQLite, inside a transaction,
        OUTBOX_DB_THREAD off) this thread."""
        if self._worker is not None:
            yield self._worker
            return
        if not self._can_use_a_thread():
            yield INLINE
            return
        worker = self._new_worker()
        try:
            yield worker
        finally:
            worker.close()

    def _new_worker(self) -> ThreadDbWorker:
        return ThreadDbWorker(f"outbox-{self.job}-db")

    def _can_use_a_thread(self) -> bool:
        if not (self.db_thread if self.db_thread is not None else outbox_settings.DB_THREAD):
            return False
        connection = connections[self.using]
        # Another connection cannot see the caller's uncommitted rows; SQLite has one writer.
        return connection.vendor != "sqlite" and not connection.in_atomic_block

    def _tidy(self) -> None:
        tidy_connections()
        if self._worker is not None:
            self._worker.each_connection(tidy_connections)

    def _ensure_open(self) -> None:
        if not self._opened:
            self.backend.open()
            self._opened = True

    def _close_backend(self) -> None:
        if self._opened:
            self._opened = False
            try:
                self.backend.close()
            except Exception:
                logger.debug("closing the backend failed", exc_info=True)

    def close(self) -> None:
        self._close_backend()

    def beat(self) -> None:
        """Touch the heartbeat file, for a liveness probe."""
        if self.heartbeat_path is None:
            return
        try:
            self.heartbeat_path.touch()
        except FileNotFoundError:
            self.heartbeat_path.parent.mkdir(parents=True, exist_ok=True)
            self.heartbeat_path.touch()
