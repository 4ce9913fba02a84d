"""The row's lifecycle: every transition is a QuerySet method, fenced where a claim holds the
row, and stamps ``updated_at`` from the database clock (which the incident queries read)."""

from __future__ import annotations

import ast
import re
from datetime import timedelta
from pathlib import Path

import pytest

from django_outbox.backends import locmem
from django_outbox.backends.base import Reason
from django_outbox.db import db_now
from django_outbox.models import OutboxEvent, Status
from django_outbox.purge import purge
from django_outbox.relay import BrokerOutage, Relay
from django_outbox.retry import FixedRetryPolicy
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = 3600.0
PACKAGE = Path(__file__).resolve().parent.parent / "django_outbox"
#: The columns only the lifecycle methods may write.
LIFECYCLE_COLUMNS = {
    "status",
    "next_retry_time",
    "due_at",
    "retry_count",
    "replay_count",
    "leased_until",
    "lease_token",
    "last_error",
}


def old_row(**fields) -> OutboxEvent:
    """A row created and last changed an hour ago (database clock)."""
    (row,) = make_events({"age": HOUR, **fields})
    OutboxEvent.objects.filter(pk=row.pk).update(updated_at=db_now() - timedelta(hours=1))
    return row


def assert_just_changed(row: OutboxEvent) -> OutboxEvent:
    row.refresh_from_db()
    assert abs((db_now() - row.updated_at).total_seconds()) < 60, row.updated_at
    return row


def test_a_new_row_is_pending_due_now_and_takes_the_defaults_of_what_it_is_not_given():
    from django_outbox._compat.django import insert_rows

    row = OutboxEvent.objects.new_pending(
        event_id="e-1", event_type="X", payload={"a": 1}, occurred_at=db_now()
    )
    assert (row.pk, row.status, row.retry_count, row.replay_count) == (None, Status.PENDING, 0, 0)
    assert (row.headers, row.aggregate_type, row.lease_token, row.last_error) == ({}, "", "", "")
    insert_rows(OutboxEvent, "default", [row])
    assert OutboxEvent.objects.due().get().event_id == "e-1"
    with pytest.raises(TypeError, match=r"does not have: \['colour'\]"):
        OutboxEvent.objects.new_pending(event_id="e-2", event_type="X", payload={}, colour=1)


def test_sent_stamps_updated_at():
    row = old_row()
    Relay(backend=locmem.LocmemBackend()).drain()
    assert assert_just_changed(row).status == Status.SENT


def test_failed_attempt_stamps_updated_at():
    row = old_row()
    locmem.fail_next.append(Reason.NACKED)
    Relay(backend=locmem.LocmemBackend()).drain()
    row = assert_just_changed(row)
    assert (row.status, row.retry_count) == (Status.PENDING, 1)
    assert row.last_error.startswith("[nacked]")


def test_death_stamps_updated_at_so_the_incident_query_finds_when_it_died():
    row = old_row(retry_count=2)
    locmem.fail_next.append(Reason.NACKED)
    relay = Relay(backend=locmem.LocmemBackend(), policy=FixedRetryPolicy(1, max_attempts=2))
    assert relay.drain().dead == 1
    assert assert_just_changed(row).status == Status.DEAD
    # docs/operations.md: MAX(updated_at) AS last_death is when the last row died.
    last_death = max(OutboxEvent.objects.dead().values_list("updated_at", flat=True))
    assert last_death > row.created_at + timedelta(minutes=59)


def test_release_on_an_outage_stamps_updated_at():
    row = old_row()
    locmem.unavailable = True
    with pytest.raises(BrokerOutage):
        Relay(backend=locmem.LocmemBackend()).drain()
    row = assert_just_changed(row)
    assert (row.status, row.retry_count, row.lease_token) == (Status.PENDING, 0, "")


def test_claim_stamps_updated_at():
    row = old_row()
    token, rows = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    assert [r.pk for r in rows] == [row.pk]
    assert assert_just_changed(row).lease_token == token


