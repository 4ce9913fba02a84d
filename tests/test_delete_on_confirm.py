"""OUTBOX_RETENTION_DAYS = 0: the relay's settle deletes what the broker confirmed, keeps no
SENT rows, and every place that shows or replays SENT rows says so (issue 31, item 2)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core import checks
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_outbox import outbox
from django_outbox.backends import locmem
from django_outbox.backends.base import PublishResult, Reason
from django_outbox.checks import (
    Codes,
    check_ordered_delete_on_confirm,
    check_positive_numbers,
    check_retention,
)
from django_outbox.conf import outbox_settings
from django_outbox.models import OutboxEvent, Status
from django_outbox.purge import purge
from tests.utils.relay import make_relay
from tests.utils.rows import expire_leases, make_events

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "admin:django_outbox_outboxevent_changelist"
DASHBOARD = "admin:django_outbox_outboxevent_dashboard"


@pytest.fixture
def delete_on_confirm(settings):
    settings.OUTBOX_RETENTION_DAYS = 0
    return settings


def emit_many(n: int) -> list[str]:
    with outbox.atomic() as box:
        for i in range(n):
            box.emit("E", aggregate_type="T", aggregate_id=str(i), payload={"i": i})
        return [event.event_id for event in box.events]


def statements(ctx: CaptureQueriesContext, verb: str) -> list[str]:
    return [q["sql"] for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith(verb)]


def test_the_setting_reads_zero_as_delete_on_confirm(settings):
    assert not outbox_settings.deletes_on_confirm
    settings.OUTBOX_RETENTION_DAYS = 0
    assert outbox_settings.deletes_on_confirm
    settings.OUTBOX_RETENTION_DAYS = False  # not a number of days: E007, not this mode
    assert not outbox_settings.deletes_on_confirm


def test_drain_deletes_the_confirmed_rows_and_publishes_each_once(delete_on_confirm):
    ids = emit_many(250)
    result = make_relay(batch_size=100).drain()
    assert (result.found, result.sent, result.failed, result.batches) == (250, 250, 0, 3)
    assert not OutboxEvent.objects.exists()
    assert sorted(m.message_id for m in locmem.outbox) == sorted(ids)


def test_the_settle_of_confirmed_rows_is_one_delete_statement(delete_on_confirm):
    emit_many(20)
    relay = make_relay(batch_size=20, db_thread=False)
    batch = relay.send(relay.claim(20))
    relay.collect(batch)
    with CaptureQueriesContext(connection) as ctx:
        relay.settle(batch)
    assert len(statements(ctx, "DELETE")) == 1
    assert statements(ctx, "UPDATE") == []
    assert not OutboxEvent.objects.exists()


def test_failed_rows_are_kept_and_retried_only_confirmed_ones_go(delete_on_confirm):
    emit_many(3)
    relay = make_relay(lease_seconds=60)
    batch = relay.claim(10)
    batch.results = [
        PublishResult.sent(),
        PublishResult.failed(Reason.NACKED, "nacked"),
        PublishResult.sent(),
    ]
    result = relay.settle(batch)
    assert (result.sent, result.failed) == (2, 1)
    (left,) = OutboxEvent.objects.all()
    assert (left.status, left.retry_count) == (Status.PENDING, 1)
    assert left.pk == batch.rows[1].pk


def test_the_delete_is_fenced_on_the_lease_token(delete_on_confirm):
    """A relay frozen past its lease deletes nothing another relay has claimed since."""
    emit_many(2)
    stale = make_relay(lease_seconds=60)
    batch = stale.claim(10)
    expire_leases()
    token, taken = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    assert len(taken) == 2
    batch.results = [PublishResult.sent(), PublishResult.sent()]
    assert stale.settle(batch).sent == 0
    assert sorted(OutboxEvent.objects.values_list("lease_token", flat=True)) == [token, token]
    # And through the queryset: the claim's token deletes its own rows only.
    events = OutboxEvent.objects.all()
    assert events.delete_confirmed(batch.token, [r.pk for r in taken]) == 0
    assert events.delete_confirmed(token, [r.pk for r in taken]) == 2


def test_a_requeued_row_is_not_deleted_by_the_claim_it_left(delete_on_confirm):
    (row,) = make_events({})
    token, _ = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    OutboxEvent.objects.filter(pk=row.pk).requeue()
    assert OutboxEvent.objects.all().delete_confirmed(token, [row.pk]) == 0
    assert OutboxEvent.objects.filter(pk=row.pk, status=Status.PENDING).exists()


def test_purge_then_deletes_every_sent_row_left_whatever_its_age(delete_on_confirm):
    make_events({"status": Status.SENT, "age": 60}, {"status": Status.SENT, "age": 9 * 86400})
    make_events({"status": Status.DEAD, "age": 86400}, {"status": Status.DEAD, "age": 9 * 86400})
    make_events({"age": 9 * 86400})
    result = purge(include_dead=True)
    # DEAD rows keep the default retention: they were never delivered.
    assert (result.sent, result.dead) == (2, 1)
    assert sorted(OutboxEvent.objects.values_list("status", flat=True)) == [
        Status.PENDING,
        Status.DEAD,
    ]
    assert "(2 sent, 1 dead)" in result.summary()


def test_purge_outbox_runs_without_force(delete_on_confirm):
    make_events({"status": Status.SENT})
    out = StringIO()
    call_command("purge_outbox", stdout=out)
    assert "(1 sent, dead rows kept)" in out.getvalue()


def test_zero_is_a_valid_retention_and_no_warning(delete_on_confirm):
    assert [m for m in check_positive_numbers() if "RETENTION" in m.msg] == []
    assert check_retention() == []
    delete_on_confirm.OUTBOX_RETENTION_DAYS = -1
    (error,) = [m for m in check_positive_numbers() if "RETENTION" in m.msg]
    assert error.id == Codes.NUMBERS and "a number >= 0" in error.msg


def test_ordered_mode_needs_sent_rows(delete_on_confirm):
    assert check_ordered_delete_on_confirm() == []
    delete_on_confirm.OUTBOX_ORDERED = ["ORDER_CREATED"]
    (error,) = check_ordered_delete_on_confirm()
    assert (error.id, error.level) == (Codes.ORDERED_DELETE_ON_CONFIRM, checks.ERROR)
    assert "previous_sequence" in error.msg and "OUTBOX_RETENTION_DAYS" in error.hint
    delete_on_confirm.OUTBOX_RETENTION_DAYS = 7
    assert check_ordered_delete_on_confirm() == []


def test_a_replay_of_sent_rows_says_there_are_none(delete_on_confirm):
    out, err = StringIO(), StringIO()
    call_command("outbox_requeue", "--status", "sent", stdout=out, stderr=err)
    assert "OUTBOX_RETENTION_DAYS is 0" in err.getvalue()
    assert "no SENT rows to replay" in err.getvalue()
    err = StringIO()
    call_command("outbox_requeue", stdout=out, stderr=err)  # dead letters: no word
    assert err.getvalue() == ""


def test_a_replay_says_nothing_when_sent_rows_are_kept():
    err = StringIO()
    call_command("outbox_requeue", "--status", "sent", stdout=StringIO(), stderr=err)
    assert err.getvalue() == ""


@pytest.mark.parametrize("page", [CHANGELIST, DASHBOARD])
def test_the_admin_says_sent_rows_are_not_kept(superuser_client, settings, page):
    body = superuser_client.get(reverse(page)).content.decode()
    assert "OUTBOX_RETENTION_DAYS is 0" not in body
    settings.OUTBOX_RETENTION_DAYS = 0
    response = superuser_client.get(reverse(page))
    body = response.content.decode()
    assert "OUTBOX_RETENTION_DAYS is 0" in body
    assert "django_outbox_events_published_total" in body
    assert response.context["outbox_warnings"] == []  # a note, not an alarm
