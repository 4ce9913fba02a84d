"""Querysets that speak the outbox's domain: pending, due, stale, dead, claim."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, models, transaction
from django.db.models.base import ModelState

from .db import DbNow

if TYPE_CHECKING:
    from .models import OutboxEvent

# Plain ints so this module does not import models (models imports this module).
PENDING, SENT, DEAD = 0, 1, 2

# What a claim loads: what a message is built from and a settle needs. The rest
# (next_retry_time, last_error, sent_at, updated_at) is deferred: building the rows is a good
# part of a relay's time, and each datetime column costs a parse per row.
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
    "retry_count",
    "status",
    "lease_token",
)


def _seconds(value: float | timedelta) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


class _AnyOf(models.Lookup):
    """``lhs = ANY(%s)`` with a list as the one parameter (PostgreSQL)."""

    lookup_name = "any_of"
    prepare_rhs = False

    def as_sql(self, compiler: Any, connection: Any) -> Any:
        lhs, lhs_params = self.process_lhs(compiler, connection)
        return f"{lhs} = ANY(%s)", (*lhs_params, self.rhs)


class OutboxEventQuerySet(models.QuerySet["OutboxEvent"]):
    def pending(self) -> OutboxEventQuerySet:
        """Not yet confirmed by the broker (including rows leased by a relay right now)."""
        return self.filter(status=PENDING)

    def sent(self) -> OutboxEventQuerySet:
        return self.filter(status=SENT)

    def dead(self) -> OutboxEventQuerySet:
        return self.filter(status=DEAD)

    def due(self) -> OutboxEventQuerySet:
        """PENDING rows whose next_retry_time has passed, by the database clock."""
        return self.pending().filter(next_retry_time__lte=DbNow())

    def stale(self, older_than: float | timedelta) -> OutboxEventQuerySet:
        """PENDING rows created at least ``older_than`` ago (seconds or a timedelta)."""
        return self.pending().filter(created_at__lte=DbNow() - _seconds(older_than))

    def created_since(self, seconds: float | timedelta) -> OutboxEventQuerySet:
        return self.filter(created_at__gte=DbNow() - _seconds(seconds))

    def for_aggregate(self, aggregate_type: str, aggregate_id: str) -> OutboxEventQuerySet:
        return self.filter(aggregate_type=aggregate_type, aggregate_id=str(aggregate_id))

    def with_ids(self, ids: Sequence[int]) -> OutboxEventQuerySet:
        """Rows whose id is one of ``ids`` (``pk__in``).

        On PostgreSQL the ids travel as one array (``id = ANY(%s)``): a relay's batch has
        hundreds, and ``IN (%s, %s, ...)`` makes a statement too long for psycopg's cache of
        parsed queries, with each id prepared by the field on every settle.
        """
        if connections[self.db].vendor == "postgresql":
            return self.filter(_AnyOf(models.F("pk"), list(ids)))
        return self.filter(pk__in=ids)

    def claim(
        self,
        limit: int,
        *,
        lease_seconds: float,
        token: str | None = None,
        ordered: bool | Sequence[str] | None = None,
        dead_head: str | None = None,
    ) -> tuple[str, list[OutboxEvent]]:
        """Lease up to ``limit`` rows of this queryset, oldest first, for one relay pass.

        Rows are locked with ``SELECT ... FOR UPDATE SKIP LOCKED`` in a short transaction
        that pushes ``next_retry_time`` forward by ``lease_seconds`` and stamps a fresh
        ``lease_token``; the transaction commits before this returns, so nothing is held
        open while the caller publishes. Another relay skips locked rows, and once committed
        the rows are no longer due until the lease runs out. Returns the token (settles are
        fenced on it) and the claimed rows, with the columns a message is built from
        loaded (``CLAIM_FIELDS``; the others load when read). Call it on ``due()`` or
        ``stale()``.

        Ordered mode (``ordered``/``dead_head`` default to ``OUTBOX_ORDERED`` and
        ``OUTBOX_ORDERED_DEAD_HEAD``): ordered rows are taken only while they are their
        aggregate's head (its earliest PENDING, or DEAD unless skipped, ordered row), by a
        filter in this same locking query (see :func:`django_outbox.ordering.heads_only`),
        so a successor is never claimed while its predecessor is PENDING (leased, in
        backoff) or DEAD. A second statement reads each claimed head's
        ``previous_sequence`` for the consumers. Unordered rows skip both.
        """
        from . import ordering

        token = token or uuid.uuid4().hex
        ordered = ordering.current_ordered() if ordered is None else ordered
        with transaction.atomic(using=self.db):
            candidates = ordering.heads_only(self, ordered, dead_head)
            locked = candidates.select_for_update(skip_locked=True).order_by("id")[:limit]
            if connections[self.db].vendor == "postgresql":
                rows = self._lease_returning(locked, lease_seconds, token)
            else:
                query = locked.values_list(*CLAIM_FIELDS).query
                rows = self._fetch_rows(*query.get_compiler(using=self.db).as_sql())
                if rows:
                    self.model._default_manager.using(self.db).with_ids(
                        [row.pk for row in rows]
                    ).update(next_retry_time=DbNow() + _seconds(lease_seconds), lease_token=token)
            if rows and ordered:
                self._previous_sequences(rows, ordered)
        for row in rows:
            row.lease_token = token
        return token, rows

    def _lease_returning(
        self, locked: OutboxEventQuerySet, lease_seconds: float, token: str
    ) -> list[OutboxEvent]:
        """PostgreSQL: lock, lease and read the rows in one statement (UPDATE ... RETURNING),
        one round trip instead of two and no list of ids sent back."""
        connection = connections[self.db]
        table = connection.ops.quote_name(self.model._meta.db_table)
        select, params = locked.values("id").query.get_compiler(using=self.db).as_sql()
        quote = connection.ops.quote_name
        columns = ", ".join(quote(name) for name in CLAIM_FIELDS)
        # statement_timestamp(): the clock DbNow() reads on PostgreSQL, as every lease does.
        sql = (
            f"UPDATE {table} SET {quote('next_retry_time')} = statement_timestamp() + %s, "
            f"{quote('lease_token')} = %s WHERE {quote('id')} IN ({select}) RETURNING {columns}"
        )
        rows = self._fetch_rows(sql, [_seconds(lease_seconds), token, *params])
        rows.sort(key=lambda row: row.pk)
        return rows

    def _fetch_rows(self, sql: str, params: Sequence[Any]) -> list[OutboxEvent]:
        """Run ``sql``, which selects ``CLAIM_FIELDS`` in order, and build the rows.

        Built as ``Model.from_db()`` would build them (the field converters applied, the
        other columns deferred, ``_state`` of a loaded row) but without ``Model.__init__``,
        its per-field work and ``pre_init``/``post_init`` signals: with them, building the
        instances took twice as long as running the claim and reading its rows.
        """
        model = self.model
        connection = connections[self.db]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            records = cursor.fetchall()
        if not records:
            return []
        fields: list[Any] = [model._meta.get_field(name) for name in CLAIM_FIELDS]
        attnames = [field.attname for field in fields]
        converters = []
        for index, field in enumerate(fields):
            column = field.get_col(model._meta.db_table)
            functions = connection.ops.get_db_converters(column) + field.get_db_converters(
                connection
            )
            if functions:
                converters.append((index, functions, column))
        rows: list[OutboxEvent] = []
        for record in records:
            values = list(record)
            for index, functions, column in converters:
                value = values[index]
                for function in functions:
                    value = function(value, column, connection)
                values[index] = value
            row = model.__new__(model)
            row.__dict__.update(zip(attnames, values, strict=True))
            row._state = ModelState()
            row._state.adding = False
            row._state.db = self.db
            rows.append(row)
        return rows

    def _previous_sequences(self, rows: list[OutboxEvent], ordered: bool | Sequence[str]) -> None:
        """Set ``previous_sequence`` on the claimed ordered heads (the relay sends it).

        It is the id of the aggregate's last SENT ordered row before the head (0: none): a
        DEAD row skipped under the "skip" policy was never delivered, so it does not count.
        """
        from . import ordering

        ids = [row.pk for row in rows if ordering.is_ordered(row, ordered)]
        if not ids:
            return
        base = self.model._default_manager.using(self.db).all()
        previous = dict(
            base.with_ids(ids)
            .annotate(previous=models.Subquery(ordering.previous_sent(base, ordered)))
            .values_list("pk", "previous")
        )
        for row in rows:
            if row.pk in previous:
                row.previous_sequence = previous[row.pk] or 0  # type: ignore[attr-defined]

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
        from . import ordering

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
                status=PENDING,
                id__gt=models.OuterRef("id"),
            )
            .filter(q)
            .order_by()
        )
        waiting = later.values("aggregate_type").annotate(n=models.Count("id")).values("n")
        return (
            self.filter(status=DEAD)
            .filter(q)
            .filter(models.Exists(later))
            .filter(id__in=ordering.heads(base, ordered, ordering.BLOCK))
            .annotate(waiting=models.Subquery(waiting, output_field=models.IntegerField()))
            .order_by("id")
        )

    def held_by(self, token: str) -> OutboxEventQuerySet:
        """Rows still PENDING under the claim ``token``: the fence of every settle."""
        return self.filter(status=PENDING, lease_token=token)

    def status_counts(self) -> dict[int, int]:
        rows: Any = self.order_by().values_list("status").annotate(n=models.Count("id"))
        return {status: n for status, n in rows}
