"""Querysets that speak the outbox's domain, and the row's whole lifecycle.

Reading: ``pending()``, ``due()``, ``stale()``, ``scheduled()``, ``dead()``,
``blocked_aggregates()`` ...

Writing: every transition of an outbox row is a method here, and no other module writes
``status``, ``next_retry_time``, ``due_at``, ``retry_count``, ``replay_count``,
``leased_until``, ``lease_token`` or ``last_error``::

    emit()            claim()                    mark_sent()
    ─────> PENDING ──────────> PENDING, leased ─────────────> SENT ──delete_in_batches()──>
            ^   ^                  │       ├─ delete_confirmed() ─> gone (OUTBOX_RETENTION_DAYS = 0)
            │   └─── release() ────┘       └─ mark_failed() ─> PENDING, due after a backoff,
            │                                                  or DEAD past the last one
            ├──── requeue() ──── DEAD <── mark_dead() ── PENDING
            └──── requeue(replay=True) ──── SENT (published again, same event_id)

Each one stamps ``updated_at`` from the database clock. The transitions of a claimed row
(``mark_sent``, ``delete_confirmed``, ``mark_failed``, ``release``) are *fenced* on the
claim's lease token through :meth:`OutboxEventQuerySet.held_by`: a relay that outlived its
lease changes nothing that another relay has claimed or settled since.

``emit()`` makes a row due at once, or *scheduled*: due at ``deliver_at`` or after ``delay``
(``due_at``, see :func:`~django_outbox.schedule.due_time`), and not claimable before.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connections, models, transaction

from . import ordering
from ._compat.django import build_rows, delete_rows
from .db import DbNow, read_committed_atomic
from .exceptions import error_text
from .schedule import as_timedelta, due_since, due_time, scheduled_q
from .states import Status

if TYPE_CHECKING:
    from .models import InboxMessage, OutboxEvent  # noqa: F401 (InboxMessage: a type argument)
    from .retry import RetryPolicy

# What a claim loads: what a message is built from, a settle and the confirm latency
# (created_at, due_at) need. The rest (next_retry_time, leased_until, last_error, sent_at,
# updated_at) is deferred: building the rows is a good part of a relay's time, and each
# datetime column costs a parse per row (due_at only where it is set: NULL is not parsed).
CLAIM_FIELDS = (
    "id",
    "event_id",
    "event_type",
    "aggregate_type",
    "aggregate_id",
    "payload",
    "headers",
    "occurred_at",
    "created_at",
    "due_at",
    "retry_count",
    "replay_count",
    "status",
    "lease_token",
)


_M = TypeVar("_M", bound=models.Model)
_Q = TypeVar("_Q", bound="BatchedQuerySet[Any]")


@functools.cache
def _columns(model: type[models.Model]) -> tuple[tuple[tuple[str, Any], ...], frozenset[str]]:
    """``model``'s columns as (attname, field), in the order ``Model(*values)`` takes them,
    and the set of their attnames."""
    fields = model._meta.concrete_fields
    return tuple((field.attname, field) for field in fields), frozenset(
        field.attname for field in fields
    )


class _AnyOf(models.Lookup):
    """``lhs = ANY(%s)`` with a list as the one parameter (PostgreSQL)."""

    lookup_name = "any_of"
    prepare_rhs = False

    def as_sql(self, compiler: Any, connection: Any) -> Any:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        return f"{lhs} = ANY(%s)", (*lhs_params, self.rhs)


class BatchedQuerySet(models.QuerySet[_M]):
    """What every table of this app that is deleted from in bulk shares: selection by a
    list of primary keys, and deletion in short batches."""

    def with_ids(self: _Q, ids: Sequence[int]) -> _Q:
        """Rows whose id is one of ``ids`` (``pk__in``).

        On PostgreSQL the ids travel as one array (``id = ANY(%s)``): a relay's batch has
        hundreds, and ``IN (%s, %s, ...)`` makes a statement too long for psycopg's cache of
        parsed queries, with each id prepared by the field on every settle.
        """
        if connections[self.db].vendor == "postgresql":
            return self.filter(_AnyOf(models.F("pk"), list(ids)))
        return self.filter(pk__in=ids)

    def delete_in_batches(
        self,
        batch_size: int,
        *,
        on_batch: Callable[[int, float], None] | None = None,
        pause_ratio: float = 0.0,
    ) -> tuple[int, int]:
        """Delete the rows of this queryset, ``batch_size`` at a time, each batch in its own
        short transaction. Returns (rows deleted, batches); ``on_batch`` and
        ``pause_ratio`` as for :meth:`_in_batches`."""
        # Nothing references outbox or inbox rows, so each batch is one DELETE of its ids.
        return self._in_batches(
            batch_size, lambda batch: batch.delete()[0], on_batch=on_batch, pause_ratio=pause_ratio
        )

    def _in_batches(
        self: _Q,
        batch_size: int,
        change: Callable[[_Q], int],
        limit: int | None = None,
        *,
        on_batch: Callable[[int, float], None] | None = None,
        pause_ratio: float = 0.0,
    ) -> tuple[int, int]:
        """Apply ``change`` to the rows of this queryset, oldest first, ``batch_size`` (and
        at most ``limit`` in all) at a time, each batch in its own short transaction, so a
        bulk operation never holds many row locks for long. ``change`` gets this queryset
        narrowed to the batch's ids and returns how many rows it changed. Returns (rows
        changed, batches).

        Each batch runs at READ COMMITTED on MySQL/MariaDB (:func:`read_committed_atomic`),
        so it holds no gap lock an ``emit()`` would wait for. After each batch but the last
        it sleeps ``pause_ratio`` times as long as the batch took: a batch takes the disk and
        the log (every changed row is a change to each index of the table), and the pause
        hands them back to the application's writers; a slow batch (a busy server) buys a
        longer pause. ``on_batch(rows, seconds)`` is called after each batch has committed,
        with the rows it changed and how long its transaction took.
        """
        changed = batches = 0
        last_id = 0
        remaining = limit
        while remaining is None or remaining > 0:
            size = batch_size if remaining is None else min(batch_size, remaining)
            started = time.perf_counter()
            with read_committed_atomic(self.db):
                # Walking up the id keeps every SELECT a short range scan, even if a row of
                # the previous batch could not be changed; this queryset's filter is checked
                # again by the change, so a row whose state moved meanwhile is left alone.
                ids = list(
                    self.filter(pk__gt=last_id).order_by("pk").values_list("pk", flat=True)[:size]
                )
                if not ids:
                    break
                count = change(self.with_ids(ids))
            took = time.perf_counter() - started
            batches += 1
            changed += count
            last_id = ids[-1]
            if on_batch is not None:
                on_batch(count, took)
            if remaining is not None:
                remaining -= len(ids)
            if len(ids) < size:
                break
            if pause_ratio > 0 and (remaining is None or remaining > 0):
                time.sleep(took * pause_ratio)
        return changed, batches


class OutboxEventQuerySet(BatchedQuerySet["OutboxEvent"]):
    def pending(self) -> OutboxEventQuerySet:
        """Not yet confirmed by the broker (including rows leased by a relay right now)."""
        return self.filter(status=Status.PENDING)

    def sent(self) -> OutboxEventQuerySet:
        return self.filter(status=Status.SENT)

    def dead(self) -> OutboxEventQuerySet:
        return self.filter(status=Status.DEAD)

    def due(self) -> OutboxEventQuerySet:
        """PENDING rows whose next_retry_time has passed and that no relay holds (no lease,
        or one that has run out), by the database clock."""
        return (
            self.pending()
            .filter(next_retry_time__lte=DbNow())
            .filter(models.Q(leased_until__isnull=True) | models.Q(leased_until__lte=DbNow()))
        )

    def leased(self) -> OutboxEventQuerySet:
        """PENDING rows a relay holds right now: claimed, lease not yet run out."""
        return self.pending().filter(leased_until__gt=DbNow())

    def stale(self, older_than: float | timedelta) -> OutboxEventQuerySet:
        """PENDING rows that became due at least ``older_than`` ago (seconds or a timedelta):
        created then, or, for a scheduled or requeued row, due since then (:func:`due_since`)."""
        return (
            self.pending()
            .alias(became_due=due_since())
            .filter(became_due__lte=DbNow() - as_timedelta(older_than))
        )

    def scheduled(self, now: Any = None) -> OutboxEventQuerySet:
        """PENDING rows scheduled for later (``emit(deliver_at=, delay=)``), not due yet at
        ``now`` (default: the database clock). See :func:`scheduled_q`."""
        return self.filter(scheduled_q(now))

    def created_since(self, seconds: float | timedelta) -> OutboxEventQuerySet:
        return self.filter(created_at__gte=DbNow() - as_timedelta(seconds))

    def for_aggregate(self, aggregate_type: str, aggregate_id: str) -> OutboxEventQuerySet:
        return self.filter(aggregate_type=aggregate_type, aggregate_id=str(aggregate_id))

    def claim(
        self,
        limit: int,
        *,
        lease_seconds: float,
        token: str | None = None,
        ordered: bool | Sequence[str] | None = None,
        dead_head: str | None = None,
        run: int = 1,
        after: Sequence[OutboxEvent] = (),
        heads: bool = True,
    ) -> tuple[str, list[OutboxEvent]]:
        """Lease up to ``limit`` rows of this queryset, oldest first: one relay batch.

        Rows are locked with ``SELECT ... FOR UPDATE SKIP LOCKED`` in a short transaction
        that sets ``leased_until`` to ``lease_seconds`` ahead and stamps a fresh
        ``lease_token`` (columns in no index: on PostgreSQL a HOT update, migration 0008);
        the transaction commits before this returns, so nothing is held open while the
        caller publishes. Another relay skips locked rows, and once committed
        the rows are no longer due until the lease runs out. Returns the token (settles are
        fenced on it) and the claimed rows, with the columns a message is built from
        loaded (``CLAIM_FIELDS``; the others load when read). Call it on ``due()`` or
        ``stale()``.

        Ordered mode (``ordered``/``dead_head`` default to ``OUTBOX_ORDERED`` and
        ``OUTBOX_ORDERED_DEAD_HEAD``; :mod:`django_outbox.ordering` tells it): an ordered row
        is taken only while it is its aggregate's head, by a filter in this same locking
        query, and a second statement reads each claimed head's ``previous_sequence``.
        Unordered rows skip both. With ``run`` > 1 (the relay passes
        ``OUTBOX_ORDERED_RUN``), while the heads leave room in the batch, each claimed head
        brings up to ``run - 1`` followers, leased under the same token; so does each row of
        ``after`` (the last event of each run of this relay's batch in flight, confirmed and
        not yet settled), up to ``run``. ``heads=False``: only the runs behind ``after``,
        no head and no unordered row: finding heads reads an index entry per aggregate with
        unsent events (on SQLite the whole unsent ordered backlog), continuing a run only
        the run, so the relay leaves the search out of some of its claims
        (:class:`django_outbox.relay.runs.HeadSearch`).
        """
        token = token or uuid.uuid4().hex
        ordered = ordering.current_ordered() if ordered is None else ordered
        with transaction.atomic(using=self.db):
            rows = (
                self._claim_heads(limit, lease_seconds, token, ordered, dead_head) if heads else []
            )
            if ordered and run > 1 and len(rows) < limit and (rows or after):
                rows = self._claim_runs(
                    rows, limit - len(rows), run, lease_seconds, token, ordered, dead_head, after
                )
        for row in rows:
            row.lease_token = token
        return token, rows

    def _claim_heads(
        self,
        limit: int,
        lease_seconds: float,
        token: str,
        ordered: bool | Sequence[str],
        dead_head: str | None,
    ) -> list[OutboxEvent]:
        """Lease up to ``limit`` rows, oldest first: unordered rows and ordered heads (with
        their ``previous_sequence``). In the caller's transaction."""
        vendor = connections[self.db].vendor
        if vendor == "postgresql":
            rows = self._lease_returning(self, limit, lease_seconds, token, ordered, dead_head)
        else:
            if vendor == "mysql" and ordering.ordered_q(ordered) is not None:
                # The oldest rows first, as on PostgreSQL (_lease_returning); then, if the
                # batch has room left, every head (rows just leased are no longer due).
                # Each look locks candidates listed beforehand (ordering.claimable).
                ids = ordering.claimable(self, ordered, dead_head, limit, window=True)
                rows = self._lock_and_lease(
                    self._ids_or_none(ids), limit, lease_seconds, token, listed=True
                )
                room = limit - len(rows)
                if room > 0:
                    ids = ordering.claimable(self, ordered, dead_head, room, window=False)
                    rows += self._lock_and_lease(
                        self._ids_or_none(ids), room, lease_seconds, token, listed=True
                    )
                    rows.sort(key=lambda row: row.pk)
            else:
                rows = self._lock_and_lease(
                    ordering.heads_only(self, ordered, dead_head), limit, lease_seconds, token
                )
        if rows and ordered:
            base = self.model._default_manager.using(self.db).all()
            ordering.set_previous_sequences(base, rows, ordered)
        return rows

    def _ids_or_none(self, ids: Sequence[int]) -> OutboxEventQuerySet:
        return self.with_ids(ids) if ids else self.none()

    def _lock_and_lease(
        self,
        candidates: OutboxEventQuerySet,
        limit: int,
        lease_seconds: float,
        token: str,
        *,
        listed: bool = False,
    ) -> list[OutboxEvent]:
        """Lock, read and lease up to ``limit`` of ``candidates``, oldest first (not PG).
        ``listed``: ``candidates`` are a list of ids (:func:`ordering.claimable`)."""
        if not limit or candidates.query.is_empty():
            return []
        locked = candidates.select_for_update(skip_locked=True).order_by("id")[:limit]
        query = locked.values_list(*CLAIM_FIELDS).query
        sql, params = query.get_compiler(using=self.db).as_sql()
        if listed and getattr(connections[self.db], "mysql_is_mariadb", False):
            # MariaDB turns an IN list of 1,000 ids or more into a subquery on a table of
            # values, and then walks the primary key past a hot aggregate's whole queue
            # probing it; as a list it reads each id on the primary key.
            sql = f"SET STATEMENT in_predicate_conversion_threshold=0 FOR {sql}"
        rows = self._fetch_rows(sql, params)
        if rows:
            self._lease([row.pk for row in rows], lease_seconds, token)
        return rows

    def _lease_returning(
        self,
        candidates: OutboxEventQuerySet,
        limit: int,
        lease_seconds: float,
        token: str,
        ordered: bool | Sequence[str] = False,
        dead_head: str | None = None,
    ) -> list[OutboxEvent]:
        """PostgreSQL: lock, lease and read the rows in one statement (UPDATE ... RETURNING),
        one round trip instead of two and no list of ids sent back.

        The rows are looked for in two sets, each on its own partial index (migration
        0007_scheduled_events), and the ``limit`` lowest ids of both are leased:

        - rows that were never scheduled nor requeued (``due_at`` NULL), by id on
          ``django_outbox_claim_now_idx``: nearly all of them are due. In ordered mode
          this set is two: the unordered rows (without an aggregate: on
          ``django_outbox_unordered_idx``), and the aggregates' heads
          (:func:`~django_outbox.ordering.heads`, one entry per aggregate of
          ``django_outbox_heads_idx``, migration 0012), so that neither walks past the
          ordered backlog queued behind the heads;
        - the others, by due time on ``django_outbox_scheduled_idx``, a range that ends at
          now, so events scheduled for later are never read.

        One walk by id over every PENDING row would read the whole backlog of scheduled
        events on every claim (PostgreSQL's estimate of how many PENDING rows are due comes
        from the SENT rows' times, so it chooses that walk): 34 ms a claim, idle or not, with
        100,000 of them waiting, against 0.3 ms this way (bench/scheduled_bench.py).
        """
        rows = self._fetch_rows(
            *self._lease_sql(candidates, limit, lease_seconds, token, ordered, dead_head, True)
        )
        if ordering.ordered_q(ordered) is not None and len(rows) < limit:
            # The oldest rows held fewer heads than the batch has room for (a hot
            # aggregate's backlog in front, or little due): look aggregate by aggregate.
            # The rows just leased are no longer due, so none is taken twice.
            rows += self._fetch_rows(
                *self._lease_sql(
                    candidates, limit - len(rows), lease_seconds, token, ordered, dead_head
                )
            )
        rows.sort(key=lambda row: row.pk)
        return rows

    def _lease_sql(
        self,
        candidates: OutboxEventQuerySet,
        limit: int,
        lease_seconds: float,
        token: str,
        ordered: bool | Sequence[str] = False,
        dead_head: str | None = None,
        window: bool = False,
    ) -> tuple[str, list[Any]]:
        """The statement of :meth:`_lease_returning` and its parameters; ``window``: the
        heads only among the oldest rows (:func:`~django_outbox.ordering.window_heads`)."""
        connection = connections[self.db]
        quote = connection.ops.quote_name
        table = quote(self.model._meta.db_table)
        locked = candidates.select_for_update(skip_locked=True)
        q = ordering.ordered_q(ordered) if ordered else None
        now_sets = [locked]
        if q is not None:
            base = self.model._default_manager.using(self.db).all()
            heads = (
                ordering.window_heads(base, ordered, dead_head, limit * ordering.HEADS_WINDOW)
                if window
                else ordering.heads(base, ordered, dead_head)
            )
            now_sets = [locked.filter(~q), locked.filter(id__in=heads)]
            locked = ordering.heads_only(locked, ordered, dead_head)
        branches = [
            each.filter(due_at__isnull=True).order_by("id").values("id")[:limit]
            for each in now_sets
        ]
        branches.append(
            locked.filter(due_at__isnull=False)
            .order_by("next_retry_time", "id")
            .values("id")[:limit]
        )
        selects: list[str] = []
        params: list[Any] = []
        for branch in branches:
            sql, branch_params = branch.query.get_compiler(using=self.db).as_sql()
            selects.append(f"SELECT {quote('id')} FROM ({sql}) b{len(selects)}")
            params.extend(branch_params)
        columns = ", ".join(quote(name) for name in CLAIM_FIELDS)
        # statement_timestamp(): the clock DbNow() reads on PostgreSQL, as every lease does.
        # Rows locked by a branch and not among the lowest ids are left as they were; their
        # lock ends with this short transaction.
        sql = (
            f"UPDATE {table} SET {quote('leased_until')} = statement_timestamp() + %s, "
            f"{quote('lease_token')} = %s, {quote('updated_at')} = statement_timestamp() "
            f"WHERE {quote('id')} IN ({' UNION ALL '.join(selects)} ORDER BY 1 LIMIT %s) "
            f"RETURNING {columns}"
        )
        return sql, [as_timedelta(lease_seconds), token, *params, limit]

    def _fetch_rows(self, sql: str, params: Sequence[Any]) -> list[OutboxEvent]:
        """Run ``sql``, which selects ``CLAIM_FIELDS`` in order, and build the rows.

        Built as ``Model.from_db()`` would build them (the field converters applied, the
        other columns deferred, ``_state`` of a loaded row) but without ``Model.__init__``,
        its per-field work and ``pre_init``/``post_init`` signals: with them, building the
        instances took twice as long as running the claim and reading its rows. That relies
        on Django internals, kept in :func:`django_outbox._compat.django.build_rows`.
        """
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql, params)
            records = cursor.fetchall()
        return build_rows(self.model, self.db, CLAIM_FIELDS, records)

    def _lease(self, ids: Sequence[int], lease_seconds: float, token: str) -> None:
        """Lease the rows ``ids``, locked by the caller's transaction, under ``token``."""
        self.model._default_manager.using(self.db).with_ids(ids).update(
            leased_until=DbNow() + as_timedelta(lease_seconds),
            lease_token=token,
            updated_at=DbNow(),
        )

    def _claim_runs(
        self,
        rows: list[OutboxEvent],
        room: int,
        run: int,
        lease_seconds: float,
        token: str,
        ordered: bool | Sequence[str],
        dead_head: str | None,
        after: Sequence[OutboxEvent] = (),
    ) -> list[OutboxEvent]:
        """``rows`` (just claimed, in this transaction) with the followers
        :func:`~django_outbox.ordering.runs_behind` wants behind them (and behind ``after``)
        that are in this queryset and free to lock, ``room`` in all, leased under the same
        ``token``."""
        base = self.model._default_manager.using(self.db).all()
        wanted = ordering.runs_behind(
            base, rows, after, room=room, run=run, ordered=ordered, dead_head=dead_head
        )
        if wanted is None:
            return rows
        query = (
            self.with_ids(wanted.ids())
            .select_for_update(skip_locked=True)
            .order_by("id")
            .values_list(*CLAIM_FIELDS)
            .query
        )
        free = {
            row.pk: row for row in self._fetch_rows(*query.get_compiler(using=self.db).as_sql())
        }
        taken = wanted.chain(free)
        if not taken:
            return rows
        self._lease([row.pk for row in taken], lease_seconds, token)
        return sorted([*rows, *taken], key=lambda row: row.pk)

    # -- ordered mode: what is stuck ---------------------------------------------------------
    def blocked_aggregates(
        self, ordered: bool | Sequence[str] | None = None, dead_head: str | None = None
    ) -> OutboxEventQuerySet:
        """DEAD heads that hold back later PENDING events of their aggregate.

        One row per blocked aggregate (its earliest unsent ordered event, which is DEAD),
        annotated with ``waiting``: how many ordered PENDING events wait behind it.
        Requeueing that row (status PENDING) unblocks the aggregate. Empty when ordered
        mode is off or ``OUTBOX_ORDERED_DEAD_HEAD`` is "skip" (nothing waits on a DEAD row).
        """
        ordered = ordering.current_ordered() if ordered is None else ordered
        policy = ordering.current_dead_head_policy() if dead_head is None else dead_head
        q = ordering.ordered_q(ordered)
        if q is None or policy == ordering.SKIP:
            return self.none()
        base = self.model._default_manager.using(self.db).all()
        later = (
            base.filter(
                aggregate_type=models.OuterRef("aggregate_type"),
                aggregate_id=models.OuterRef("aggregate_id"),
                status=Status.PENDING,
                id__gt=models.OuterRef("id"),
            )
            .filter(q)
            .order_by()
        )
        waiting = later.values("aggregate_type").annotate(n=models.Count("id")).values("n")
        return (
            self.filter(status=Status.DEAD)
            .filter(q)
            .filter(models.Exists(later))
            .filter(id__in=ordering.heads(base, ordered, ordering.BLOCK))
            .annotate(waiting=models.Subquery(waiting, output_field=models.IntegerField()))
            .order_by("id")
        )

    # -- the row's lifecycle: the transitions after claim() ---------------------------------
    def new_pending(
        self,
        *,
        deliver_at: datetime | None = None,
        delay: timedelta | None = None,
        **fields: Any,
    ) -> OutboxEvent:
        """An unsaved row in its first state, for emit() to insert: PENDING, no attempt yet,
        due at once by the database clock, or scheduled (see :func:`due_time`): then
        ``next_retry_time`` and ``due_at`` both hold the due time, so the claim's index
        finds it when it is due and retries keep ``due_at`` while they move the other."""
        due = due_time(deliver_at, delay)
        # One clock for the three columns: the INSERT compiles it once however many rows.
        now = DbNow()
        values = {
            "id": None,
            "status": Status.PENDING,
            "retry_count": 0,
            "replay_count": 0,
            "next_retry_time": now if due is None else due,
            "due_at": due,
            "created_at": now,
            # No lease (it has run out), but a value: the claim that sets it then leaves
            # the record's length as it is (see models.LeaseTokenField).
            "leased_until": now,
            "lease_token": "",
            "last_error": "",
            "updated_at": None,
            "sent_at": None,
            **fields,
        }
        # Positionally, in the columns' order, as Model.from_db() builds a row: the
        # keyword form's per-field lookups took longer than the rest of emit()'s checks.
        model: Any = self.model
        columns, names = _columns(model)
        if not values.keys() <= names:
            unknown = sorted(values.keys() - names)
            raise TypeError(f"new_pending() got fields OutboxEvent does not have: {unknown}")
        # A field the caller leaves out (emit() gives them all) gets its default, as with
        # Model(**fields).
        return model(  # type: ignore[no-any-return]
            *[values[name] if name in values else field.get_default() for name, field in columns]
        )

    def held_by(self, token: str) -> OutboxEventQuerySet:
        """Rows still PENDING under the claim ``token``: the fence of every settle."""
        return self.filter(status=Status.PENDING, lease_token=token)

    def mark_sent(self, token: str, ids: Sequence[int]) -> int:
        """The broker confirmed these rows of the claim ``token``: SENT.

        Returns how many changed; fewer than ``ids`` means the others were taken over by
        another relay after this claim's lease ran out (they may be delivered twice).
        """
        # By primary key: the token alone would have the database read every PENDING row
        # (no index has it) to find this batch's.
        return (
            self.held_by(token)
            .with_ids(ids)
            .update(
                status=Status.SENT,
                sent_at=DbNow(),
                leased_until=None,
                lease_token="",
                updated_at=DbNow(),
            )
        )

    def delete_confirmed(self, token: str, ids: Sequence[int]) -> int:
        """The broker confirmed these rows of the claim ``token``: deleted, not kept as SENT
        (``OUTBOX_RETENTION_DAYS = 0``).

        One ``DELETE`` with :meth:`mark_sent`'s fence: a row another relay took over after
        this claim's lease ran out is left to it. Returns how many went.
        """
        return delete_rows(self.held_by(token).with_ids(ids))

    def mark_failed(
        self,
        token: str,
        failures: Sequence[tuple[OutboxEvent, str]],
        policy: RetryPolicy,
    ) -> list[OutboxEvent]:
        """Count a failed attempt on each ``(row, error)`` of the claim ``token``.

        ``retry_count`` goes up by one and ``last_error`` records ``error``; the row is due
        again after the delay ``policy`` gives for that count, or DEAD when it gives none.
        Only rows still held under ``token`` change: they are returned, updated in memory
        too, so the caller counts and alerts on exactly what it changed.
        """
        if not failures:
            return []
        with transaction.atomic(using=self.db, savepoint=False):
            # Failures are rare: lock what is still ours so counts and alerts are exact.
            ours = set(
                self.held_by(token)
                .with_ids([row.pk for row, _ in failures])
                .select_for_update()
                .values_list("pk", flat=True)
            )
            changed = [(row, error) for row, error in failures if row.pk in ours]
            for row, error in changed:
                row.retry_count += 1
                row.last_error = error_text(error)
                row.leased_until = None
                row.lease_token = ""
                row.updated_at = DbNow()
                delay = policy.delay_after(row.retry_count)
                if delay is None:
                    row.status = Status.DEAD
                    row.next_retry_time = DbNow()
                else:
                    row.next_retry_time = DbNow() + timedelta(seconds=delay)
            rows: list[Any] = [row for row, _ in changed]
            self.bulk_update(
                rows,
                [
                    "retry_count",
                    "last_error",
                    "leased_until",
                    "lease_token",
                    "status",
                    "next_retry_time",
                    "updated_at",
                ],
            )
        return rows

    def release(self, token: str, ids: Sequence[int], error: str | None = None) -> int:
        """Give rows of the claim ``token`` back: due at once, no attempt counted.

        ``error`` (why they were not published, e.g. the broker went away) replaces
        ``last_error``; None keeps it (a claim made ahead and not needed). Returns how many
        were still held under ``token``.

        Only the lease is cleared: ``next_retry_time`` had passed when the row was claimed,
        so the row is due at once, and the update stays off every index (HOT).
        """
        changes: dict[str, Any] = {
            "leased_until": None,
            "lease_token": "",
            "updated_at": DbNow(),
        }
        if error is not None:
            changes["last_error"] = error_text(error)
        return self.held_by(token).with_ids(ids).update(**changes)

    def requeue(self, *, replay: bool = False) -> int:
        """DEAD and PENDING rows of this queryset (and SENT ones with ``replay``): due now,
        ``retry_count`` 0, no lease.

        ``last_error`` is kept, so the reason a row died stays visible until its next
        attempt. Clearing the lease of a row a relay is publishing right now fences that
        relay's settle: the row is published again, a duplicate consumers absorb (leave
        those out with :meth:`exclude_in_flight`). SENT rows are left alone unless
        ``replay``: then they are published again with the same ``event_id``, and their
        ``replay_count`` goes up by one (the relay sends it as the ``x-outbox-replay``
        header); ``sent_at`` keeps the last delivery's time until the next one. Returns how
        many rows changed.

        Due now in ``due_at`` too: a scheduled row requeued early is no longer scheduled,
        and staleness and the oldest PENDING age count from the requeue, not from a death
        (or a delivery) days ago.
        """
        statuses = [Status.PENDING, Status.DEAD, *([Status.SENT] if replay else [])]
        changes: dict[str, Any] = {}
        if replay:
            # First: MySQL/MariaDB evaluate SET assignments left to right, so this must
            # read the status before it is set to PENDING below.
            changes["replay_count"] = models.Case(
                models.When(status=Status.SENT, then=models.F("replay_count") + 1),
                default=models.F("replay_count"),
            )
        changes.update(
            status=Status.PENDING,
            next_retry_time=DbNow(),
            due_at=DbNow(),
            retry_count=0,
            leased_until=None,
            lease_token="",
            updated_at=DbNow(),
        )
        return self.order_by().filter(status__in=statuses).update(**changes)

    def requeue_in_batches(
        self, batch_size: int, *, limit: int | None = None, replay: bool = False
    ) -> tuple[int, int]:
        """:meth:`requeue` the rows of this queryset, oldest first, ``batch_size`` at a
        time, each batch in its own short transaction (no long lock on the table, and the
        relay starts on the first batch while the next is requeued), at most ``limit`` in
        all. Returns (rows changed, batches)."""
        return self._in_batches(batch_size, lambda batch: batch.requeue(replay=replay), limit)

    def exclude_in_flight(self) -> OutboxEventQuerySet:
        """This queryset without the PENDING rows a relay is publishing right now (claimed,
        lease not yet run out): requeueing those would publish them twice."""
        return self.exclude(status=Status.PENDING, leased_until__gt=DbNow())

    def mark_dead(self) -> int:
        """PENDING rows of this queryset: DEAD, so no relay publishes them. Returns how many
        changed; SENT and DEAD rows are left alone."""
        return (
            self.order_by()
            .filter(status=Status.PENDING)
            .update(status=Status.DEAD, leased_until=None, lease_token="", updated_at=DbNow())
        )

    def status_counts(self) -> dict[int, int]:
        rows: Any = self.order_by().values_list("status").annotate(n=models.Count("id"))
        return {status: n for status, n in rows}


class InboxMessageQuerySet(BatchedQuerySet["InboxMessage"]):
    """The consumers' inbox: rows are inserted by the consumer and deleted by purge_outbox."""

    def processed_before(self, days: float) -> InboxMessageQuerySet:
        """Rows processed more than ``days`` ago, by the database clock (the
        ``processed_at`` index ``django_outbox_inbox_at_idx`` serves it)."""
        return self.filter(processed_at__lt=DbNow() - timedelta(days=days))
