"""purge() and manage.py purge_outbox on the real database DATABASE_URL names."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError, connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_outbox.checks import Codes, check_inbox_retention
from django_outbox.db import db_now
from django_outbox.models import InboxMessage, OutboxEvent, Status
from django_outbox.purge import RetentionTooShort, purge
from tests.utils.rows import make_events, make_inbox
from tests.utils.threads import db_thread

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


def test_pauses_between_batches_in_proportion_to_their_time(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("django_outbox.querysets.time.sleep", slept.append)
    make_rows(25, status=Status.SENT, age_days=10)
    times: list[float] = []
    purge(batch_size=10, pause_ratio=2, on_batch=lambda kind, rows, took: times.append(took))
    # No pause after the last batch (5 rows), nor in the inbox's one empty batch.
    assert slept == [2 * t for t in times[:2]] and len(times) == 3
    slept.clear()
    make_rows(25, status=Status.SENT, age_days=10)
    with override_settings(OUTBOX_PURGE_PAUSE_RATIO=0):
        assert purge(batch_size=10).sent == 25
    assert slept == []


@pytest.mark.parametrize("value", [-1, "1", True, None])
def test_a_bad_pause_ratio_deletes_nothing_and_exits_2(settings, value):
    settings.OUTBOX_PURGE_PAUSE_RATIO = value
    make_rows(1, status=Status.SENT, age_days=10)
    with pytest.raises(CommandError, match="OUTBOX_PURGE_PAUSE_RATIO") as info:
        call_command("purge_outbox")
    assert info.value.returncode == 2 and OutboxEvent.objects.count() == 1


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


# --- what a batch holds while it runs ------------------------------------------------------


def emit_with_a_lock_timeout(outcome: list[str]) -> None:
    """emit() in this thread's own connection, giving up on a lock after 2 s (not waiting
    for it forever: the test then fails instead of hanging)."""
    from django_outbox import outbox

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET lock_timeout = '2s'")
        else:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 2")
    try:
        with outbox.atomic() as box:
            box.emit("ORDER_CREATED", payload={"n": 1})
        outcome.append("emitted")
    except OperationalError as exc:
        outcome.append(f"waited for a lock: {exc}")


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_batch_in_flight_never_makes_emit_wait_for_a_lock(isolation):
    # Every row is old, so a batch holds the table's last id, and the table is small, so
    # the optimizer may scan it rather than look the ids up: under REPEATABLE READ InnoDB
    # would then lock every row and the gap after the last one, and every INSERT would
    # wait for the batch to commit.
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer at a time: any open write blocks emit()")
    if connection.vendor != "mysql" and isolation != "read committed":
        pytest.skip("the isolation level matters to InnoDB's gap locks")
    make_rows(30, status=Status.SENT, age_days=10)
    outcome: list[str] = []

    def emit_before_the_delete_commits(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.lstrip().upper().startswith("DELETE") and not outcome:
            thread = db_thread(emit_with_a_lock_timeout, outcome)
            thread.start()
            thread.join(30)
        return result

    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation.upper()}")
    try:
        with connection.execute_wrapper(emit_before_the_delete_commits):
            assert purge(older_than_days=7, batch_size=20).sent == 30
    finally:
        if connection.vendor == "mysql":
            with connection.cursor() as cursor:
                cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    assert outcome == ["emitted"]
    assert counts() == {"PENDING": 1, "SENT": 0, "DEAD": 0}


def test_inside_a_transaction_the_batches_are_savepoints_of_it():
    # The READ COMMITTED of each batch (MySQL/MariaDB) is for a transaction of its own:
    # inside one already open, changing the level would be an error.
    make_rows(3, status=Status.SENT, age_days=10)
    make_inbox(20)
    with transaction.atomic():
        result = purge(batch_size=2)
    assert (result.sent, result.batches, result.inbox) == (3, 2, 1)
    assert counts()["SENT"] == 0


# --- the command ---------------------------------------------------------------------------


def test_command_prints_a_one_line_summary():
    make_rows(3, status=Status.SENT, age_days=10)
    make_rows(1, status=Status.DEAD, age_days=10)
    out = StringIO()
    call_command("purge_outbox", "--batch-size", "2", stdout=out)
    assert out.getvalue().strip() == (
        "purge_outbox: deleted 3 row(s) older than 7 day(s) (3 sent, dead rows kept) in 2 "
        "batch(es); inbox: deleted 0 row(s) older than 14 day(s) in 0 batch(es)"
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


def test_command_verbosity_2_prints_each_batch():
    make_rows(5, status=Status.SENT, age_days=10)
    make_inbox(20, 20, 20)
    out = StringIO()
    call_command("purge_outbox", "--batch-size", "2", "-v", "2", stdout=out)
    lines = out.getvalue().splitlines()
    kinds = [line.split()[2] for line in lines if " row(s) deleted in " in line]
    assert kinds == ["sent"] * 3 + ["inbox"] * 2
    assert lines[-1].startswith("purge_outbox: deleted 5 row(s)")


# --- the consumers' inbox -------------------------------------------------------------------


def inbox_ages() -> list[int]:
    """The age in whole days (database clock) of every inbox row left, oldest first."""
    now = db_now()
    ages = InboxMessage.objects.values_list("processed_at", flat=True)
    return sorted((round((now - at).total_seconds() / 86400) for at in ages), reverse=True)


def test_inbox_rows_past_the_default_14_days_go_younger_ones_stay():
    make_inbox(40, 15, 13, 1, 0)
    result = purge()
    assert (result.inbox, result.inbox_days, result.inbox_batches) == (2, 14, 1)
    assert inbox_ages() == [13, 1, 0]
    assert result.warnings == []


@override_settings(OUTBOX_INBOX_RETENTION_DAYS=30)
def test_inbox_retention_comes_from_its_setting():
    make_inbox(40, 20)
    assert purge().inbox == 1
    assert inbox_ages() == [20]


def test_inbox_is_purged_in_batches_each_one_statement():
    make_inbox(*[20] * 7)
    with CaptureQueriesContext(connection) as ctx:
        result = purge(batch_size=3)
    assert (result.inbox, result.inbox_batches) == (7, 3)
    assert delete_statements(ctx) == 3
    assert InboxMessage.objects.count() == 0


@override_settings(OUTBOX_INBOX_RETENTION_DAYS=3, OUTBOX_RETENTION_DAYS=7)
def test_a_shorter_inbox_setting_is_raised_to_the_sent_retention_with_a_warning():
    make_inbox(8, 5, 2)
    result = purge()
    assert (result.inbox, result.inbox_days) == (1, 7)
    assert inbox_ages() == [5, 2]
    (warning,) = result.warnings
    assert "OUTBOX_INBOX_RETENTION_DAYS (3)" in warning and "kept 7 days" in warning


def test_the_inbox_is_never_purged_sooner_than_this_runs_sent_rows():
    # --older-than-days 30 keeps SENT rows 30 days: any of them can still be replayed, so
    # the default inbox retention (14) follows it, without a warning (nothing was set).
    make_inbox(40, 20)
    make_rows(1, status=Status.SENT, age_days=20)
    result = purge(older_than_days=30)
    assert (result.sent, result.inbox, result.inbox_days) == (0, 1, 30)
    assert inbox_ages() == [20] and result.warnings == []


@override_settings(OUTBOX_RETENTION_DAYS=7)
def test_a_forced_short_run_does_not_shorten_the_inbox():
    make_inbox(20, 5)
    result = purge(older_than_days=1, force=True)
    assert (result.inbox, result.inbox_days) == (1, 14)
    assert inbox_ages() == [5]


@override_settings(OUTBOX_INBOX_RETENTION_DAYS=None)
def test_none_keeps_the_inbox():
    make_inbox(400)
    result = purge()
    assert (result.inbox, result.inbox_days) == (0, None)
    assert InboxMessage.objects.count() == 1
    assert result.summary().endswith("inbox kept (OUTBOX_INBOX_RETENTION_DAYS is None)")


def test_dry_run_counts_the_inbox_and_deletes_nothing():
    make_inbox(20, 20, 1)
    with CaptureQueriesContext(connection) as ctx:
        result = purge(dry_run=True)
    assert result.inbox == 2 and delete_statements(ctx) == 0
    assert InboxMessage.objects.count() == 3
    assert "inbox: would delete 2 row(s) older than 14 day(s)" in result.summary()


@pytest.mark.parametrize("value", ["14", 0, -1, True])
def test_a_bad_inbox_retention_deletes_nothing_and_exits_2(settings, value):
    settings.OUTBOX_INBOX_RETENTION_DAYS = value
    make_rows(1, status=Status.SENT, age_days=10)
    make_inbox(20)
    with pytest.raises(CommandError, match="OUTBOX_INBOX_RETENTION_DAYS") as info:
        call_command("purge_outbox")
    assert info.value.returncode == 2
    assert OutboxEvent.objects.count() == 1 and InboxMessage.objects.count() == 1


@override_settings(OUTBOX_INBOX_RETENTION_DAYS=3)
def test_command_warns_on_stderr_when_the_inbox_retention_is_raised():
    make_inbox(10)
    out, err = StringIO(), StringIO()
    call_command("purge_outbox", stdout=out, stderr=err)
    assert "OUTBOX_INBOX_RETENTION_DAYS (3) is shorter" in err.getvalue()
    assert "inbox: deleted 1 row(s) older than 7 day(s)" in out.getvalue()


# --- the inbox retention's system checks ------------------------------------------------------


@pytest.mark.once
@pytest.mark.parametrize("value", ["14", 0, -1, True, [14]])
def test_check_refuses_a_bad_inbox_retention(settings, value):
    settings.OUTBOX_INBOX_RETENTION_DAYS = value
    (error,) = check_inbox_retention()
    assert error.id == Codes.INBOX_RETENTION == "django_outbox.E024"
    assert "None" in error.hint


@pytest.mark.once
def test_check_refuses_an_inbox_retention_set_shorter_than_the_sent_retention(settings):
    settings.OUTBOX_RETENTION_DAYS = 10
    settings.OUTBOX_INBOX_RETENTION_DAYS = 9.5
    (error,) = check_inbox_retention()
    assert error.id == Codes.INBOX_RETENTION_SHORT == "django_outbox.E025"
    assert "(9.5)" in error.msg and "to 10 or more" in error.hint
    settings.OUTBOX_INBOX_RETENTION_DAYS = 10
    assert check_inbox_retention() == []


@pytest.mark.once
@pytest.mark.parametrize("value", [-1, "1", True, None])
def test_check_refuses_a_bad_pause_ratio(settings, value):
    from django_outbox.checks import check_positive_numbers

    settings.OUTBOX_PURGE_PAUSE_RATIO = value
    (error,) = check_positive_numbers()
    assert error.id == Codes.NUMBERS and "OUTBOX_PURGE_PAUSE_RATIO" in error.msg
    settings.OUTBOX_PURGE_PAUSE_RATIO = 0
    assert check_positive_numbers() == []


@pytest.mark.once
def test_check_passes_the_default_and_none(settings):
    assert check_inbox_retention() == []
    # The default follows a longer outbox retention by itself (see the purge tests).
    settings.OUTBOX_RETENTION_DAYS = 30
    assert check_inbox_retention() == []
    settings.OUTBOX_INBOX_RETENTION_DAYS = None
    assert check_inbox_retention() == []
