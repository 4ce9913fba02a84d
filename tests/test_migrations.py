"""The upgrade path: a database the previous release created migrates forward losing nothing.

The previous release is 0.1.0; the last migration it shipped is ``0005_claim_index``. The
test builds the schema with exactly those migrations (from zero), writes rows through the
historical models of that state, migrates to today's leaf (whatever later migrations there
are by then), and checks every row with today's models. Released migrations never change:
``test_released_migrations_are_unchanged`` holds their contents, so a schema change has to
come as a new migration, which the upgrade test then applies.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from django_outbox import outbox
from django_outbox.models import AggregateSequence, InboxMessage, OutboxEvent, Status

APP = "django_outbox"
PREVIOUS_RELEASE = "0.1.0"
#: The last migration of the previous release, named explicitly: not today's leaf.
PREVIOUS_LEAF = (APP, "0005_claim_index")

#: sha256 of each migration file a release has shipped (0.1.0: 0001-0005).
RELEASED_MIGRATIONS = {
    "0001_initial.py": "cc5558c3f58775096d0657b5f0488e96d82c57d4df3e0eee6bd2dee289707741",
    "0002_inboxmessage.py": "7d0391aab20120ccc360c8ec0e07221e7438e6719b1d197c53b8d1c269181693",
    "0003_aggregate_head_index.py": "48bff63c9931985eae599756671c0542d423e996873733b0249948d016a9794a",  # noqa: E501
    "0004_aggregatesequence.py": "181e2e2ffc42b98e8140365c763ae032116def450377419c815138a9e0436b57",
    "0005_claim_index.py": "8ee3dcf8ab07a2f549ee54c40c7f0615836d3be1067c61149e01429963abefaf",
}

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "django_outbox" / "migrations"


def _migrate(targets: list[tuple[str, str | None]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()  # what is applied now, after the previous migrate
    executor.migrate(targets)
    return executor


@pytest.mark.once
def test_released_migrations_are_unchanged():
    for name, digest in RELEASED_MIGRATIONS.items():
        actual = hashlib.sha256((MIGRATIONS_DIR / name).read_bytes()).hexdigest()
        assert actual == digest, (
            f"{name} shipped in a release and must not change: databases already ran it. "
            "Put the schema change in a new migration."
        )


@pytest.mark.django_db(transaction=True)
def test_rows_written_by_the_previous_release_survive_the_upgrade():
    leaf = MigrationExecutor(connection).loader.graph.leaf_nodes(APP)
    assert leaf, "django_outbox has no migrations?"
    now = timezone.now()
    try:
        # The previous release's schema, built by its own migrations.
        _migrate([(APP, None)])
        assert OutboxEvent._meta.db_table not in connection.introspection.table_names()
        executor = _migrate([PREVIOUS_LEAF])
        old = executor.loader.project_state([PREVIOUS_LEAF]).apps
        OldEvent = old.get_model(APP, "OutboxEvent")
        rows = {
            "pending": dict(status=0, retry_count=3, last_error="[timeout] no confirm in 10 s"),
            "sent": dict(status=1, retry_count=1, sent_at=now - timedelta(minutes=5)),
            "dead": dict(status=2, retry_count=11, last_error="[unroutable] no queue bound"),
        }
        for name, fields in rows.items():
            OldEvent.objects.create(
                event_id=f"evt-{name}",
                aggregate_type="ORDER",
                aggregate_id=f"order-{name}",
                event_type="ORDER_CREATED",
                payload={"order": name, "amount": "12.50", "lines": [1, 2]},
                headers={"traceparent": f"00-{name}"},
                occurred_at=now - timedelta(hours=1),
                next_retry_time=now + timedelta(minutes=2),
                created_at=now - timedelta(hours=1),
                **fields,
            )
        old.get_model(APP, "InboxMessage").objects.create(
            handler="points.handlers.AwardPoints", source_event_id="evt-sent", event_type="X"
        )
        old.get_model(APP, "AggregateSequence").objects.create(
            handler="points.handlers.AwardPoints",
            aggregate_type="ORDER",
            aggregate_id="order-sent",
            last_sequence=41,
        )

        _migrate(leaf)

        events = {e.event_id: e for e in OutboxEvent.objects.all()}
        assert set(events) == {"evt-pending", "evt-sent", "evt-dead"}
        expected = {
            "evt-pending": (Status.PENDING, 3, "[timeout] no confirm in 10 s"),
            "evt-sent": (Status.SENT, 1, ""),
            "evt-dead": (Status.DEAD, 11, "[unroutable] no queue bound"),
        }
        for event_id, (status, retry_count, last_error) in expected.items():
            event = events[event_id]
            assert (event.status, event.retry_count, event.last_error) == (
                status,
                retry_count,
                last_error,
            )
            assert event.payload["lines"] == [1, 2]
            assert event.headers == {"traceparent": f"00-{event_id.removeprefix('evt-')}"}
            assert abs(event.next_retry_time - (now + timedelta(minutes=2))) < timedelta(seconds=1)
        assert events["evt-sent"].sent_at is not None
        assert InboxMessage.objects.get(source_event_id="evt-sent").handler.endswith("Points")
        assert AggregateSequence.objects.get(aggregate_id="order-sent").last_sequence == 41

        # And today's code writes next to the old rows.
        with outbox.atomic() as box:
            box.emit("ORDER_PAID", aggregate_type="ORDER", aggregate_id="1", payload={})
        assert OutboxEvent.objects.count() == 4
    finally:
        _migrate(leaf)  # the rest of the session expects today's schema


def _index_names() -> set[str]:
    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, OutboxEvent._meta.db_table))


@pytest.mark.django_db(transaction=True)
def test_scheduled_events_migration_goes_back_and_forth():
    """0007_scheduled_events adds due_at (and on PostgreSQL swaps the claim indexes), and
    takes them back off."""
    leaf = MigrationExecutor(connection).loader.graph.leaf_nodes(APP)
    claim = {"django_outbox_claim_now_idx", "django_outbox_scheduled_idx"}
    before = (APP, "0006_replay_count")
    try:
        _migrate([before])
        columns = {
            c.name
            for c in connection.introspection.get_table_description(
                connection.cursor(), OutboxEvent._meta.db_table
            )
        }
        assert "due_at" not in columns
        assert not claim & _index_names()
        _migrate([(APP, "0007_scheduled_events")])
        if connection.vendor == "postgresql":
            assert claim <= _index_names()
            assert "django_outbox_claim_idx" not in _index_names()
        _migrate([before])
        if connection.features.supports_partial_indexes:
            assert "django_outbox_claim_idx" in _index_names()
        assert not claim & _index_names()
    finally:
        _migrate(leaf)


@pytest.mark.django_db(transaction=True)
def test_scheduled_events_migration_finds_what_was_created_by_hand_beforehand():
    """docs/installation.md: on a large PostgreSQL table, the column and the indexes are
    created first (the indexes CONCURRENTLY); the migration then finds them done."""
    if connection.vendor != "postgresql":
        pytest.skip("the statements are PostgreSQL's")
    leaf = MigrationExecutor(connection).loader.graph.leaf_nodes(APP)
    try:
        _migrate([(APP, "0006_replay_count")])
        with connection.cursor() as cursor:
            for statement in (
                "ALTER TABLE django_outbox_outboxevent "
                "ADD COLUMN IF NOT EXISTS due_at timestamp with time zone NULL",
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS django_outbox_claim_now_idx "
                "ON django_outbox_outboxevent (id) WHERE status = 0 AND due_at IS NULL",
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS django_outbox_scheduled_idx "
                "ON django_outbox_outboxevent (next_retry_time) "
                "WHERE status = 0 AND due_at IS NOT NULL",
            ):
                cursor.execute(statement)
        _migrate(leaf)
        assert {"django_outbox_claim_now_idx", "django_outbox_scheduled_idx"} <= _index_names()
    finally:
        _migrate(leaf)


@pytest.mark.django_db(transaction=True)
def test_mysql_heads_index_migration_goes_back_and_forth_and_finds_it_done():
    """0013_heads_index_mysql: the index on MySQL/MariaDB only (PostgreSQL has 0012's partial
    index of that name, SQLite none: nothing changes there); taken back off, and not created
    twice when it was created by hand beforehand (docs/installation.md: a large table)."""
    leaf = MigrationExecutor(connection).loader.graph.leaf_nodes(APP)
    name = "django_outbox_heads_idx"
    before, after = (APP, "0012_heads_index"), (APP, "0013_heads_index_mysql")
    had = name in _index_names()
    try:
        _migrate([before])
        assert (name in _index_names()) == (connection.vendor == "postgresql")
        _migrate([after])
        assert (name in _index_names()) == had
        if connection.vendor != "mysql":
            return
        _migrate([before])
        assert name not in _index_names()
        with connection.cursor() as cursor:
            cursor.execute(
                f"CREATE INDEX {name} ON django_outbox_outboxevent "
                "(status, aggregate_id, aggregate_type, id) ALGORITHM=INPLACE LOCK=NONE"
            )
        _migrate([after])
        assert name in _index_names()
    finally:
        _migrate(leaf)
