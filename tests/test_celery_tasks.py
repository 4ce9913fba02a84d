"""The Celery tasks run in-process (eagerly): periodic jobs, their lock, consumer tasks."""

from __future__ import annotations

import logging
import threading
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connections
from django.utils import timezone

from django_outbox import outbox, tasks
from django_outbox.backends import locmem
from django_outbox.celery import IdempotentTask, beat_schedule
from django_outbox.db import DbNow, job_lock
from django_outbox.message import ReceivedEvent, encode_task_envelope
from django_outbox.models import InboxMessage, OutboxEvent, Status
from orders.services import create_order
from points.models import PointsLedger
from points.tasks import award_points
from tests import celery_tasks
from tests.utils.rows import unsaved_event

pytestmark = pytest.mark.django_db(transaction=True)


def emit(n: int, *, age: float = 0.0) -> list[int]:
    with outbox.atomic() as box:
        for i in range(n):
            box.emit("E", aggregate_type="T", aggregate_id=str(i), payload={"i": i})
        ids = [e.event_id for e in box.events]
    rows = OutboxEvent.objects.filter(event_id__in=ids)
    if age:
        rows.update(created_at=DbNow() - timedelta(seconds=age))
    return list(rows.values_list("pk", flat=True))


def held_elsewhere(name: str, using: str = "default"):
    """Hold job_lock(name) from another thread (another database session) until released."""
    taken, release = threading.Event(), threading.Event()
    outcome: list[bool] = []

    def hold() -> None:
        try:
            with job_lock(name, using) as held:
                outcome.append(held)
                taken.set()
                release.wait(30)
        finally:
            connections[using].close()

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(30)
    assert outcome == [True]
    return release, thread


def test_publish_task_is_one_relay_pass():
    emit(3)
    result = tasks.publish.apply().get()
    assert result == {"found": 3, "sent": 3, "failed": 0, "dead": 0, "batches": 1}
    assert OutboxEvent.objects.sent().count() == 3
    assert len(locmem.outbox) == 3


def test_compensate_task_takes_only_stale_rows_with_the_compensation_policy(settings):
    settings.OUTBOX_COMPENSATE_RETRY_DELAY = 42
    fresh = emit(2)
    stale = emit(3, age=900)
    locmem.fail_next.append(locmem.Reason.NACKED)
    result = tasks.compensate.apply(kwargs={"stale_after": 600}).get()
    assert (result["found"], result["sent"], result["failed"]) == (3, 2, 1)
    assert set(OutboxEvent.objects.filter(pk__in=fresh).values_list("status", flat=True)) == {
        Status.PENDING
    }
    failed = OutboxEvent.objects.get(pk__in=stale, status=Status.PENDING)
    assert failed.retry_count == 1
    # FixedRetryPolicy.compensation(): due again after OUTBOX_COMPENSATE_RETRY_DELAY.
    delay = failed.next_retry_time - timezone.now()
    assert timedelta(seconds=30) < delay <= timedelta(seconds=42)


def test_purge_task_deletes_old_sent_rows():
    old = emit(2)
    OutboxEvent.objects.filter(pk__in=old).update(
        status=Status.SENT, created_at=DbNow() - timedelta(days=10)
    )
    emit(1)
    assert tasks.purge.apply().get() == {"sent": 2, "dead": 0, "batches": 1, "inbox": 0}
    assert OutboxEvent.objects.count() == 1


@pytest.mark.parametrize("job", ["publish", "compensate", "purge"])
def test_a_run_while_another_holds_the_lock_is_skipped(job):
    ids = emit(2, age=900)
    release, thread = held_elsewhere(job)
    try:
        assert getattr(tasks, job).apply().get() == {"skipped": True}
    finally:
        release.set()
        thread.join(30)
    assert OutboxEvent.objects.filter(pk__in=ids, status=Status.PENDING).count() == 2
    assert getattr(tasks, job).apply().get() != {"skipped": True}


def test_a_lock_goes_with_its_connection(db_vendor):
    """A worker that dies mid-run (its connection closes) leaves no lock behind."""
    if db_vendor == "sqlite":
        pytest.skip("SQLite's lock is per process: it dies with the process")
    name = f"test-{uuid.uuid4().hex[:8]}"
    taken, checked, died = threading.Event(), threading.Event(), threading.Event()

    def hold_then_die() -> None:
        context = job_lock(name)
        assert context.__enter__() is True
        taken.set()
        checked.wait(30)
        connections["default"].close()  # never released: the connection just goes away
        died.set()

    thread = threading.Thread(target=hold_then_die)
    thread.start()
    try:
        assert taken.wait(30)
        with job_lock(name) as held:
            assert held is False
    finally:
        checked.set()
        thread.join(30)
    assert died.is_set()
    with job_lock(name) as held:
        assert held is True


