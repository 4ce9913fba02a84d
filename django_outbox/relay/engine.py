"""The relay: claim -> send -> collect -> settle. One engine for publish_outbox and
compensate_outbox.

1. **Claim** a batch of due rows in a short transaction (``SELECT ... FOR UPDATE SKIP
   LOCKED``; on PostgreSQL one ``UPDATE ... RETURNING``) that leases them: it sets
   ``leased_until`` and stamps a lease token, columns in no index (migration 0008). The
   transaction commits before anything is sent.
2. **Send** the batch through the backend, outside any transaction: it is in flight.
3. **Collect** the broker's answer: one result per row (confirmed, or why not).
4. **Settle** in one short transaction: confirmed rows become SENT (or are deleted, with
   ``OUTBOX_RETENTION_DAYS = 0``); failed ones get
   ``retry_count + 1``, ``last_error`` and their next due time from the retry policy, or
   DEAD past it; rows the connection was lost under, and the rest of an ordered run behind
   a failed event (held back), are released. Every update is fenced on the lease token, so
   a relay that was frozen past its lease cannot overwrite what another relay settled since.

A batch the relay stops holding before it is settled (a stop, an outage, an error, a lease
too short to send it on) is **released**: its rows are due again at once, no attempt
counted. A relay killed anywhere leaves rows that are due again once their lease runs out:
duplicates are possible, loss is not. A broker that cannot be reached is not the events'
fault: the batch is released and the relay backs off.

:class:`Relay` holds the steps, :meth:`Relay.drain` is one pass (until nothing is due) and
:meth:`Relay.serve` the loop of ``publish_outbox``; :mod:`.pipeline` runs the steps for
several batches at once; :mod:`.runs` sends ordered runs; the row writes themselves are
:class:`~django_outbox.querysets.OutboxEventQuerySet` methods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from django.db import connections, transaction

from .. import metrics, ordering, tracing
from ..backends import get_backend
from ..backends.base import BaseBackend, BrokerUnavailable, PublishResult, Reason
from ..conf import outbox_settings
from ..db import tidy_connections
from ..exceptions import error_text
from ..models import OutboxEvent, Status, outbox_db
from ..querysets import OutboxEventQuerySet
from ..retry import FixedRetryPolicy, RetryPolicy, ScheduleRetryPolicy
from ..worker import Backoff, Heartbeat, keep_running
from .batch import Batch, BrokerOutage, PassResult, Stage, failure_line
from .lanes import INLINE, Lanes, ThreadLanes
from .pipeline import Pipeline
from .runs import HELD_BACK, Runs
from .wake import Waker, make_waker

logger = logging.getLogger("django_outbox.relay")

#: Seconds of lease a batch must have left beyond a full confirm wait when it is sent.
LEASE_MARGIN = 5.0

#: After a pass that found events, the relay looks again after this fraction of the poll
#: interval: events that keep coming are picked up within a tenth of it (polling is all
#: MySQL/MariaDB and SQLite have), and an idle relay still polls at the interval. With
#: LISTEN/NOTIFY, sooner still after a pass that was woken or found events: the waker's
#: ``recheck`` (see relay.wake and notify.py, the NOTIFY window).
BUSY_POLL_FRACTION = 0.1


#: The batch size of a relay when OUTBOX_BATCH_SIZE is unset, per database vendor: the
#: fastest drain measured by bench.relay_bench (ratio to raw pika, medians): PostgreSQL 0.76
#: at 500, 0.88 at 1000, 0.85 at 2000; MariaDB 0.76 at 500, 0.82 at 1000 (0.70 and 0.64
#: while its claims split pages, before migration 0010). docs/benchmarks.md. SQLite, for
#: development, is not measured.
DEFAULT_BATCH_SIZES = {"postgresql": 1000, "mysql": 1000}
DEFAULT_BATCH_SIZE = 500


def default_batch_size(using: str) -> int:
    """The batch size for the database ``using`` when OUTBOX_BATCH_SIZE is unset."""
    return DEFAULT_BATCH_SIZES.get(connections[using].vendor, DEFAULT_BATCH_SIZE)


def due_source(queryset: OutboxEventQuerySet) -> OutboxEventQuerySet:
    """What publish_outbox claims: every due row."""
    return queryset.due()


def stale_source(stale_after: float) -> Callable[[OutboxEventQuerySet], OutboxEventQuerySet]:
    """What compensate_outbox claims: due rows created at least ``stale_after`` s ago."""

    def source(queryset: OutboxEventQuerySet) -> OutboxEventQuerySet:
        # due() leaves out rows a live relay holds: their lease has not run out.
        return queryset.due().stale(stale_after)

    return source


def _unavailable(exc: BrokerUnavailable) -> str:
    """What a row records when the broker could not be reached to publish it."""
    return f"broker unavailable: {exc}"


def _failure_key(result: PublishResult) -> tuple[str, str]:
    """A failed attempt's reason and error, for counting failures of one kind together."""
    return (result.reason.value if result.reason else "error", result.error)


