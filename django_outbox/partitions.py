"""A PostgreSQL outbox table partitioned by time, and retention that drops whole partitions.

Opt-in, through ``manage.py outbox_partition`` (docs/operations.md, "A partitioned outbox"):

* :func:`convert` turns the unpartitioned table Django's migrations made into one
  partitioned by range of ``created_at``: the table is renamed ``<table>_unpartitioned``
  (kept, with its rows, until the operator drops it), a partitioned table takes its name,
  columns, defaults, identity, checks and index names (the primary key becomes
  ``(id, created_at)`` and the ``event_id`` unique constraint ``(event_id, created_at)``:
  PostgreSQL wants the partition key in each), a partition per span (a day by default)
  from the retention window to a few spans ahead, and a DEFAULT partition for anything
  outside them; then the rows are copied, all in one transaction under the old table's
  lock;
* :func:`ensure_partitions` creates the partitions of the next spans (``purge_outbox``
  calls it, so the daily CronJob keeps them ahead);
* :func:`drop_partitions` is the retention: a partition wholly older than the cutoff is
  detached and dropped only when it holds SENT rows alone, checked under the lock that
  detaching takes, so a row requeued, replayed or leased by a relay meanwhile cannot be
  dropped with it. A partition that still holds PENDING or DEAD rows is kept (its SENT rows
  go by the batched DELETE, as on an unpartitioned table) until they are sent or purged.

Detaching takes an ACCESS EXCLUSIVE lock on the outbox table, which every ``emit()`` waits
for: each attempt waits at most :data:`LOCK_TIMEOUT_MS` for it (``lock_timeout``), holds
it for an index probe and a catalog change, and is retried later if it could not get it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from django.db import OperationalError, connections, transaction
from django.utils.dateparse import parse_datetime

from .exceptions import OutboxError
from .models import OutboxEvent
from .states import Status

#: How long one attempt at a partition's lock waits before it gives up (and is retried):
#: what it may make an emit() wait, on top of the few milliseconds it holds the lock.
LOCK_TIMEOUT_MS = 50
#: Attempts per partition before a run leaves it to the next one.
LOCK_ATTEMPTS = 20
#: Partitions created ahead of now.
DEFAULT_AHEAD = 3
DEFAULT_SPAN = timedelta(days=1)
#: The suffix of the unpartitioned table :func:`convert` keeps, and of its indexes' names.
KEPT = "_unpartitioned"
KEPT_INDEX = "_u"


class PartitionError(OutboxError):
    """The outbox table cannot be converted or partitioned as asked."""


@dataclass
class Partition:
    name: str
    start: datetime | None  # None: the DEFAULT partition
    end: datetime | None


@dataclass
class DropResult:
    dropped: list[str] = field(default_factory=list)
    #: Partitions past the cutoff kept: name -> why (the rows that are not SENT).
    kept: dict[str, str] = field(default_factory=dict)


def table() -> str:
    return OutboxEvent._meta.db_table


def is_partitioned(using: str) -> bool:
    """Whether the outbox table on ``using`` is a partitioned table (PostgreSQL)."""
    if connections[using].vendor != "postgresql":
        return False
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT c.relkind = 'p' FROM pg_class c WHERE c.oid = to_regclass(%s)", [table()]
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def _require_postgresql(using: str) -> None:
    vendor = connections[using].vendor
    if vendor != "postgresql":
        raise PartitionError(
            f"A partitioned outbox is PostgreSQL only; database {using!r} is {vendor}. "
            "Use purge_outbox's batched DELETE, or OUTBOX_RETENTION_DAYS = 0 "
            "(docs/operations.md, 'Sizing the outbox')."
        )


def partitions(using: str) -> list[Partition]:
    """The outbox table's partitions, oldest first, the DEFAULT one last."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
            [table()],
        )
        rows = cursor.fetchall()
    found = []
    for name, bound in rows:
        if bound == "DEFAULT":
            found.append(Partition(name, None, None))
            continue
        start, end = (_timestamp(v) for v in re.findall(r"'([^']*)'", bound))
        found.append(Partition(name, start, end))
    return sorted(found, key=lambda p: (p.start is None, p.start or datetime.min))


def _timestamp(text: str) -> datetime:
    value = parse_datetime(text)
    if value is None:
        raise PartitionError(f"cannot read the partition bound {text!r}")
    return value.astimezone(timezone.utc)


