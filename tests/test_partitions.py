"""A PostgreSQL outbox partitioned by time: outbox_partition --convert, partitions kept
ahead, and retention that drops whole partitions holding SENT rows only (issue 31, item 2).

Each test converts the test database's table and puts the unpartitioned one back after
(:func:`unconvert`), so the other tests see the table the migrations made.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction

from django_outbox import outbox, partitions
from django_outbox.backends import locmem
from django_outbox.models import OutboxEvent, Status
from django_outbox.purge import purge
from tests.utils.relay import make_relay
from tests.utils.rows import make_events
from tests.utils.threads import db_thread

pytestmark = pytest.mark.django_db(transaction=True)

DAY = 86400.0
BUSY = "its lock was busy; the next run tries again"
TABLE = OutboxEvent._meta.db_table


def unconvert() -> None:
    """Drop the partitioned table and put back the one :func:`partitions.convert` kept,
    under its own index names (for tests only: rows written since the conversion go)."""
    with connection.cursor() as cursor:
        cursor.execute(f'DROP TABLE IF EXISTS "{TABLE}"')
        cursor.execute(f'ALTER TABLE "{TABLE}{partitions.KEPT}" RENAME TO "{TABLE}"')
        cursor.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = to_regclass(%s)",
            [TABLE],
        )
        for (name,) in cursor.fetchall():
            original = name.removesuffix(partitions.KEPT_INDEX)
            cursor.execute(f'ALTER INDEX "{name}" RENAME TO "{original}"')


@pytest.fixture
def postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("a partitioned outbox is PostgreSQL only")


@pytest.fixture
def converted(postgres: None) -> Iterator[None]:
    yield
    if partitions.is_partitioned("default"):
        unconvert()


def convert(**kwargs: object) -> partitions.ConvertResult:
    kwargs.setdefault("history", timedelta(days=10))
    return partitions.convert("default", **kwargs)  # type: ignore[arg-type]


def names(using: str = "default") -> list[str]:
    return [p.name for p in partitions.partitions(using)]


def partition_of(row: OutboxEvent) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT tableoid::regclass::text FROM "{TABLE}" WHERE id = %s', [row.pk])
        return str(cursor.fetchone()[0]).strip('"')


def test_convert_keeps_every_row_and_index_and_the_relay_runs_on(converted):
    rows = make_events(
        {"status": Status.SENT, "age": 3 * DAY},
        {"status": Status.DEAD, "age": 2 * DAY},
        {"age": 60},
        {"status": Status.SENT, "age": 30 * DAY},  # older than the partitions: DEFAULT
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s", [TABLE])
        before = {name for (name,) in cursor.fetchall()}
    result = convert()
    assert partitions.is_partitioned("default")
    assert result.rows == 4 and result.kept_table == TABLE + partitions.KEPT
    assert len(result.partitions) == 14  # 10 days back, today, 3 ahead
    assert partition_of(rows[3]) == TABLE + "_pdefault"
    assert partition_of(rows[2]).startswith(TABLE + "_p2")
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s", [TABLE])
        assert {name for (name,) in cursor.fetchall()} == before
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [result.partitions[0]])
        assert "fillfactor=50" in cursor.fetchone()[0]  # the table's storage, per partition
    assert sorted(OutboxEvent.objects.values_list("pk", flat=True)) == [r.pk for r in rows]
    with outbox.atomic() as box:
        box.emit("E", aggregate_type="T", aggregate_id="1", payload={})
    new = OutboxEvent.objects.get(event_type="E")
    assert new.pk > rows[-1].pk
    assert make_relay().drain().sent == 2
    assert len(locmem.outbox) == 2
    assert OutboxEvent.objects.get(pk=new.pk).status == Status.SENT


def test_convert_twice_is_refused(converted):
    convert()
    with pytest.raises(partitions.PartitionError, match="partitioned already"):
        convert()


def test_purge_drops_old_partitions_of_sent_rows_and_keeps_the_others(converted):
    convert()
    only_sent = make_events({"status": Status.SENT, "age": 9 * DAY + 60})
    mixed = make_events(
        {"status": Status.SENT, "age": 8 * DAY + 60},
        {"status": Status.DEAD, "age": 8 * DAY + 120},
    )
    young = make_events({"status": Status.SENT, "age": DAY})
    dropped, kept = partition_of(only_sent[0]), partition_of(mixed[0])
    result = purge(older_than_days=7)
    assert dropped in result.partitions_dropped and dropped not in names()
    assert result.partitions_kept[kept] == "1 DEAD"
    assert f"partition {kept} is past retention and kept: 1 DEAD" in result.warnings
    # What the kept partition's SENT rows are left to: the batched DELETE, as before.
    assert result.sent == 1
    assert sorted(OutboxEvent.objects.values_list("pk", flat=True)) == [mixed[1].pk, young[0].pk]
    assert "partitions: dropped" in result.summary()


def test_a_partition_where_a_relay_holds_a_lease_is_kept_and_the_relay_settles(converted):
    convert()
    (old,) = make_events({"age": 9 * DAY})
    relay = make_relay(lease_seconds=60)
    batch = relay.send(relay.claim(10))
    where = partition_of(old)
    result = purge(older_than_days=7)
    assert result.partitions_kept[where] == "1 PENDING"
    relay.collect(batch)
    assert relay.settle(batch).sent == 1
    assert where in purge(older_than_days=7).partitions_dropped
    assert len(locmem.outbox) == 1


def in_thread(work: Callable[[], Any]) -> Any:
    """``work()`` on a connection of its own; its result."""
    results: list[Any] = []
    thread = db_thread(lambda: results.append(work()))
    thread.start()
    thread.join(60)
    return results[0]


def test_a_replay_racing_the_drop_keeps_the_partition(converted, monkeypatch):
    """The check and the detach hold the table's lock together: a replay of an old SENT
    row still uncommitted makes the drop give up; committed, it keeps the partition."""
    convert()
    monkeypatch.setattr(partitions, "LOCK_ATTEMPTS", 1)
    (old,) = make_events({"status": Status.SENT, "age": 9 * DAY})
    where = partition_of(old)
    with transaction.atomic():
        OutboxEvent.objects.filter(pk=old.pk).requeue(replay=True)
        busy = in_thread(lambda: partitions.drop_partitions("default", timedelta(days=7)))
    # Every partition past the cutoff waits for the same lock on the table.
    assert busy.dropped == [] and busy.kept[where] == BUSY
    assert set(busy.kept.values()) == {BUSY}
    assert partitions.drop_partitions("default", timedelta(days=7)).kept == {where: "1 PENDING"}
    assert OutboxEvent.objects.get(pk=old.pk).status == Status.PENDING


def test_a_drop_waits_for_the_lock_at_most_the_lock_timeout(converted, monkeypatch):
    convert()
    make_events({"status": Status.SENT, "age": 9 * DAY})
    monkeypatch.setattr(partitions, "LOCK_ATTEMPTS", 1)
    with transaction.atomic():
        # A claim in progress: a lock on the table the drop's lock must wait for.
        list(OutboxEvent.objects.select_for_update().filter(status=Status.SENT)[:1])
        started = time.monotonic()
        busy = in_thread(lambda: partitions.drop_partitions("default", timedelta(days=7)))
        waited = time.monotonic() - started
    assert busy.dropped == [] and set(busy.kept.values()) == {BUSY}
    assert waited < 1.0  # LOCK_TIMEOUT_MS, the sleep after a failed attempt, the queries
    assert purge(older_than_days=7).partitions_dropped != []


def test_ensure_partitions_keeps_spans_ready_ahead(converted):
    convert(span=timedelta(hours=1), history=timedelta(hours=2), ahead=1)
    before = names()
    created = partitions.ensure_partitions("default", ahead=4)
    assert len(created) == 3
    assert names() == before[:-1] + created + [TABLE + "_pdefault"]
    assert re.fullmatch(rf"{TABLE}_p\d{{8}}_\d{{6}}", created[0])
    assert partitions.ensure_partitions("default", ahead=4) == []


def test_the_command_converts_then_lists_and_creates(converted):
    make_events({"status": Status.SENT})
    out = StringIO()
    call_command("outbox_partition", "--convert", "--span", "1d", stdout=out)
    assert "converted, 1 row(s) copied into" in out.getvalue()
    assert f"DROP TABLE {TABLE}{partitions.KEPT}" in out.getvalue()
    out = StringIO()
    call_command("outbox_partition", "--ahead", "5", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[-1] == "outbox_partition: created 2 partition(s) ahead"
    assert lines[-2].startswith(f"{TABLE}_pdefault  DEFAULT")


def test_the_command_says_what_to_do_on_a_table_not_converted(postgres):
    with pytest.raises(CommandError, match="--convert first") as info:
        call_command("outbox_partition")
    assert info.value.returncode == 2


def test_elsewhere_the_command_says_it_is_postgresql_only():
    if connection.vendor == "postgresql":
        pytest.skip("on PostgreSQL the command works")
    with pytest.raises(CommandError, match="PostgreSQL only") as info:
        call_command("outbox_partition", "--convert")
    assert info.value.returncode == 2
    assert not partitions.is_partitioned("default")
    assert purge(older_than_days=7).partitions_dropped == []