def test_a_lease_holds_the_row_until_it_runs_out_and_leaves_its_due_time_alone():
    (row,) = make_events({"due_age": 5})
    due_before = OutboxEvent.objects.get(pk=row.pk).next_retry_time
    token, _ = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    held = OutboxEvent.objects.get(pk=row.pk)
    assert held.next_retry_time == due_before
    assert held.leased_until > db_now() + timedelta(seconds=50)
    assert not OutboxEvent.objects.due().exists()
    assert list(OutboxEvent.objects.leased()) == [held]
    # Released: due at once (its due time had passed), the lease gone, no index changed.
    assert OutboxEvent.objects.all().release(token, [row.pk]) == 1
    released = OutboxEvent.objects.get(pk=row.pk)
    assert (released.next_retry_time, released.leased_until) == (due_before, None)
    assert list(OutboxEvent.objects.due()) == [released]
    # A lease that ran out (its relay died) leaves the row due for any relay.
    token, _ = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    OutboxEvent.objects.filter(pk=row.pk).update(leased_until=db_now() - timedelta(seconds=1))
    assert list(OutboxEvent.objects.due()) == [released]
    assert not OutboxEvent.objects.leased().exists()


def test_settles_clear_the_lease():
    sent, failed, dead = make_events({}, {}, {})
    token, _ = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    events = OutboxEvent.objects.all()
    assert events.mark_sent(token, [sent.pk]) == 1
    events.mark_failed(token, [(failed, "[nacked] x")], FixedRetryPolicy(60, max_attempts=2))
    events.mark_failed(token, [(dead, "[nacked] x")], FixedRetryPolicy(60, max_attempts=0))
    leases = OutboxEvent.objects.order_by("pk").values_list("status", "leased_until")
    assert list(leases) == [(Status.SENT, None), (Status.PENDING, None), (Status.DEAD, None)]


def test_the_lease_writes_no_indexed_column():
    """The claim's UPDATE changes only columns no index holds, so on PostgreSQL it is a HOT
    update: no new index entry per claimed row (migration 0008)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    make_events({}, {})
    with CaptureQueriesContext(connection) as queries:
        OutboxEvent.objects.due().claim(10, lease_seconds=60)
    (update,) = [q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assignments = update.split(" SET ", 1)[1].split(" WHERE ", 1)[0]
    written = set(re.findall(r'[`"]?(\w+)[`"]?\s*=', assignments))
    assert written == {"leased_until", "lease_token", "updated_at"}
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, OutboxEvent._meta.db_table)
    indexed = {column for c in constraints.values() if c["index"] for column in c["columns"]}
    assert indexed and not written & indexed


def test_postgresql_leaves_room_on_each_page_for_the_lease():
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("fillfactor is PostgreSQL's")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
            [OutboxEvent._meta.db_table],
        )
        (options,) = cursor.fetchone()
    assert "fillfactor=50" in options


def test_requeue_and_mark_dead_stamp_updated_at():
    dead = old_row(status=Status.DEAD, retry_count=11, last_error="[nacked] no")
    pending = old_row()
    assert OutboxEvent.objects.filter(pk=dead.pk).requeue() == 1
    dead = assert_just_changed(dead)
    assert (dead.status, dead.retry_count, dead.last_error) == (Status.PENDING, 0, "[nacked] no")
    assert OutboxEvent.objects.filter(pk=pending.pk).mark_dead() == 1
    assert assert_just_changed(pending).status == Status.DEAD


def test_requeue_and_mark_dead_leave_other_states_alone():
    (sent,) = make_events({"status": Status.SENT})
    (dead,) = make_events({"status": Status.DEAD})
    assert OutboxEvent.objects.filter(pk=sent.pk).requeue() == 0
    assert OutboxEvent.objects.filter(pk__in=[sent.pk, dead.pk]).mark_dead() == 0
    assert OutboxEvent.objects.get(pk=sent.pk).status == Status.SENT


def test_settles_are_fenced_on_the_lease_token():
    (row,) = make_events({})
    token, _ = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    OutboxEvent.objects.filter(pk=row.pk).requeue()  # taken back: the claim is void
    events = OutboxEvent.objects.all()
    assert events.mark_sent(token, [row.pk]) == 0
    assert events.mark_failed(token, [(row, "x")], FixedRetryPolicy(1, max_attempts=1)) == []
    assert events.release(token, [row.pk], "y") == 0
    row.refresh_from_db()
    assert (row.status, row.retry_count, row.last_error) == (Status.PENDING, 0, "")


def test_mark_failed_cuts_a_long_error():
    (row,) = make_events({})
    token, rows = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    policy = FixedRetryPolicy(1, max_attempts=5)
    OutboxEvent.objects.all().mark_failed(token, [(rows[0], "e" * 5000)], policy)
    row.refresh_from_db()
    assert len(row.last_error) == 2000


def test_purge_deletes_in_batches_through_the_queryset():
    make_events(*({"status": Status.SENT, "age": 10 * 86400} for _ in range(5)))
    result = purge(older_than_days=7, batch_size=2)
    assert (result.sent, result.batches) == (5, 3)


# -- one place writes the row's state --------------------------------------------------------
#: Models of the app whose rows are not the outbox's: their own columns may share a name.
OTHER_MODELS = {"OutboxTaskResult"}


def _writes_outside_the_lifecycle() -> list[str]:
    """Calls of update()/bulk_update() in django_outbox, outside querysets.py, that name a
    lifecycle column (as a keyword or as a field-name string). A task result's row
    (``OutboxTaskResult``, tasks_worker.py) has a ``status`` of its own: not the outbox's."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "querysets.py" or "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"update", "bulk_update"}
            ):
                continue
            if any(isinstance(n, ast.Name) and n.id in OTHER_MODELS for n in ast.walk(node.func)):
                continue
            names = {kw.arg for kw in node.keywords} | {
                n.value
                for n in ast.walk(node)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
            }
            if names & LIFECYCLE_COLUMNS:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