def _floor(moment: datetime, span: timedelta) -> datetime:
    epoch = datetime(2000, 1, 1, tzinfo=timezone.utc)
    return epoch + ((moment - epoch) // span) * span


def _name(start: datetime, span: timedelta) -> str:
    whole_days = span % timedelta(days=1) == timedelta(0)
    stamp = f"{start:%Y%m%d}" if whole_days else f"{start:%Y%m%d_%H%M%S}"
    return f"{table()}_p{stamp}"


def _now(using: str) -> datetime:
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        (now,) = cursor.fetchone()
    return now.astimezone(timezone.utc)  # type: ignore[no-any-return]


def _quote(using: str, name: str) -> str:
    return connections[using].ops.quote_name(name)


def _options(cursor: Any, relation: str) -> str:
    """``WITH (...)`` of the storage parameters of ``relation`` (the table's fillfactor,
    autovacuum settings an operator set), for a new partition to take; '' for none."""
    cursor.execute("SELECT reloptions FROM pg_class WHERE oid = to_regclass(%s)", [relation])
    row = cursor.fetchone()
    options = row[0] if row and row[0] else []
    return f" WITH ({', '.join(options)})" if options else ""


def _create(cursor: Any, using: str, start: datetime, span: timedelta, options: str) -> str:
    name = _name(start, span)
    cursor.execute(
        f"CREATE TABLE {_quote(using, name)} PARTITION OF {_quote(using, table())} "
        f"FOR VALUES FROM (%s) TO (%s){options}",
        [start, start + span],
    )
    return name


@dataclass
class ConvertResult:
    rows: int
    partitions: list[str]
    kept_table: str
    seconds: float


def convert(
    using: str,
    *,
    span: timedelta = DEFAULT_SPAN,
    history: timedelta = timedelta(days=7),
    ahead: int = DEFAULT_AHEAD,
) -> ConvertResult:
    """Turn the outbox table on ``using`` into one partitioned by ``created_at``, a
    partition per ``span`` from ``history`` ago to ``ahead`` spans from now (older rows go
    to the DEFAULT partition), and copy its rows; see the module's docstring. One
    transaction: emits wait for it (the copy is most of it)."""
    _require_postgresql(using)
    if span < timedelta(seconds=1):
        raise PartitionError(f"a partition must span at least a second, not {span}")
    started = time.monotonic()
    old = table() + KEPT
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        if is_partitioned(using):
            raise PartitionError(f"{table()} is partitioned already.")
        cursor.execute("SELECT to_regclass(%s)", [old])
        if cursor.fetchone()[0] is not None:
            raise PartitionError(
                f"{old} exists: a conversion was made before. Drop it once you no longer "
                "need it (DROP TABLE), then run this again."
            )
        cursor.execute(f"LOCK TABLE {_quote(using, table())} IN ACCESS EXCLUSIVE MODE")
        options = _options(cursor, table())
        # The indexes that are no constraint, as their definitions name them now (the same
        # statements create them on the partitioned table under the same names).
        cursor.execute(
            "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i "
            "LEFT JOIN pg_constraint c ON c.conindid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(%s) AND c.oid IS NULL",
            [table()],
        )
        indexes = [row[0] for row in cursor.fetchall()]
        # The primary key and unique constraints, under their names now.
        cursor.execute(
            "SELECT conname, contype, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = to_regclass(%s) AND contype IN ('p', 'u')",
            [table()],
        )
        keys = cursor.fetchall()
        cursor.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(%s)",
            [table()],
        )
        for (name,) in cursor.fetchall():
            cursor.execute(
                f"ALTER INDEX {_quote(using, name)} RENAME TO {_quote(using, name + KEPT_INDEX)}"
            )
        cursor.execute(f"ALTER TABLE {_quote(using, table())} RENAME TO {_quote(using, old)}")
        cursor.execute(
            f"CREATE TABLE {_quote(using, table())} (LIKE {_quote(using, old)} INCLUDING "
            "DEFAULTS INCLUDING IDENTITY INCLUDING CONSTRAINTS INCLUDING STORAGE) "
            "PARTITION BY RANGE (created_at)"
        )
        for name, _kind, definition in keys:
            columns = re.search(r"\((.*)\)", definition)
            assert columns is not None
            kind = "PRIMARY KEY" if _kind == "p" else "UNIQUE"
            cursor.execute(
                f"ALTER TABLE {_quote(using, table())} ADD CONSTRAINT {_quote(using, name)} "
                f"{kind} ({columns.group(1)}, created_at)"
            )
        for definition in indexes:
            cursor.execute(definition)
        now = _now(using)
        first, last = _floor(now - history, span), _floor(now, span) + ahead * span
        names = []
        start = first
        while start <= last:
            names.append(_create(cursor, using, start, span, options))
            start += span
        cursor.execute(
            f"CREATE TABLE {_quote(using, table() + '_pdefault')} PARTITION OF "
            f"{_quote(using, table())} DEFAULT{options}"
        )
        cursor.execute(f"INSERT INTO {_quote(using, table())} SELECT * FROM {_quote(using, old)}")
        rows = cursor.rowcount
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, 'id'), "
            f"(SELECT COALESCE(MAX(id), 0) + 1 FROM {_quote(using, old)}), false)",
            [table()],
        )
    with connections[using].cursor() as cursor:
        cursor.execute(f"ANALYZE {_quote(using, table())}")
    return ConvertResult(rows, names, old, time.monotonic() - started)


