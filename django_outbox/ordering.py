"""Ordered delivery per aggregate, the claim's side: which rows are ordered, which of them
are heads, and the runs a claim takes behind the heads. :mod:`django_outbox.relay.runs`
tells ordered mode from the claim to the settle, and holds the relay's side.

An *ordered* row (``OUTBOX_ORDERED``: ``True`` for every event, or a list of event types
and/or aggregate types) with a non-empty ``aggregate_id`` may only be claimed while it is
the *head* of its aggregate: no earlier ordered row of the same (``aggregate_type``,
``aggregate_id``) is still PENDING (claimed, in retry backoff or not yet tried) or, with the
default ``OUTBOX_ORDERED_DEAD_HEAD = "block"``, DEAD. The rule is a filter (``id IN`` the
aggregates' heads) inside the claim query itself (see :meth:`OutboxEventQuerySet.claim`),
so it holds across any number of relays and the compensator without a lock table or an
advisory lock: a head stays PENDING until it is SENT, and while it is PENDING every claim
excludes its successors.

**Runs.** With ``OUTBOX_ORDERED_RUN`` > 1 the claim takes, behind each head it leased,
the next PENDING ordered rows of its aggregate, its *followers* (:func:`runs_behind`,
:meth:`Followers.chain`), leased under the same token; and behind the last row of each run
of the relay's batch in flight (the claim's ``after``), the rows that follow it. Each
claimed ordered row carries ``OutboxEvent.previous_sequence`` (a head's from
:func:`set_previous_sequences`; a follower's is the row before it) and a follower
``OutboxEvent.run_follows``: typed attributes of the row, read by the relay and the
message's headers.

Rows without an ``aggregate_id`` are never ordered: they have no aggregate to wait for.
See docs/ordered.md for the guarantee and what it assumes about the writers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models import Max, Min, OuterRef, Q, Subquery
from django.db.models.expressions import RawSQL

from .conf import outbox_settings
from .states import Status

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from .models import OutboxEvent
    from .querysets import OutboxEventQuerySet

BLOCK, SKIP = "block", "skip"
DEAD_HEAD_POLICIES = (BLOCK, SKIP)

Ordered = bool | Sequence[str]


def current_ordered() -> Ordered:
    return outbox_settings.ORDERED


def current_dead_head_policy() -> str:
    return outbox_settings.ORDERED_DEAD_HEAD


def is_enabled(ordered: Ordered | None = None) -> bool:
    ordered = current_ordered() if ordered is None else ordered
    return bool(ordered)


def ordered_q(ordered: Ordered | None = None, prefix: str = "") -> Q | None:
    """The filter selecting ordered rows, or None when ordered mode is off."""
    ordered = current_ordered() if ordered is None else ordered
    if not ordered:
        return None
    q = ~Q(**{f"{prefix}aggregate_id": ""})
    if ordered is True:
        return q
    names = sorted({str(name) for name in ordered})  # type: ignore[union-attr]
    return q & (
        Q(**{f"{prefix}event_type__in": names}) | Q(**{f"{prefix}aggregate_type__in": names})
    )


def is_ordered(event: Any, ordered: Ordered | None = None) -> bool:
    """Python twin of :func:`ordered_q` for one row."""
    ordered = current_ordered() if ordered is None else ordered
    if not ordered or not event.aggregate_id:
        return False
    if ordered is True:
        return True
    return event.event_type in ordered or event.aggregate_type in ordered  # type: ignore[operator]


def blocking_statuses(policy: str | None = None) -> tuple[int, ...]:
    policy = current_dead_head_policy() if policy is None else policy
    return (Status.PENDING,) if policy == SKIP else (Status.PENDING, Status.DEAD)


def previous_sent(base: OutboxEventQuerySet, ordered: Ordered) -> QuerySet[OutboxEvent, Any]:
    """The id of the outer row's predecessor that consumers saw: its aggregate's last SENT
    ordered row before it (a skipped DEAD row was never delivered, so it does not count).

    A ``MAX`` rather than ``ORDER BY id DESC LIMIT 1``: MariaDB answers it from the end of
    the ``(aggregate_type, aggregate_id, status, id)`` range, and chose a far worse plan
    for the ordered form.
    """
    q = ordered_q(ordered)
    assert q is not None
    return (
        base.filter(
            aggregate_type=OuterRef("aggregate_type"),
            aggregate_id=OuterRef("aggregate_id"),
            status=Status.SENT,
            id__lt=OuterRef("id"),
        )
        .filter(q)
        .order_by()
        .values("aggregate_type")
        .annotate(previous=Max("id"))
        .values("previous")
    )


def heads(
    base: OutboxEventQuerySet, ordered: Ordered, policy: str | None = None
) -> QuerySet[OutboxEvent, Any]:
    """The id of every aggregate's head: its earliest ordered row that blocks (PENDING, and
    DEAD unless the policy skips them). Meant for ``id__in``.

    On PostgreSQL and MySQL/MariaDB one index entry per aggregate with unsent rows
    (``django_outbox_heads_idx``, migrations 0012 and 0013: :func:`_heads_skip_scan`,
    :func:`_heads_loose_scan`). On SQLite one pass over the unsent ordered rows, grouped by
    aggregate: its cost follows the backlog, not the table, and it does not depend on the
    planner choosing an index per candidate row (a per-row ``NOT EXISTS`` probe did, and
    degraded to a scan of the aggregate's sent history for a hot aggregate).
    """
    q = ordered_q(ordered)
    assert q is not None
    vendor = connections[base.db].vendor
    if vendor == "postgresql":
        return _heads_skip_scan(base, ordered, policy)  # type: ignore[return-value]
    if vendor == "mysql":
        return _heads_loose_scan(base, ordered, policy)  # type: ignore[return-value]
    return (
        base.filter(status__in=blocking_statuses(policy))
        .filter(q)
        .order_by()
        .values("aggregate_type", "aggregate_id")
        .annotate(head=Min("id"))
        .values("head")
    )


#: How many of the oldest PENDING ordered rows a claim checks one by one for heads before it
#: looks for them aggregate by aggregate (:func:`window_heads`), in batches of the claim.
HEADS_WINDOW = 10


def _only(ordered: Ordered, quote: Any, alias: str = "") -> tuple[str, list[str]]:
    """The SQL of :func:`ordered_q` beyond ``aggregate_id <> ''`` (a list of types), and its
    parameters."""
    if ordered is True:
        return "", []
    names = sorted({str(name) for name in ordered})  # type: ignore[union-attr]
    marks = ", ".join(["%s"] * len(names))
    event_type, aggregate_type = alias + quote("event_type"), alias + quote("aggregate_type")
    sql = f" AND ({event_type} IN ({marks}) OR {aggregate_type} IN ({marks}))"
    return sql, [*names, *names]


def claimable(
    queryset: OutboxEventQuerySet,
    ordered: Ordered,
    policy: str | None,
    limit: int,
    *,
    window: bool,
) -> list[int]:
    """MySQL/MariaDB: the ids a claim's locking read then takes from (by primary key), read
    without locks in a statement of their own: the heads (``window``: among the oldest rows,
    :func:`window_heads`; else every aggregate's, :func:`heads`) and the ``limit`` oldest
    unordered rows of ``queryset``.

    A list, not a filter: with ``NOT ordered OR id IN heads`` (or ``id IN`` a subquery of
    the candidates) in the locking read, MariaDB walked every due row by id, past a hot
    aggregate's whole queue, whenever it expected the walk to fill the batch; with the ids
    given it reads each one on the primary key. The unordered rows come from
    ``django_outbox_heads_idx`` (``status, aggregate_id``: migration 0013) when
    ``OUTBOX_ORDERED`` is ``True``. A head in this statement's snapshot is still one when it
    is locked, as in one statement (see :func:`heads_only`): rows do not become unsent
    again; one another relay claimed meanwhile is locked or no longer due there.
    """
    q = ordered_q(ordered)
    assert q is not None
    base = queryset.model._default_manager.using(queryset.db).all()
    found = (
        window_heads(base, ordered, policy, limit * HEADS_WINDOW)
        if window
        else heads(base, ordered, policy)
    )
    assert isinstance(found, RawSQL)
    unordered = queryset.filter(~q).order_by("id").values("id")[:limit]
    sql, params = unordered.query.get_compiler(using=queryset.db).as_sql()
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(f"({found.sql}) UNION ALL ({sql})", [*found.params, *params])
        return [pk for (pk,) in cursor.fetchall() if pk is not None]


def window_heads(
    base: OutboxEventQuerySet, ordered: Ordered, policy: str | None, window: int
) -> RawSQL:
    """The heads among the ``window`` oldest PENDING ordered rows that are due from their
    creation, each checked on one index entry (``django_outbox_heads_idx`` on PostgreSQL,
    migration 0012; ``django_outbox_agg_head_idx`` on MySQL/MariaDB): no earlier row of its
    aggregate blocks it. Meant for ``id__in``.

    The claim's first look: where aggregates are many, the oldest rows are mostly heads and
    this finds a batch for the price of a batch. Behind a hot aggregate it finds that one
    head, and the claim looks further with :func:`heads` (one entry per aggregate).
    """
    quote = connections[base.db].ops.quote_name
    table = quote(base.model._meta.db_table)
    t, a, pk, status = (quote(name) for name in ("aggregate_type", "aggregate_id", "id", "status"))
    only, params = _only(ordered, quote)
    only_p, params_p = _only(ordered, quote, "p.")
    if connections[base.db].vendor == "postgresql":
        # A row is a head when it is the first entry of its aggregate that counts, asked
        # in the index's own order, so that it reads one entry of django_outbox_heads_idx
        # (an anti-join "no earlier row" let it choose the primary key, and estimate so
        # high a cost that it compiled the statement with JIT: 400 ms).
        statuses = ", ".join(str(int(s)) for s in blocking_statuses(policy))
        check = (
            f"w.id = (SELECT p.{pk} FROM {table} p WHERE p.{status} IN (0, 2) "
            f"AND p.{a} <> '' AND p.{t} = w.t AND p.{a} = w.a AND p.{status} IN ({statuses})"
            f"{only_p} ORDER BY p.{t}, p.{a}, p.{pk} LIMIT 1)"
        )
        walk = ""
    else:
        # MySQL/MariaDB: the first PENDING row of its aggregate, and no DEAD one before it
        # when they block, each one equality on agg_head_idx read in id order, one entry.
        # (A MIN() over status IN (0, 2) read every unsent row of the aggregate: a claim
        # took twice as long with 20 events queued per aggregate as with one.)
        check, params_p = _is_head(table, quote, "w", ordered, policy)
        # By id: MariaDB would rather read every PENDING row on (status, next_retry_time).
        walk = " FORCE INDEX (PRIMARY)"
    sql = (
        f"SELECT w.id FROM (SELECT {pk} AS id, {t} AS t, {a} AS a FROM {table}{walk} "
        f"WHERE {status} = 0 AND {quote('due_at')} IS NULL AND {a} <> ''{only} "
        f"ORDER BY {pk} LIMIT %s) w WHERE {check}"
    )
    return _once(base, sql, [*params, int(window), *params_p])


def _is_head(
    table: str, quote: Any, alias: str, ordered: Ordered, policy: str | None
) -> tuple[str, list[str]]:
    """MySQL/MariaDB: the condition that the PENDING ordered row ``alias`` (columns ``id``,
    ``t``, ``a``) is its aggregate's head, and its parameters."""
    t, a, pk, status = (quote(name) for name in ("aggregate_type", "aggregate_id", "id", "status"))
    only_p, params = _only(ordered, quote, "p.")
    sql = (
        f"{alias}.id = (SELECT p.{pk} FROM {table} p WHERE p.{t} = {alias}.t "
        f"AND p.{a} = {alias}.a AND p.{status} = {int(Status.PENDING)}{only_p} "
        f"ORDER BY p.{pk} LIMIT 1)"
    )
    if Status.DEAD in blocking_statuses(policy):
        only_d, params_d = _only(ordered, quote, "d.")
        sql += (
            f" AND NOT EXISTS (SELECT 1 FROM {table} d WHERE d.{t} = {alias}.t "
            f"AND d.{a} = {alias}.a AND d.{status} = {int(Status.DEAD)} "
            f"AND d.{pk} < {alias}.id{only_d})"
        )
        params += params_d
    return sql, params


def _once(base: OutboxEventQuerySet, sql: str, params: list[Any]) -> RawSQL:
    """``sql``, a list of ids for ``id__in``, computed once per statement on PostgreSQL.

    As an array (an InitPlan), not a subquery the planner may run again for every candidate
    row: with statistics from an emptier table (a backlog written since the last ANALYZE)
    it chose a nested loop that ran the search once per PENDING row, for minutes.
    """
    if connections[base.db].vendor == "postgresql":
        sql = f"SELECT unnest(ARRAY({sql}))"
    return RawSQL(sql, params)


def _heads_skip_scan(base: OutboxEventQuerySet, ordered: Ordered, policy: str | None) -> RawSQL:
    """PostgreSQL: :func:`heads` read from ``django_outbox_heads_idx`` (migration 0012), one
    index entry per aggregate with unsent rows, however many rows each has queued: a
    recursive query jumps from each aggregate's first entry to the next aggregate's (a
    "loose index scan"; PostgreSQL before 18 has no skip scan of its own).

    The first entry of an aggregate is its earliest unsent row: with DEAD heads blocking
    and every row with an aggregate ordered, that is the head. Otherwise (the "skip"
    policy, or ``OUTBOX_ORDERED`` a list of types) the head is looked up from there, on
    the same index, passing the rows that do not count (DEAD ones, other types: few).
    """
    quote = connections[base.db].ops.quote_name
    table = quote(base.model._meta.db_table)
    t, a, pk, status = (quote(name) for name in ("aggregate_type", "aggregate_id", "id", "status"))
    # The index's predicate, word for word, so that the planner knows it applies.
    unsent = f"{status} IN (0, 2) AND {a} <> ''"
    walk = (
        f"WITH RECURSIVE agg(t, a, head) AS ("
        f"(SELECT {t}, {a}, {pk} FROM {table} WHERE {unsent} ORDER BY {t}, {a}, {pk} LIMIT 1) "
        f"UNION ALL SELECT n.t, n.a, n.head FROM agg CROSS JOIN LATERAL ("
        f"SELECT {t} AS t, {a} AS a, {pk} AS head FROM {table} WHERE {unsent} "
        f"AND ({t}, {a}) > (agg.t, agg.a) ORDER BY {t}, {a}, {pk} LIMIT 1) n) "
    )
    params: list[Any] = []
    if ordered is True and Status.DEAD in blocking_statuses(policy):
        return _once(base, walk + "SELECT head FROM agg", params)
    statuses = ", ".join(str(int(s)) for s in blocking_statuses(policy))
    only, params = _only(ordered, quote)
    return _once(
        base,
        walk + f"SELECT h.id FROM agg CROSS JOIN LATERAL (SELECT {pk} AS id FROM {table} "
        f"WHERE {unsent} AND {t} = agg.t AND {a} = agg.a AND {pk} >= agg.head "
        f"AND {status} IN ({statuses}){only} ORDER BY {pk} LIMIT 1) h",
        params,
    )


def _heads_loose_scan(base: OutboxEventQuerySet, ordered: Ordered, policy: str | None) -> RawSQL:
    """MySQL/MariaDB: :func:`heads` read from ``django_outbox_heads_idx`` (``status,
    aggregate_id, aggregate_type, id``, migration 0013), one index entry per aggregate and
    blocking status: the optimizer's own loose index scan ("Using index for group-by")
    jumps from each aggregate's first row of a status to the next aggregate's, and the SENT
    rows are in a range of their own that it never reads. The earlier of an aggregate's
    first PENDING and first DEAD row (when DEAD rows block) is its head.

    With ``OUTBOX_ORDERED`` a list of types the head is looked up from there, one entry of
    ``agg_head_idx`` for each (passing the rows of other types: few). MariaDB has no
    partial index, and no loose scan on an index of generated columns (a virtual column
    NULL on SENT rows would have kept them out of the index's way), so status leads.
    """
    quote = connections[base.db].ops.quote_name
    table = quote(base.model._meta.db_table)
    t, a, pk, status = (quote(name) for name in ("aggregate_type", "aggregate_id", "id", "status"))
    statuses = ", ".join(str(int(s)) for s in blocking_statuses(policy))
    groups = (
        f"SELECT {status} AS s, {t} AS t, {a} AS a, MIN({pk}) AS id FROM {table} "
        f"WHERE {status} IN ({statuses}) AND {a} <> '' GROUP BY {status}, {a}, {t}"
    )
    first = "g.id"
    params: list[str] = []
    if ordered is not True:
        only_p, params = _only(ordered, quote, "p.")
        first = (
            f"(SELECT p.{pk} FROM {table} p WHERE p.{t} = g.t AND p.{a} = g.a "
            f"AND p.{status} = g.s{only_p} ORDER BY p.{pk} LIMIT 1)"
        )
    return RawSQL(
        f"SELECT MIN(f.id) AS id FROM (SELECT {first} AS id, g.t, g.a FROM ({groups}) g) f "
        f"WHERE f.id IS NOT NULL GROUP BY f.t, f.a",
        params,
    )


def heads_only(
    queryset: OutboxEventQuerySet, ordered: Ordered | None = None, policy: str | None = None
) -> OutboxEventQuerySet:
    """``queryset`` without the ordered rows that are not their aggregate's head.

    Unordered rows pass untouched, so they keep the relay's full speed. In a locking read
    the heads come from the statement's snapshot while the candidate rows may be newer (on
    MySQL/MariaDB a locking read sees the latest committed version): a row committed after
    the snapshot is not among the heads, so it waits for the next claim. A row that was a
    head in the snapshot is still one: rows never become unsent again, except a requeued
    DEAD row under the "skip" policy (the point of that policy) and a replayed SENT row
    (``requeue(replay=True)``). A replay committed after the snapshot is not yet a head
    either, so a later row of its aggregate may be claimed in the same statement: the
    replay's copy then goes out after that row's first delivery (docs/ordered.md,
    "Requeue and replay").
    """
    ordered = current_ordered() if ordered is None else ordered
    q = ordered_q(ordered)
    if q is None:
        return queryset
    base = queryset.model._default_manager.using(queryset.db).all()
    return queryset.filter(~q | Q(id__in=heads(base, ordered, policy)))


AggregateKey = tuple[str, str]


def current_run() -> int:
    """``OUTBOX_ORDERED_RUN``: the most events of one aggregate one claim takes (>= 1)."""
    return max(1, int(outbox_settings.ORDERED_RUN))


def key_of(event: Any) -> AggregateKey:
    return (event.aggregate_type, event.aggregate_id)


def followers(
    base: OutboxEventQuerySet,
    claimed_heads: Sequence[Any],
    ordered: Ordered,
    policy: str | None,
    limit: int,
) -> dict[AggregateKey, list[int]]:
    """The PENDING ordered rows behind each of ``claimed_heads`` (rows just claimed, and
    leased, as their aggregate's head), in ``id`` order, at most ``limit`` in all, for
    :meth:`OutboxEventQuerySet.claim` to take with them as *runs*.

    An aggregate's list stops before its first DEAD row when DEAD heads block: that row
    would be the head once the run is SENT, and nothing behind it may go first. Whether
    each row is due, and free to lock, is for the caller to check in its locking read
    (a run is cut at its first row that is not). Non-locking reads: two short statements
    on the ``(aggregate_type, aggregate_id, status, id)`` index (``agg_head_idx``).
    """
    q = ordered_q(ordered)
    if q is None or not claimed_heads or limit <= 0:
        return {}
    behind = Q()
    for head in claimed_heads:
        behind |= Q(
            aggregate_type=head.aggregate_type, aggregate_id=head.aggregate_id, id__gt=head.pk
        )
    rows = (
        base.filter(behind, status=Status.PENDING)
        .filter(q)
        .order_by("id")
        .values_list("id", "aggregate_type", "aggregate_id")[:limit]
    )
    found: dict[AggregateKey, list[int]] = {}
    for pk, aggregate_type, aggregate_id in rows:
        found.setdefault((aggregate_type, aggregate_id), []).append(pk)
    if found and Status.DEAD in blocking_statuses(policy):
        first_dead = (
            base.filter(behind, status=Status.DEAD)
            .filter(q)
            .order_by()
            .values_list("aggregate_type", "aggregate_id")
            .annotate(first=Min("id"))
        )
        for aggregate_type, aggregate_id, first in first_dead:
            ids = found.get((aggregate_type, aggregate_id))
            if ids:
                found[(aggregate_type, aggregate_id)] = [pk for pk in ids if pk < first]
    return found


@dataclass(frozen=True)
class Followers:
    """The followers a claim wants: behind each row a run starts from, its aggregate's next
    PENDING ordered ids in run order, at most as many as that start may bring."""

    starts: list[tuple[OutboxEvent, int]]  # (the row a run continues from, its cap)
    wanted: dict[AggregateKey, list[int]]

    def _ids_behind(self, start: OutboxEvent, cap: int) -> list[int]:
        return self.wanted.get(key_of(start), [])[:cap]

    def ids(self) -> list[int]:
        """Every id wanted, for the claim's locking read."""
        return [pk for start, cap in self.starts for pk in self._ids_behind(start, cap)]

    def chain(self, free: Mapping[int, OutboxEvent]) -> list[OutboxEvent]:
        """The followers taken from ``free`` (the wanted rows the locking read got, due and
        not locked by anyone else): each run is cut at its first row that is not there.
        Each follower gets ``run_follows`` (the id of the row before it in the run, which
        the relay must have seen confirmed first) and, as ``previous_sequence``, that same
        id: it is SENT by the time consumers see the follower."""
        taken: list[OutboxEvent] = []
        for start, cap in self.starts:
            before = start.pk
            for pk in self._ids_behind(start, cap):
                follower = free.get(pk)
                if follower is None:  # not due, or locked: the run ends before it
                    break
                follower.run_follows = before
                follower.previous_sequence = before
                taken.append(follower)
                before = pk
        return taken


def runs_behind(
    base: OutboxEventQuerySet,
    rows: Sequence[OutboxEvent],
    after: Sequence[OutboxEvent],
    *,
    room: int,
    run: int,
    ordered: Ordered,
    dead_head: str | None,
) -> Followers | None:
    """The followers a claim looks for: up to ``run - 1`` per ordered head of ``rows`` (just
    claimed), ``room`` in all; and up to ``run`` behind each row of ``after`` whose
    aggregate has no head among ``rows``. None: there are none.

    A follower is the head's aggregate's next PENDING ordered row (then the one after it,
    ...); the claim takes it if it is in the claim's queryset (due, and stale for the
    compensator) and not locked by anyone else: a run is cut at its first row that is not
    (:meth:`Followers.chain`), or before a DEAD row that blocks (:func:`followers`), so a
    run is always the unbroken start of its aggregate's queue. Holding the head leased
    already keeps every other relay off the followers (they are not heads while it is
    PENDING); their own lease keeps them so once it is SENT, until the run is settled.

    A row of ``after`` was confirmed by the broker already (its settle may still be on the
    way: it is PENDING under this relay's lease, or SENT), so the rows behind it may go out
    at once; no other relay can take them first, for the same reason as behind a head.
    When its settle committed before this claim's heads were read, its successor is a head
    of ``rows`` and its run is built from there instead.
    """
    heads = [row for row in rows if is_ordered(row, ordered)]
    keys = {key_of(row) for row in heads}
    starts = [(row, run - 1) for row in heads]
    for row in after:
        if key_of(row) not in keys and is_ordered(row, ordered):
            keys.add(key_of(row))
            starts.append((row, run))
    wanted = followers(base, [row for row, _ in starts], ordered, dead_head, room)
    return Followers(starts, wanted) if wanted else None


def set_previous_sequences(
    base: OutboxEventQuerySet, rows: Sequence[OutboxEvent], ordered: Ordered
) -> None:
    """Set ``previous_sequence`` on the claimed ordered heads among ``rows`` (the relay
    sends it): the id of the aggregate's last SENT ordered row before the head (0: none).
    A DEAD row skipped under the "skip" policy was never delivered, so it does not count."""
    ids = [row.pk for row in rows if is_ordered(row, ordered)]
    if not ids:
        return
    previous = dict(
        base.with_ids(ids)
        .annotate(previous=Subquery(previous_sent(base, ordered)))
        .values_list("pk", "previous")
    )
    for row in rows:
        if row.pk in previous:
            row.previous_sequence = previous[row.pk] or 0


def dead_head_note(event: Any) -> str:
    """What a DEAD ordered row means for its aggregate, for the dead-letter alert."""
    if not is_ordered(event):
        return ""
    if current_dead_head_policy() == SKIP:
        return (
            "skipped: later events of this aggregate are published without it "
            "(OUTBOX_ORDERED_DEAD_HEAD='skip')"
        )
    return "blocks the later events of this aggregate until it is requeued"