@pytest.mark.once
def test_only_the_queryset_writes_the_rows_state():
    assert _writes_outside_the_lifecycle() == []


def test_a_url_in_an_error_is_recorded_with_its_password_masked():
    """last_error is shown to every admin user who may view the outbox."""
    (row,) = make_events({})
    token, rows = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    error = "cannot connect to 'amqp://app:2024/s3cret@rabbit:5672/%2F': refused"
    OutboxEvent.objects.all().mark_failed(token, [(rows[0], error)], FixedRetryPolicy(1, 5))
    row.refresh_from_db()
    # The host part ends at the password's "/": a client tries host "app", port 2024, and
    # everything after the user is masked, up to the next space.
    assert row.last_error == "cannot connect to 'amqp://app:***@*** refused"
    assert "s3cret" not in row.last_error


def test_mysql_claims_rewrite_their_rows_in_place():
    """On MySQL/MariaDB a claim leaves its rows' length as it was (``lease_token`` is
    ``CHAR(32)``, ``leased_until`` is written at the INSERT): InnoDB rewrites them in place
    instead of splitting the outbox's full pages. Seen in the redo log the claim writes:
    about 0.2 kB a row, against 5.3 kB when the claim made the rows longer."""
    from django.db import connection

    from django_outbox import outbox

    if connection.vendor != "mysql":
        pytest.skip("InnoDB's redo log")

    def redo_lsn() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_lsn_current'")
            return int(cursor.fetchone()[1])

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT data_type FROM information_schema.columns WHERE table_schema = DATABASE() "
            "AND table_name = %s AND column_name = 'lease_token'",
            [OutboxEvent._meta.db_table],
        )
        assert cursor.fetchone()[0] == "char"
    with outbox.atomic() as box:
        for n in range(1000):
            box.emit("ORDER_CREATED", payload={"order_id": n, "note": "x" * 200}, aggregate_id=n)
    before = redo_lsn()
    _, rows = OutboxEvent.objects.due().claim(1000, lease_seconds=60)
    per_row = (redo_lsn() - before) / len(rows)
    assert len(rows) == 1000
    assert per_row < 1500, f"{per_row:.0f} bytes of redo log per row claimed"