def _locked(using: str, work: Any) -> Any:
    """Run ``work(cursor)`` in a transaction whose locks wait at most LOCK_TIMEOUT_MS,
    retried up to LOCK_ATTEMPTS times; None when the lock was never had."""
    for attempt in range(LOCK_ATTEMPTS):
        try:
            with transaction.atomic(using=using), connections[using].cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_MS}ms'")
                return work(cursor)
        except OperationalError as exc:
            if "lock timeout" not in str(exc):
                raise
            time.sleep(min(1.0, 0.05 * (attempt + 1)))
    return None


def ensure_partitions(
    using: str, *, ahead: int = DEFAULT_AHEAD, span: timedelta | None = None
) -> list[str]:
    """Create the partitions missing from the last one to ``ahead`` spans past now (the
    span of the existing partitions, else ``span`` or a day); returns their names."""
    _require_postgresql(using)
    existing = [p for p in partitions(using) if p.start is not None]
    if not existing:
        raise PartitionError(f"{table()} has no time partition: run outbox_partition --convert.")
    last = existing[-1]
    assert last.start is not None and last.end is not None
    span = last.end - last.start if span is None else span
    goal = _floor(_now(using), span) + ahead * span
    with connections[using].cursor() as cursor:
        options = _options(cursor, last.name)
    created = []
    start = last.end
    while start <= goal:
        name = _locked(
            using, lambda cursor, start=start: _create(cursor, using, start, span, options)
        )
        if name is None:
            break  # the next run creates it
        created.append(name)
        start += span
    return created


def drop_partitions(using: str, older_than: timedelta, *, dry_run: bool = False) -> DropResult:
    """Detach and drop each partition whose whole range is older than ``older_than`` (by
    the database clock) and that holds SENT rows only; keep (and say why) those that hold
    any other row."""
    _require_postgresql(using)
    result = DropResult()
    cutoff = _now(using) - older_than
    for partition in partitions(using):
        if partition.end is None or partition.end > cutoff:
            continue
        name = _quote(using, partition.name)

        def detach(cursor: Any, name: str = name) -> str:
            # The lock DETACH takes, first: no row can change status, be leased or be
            # requeued between the check and the detach.
            if not dry_run:
                cursor.execute(f"LOCK TABLE {_quote(using, table())} IN ACCESS EXCLUSIVE MODE")
            cursor.execute(
                f"SELECT status, COUNT(*) FROM {name} WHERE status <> %s GROUP BY status",
                [int(Status.SENT)],
            )
            others = dict(cursor.fetchall())
            if others:
                return ", ".join(f"{n} {Status(s).name}" for s, n in sorted(others.items()))
            if not dry_run:
                cursor.execute(f"ALTER TABLE {_quote(using, table())} DETACH PARTITION {name}")
            return ""

        why = _locked(using, detach)
        if why is None:
            result.kept[partition.name] = "its lock was busy; the next run tries again"
        elif why:
            result.kept[partition.name] = why
        else:
            if not dry_run:
                with connections[using].cursor() as cursor:
                    cursor.execute(f"DROP TABLE {name}")
            result.dropped.append(partition.name)
    return result
