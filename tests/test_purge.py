"""purge() and manage.py purge_outbox on the real database DATABASE_URL names."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_outbox.models import OutboxEvent, Status
from django_outbox.purge import RetentionTooShort, purge
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db(transaction=True)


def make_rows(n: int, *, status: int, age_days: float) -> list[int]:
    """The ids of n rows in ``status`` whose created_at is ``age_days`` ago (database clock)."""
    return [row.pk for row in make_events(*[{"status": status, "age": age_days * 86400}] * n)]


def counts() -> dict[str, int]:
    by_status = OutboxEvent.objects.status_counts()
    return {s.name: by_status.get(s.value, 0) for s in Status}


def delete_statements(ctx: CaptureQueriesContext) -> int:
    return sum(1 for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("DELETE"))


def test_only_old_sent_rows_are_deleted_pending_never_dead_kept():
    make_rows(5, status=Status.SENT, age_days=10)
    make_rows(3, status=Status.SENT, age_days=1)
    make_rows(4, status=Status.PENDING, age_days=30)
    make_rows(2, status=Status.DEAD, age_days=30)
    result = purge(older_than_days=7)
    assert (result.sent, result.dead, result.total) == (5, 0, 5)
    assert counts() == {"PENDING": 4, "SENT": 3, "DEAD": 2}


def test_dead_rows_go_only_when_asked():
    make_rows(2, status=Status.DEAD, age_days=30)
    make_rows(1, status=Status.DEAD, age_days=1)
    make_rows(1, status=Status.PENDING, age_days=30)
    result = purge(older_than_days=7, include_dead=True)
    assert result.dead == 2
    assert counts() == {"PENDING": 1, "SENT": 0, "DEAD": 1}


@override_settings(OUTBOX_PURGE_DEAD=True)
def test_dead_rows_go_with_the_setting():
    make_rows(2, status=Status.DEAD, age_days=30)
    assert purge().dead == 2


def test_deletes_in_batches_each_one_statement():
    make_rows(25, status=Status.SENT, age_days=10)
    with CaptureQueriesContext(connection) as ctx:
        result = purge(older_than_days=7, batch_size=10)
    assert result.sent == 25 and result.batches == 3
    assert delete_statements(ctx) == 3
    assert OutboxEvent.objects.count() == 0


@override_settings(OUTBOX_PURGE_BATCH_SIZE=4, OUTBOX_RETENTION_DAYS=5)
def test_defaults_come_from_settings():
    make_rows(8, status=Status.SENT, age_days=6)
    with CaptureQueriesContext(connection) as ctx:
        result = purge()
    # 8 rows in batches of 4: two full batches, then an empty SELECT ends the loop.
    assert result.sent == 8 and delete_statements(ctx) == 2


def test_dry_run_deletes_nothing():
    make_rows(5, status=Status.SENT, age_days=10)
    make_rows(2, status=Status.DEAD, age_days=10)
    with CaptureQueriesContext(connection) as ctx:
        result = purge(older_than_days=7, include_dead=True, dry_run=True)
    assert (result.sent, result.dead) == (5, 2)
    assert delete_statements(ctx) == 0
    assert OutboxEvent.objects.count() == 7
    assert "would delete 7 row(s)" in result.summary()


def test_retention_guard():
    make_rows(2, status=Status.SENT, age_days=2)
    with pytest.raises(RetentionTooShort, match="--force"):
        purge(older_than_days=1)
    assert purge(older_than_days=1, force=True).sent == 2


# --- the command ---------------------------------------------------------------------------


def test_command_prints_a_one_line_summary():
    make_rows(3, status=Status.SENT, age_days=10)
    make_rows(1, status=Status.DEAD, age_days=10)
    out = StringIO()
    call_command("purge_outbox", "--batch-size", "2", stdout=out)
    assert out.getvalue().strip() == (
        "purge_outbox: deleted 3 row(s) older than 7 day(s) (3 sent, dead rows kept) in 2 batch(es)"
    )
    assert counts()["DEAD"] == 1


def test_command_dry_run_and_include_dead():
    make_rows(1, status=Status.DEAD, age_days=10)
    out = StringIO()
    call_command("purge_outbox", "--dry-run", "--include-dead", stdout=out)
    assert "would delete 1 row(s)" in out.getvalue() and "1 dead" in out.getvalue()
    assert OutboxEvent.objects.count() == 1


def test_command_refuses_short_retention_with_exit_code_2():
    with pytest.raises(CommandError, match="below 3") as info:
        call_command("purge_outbox", "--older-than-days", "1")
    assert info.value.returncode == 2
    call_command("purge_outbox", "--older-than-days", "1", "--force", stdout=StringIO())


@override_settings(OUTBOX_RETENTION_DAYS=2)
def test_command_refuses_a_short_retention_setting():
    with pytest.raises(CommandError) as info:
        call_command("purge_outbox")
    assert info.value.returncode == 2


@pytest.mark.parametrize(
    "args", [["--older-than-days", "0"], ["--older-than-days", "x"], ["--batch-size", "0"]]
)
def test_bad_options_are_refused_by_argparse(args):
    with pytest.raises(CommandError, match="argument"):
        call_command("purge_outbox", *args)


def test_command_unknown_database_exits_2():
    with pytest.raises(CommandError, match="DATABASES") as info:
        call_command("purge_outbox", "--database", "nope")
    assert info.value.returncode == 2