# The Django fixup runs the system checks, which ask every database about JSON support.
@pytest.mark.django_db(databases="__all__")
def test_beat_schedule_matches_the_article():
    from celery.schedules import crontab

    schedule = beat_schedule()
    assert schedule["outbox-compensate"]["task"] == "django_outbox.compensate"
    assert schedule["outbox-compensate"]["schedule"] == 300.0
    purge = schedule["outbox-purge"]
    assert purge["task"] == "django_outbox.purge"
    assert isinstance(purge["schedule"], crontab)
    assert purge["schedule"].hour == {3} and purge["schedule"].minute == {30}
    assert "outbox-publish" not in schedule
    assert beat_schedule(publish_every=2)["outbox-publish"]["options"] == {"expires": 2}

    from config.celery import app

    app.loader.import_default_modules()
    for entry in app.conf.beat_schedule.values():
        assert entry["task"] in app.tasks, entry


# -- consumer tasks ----------------------------------------------------------------------------
def envelope(**kwargs) -> dict:
    return encode_task_envelope(unsaved_event(**kwargs))


def test_award_task_runs_once_a_duplicate_is_a_successful_no_op(caplog):
    order = create_order(user_id=7, amount=Decimal("12.50"))
    event = OutboxEvent.objects.get(aggregate_id=order.number)
    message = encode_task_envelope(event)
    first = award_points.apply(args=[message])
    with caplog.at_level(logging.INFO, logger="django_outbox.celery"):
        second = award_points.apply(args=[message])
    assert first.successful() and second.successful()
    assert second.get() is None
    ledger = PointsLedger.objects.get()
    assert (ledger.source_event_id, ledger.points, ledger.user_id) == (event.event_id, 12, 7)
    assert f"{event.event_id} is a duplicate" in caplog.text


def test_inbox_style_task_records_the_task_name_and_returns_the_function_result():
    message = envelope()
    assert celery_tasks.inbox_award.apply(args=[message]).get() == (
        f"awarded {message['event_id']}"
    )
    assert celery_tasks.inbox_award.apply(args=[message]).get() is None
    inbox = InboxMessage.objects.get()
    assert (inbox.handler, inbox.source_event_id) == ("tests.inbox_award", message["event_id"])
    assert PointsLedger.objects.count() == 1


def test_a_failing_task_rolls_back_retries_then_fails():
    message = envelope()
    result = celery_tasks.failing_award.apply(args=[message])
    assert result.failed()
    assert isinstance(result.result, RuntimeError)
    assert celery_tasks.calls[message["event_id"]] == 3  # max_retries=2
    assert PointsLedger.objects.count() == 0


def test_a_database_fault_is_retried_without_counting_toward_max_retries():
    """A missing table under the task is the consumer's fault: before, the task failed after
    max_retries + 1 calls and Celery acknowledged (dropped) the message."""
    message = envelope()
    result = celery_tasks.database_fault_award.apply(args=[message])
    assert result.successful(), result.traceback
    assert celery_tasks.calls[message["event_id"]] == 5  # max_retries=1
    assert PointsLedger.objects.get().source_event_id == message["event_id"]


def test_the_function_can_be_called_with_a_received_event():
    event = ReceivedEvent(
        event_id=uuid.uuid4().hex,
        event_type="ORDER_CREATED",
        payload={"user_id": 3, "amount": "4.99", "number": "N1"},
    )
    award_points(event)
    award_points(event)
    assert PointsLedger.objects.get().points == 4


@pytest.mark.parametrize(
    ("argument", "reason"),
    [
        ("not an event", "not an outbox event envelope"),
        # The same header checks as consume_outbox (message.py): these raised ValueError.
        (dict(envelope(), headers={"attempt": "abc"}), "header attempt"),
        (dict(envelope(), headers={"sequence": [1, 2]}), "header sequence"),
        (dict(envelope(), headers={"occurred_at": "2024-13-45T00:00:00"}), "occurred_at"),
        (dict(envelope(), headers=["not", "a", "table"]), "not a table"),
    ],
)
def test_a_malformed_task_message_is_rejected_to_the_dead_letter_exchange(argument, reason):
    result = award_points.apply(args=[argument])
    # REJECTED with requeue=False: the worker basic.rejects it (the queue's dead-letter
    # exchange gets it); FAILURE would have acked and dropped it.
    assert result.state == "REJECTED"
    assert reason in str(result.result)
    assert result.result.requeue is False
    assert PointsLedger.objects.count() == 0


def test_a_malformed_envelope_called_directly_raises():
    from django_outbox.message import UndecodableMessage

    with pytest.raises(UndecodableMessage, match="header attempt"):
        award_points(dict(envelope(), headers={"attempt": "abc"}))


def test_idempotent_task_defaults():
    assert IdempotentTask.acks_late is True
    assert IdempotentTask.reject_on_worker_lost is True
    assert award_points.acks_late is True