def _attempt_error(result: PublishResult) -> str:
    """What a failed attempt records in ``last_error``: ``[reason] error``."""
    return f"[{result.reason.value if result.reason else 'error'}] {result.error}"


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
        pass_limit: int | None = None,
    ) -> None:
        self.backend = backend if backend is not None else get_backend()
        self.using = outbox_db(using)
        # When a drain claims the batch after the one it sends: before writing it where the
        # claim's time is spent in the database (MySQL/MariaDB: a locking read that sorts,
        # then an UPDATE), so it overlaps the write; after it on PostgreSQL, where the claim
        # is one statement and most of its time is building the rows in Python, which
        # would take the GIL from the thread writing the batch. bench.relay_bench, ratio
        # to raw pika: PostgreSQL 0.79 claiming before, 0.88 after; MariaDB 0.69 before,
        # 0.66 after.
        self.claim_before_send = connections[self.using].vendor != "postgresql"
        self.batch_size = batch_size or outbox_settings.BATCH_SIZE or default_batch_size(self.using)
        self.lease_seconds = lease_seconds or outbox_settings.LEASE_SECONDS
        self.policy = policy or ScheduleRetryPolicy.from_settings()
        self.source = source
        self.job = job
        heartbeat = outbox_settings.HEARTBEAT_FILE if heartbeat_file is None else heartbeat_file
        self.heartbeat = Heartbeat(heartbeat)
        self.db_thread = db_thread  # None: OUTBOX_DB_THREAD
        self.pass_limit = pass_limit  # drain()'s max_events when it is given none
        self._opened = False
        self._serve_lanes: ThreadLanes | None = None  # serve()'s, for all its drains
        # What the backend has been sent and not yet waited for, oldest first (its wait()
        # answers in this order): a batch, and which of its rows (None: all of them). A
        # batch with ordered runs is sent in several waves, interleaved with other batches.
        self._outstanding: deque[tuple[Batch, list[int] | None]] = deque()

    @classmethod
    def compensator(
        cls,
        *,
        stale_after: float | None = None,
        max_batch: int | None = None,
        backend: BaseBackend | None = None,
        using: str | None = None,
    ) -> Relay:
        """The relay of one compensation pass (compensate_outbox, the Celery task): stale
        PENDING rows only of database ``using`` (default :func:`outbox_db`), at most
        ``max_batch`` a pass, the compensation retry policy."""
        stale_after = stale_after or outbox_settings.COMPENSATE_STALE_AFTER
        max_batch = max_batch or outbox_settings.COMPENSATE_MAX_BATCH
        return cls(
            backend=backend if backend is not None else get_backend(),
            batch_size=max_batch,
            policy=FixedRetryPolicy.compensation(),
            source=stale_source(stale_after),
            job="compensate",
            using=using,
            pass_limit=max_batch,
        )

    def queryset(self) -> OutboxEventQuerySet:
        return OutboxEvent.objects.using(self.using).all()

    # -- the steps of a batch ----------------------------------------------------------------
    def claim(self, limit: int, after: Sequence[OutboxEvent] = (), *, heads: bool = True) -> Batch:
        """Lease up to ``limit`` rows of the source, oldest first; in ordered mode with the
        runs behind ``after`` (confirmed rows of the last batch), and only those runs when
        ``heads`` is False (see :meth:`OutboxEventQuerySet.claim`)."""
        ordered = ordering.current_ordered()
        token, rows = self.source(self.queryset()).claim(
            limit,
            lease_seconds=self.lease_seconds,
            ordered=ordered,
            run=ordering.current_run(),
            after=after,
            heads=heads,
        )
        batch = Batch(token, rows, limit, time.monotonic())
        if ordered:
            batch.runs = Runs.of(rows, after)
        return batch

    def send(self, batch: Batch) -> Batch:
        """Hand the batch to the backend; its results are collected later."""
        batch.stage = Stage.IN_FLIGHT
        batch.spans = tracing.start_publish(batch.rows, self.backend)
        first = batch.runs.first_wave() if batch.runs is not None else None
        if first is None:
            batch.results = self._call_backend(batch, self._send_rows, batch.rows)
            if batch.results is None:
                self._outstanding.append((batch, None))
        else:
            self._send_first_wave(batch, first)
        return batch

    def collect(self, batch: Batch) -> Batch:
        """Wait for the batch's results from the backend: one per row.

        The backend answers for what it was sent in order, so the parts sent before this
        batch's (or between two waves of it, for a batch with ordered runs) are taken
        first and kept on their batches. A confirm in a run sends the run's next event at
        once (:meth:`_collect_wave`), so runs move on while other batches are waited for.
        """
        while batch.results is None and self._outstanding:
            owner, wave = self._outstanding.popleft()
            if wave is None:
                owner.results = self._call_backend(owner, self.backend.wait) or []
            else:
                self._collect_wave(owner, wave)
        if batch.results is None:
            raise RuntimeError("collect() of a batch that is not in flight")
        if len(batch.results) != len(batch.rows):
            raise RuntimeError(
                f"{type(self.backend).__name__} returned {len(batch.results)} results for "
                f"{len(batch.rows)} events; a backend must return one result per event."
            )
        batch.stage = Stage.COLLECTED
        if batch.spans is not None:  # the broker answered: the publish spans end here
            batch.spans.confirmed(batch.results)
        return batch

    def settle(self, batch: Batch) -> PassResult:
        """Record the batch's results on its rows. Raises BrokerOutage, after recording,
        when the connection to the broker was lost under the batch (its unconfirmed rows
        are released)."""
        assert batch.results is not None
        result = self._record(batch.token, batch.rows, batch.results)
        batch.stage = Stage.SETTLED
        result.batches = 1
        metrics.batch_duration(time.monotonic() - batch.claimed_at, self.job, self.using)
        if result.lost:
            raise BrokerOutage(f"connection lost with {result.lost} events unconfirmed", result)
        return result

    def release(self, batch: Batch, error: str | None = None) -> int:
        """Give back the rows of a batch that will not be settled: due again at once, no
        attempt counted. Every way out for a batch the relay holds ends here.

        ``error`` says why they could not be published (recorded in ``last_error`` and
        counted as ``connection_lost`` failures); None keeps ``last_error`` (a stop, a batch
        claimed ahead and not needed). Best effort: if the database is gone too, the lease
        runs out by itself. Returns how many rows were given back.
        """
        if not batch.held:
            return 0
        batch.stage = Stage.RELEASED
        if batch.spans is not None:  # given back before the broker answered for it
            batch.spans.released(error)
        try:
            given = self.queryset().release(batch.token, [r.pk for r in batch.rows], error)
        except Exception:
            logger.warning(
                "[%s] could not release %d claimed events; they are due again when their "
                "lease runs out",
                self.job,
                len(batch.rows),
                exc_info=True,
            )
            return 0
        if error is not None:
            metrics.failed(Reason.CONNECTION_LOST.value, len(batch.rows), self.job, self.using)
        if given < len(batch.rows):
            logger.warning(
                "[%s] %d of %d events being released had been taken over by another relay "
                "(this relay outlived its lease); left to it",
                self.job,
                len(batch.rows) - given,
                len(batch.rows),
            )
        return given

    def lease_covers_a_send(self, batch: Batch) -> bool:
        """Enough of the batch's lease is left to send it and wait a full confirm timeout.

        A batch claimed ahead waits for earlier batches' confirms before it is sent; sent
        with too little lease left, another relay could take it over while its own confirms
        are still coming back.
        """
        timeout = self.backend.confirm_timeout
        return time.monotonic() - batch.claimed_at < self.lease_seconds - timeout - LEASE_MARGIN

    # -- passes ------------------------------------------------------------------------------
    def relay_batch(self, limit: int | None = None) -> PassResult:
        """Claim, send, collect and settle one batch. Raises BrokerOutage after releasing it."""
        batch = self.claim(limit or self.batch_size)
        if not batch.rows:
            return PassResult()
        try:
            return self.settle(self.collect(self.send(batch)))
        finally:
            self.release(batch)

    def drain(
        self,
        *,
        max_events: int | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> PassResult:
        """One pass (``publish_outbox --once``, ``compensate_outbox``, the Celery tasks,
        ``relay_now()``): batches until nothing is due, at most ``max_events`` (default:
        the compensator's ``max_batch``), then alert on dead rows and close the backend.

        Raises BrokerOutage when the broker went away (after alerting on what died).
        """
        try:
            return self._drain(
                max_events=self.pass_limit if max_events is None else max_events,
                should_stop=should_stop,
            )
        finally:
            self.close()

    def _drain(self, *, max_events: int | None, should_stop: Callable[[], bool]) -> PassResult:
        """:meth:`drain` without closing the backend (:meth:`serve` keeps it open).

        Pipelined (see :class:`~django_outbox.relay.pipeline.Pipeline`): while the broker
        confirms the batches in flight, the one before them is settled and the one after
        them claimed.
        """
        with self._lanes() as lanes:
            pipeline = Pipeline(self, lanes, max_events=max_events, should_stop=should_stop)
            return pipeline.drain()

    def serve(
        self,
        *,
        stop: threading.Event,
        interval: float | None = None,
        waker: Waker | None = None,
        max_events: int | None = None,
    ) -> PassResult:
        """Relay until ``stop`` is set (``publish_outbox``): drain, then sleep until woken or
        ``interval``, again.

        Never dies on a transient error (a broker or database outage): it backs off and
        tries again; the liveness probe catches a relay that stops making progress. A broker
        node lost under a batch is left once the batch is settled: the backend moves on to
        the next node (:meth:`BaseBackend.next_node`), tried at once until every node has
        failed in turn, then with the backoff.
        """
        interval = outbox_settings.POLL_INTERVAL if interval is None else interval
        waker = waker or make_waker(self.using, stop)
        total = PassResult()
        woken = False  # the last wait was ended by a wake-up
        if self._serve_lanes is None and self._can_use_a_thread():
            # One set of lanes (and database connections) for every drain it makes.
            self._serve_lanes = self._new_lanes()
        logger.info(
            "[%s] relay started: backend=%s batch_size=%d interval=%ss wake=%s",
            self.job,
            type(self.backend).__name__,
            self.batch_size,
            interval,
            type(waker).__name__,
        )

        def one_pass() -> bool:
            nonlocal woken
            self._tidy()
            self.beat()
            remaining = None if max_events is None else max_events - total.found
            if remaining is not None and remaining <= 0:
                return True
            result = self._drain(max_events=remaining, should_stop=stop.is_set)
            total.add(result)
            if result.found:
                logger.info("[%s] %s", self.job, result.summary())
            self._tidy()
            if result.found or woken:
                woken = waker.wait(min(interval * BUSY_POLL_FRACTION, waker.recheck))
            else:
                woken = waker.wait(interval)
            return False

        def fail_over(exc: Exception) -> bool:
            # Settled already (the pipeline settles a lost batch before raising): the next
            # connection may go to another node.
            return isinstance(exc, BrokerOutage) and self.backend.next_node()

        def failed(exc: Exception, pause: float) -> None:
            if isinstance(exc, BrokerOutage):
                self._close_backend()
                if pause:
                    logger.warning(
                        "[%s] broker unavailable (%s); retrying in %.1fs", self.job, exc, pause
                    )
                else:
                    logger.warning(
                        "[%s] broker unavailable (%s); trying the next broker node at once",
                        self.job,
                        exc,
                    )
            else:  # the database went away or similar
                logger.exception("[%s] relay pass failed; retrying in %.1fs", self.job, pause)
                self._tidy()

        backoff = Backoff(maximum=outbox_settings.BROKER_BACKOFF_MAX)
        try:
            keep_running(stop, one_pass, backoff=backoff, on_error=failed, fail_over=fail_over)
        finally:
            waker.close()
            self._close_backend()
            if self._serve_lanes is not None:
                self._serve_lanes.close()
                self._serve_lanes = None
            tidy_connections()
        return total

    # -- recording results -------------------------------------------------------------------
    def _record(
        self, token: str, rows: Sequence[OutboxEvent], results: Sequence[PublishResult]
    ) -> PassResult:
        """The results of a publish, in one short transaction fenced on ``token``."""
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
            if not res.ok
            and res is not HELD_BACK
            and not (res.reason is not None and res.reason.is_connection_level)
        ]
        held = [row.pk for row, res in zip(rows, results, strict=True) if res is HELD_BACK]
        result = PassResult(found=len(rows))
        events = self.queryset()
        with transaction.atomic(using=self.using):
            if sent:
                settle_sent = (
                    events.delete_confirmed
                    if outbox_settings.deletes_on_confirm
                    else events.mark_sent
                )
                result.sent = settle_sent(token, [r.pk for r in sent])
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
            if held:
                # Not attempted: due again at once, behind the failed event (or the head
                # that is claimed again with them), last_error kept.
                result.held_back = events.release(token, held)
                result.released += result.held_back
            taken = len(failed) - result.failed + len(lost) - result.lost
            if taken:
                logger.warning(
                    "[%s] %d of %d failed or unconfirmed events had been taken over by "
                    "another relay (this relay outlived its lease); left as it settled them",
                    self.job,
                    taken,
                    len(failed) + len(lost),
                )
        metrics.published((r.event_type for r in sent), self.job, self.using)
        metrics.confirm_latencies(
            (confirmed_at - r.due_since.timestamp() for r in sent), self.using
        )
        for reason in Reason:
            n = sum(1 for _, res in failed + lost if res.reason is reason)
            metrics.failed(reason.value, n, self.job, self.using)
        metrics.dead(result.dead, self.job, self.using)
        if failed:
            # One line per kind of failure (an unroutable route, a full queue): what the
            # broker said and what to do, not only which events.
            kinds: dict[tuple[str, str], list[str]] = {}
            for row, res in failed:
                kinds.setdefault(_failure_key(res), []).append(row.event_id)
            for key, ids in sorted(kinds.items(), key=lambda kind: -len(kind[1])):
                result.failures[key] += len(ids)
                logger.warning(
                    "[%s] events failed: %s (event ids: %s)",
                    self.job,
                    failure_line(len(ids), *key),
                    ", ".join(ids[:10]) + (", ..." if len(ids) > 10 else ""),
                )
        logger.debug("[%s] batch %s", self.job, result.summary())
        return result

    # -- the backend -------------------------------------------------------------------------
    def _send_rows(self, rows: list[OutboxEvent]) -> None:
        self._ensure_open()
        self.backend.send(rows)

    def _failure(self, exc: Exception, count: int, doing: str) -> PublishResult:
        """The result of ``count`` rows whose backend call raised ``exc``: a broker that
        cannot be reached is the connection's fault; any other error (a bug, an unexpected
        library error) is counted against the rows, which may be what triggers it, rather
        than looped on forever."""
        if isinstance(exc, BrokerUnavailable):
            return PublishResult.failed(Reason.CONNECTION_LOST, _unavailable(exc))
        logger.error("[%s] backend raised while %s %d events", self.job, doing, count, exc_info=exc)
        return PublishResult.failed(Reason.ERROR, error_text(exc))

    def abandon(self) -> None:
        """Forget every batch sent and not collected (the backend's :meth:`abandon`)."""
        self._outstanding.clear()
        self.backend.abandon()

    def _call_backend(
        self, batch: Batch, call: Callable[..., list[PublishResult] | None], *args: Any
    ) -> list[PublishResult] | None:
        """``call(*args)``; a broker that cannot be reached: the batch is released and
        BrokerOutage raised; any other error fails every row of the batch."""
        try:
            return call(*args)
        except BrokerUnavailable as exc:
            raise self._outage(batch, exc) from exc
        except Exception as exc:
            return [self._failure(exc, len(batch.rows), "publishing")] * len(batch.rows)

    def _outage(self, batch: Batch, exc: BrokerUnavailable) -> BrokerOutage:
        """The broker cannot be reached with nothing of ``batch`` out: its rows are given
        back (no attempt counted) and the outage returned for the caller to raise."""
        self.release(batch, _unavailable(exc))
        return BrokerOutage(str(exc), permanent=exc.permanent)

    def _ensure_open(self) -> None:
        if not self._opened:
            self.backend.open()
            self._opened = True

    def _close_backend(self) -> None:
        self._outstanding.clear()  # a closed backend answers for none of it
        if self._opened:
            self._opened = False
            try:
                self.backend.close()
            except Exception:
                logger.debug("closing the backend failed", exc_info=True)

    def close(self) -> None:
        self._close_backend()

    # -- ordered runs: a batch sent in waves (relay/runs.py tells the story) -----------------
    def _send_first_wave(self, batch: Batch, wave: list[int]) -> None:
        assert batch.runs is not None
        if wave:  # else every row waits behind an event that was not confirmed
            self._send_wave(batch, batch.runs, wave, first=True)
        batch.results = batch.runs.done()

    def _send_wave(self, batch: Batch, runs: Runs, wave: list[int], *, first: bool = False) -> None:
        """Send the rows ``wave`` of a batch with ordered runs."""
        try:
            self._send_rows([batch.rows[index] for index in wave])
        except Exception as exc:
            if first and isinstance(exc, BrokerUnavailable):
                # Nothing of the batch is out: give it all back, as for a whole batch.
                raise self._outage(batch, exc) from exc
            runs.resolve(wave, self._failure(exc, len(wave), "publishing"))
            return
        self._outstanding.append((batch, wave))

    def _collect_wave(self, batch: Batch, wave: list[int]) -> None:
        """The backend's results for the rows ``wave`` of ``batch``, the oldest part it has
        (see :meth:`collect`); an error fails those rows (and holds back their runs). The
        followers of the confirmed ones go out at once, as the next wave."""
        runs = batch.runs
        assert runs is not None
        try:
            results = self.backend.wait()
        except Exception as exc:
            results = [self._failure(exc, len(wave), "waiting for")] * len(wave)
        following = runs.take(wave, results)
        if following and not self.lease_covers_a_send(batch):
            # Too little lease left for another confirm wait: the rest of each run is
            # given back, to be claimed again (with its head) by this relay or another.
            runs.resolve(following, HELD_BACK)
        elif following:
            self._send_wave(batch, runs, following)
        batch.results = runs.done()

    # -- database lanes, connections, heartbeat ----------------------------------------------
    @contextmanager
    def _lanes(self) -> Iterator[Lanes]:
        """Where a drain does its database work: serve()'s lanes when it started some, else
        lanes for this drain, else (SQLite, inside a transaction, OUTBOX_DB_THREAD off)
        this thread."""
        if self._serve_lanes is not None:
            yield self._serve_lanes
            return
        if not self._can_use_a_thread():
            yield INLINE
            return
        lanes = self._new_lanes()
        try:
            yield lanes
        finally:
            lanes.close()

    def _new_lanes(self) -> ThreadLanes:
        return ThreadLanes(f"outbox-{self.job}-db")

    def _can_use_a_thread(self) -> bool:
        if not (self.db_thread if self.db_thread is not None else outbox_settings.DB_THREAD):
            return False
        connection = connections[self.using]
        # Another connection cannot see the caller's uncommitted rows; SQLite has one writer.
        return connection.vendor != "sqlite" and not connection.in_atomic_block

    def _tidy(self) -> None:
        tidy_connections()
        if self._serve_lanes is not None:
            self._serve_lanes.each_connection(tidy_connections)

    def beat(self) -> None:
        """Touch the heartbeat file, for a liveness probe."""
        self.heartbeat.beat()
