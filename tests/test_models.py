"""The table in the real database: named indexes and constraint, clean migrations."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_outbox.conf import OutboxSettings
from django_outbox.db import db_now
from django_outbox.models import OutboxEvent, Status
from tests.utils.rows import make_events

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.django_db
def test_relay_index_and_unique_constraint_exist_in_the_database():
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, OutboxEvent._meta.db_table)
    due = constraints["django_outbox_due_idx"]
    assert due["index"] and due["columns"] == ["status", "next_retry_time"]
    assert constraints["django_outbox_created_idx"]["columns"] == ["status", "created_at"]
    assert constraints["django_outbox_agg_head_idx"]["columns"] == [
        "aggregate_type",
        "aggregate_id",
        "status",
        "id",
    ]
    # Dropped in 0009: agg_head_idx serves what it served.
    assert "django_outbox_aggregate_idx" not in constraints
    unique = constraints["django_outbox_event_id_uniq"]
    assert unique["unique"] and unique["columns"] == ["event_id"]


def claim_plan(*, analyze: bool = False, ordered: bool = False, window: bool = False) -> str:
    """PostgreSQL's plan of the relay's claim statement (executed and rolled back when
    ``analyze``), on the due rows, 100 at a time; ``ordered``: the first (``window``) or
    the second statement of an ordered claim."""
    events = OutboxEvent.objects.all()
    with transaction.atomic(), connection.cursor() as cursor:
        sql, params = events._lease_sql(events.due(), 100, 60, "plan", ordered, None, window)
        cursor.execute(f"EXPLAIN {'(ANALYZE) ' if analyze else ''}{sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return plan


def analyze() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {OutboxEvent._meta.db_table}")


@pytest.mark.django_db
def test_relay_scan_does_not_walk_the_sent_history():
    """With a long SENT history and a small backlog, the claim reads index ranges of the
    unsent rows, never the history."""
    if connection.vendor != "postgresql":
        pytest.skip("EXPLAIN output checked on PostgreSQL")
    make_events(*[{"status": Status.SENT, "age": 3600} for _ in range(5000)])
    make_events(*[{"status": Status.PENDING, "age": 5} for _ in range(20)])
    analyze()
    plan = claim_plan()
    assert "Seq Scan" not in plan, plan
    assert "django_outbox_claim_now_idx" in plan, plan
    assert "django_outbox_scheduled_idx" in plan, plan


@pytest.mark.django_db
def test_claim_indexes_hold_the_unsent_rows_where_partial_indexes_exist():
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, OutboxEvent._meta.db_table)
    names = (
        "django_outbox_claim_idx",
        "django_outbox_claim_now_idx",
        "django_outbox_scheduled_idx",
        "django_outbox_heads_idx",
        "django_outbox_unordered_idx",
    )
    if not connection.features.supports_partial_indexes:
        # MySQL/MariaDB: none of them; 0013's index in full, status first (its SENT rows
        # are a range of their own).
        assert not set(names) - {"django_outbox_heads_idx"} & set(constraints)
        assert constraints["django_outbox_heads_idx"]["columns"] == [
            "status",
            "aggregate_id",
            "aggregate_type",
            "id",
        ]
        return
    if connection.vendor == "sqlite":  # 0005's index; its claim is one query
        assert constraints["django_outbox_claim_idx"]["columns"] == ["id"]
        assert "django_outbox_heads_idx" not in constraints
        return
    # PostgreSQL: 0007_scheduled_events replaced 0005's index by one per set the claim reads.
    assert "django_outbox_claim_idx" not in constraints
    assert constraints["django_outbox_claim_now_idx"]["columns"] == ["id"]
    assert constraints["django_outbox_scheduled_idx"]["columns"] == ["next_retry_time"]
    # 0012: ordered heads aggregate by aggregate, and the unordered rows apart.
    assert constraints["django_outbox_heads_idx"]["columns"] == [
        "aggregate_type",
        "aggregate_id",
        "id",
    ]
    assert constraints["django_outbox_unordered_idx"]["columns"] == ["id"]


@pytest.mark.django_db(transaction=True)
def test_claim_does_not_walk_the_part_of_a_backlog_already_sent():
    """Half a backlog drained since the last ANALYZE: the claim starts at the first unsent row.

    The statistics still say every row is PENDING, so without the partial claim index the
    planner walks the primary key past every SENT row, a cost that grows as the backlog drains.
    """
    if connection.vendor != "postgresql":
        pytest.skip("EXPLAIN ANALYZE output checked on PostgreSQL")
    make_events(*[{"status": Status.PENDING, "age": 5} for _ in range(3000)])
    analyze()
    first = OutboxEvent.objects.order_by("id").values_list("id", flat=True)
    OutboxEvent.objects.filter(id__lt=first[2000]).update(status=Status.SENT)
    plan = claim_plan(analyze=True)
    removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
    assert sum(removed) < 100, plan


@pytest.mark.django_db(transaction=True)
def test_claim_does_not_read_the_scheduled_events_that_are_not_due():
    """A backlog of events scheduled for later, older (lower ids) than the due rows, and a
    SENT history, from which PostgreSQL estimates that most PENDING rows are due: one walk by
    id over the PENDING rows would read every scheduled row on every claim."""
    if connection.vendor != "postgresql":
        pytest.skip("EXPLAIN ANALYZE output checked on PostgreSQL")
    make_events(*[{"status": Status.SENT, "age": 7200} for _ in range(3000)])
    later = db_now() + timedelta(days=1)
    make_events(*[{"due_at": later, "due_age": -86400} for _ in range(2000)])
    make_events(*[{"age": 5} for _ in range(20)])
    analyze()
    plan = claim_plan(analyze=True)
    removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
    assert sum(removed) < 100, plan
    _token, claimed = OutboxEvent.objects.due().claim(100, lease_seconds=60)
    assert len(claimed) == 20


def rows_read(plan: str) -> int:
    """Rows the scans of an EXPLAIN ANALYZE plan returned, over all their loops."""
    return sum(
        int(rows) * int(loops)
        for rows, loops in re.findall(r"Scan .*actual time=\S+ rows=(\d+) loops=(\d+)", plan)
    )


@pytest.mark.django_db(transaction=True)
def test_ordered_claim_does_not_read_the_queue_behind_the_heads():
    """A hot aggregate's 3,000 queued events in front of 20 other aggregates' heads: an
    ordered claim reads its window of the oldest rows, then one index entry per aggregate
    (django_outbox_heads_idx, migration 0012), never the queue."""
    if connection.vendor != "postgresql":
        pytest.skip("EXPLAIN ANALYZE output checked on PostgreSQL")
    make_events(*[("O", "hot")] * 3000, age=5)
    make_events(*[("O", str(n)) for n in range(20)], age=5)
    analyze()
    window = claim_plan(analyze=True, ordered=True, window=True)
    assert "Seq Scan" not in window, window
    # The window (100 x HEADS_WINDOW = 1,000 rows) and one entry of each one's aggregate.
    assert rows_read(window) < 2500, window
    heads = claim_plan(analyze=True, ordered=True)
    assert "django_outbox_heads_idx" in heads and "Seq Scan" not in heads, heads
    assert rows_read(heads) < 200, heads
    _token, claimed = OutboxEvent.objects.due().claim(100, lease_seconds=60, ordered=True, run=1)
    assert len(claimed) == 21


def mysql_claim_plan(*, window: bool) -> list[Any]:
    """MySQL/MariaDB: ``ANALYZE FORMAT=JSON`` of the two statements of the first
    (``window``) or the second look of an ordered claim of 100 (the candidates, then the
    locking read of them), rolled back."""
    from django_outbox import ordering

    events = OutboxEvent.objects.due()
    plans = []
    with transaction.atomic(), connection.cursor() as cursor:
        with CaptureQueriesContext(connection) as ctx:
            ids = ordering.claimable(events, True, None, 100, window=window)
        locked = events.with_ids(ids).select_for_update(skip_locked=True).order_by("id")
        sql, params = locked.values("id")[:100].query.get_compiler(using=events.db).as_sql()
        for statement, statement_params in ((ctx.captured_queries[-1]["sql"], ()), (sql, params)):
            cursor.execute(f"ANALYZE FORMAT=JSON {statement}", statement_params or None)
            plans.append(json.loads(cursor.fetchone()[0]))
        transaction.set_rollback(True)
    return plans


def mysql_rows_read(plan: Any) -> float:
    """Rows the tables of an ``ANALYZE FORMAT=JSON`` plan returned, over all their loops."""
    if isinstance(plan, list):
        return sum(mysql_rows_read(each) for each in plan)
    if not isinstance(plan, dict):
        return 0
    read = 0.0
    table = plan.get("table")
    if isinstance(table, dict) and not table.get("table_name", "").startswith("<"):
        read += (table.get("r_loops") or 0) * (table.get("r_rows") or 0)
    return read + sum(mysql_rows_read(value) for value in plan.values())


@pytest.mark.django_db(transaction=True)
def test_ordered_claim_on_mysql_does_not_read_the_queue_behind_the_heads():
    """MariaDB/MySQL, without partial indexes: behind a hot aggregate's 3,000 queued events,
    the claim's first look reads its window and one entry per row of it, the second one
    entry per aggregate (django_outbox_heads_idx, migration 0013, a loose index scan) and
    the unordered rows by their own range: neither walks the queue (the window walks by id
    past the SENT rows in front, as it did before)."""
    if not getattr(connection, "mysql_is_mariadb", False):
        pytest.skip("ANALYZE FORMAT=JSON is MariaDB's")
    make_events(*[{"status": Status.SENT, "age": 3600} for _ in range(2000)])
    make_events(*[("O", "hot")] * 3000, age=5)
    make_events(*[("O", str(n)) for n in range(20)], age=5)
    make_events(*[("", "")] * 5, age=5)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE TABLE {OutboxEvent._meta.db_table}")
        cursor.fetchall()
    window = mysql_claim_plan(window=True)
    # The window (100 x HEADS_WINDOW = 1,000 rows, past the SENT ones by id) and one entry
    # of each one's aggregate.
    assert mysql_rows_read(window) < 5500, window
    heads = mysql_claim_plan(window=False)
    assert '"using_index_for_group_by"' in json.dumps(heads), heads
    assert mysql_rows_read(heads) < 200, heads
    _token, claimed = OutboxEvent.objects.due().claim(100, lease_seconds=60, ordered=True, run=1)
    assert len(claimed) == 26


@pytest.mark.django_db(transaction=True)
def test_ordered_claim_searches_heads_once_whatever_the_statistics():
    """Statistics of an empty table and a backlog written since (before autovacuum's
    ANALYZE): the planner ran the head search again for every candidate row (a nested loop
    over the subquery), minutes for 10,000 rows. As an array it is an InitPlan: once."""
    if connection.vendor != "postgresql":
        pytest.skip("EXPLAIN output checked on PostgreSQL")
    analyze()
    make_events(*[("O", str(n % 50)) for n in range(500)], age=5)
    for window in (True, False):
        plan = claim_plan(ordered=True, window=window)
        assert "InitPlan" in plan, plan


def test_status_numbers_match_the_article():
    assert (Status.PENDING, Status.SENT, Status.DEAD) == (0, 1, 2)


@pytest.mark.once
@pytest.mark.parametrize(
    "auto_field", ["django.db.models.BigAutoField", "django.db.models.AutoField"]
)
def test_makemigrations_is_clean_whatever_the_default_auto_field(auto_field, tmp_path):
    settings_file = tmp_path / "auto_settings.py"
    settings_file.write_text(f"from tests.settings import *\nDEFAULT_AUTO_FIELD = {auto_field!r}\n")
    env = {
        "PYTHONPATH": f"{tmp_path}:{ROOT}:{ROOT / 'testproject'}",
        "DJANGO_SETTINGS_MODULE": "auto_settings",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "django", "makemigrations", "django_outbox", "--check", "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.once
def test_every_setting_is_documented():
    text = (ROOT / "docs" / "settings.md").read_text()
    missing = [name for name in OutboxSettings.names() if f"`{name}`" not in text]
    assert missing == []


def test_settings_are_read_lazily(settings):
    from django_outbox.conf import outbox_settings

    assert outbox_settings.BATCH_SIZE is None
    settings.OUTBOX_BATCH_SIZE = 7
    assert outbox_settings.BATCH_SIZE == 7


def test_a_setting_is_looked_up_once_until_a_setting_changes(settings, monkeypatch):
    """A setting the project leaves out cost Django's settings object two exceptions on
    every read; emit() reads two. Read once, then again only after a change, which
    override_settings and pytest-django's fixture announce with setting_changed."""
    from django.conf import LazySettings

    from django_outbox.conf import outbox_settings

    settings.OUTBOX_BATCH_SIZE = 7  # any OUTBOX_ setting changed: everything is read anew
    lookups: list[str] = []
    missing = LazySettings.__getattr__

    def counting(self: LazySettings, name: str) -> object:
        lookups.append(name)
        return missing(self, name)

    monkeypatch.setattr(LazySettings, "__getattr__", counting)
    for _ in range(3):
        assert outbox_settings.MAX_PAYLOAD_BYTES == 256 * 1024
    assert lookups.count("OUTBOX_MAX_PAYLOAD_BYTES") == 1
    settings.OUTBOX_MAX_PAYLOAD_BYTES = 10
    assert outbox_settings.MAX_PAYLOAD_BYTES == 10
    del settings.OUTBOX_MAX_PAYLOAD_BYTES
    assert outbox_settings.MAX_PAYLOAD_BYTES == 256 * 1024


def test_mutable_defaults_are_not_shared():
    from django_outbox.conf import outbox_settings

    outbox_settings.ROUTING_KEYS["X"] = "y"
    assert outbox_settings.ROUTING_KEYS == {}
