"""Django's Tasks API on the outbox: the backend (enqueue, get_result, validation, signals)
and the worker (``tasks_worker.py``) on the consumer engine, through locmem and RabbitMQ."""

from __future__ import annotations

import signal
import subprocess
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from django_outbox._compat.tasks import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
    task_finished,
    task_started,
)
from django_outbox.backends import locmem
from django_outbox.consumer import Outcome
from django_outbox.consumer.dispatch import Action, process_messages
from django_outbox.models import OutboxEvent, OutboxTaskResult
from django_outbox.states import Status
from django_outbox.tasks_backend import OutboxTaskBackend
from django_outbox.tasks_worker import TaskDispatcher, Worker, task_handler
from tests.task_functions import (
    TASK_OPTIONS,
    add,
    async_add,
    fail_always,
    fail_first,
    make_widget,
    make_widget_then_fail,
    not_a_task,
    slow_widget,
)
from tests.testapp.models import Widget
from tests.utils.relay import make_relay
from tests.utils.subprocess import django_env, manage_command
from tests.utils.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _dispatcher() -> TaskDispatcher:
    return TaskDispatcher(handlers=[task_handler("default", ["default", "other"])], retry_delay=0)


def _run_due(dispatcher: TaskDispatcher | None = None) -> list[Any]:
    """Relay what is due to locmem and run it through the task dispatcher: the decisions."""
    dispatcher = dispatcher or _dispatcher()
    locmem.outbox.clear()
    make_relay().drain()
    messages = list(locmem.outbox)
    locmem.outbox.clear()
    return [dispatcher.receive(m.delivery()) for m in messages]


# -- the backend ------------------------------------------------------------------------------
def test_enqueue_rolled_back_never_runs():
    with pytest.raises(RuntimeError), transaction.atomic():
        result = add.enqueue(1, 2)
        assert OutboxEvent.objects.filter(event_id=result.id).exists()
        raise RuntimeError("the business write fails")
    assert not OutboxEvent.objects.exists()
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result(result.id)
    assert _run_due() == []


def test_enqueue_committed_is_one_outbox_row_ready():
    with transaction.atomic():
        Widget.objects.create(code="w1")
        result = add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY
    assert result.enqueued_at is not None
    event = OutboxEvent.objects.get()
    assert event.event_id == result.id
    assert event.event_type == "django.tasks.default"
    assert event.payload["task"] == "tests.task_functions.add"
    assert event.payload["args"] == [2, 3]
    fetched = add.get_result(result.id)
    assert fetched.status == TaskResultStatus.READY
    assert fetched.args == [2, 3]
    assert fetched.task.func is add.func


def test_enqueue_outside_a_transaction_commits_at_once():
    result = add.enqueue(1, 1)
    assert OutboxEvent.objects.filter(event_id=result.id, status=Status.PENDING).exists()


def test_run_after_is_the_rows_scheduled_time():
    later = timezone.now() + timedelta(hours=1)
    result = add.using(run_after=later).enqueue(1, 2)
    event = OutboxEvent.objects.get(event_id=result.id)
    assert event.due_at == later.replace(microsecond=event.due_at.microsecond)
    assert abs((event.next_retry_time - later).total_seconds()) < 1
    assert _run_due() == []  # not due: not published, not run
    assert add.get_result(result.id).task.run_after == later


@pytest.mark.parametrize(
    ("make", "error", "text"),
    [
        (lambda: add.using(queue_name="nope"), InvalidTask, "Queue 'nope' is not valid"),
        (lambda: add.using(priority=101), InvalidTask, "priority must be"),
        (
            lambda: add.using(run_after=timezone.now().replace(tzinfo=None)),
            InvalidTask,
            "aware",
        ),
    ],
)
def test_validate_task_refuses_what_cannot_work(make, error, text):
    with pytest.raises(error, match=text):
        make().enqueue(1, 2)
    assert not OutboxEvent.objects.exists()


def test_priority_is_the_messages_broker_priority():
    """Django's -100..100 in 11 AMQP priorities; every attempt's row carries it."""
    from django_outbox.message import PRIORITY_HEADER
    from django_outbox.tasks_backend import broker_priority

    assert [broker_priority(p) for p in (-100, -91, -90, -11, -10, 0, 9, 10, 99, 100)] == [
        0,
        0,
        1,
        4,
        5,
        5,
        5,
        6,
        10,
        10,
    ]
    result = add.using(priority=100).enqueue(1, 2)
    assert OutboxEvent.objects.get(event_id=result.id).headers == {PRIORITY_HEADER: 10}
    assert add.get_result(result.id).task.priority == 100


def test_a_non_json_argument_is_refused_and_nothing_written():
    with pytest.raises(TypeError):
        add.enqueue(object(), 2)
    assert not OutboxEvent.objects.exists()


@pytest.mark.skipif(not TASK_OPTIONS, reason="@task(max_retries=) needs Django 6.1+")
def test_max_retries_and_options_are_checked():
    from django.core.exceptions import ImproperlyConfigured

    from django_outbox.tasks_backend import OutboxTask

    with pytest.raises(InvalidTask, match="max_retries"):
        OutboxTask(func=not_a_task, max_retries=-1)
    with pytest.raises(ImproperlyConfigured, match="MAX_RETRIES"):
        OutboxTaskBackend("x", {"OPTIONS": {"MAX_RETRIES": "3"}})
    with pytest.raises(ImproperlyConfigured, match="unknown keys"):
        OutboxTaskBackend("x", {"OPTIONS": {"RETRIES": 3}})


def test_task_enqueued_signal():
    seen: list[Any] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append((sender, task_result.id))

    task_enqueued.connect(receiver)
    try:
        result = add.enqueue(1, 2)
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [(OutboxTaskBackend, result.id)]


def test_get_result_of_an_unknown_id():
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result("no-such-task")


# -- the worker -------------------------------------------------------------------------------
def test_worker_runs_a_committed_task_once_with_its_effects():
    started: list[Any] = []
    finished: list[Any] = []

    def on_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
        started.append(task_result.status)

    def on_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
        finished.append(task_result.status)

    task_started.connect(on_started)
    task_finished.connect(on_finished)
    with transaction.atomic():
        result = make_widget.enqueue("w1", name="one")
    locmem.outbox.clear()
    make_relay().drain()
    (message,) = locmem.outbox
    dispatcher = _dispatcher()
    decision = dispatcher.receive(message.delivery())
    assert decision.action is Action.ACKNOWLEDGE
    assert decision.outcome is Outcome.PROCESSED
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "w1"
    assert result.started_at and result.finished_at and result.last_attempted_at
    assert len(result.worker_ids) == 1
    assert Widget.objects.get().name == "one"
    # A redelivery of a task that succeeded does not run it again.
    again = dispatcher.receive(message.delivery())
    assert again.outcome is Outcome.DUPLICATE
    assert again.action is Action.ACKNOWLEDGE
    assert Widget.objects.count() == 1
    task_started.disconnect(on_started)
    task_finished.disconnect(on_finished)
    assert started == [TaskResultStatus.RUNNING]
    assert finished == [TaskResultStatus.SUCCESSFUL]


@override_settings(OUTBOX_RETRY_SCHEDULE=[0])
def test_a_raising_task_is_retried_then_failed_with_its_error():
    from django_outbox.message import PRIORITY_HEADER

    result = fail_always.using(priority=-100).enqueue("x")
    decisions = _run_due()
    assert [d.action for d in decisions] == [Action.ACKNOWLEDGE]
    result.refresh()
    assert result.status == TaskResultStatus.READY
    assert len(result.errors) == 1
    # The retry is published with the task's priority too.
    retry = OutboxEvent.objects.get(event_id=f"{result.id}.2")
    assert retry.headers == {PRIORITY_HEADER: 0}
    # MAX_RETRIES 2 (tests/settings.py): two more attempts, the last dead-letters.
    assert [d.action for d in _run_due()] == [Action.ACKNOWLEDGE]
    (last,) = _run_due()
    assert last.action is Action.DEAD_LETTER
    assert "always fails: x" in last.reason
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.attempts == 3
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"] * 3
    assert "always fails: x" in result.errors[-1].traceback
    assert result.errors[-1].exception_class is ValueError
    assert result.finished_at is not None
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    assert _run_due() == []


@pytest.mark.skipif(not TASK_OPTIONS, reason="@task(max_retries=) needs Django 6.1+")
@override_settings(OUTBOX_RETRY_SCHEDULE=[0])
def test_a_failed_attempts_writes_roll_back_and_the_tasks_own_limit_applies():
    result = make_widget_then_fail.enqueue("w2")  # max_retries=1 on the task
    assert [d.action for d in _run_due()] == [Action.ACKNOWLEDGE]
    assert [d.action for d in _run_due()] == [Action.DEAD_LETTER]
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert len(result.errors) == 2
    assert not Widget.objects.exists()


@override_settings(OUTBOX_RETRY_SCHEDULE=[0])
def test_a_task_that_fails_once_succeeds_on_its_retry():
    result = fail_first.enqueue("w3")
    _run_due()
    _run_due()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 2
    assert result.attempts == 2
    assert Widget.objects.filter(code="w3").count() == 1


@override_settings(OUTBOX_RETRY_SCHEDULE=[0])
def test_a_stale_redelivery_of_a_failed_attempt_does_not_run_it_twice():
    result = fail_first.enqueue("w4")
    locmem.outbox.clear()
    make_relay().drain()
    (first,) = locmem.outbox
    dispatcher = _dispatcher()
    dispatcher.receive(first.delivery())  # fails, schedules attempt 2
    assert dispatcher.receive(first.delivery()).outcome is Outcome.DUPLICATE
    result.refresh()
    assert result.attempts == 1


def test_a_first_delivery_starts_with_one_insert_and_a_task_killed_after_start_runs_again():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_outbox.message import decode

    result = make_widget.enqueue("w9", name="nine")
    locmem.outbox.clear()
    make_relay().drain()
    (message,) = locmem.outbox
    handler = task_handler("default", ["default"])()
    # The first delivery's start is one INSERT of the RUNNING row, no locked read first.
    with CaptureQueriesContext(connection) as queries:
        row = handler._start(decode(message.delivery()), handler.database())
    assert row is not None
    assert row.status == OutboxTaskResult.TaskStatus.RUNNING
    statements = [q["sql"] for q in queries.captured_queries if "outbox" in q["sql"].lower()]
    assert len(statements) == 1
    # On PostgreSQL its commit is not flushed: one query of two statements, one round trip.
    lazy = "SET LOCAL synchronous_commit TO OFF; "
    assert statements[0].removeprefix(lazy).upper().startswith("INSERT")
    assert statements[0].startswith(lazy) == (connection.vendor == "postgresql")
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING
    # Killed there (RUNNING, nothing acknowledged): the redelivery finds the row, runs the
    # task under its lock, and counts both attempts; one more delivery does not run it.
    dispatcher = _dispatcher()
    assert dispatcher.receive(message.delivery()).outcome is Outcome.PROCESSED
    assert dispatcher.receive(message.delivery()).outcome is Outcome.DUPLICATE
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.attempts == 2
    assert Widget.objects.get().name == "nine"


def test_async_task_runs_in_the_worker():
    result = async_add.enqueue(20, 22)
    _run_due()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42


def test_get_result_from_the_results_table_in_another_thread():
    result = add.enqueue(4, 5)
    _run_due()
    seen: list[Any] = []

    def read() -> None:
        from django.db import connections

        try:
            seen.append(add.get_result(result.id).return_value)
        finally:
            connections.close_all()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert seen == [9]


def test_process_messages_helper_runs_tasks():
    add.enqueue(1, 2)
    locmem.outbox.clear()
    make_relay().drain()
    (results,) = process_messages(list(locmem.outbox), dispatcher=_dispatcher())
    assert results[0].outcome is Outcome.PROCESSED
    assert OutboxTaskResult.objects.get().return_value == 3


# -- RabbitMQ ---------------------------------------------------------------------------------
def _rabbitmq_worker(broker: Any, **options: Any) -> Worker:
    """A worker of the task queue ``default`` on the test's queue, connected: its (priority)
    queue and binding are declared."""
    from django_outbox.consumer.amqp import Consumer

    worker = Worker(
        queue_names=["default"],
        consumer_class=Consumer,
        url=broker.url,
        exchange=broker.exchange,
        queue=broker.queue,
        idle_timeout=0.5,
        **options,
    )
    worker.consumers[0].connect()
    return worker


@pytest.mark.amqp
@override_settings(OUTBOX_RETRY_SCHEDULE=[0])
def test_worker_on_rabbitmq_runs_tasks_and_dead_letters_a_failing_one(broker):
    from django_outbox.backends.pika import PikaBackend

    worker = _rabbitmq_worker(broker)
    with transaction.atomic():
        ok = make_widget.enqueue("r1")
        bad = fail_always.enqueue("r2")
    with pytest.raises(RuntimeError), transaction.atomic():
        make_widget.enqueue("never")
        raise RuntimeError("rolled back")

    def relay_and_work() -> None:
        make_relay(backend=PikaBackend(broker_url=broker.url, exchange=broker.exchange)).drain()
        worker.serve(stop=threading.Event(), once=True)

    for _ in range(3):  # the first run, then a retry per pass (MAX_RETRIES 2)
        relay_and_work()
    ok.refresh()
    bad.refresh()
    assert ok.status == TaskResultStatus.SUCCESSFUL
    assert bad.status == TaskResultStatus.FAILED
    assert bad.attempts == 3
    assert list(Widget.objects.values_list("code", flat=True)) == ["r1"]
    _method, props, _body = broker.get(broker.dlq)
    assert props.message_id == f"{bad.id}.3"
    assert "always fails: r2" in props.headers["x-outbox-reason"]


@pytest.mark.amqp
def test_higher_priority_runs_first_from_the_backlog_in_the_broker(broker):
    """The worker stopped: low, default and high priority tasks wait in the task queue (a
    RabbitMQ priority queue); a worker started with prefetch 1 runs the highest first."""
    worker = _rabbitmq_worker(broker, prefetch=1)
    worker.consumers[0].close()
    make_widget.using(priority=-100).enqueue("low-1")
    make_widget.using(priority=-50).enqueue("low-2")
    make_widget.enqueue("default")
    make_widget.using(priority=100).enqueue("high")
    make_widget.using(priority=-100).enqueue("low-3")
    _relay_to(broker)  # published in enqueue order
    worker.serve(stop=threading.Event(), once=True)
    rows = OutboxTaskResult.objects.order_by("started_at")
    assert [row.args_kwargs["args"][0] for row in rows] == [
        "high",
        "default",
        "low-2",
        "low-1",
        "low-3",
    ]


@pytest.mark.amqp
def test_a_task_queue_declared_without_priorities_is_a_clear_error(broker, tmp_path):
    """A queue an older worker (or a hand) declared without x-max-priority cannot become a
    priority queue: the worker exits 2 and says what to do, instead of reconnecting."""
    name = f"{broker.queue}.default"
    broker.declare_queue(None, name=name, durable=True)
    broker.delete_at_close(queues=[f"{name}.dlq"])
    child = _worker_child(broker, tmp_path, "--once")
    _out, err = child.communicate(timeout=120)
    assert child.returncode == 2, err.decode()
    text = err.decode()
    assert "x-max-priority" in text
    assert "delete it" in text


# -- outbox_worker, the command ---------------------------------------------------------------
def _worker_child(broker: Any, tmp_path: Any, *options: str) -> subprocess.Popen[bytes]:
    env = django_env(AMQP_URL=broker.url, TASKS_BROKER_QUEUE_PREFIX=f"{broker.queue}.")
    command = manage_command("outbox_worker", "--exchange", broker.exchange, *options)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _relay_to(broker: Any) -> None:
    from django_outbox.backends.pika import PikaBackend

    make_relay(backend=PikaBackend(broker_url=broker.url, exchange=broker.exchange)).drain()


def _declare_task_queue(broker: Any, queue_name: str = "default") -> str:
    """The broker queue a worker child reads for ``queue_name``, declared (as the worker
    declares it) so that the relay's messages have somewhere to go."""
    from django_outbox.consumer.amqp import Consumer
    from django_outbox.tasks_worker import task_consumer

    name = f"{broker.queue}.{queue_name}"
    for each in (name, f"{broker.queue}.other"):
        broker.delete_at_close(queues=[each, f"{each}.dlq"])
    consumer = task_consumer(
        "default",
        queue_name,
        consumer_class=Consumer,
        url=broker.url,
        exchange=broker.exchange,
        queue=name,
    )
    consumer.connect()
    consumer.close()
    return name


@pytest.mark.amqp
def test_outbox_worker_once_runs_the_queue_and_exits_0(broker, tmp_path):
    _declare_task_queue(broker)
    results = [make_widget.enqueue(f"c{i}") for i in range(5)]
    _relay_to(broker)
    child = _worker_child(broker, tmp_path, "--once", "--concurrency", "2", "--json")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err.decode()
    assert '"processed": 5' in out.decode()
    for result in results:
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL
    assert Widget.objects.count() == 5


def test_outbox_worker_refuses_a_queue_not_in_queues():
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match=r"not in TASKS\['default'\]\['QUEUES'\]") as caught:
        call_command("outbox_worker", "--queue", "nope", "--once")
    assert caught.value.returncode == 2


@pytest.mark.amqp
@pytest.mark.parametrize("how", ["kill", "term"])
def test_worker_stopped_mid_task_the_task_completes_once_later(broker, tmp_path, how):
    """kill -9 mid-task: its writes and its result roll back together and the message comes
    back; SIGTERM: the task in hand is finished, then the worker exits 0."""
    _declare_task_queue(broker)
    marker = tmp_path / "running"
    result = slow_widget.enqueue("k1", str(marker), 3.0)
    _relay_to(broker)
    child = _worker_child(broker, tmp_path)
    try:
        assert wait_for(marker.exists, timeout=60), child.stderr.read1().decode()  # type: ignore[union-attr]
        if how == "kill":
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            result.refresh()
            assert result.status == TaskResultStatus.RUNNING  # the attempt began, never ended
            assert not Widget.objects.exists()
        else:
            child.send_signal(signal.SIGTERM)
            _out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err.decode()
            result.refresh()
            assert result.status == TaskResultStatus.SUCCESSFUL
    finally:
        if child.poll() is None:
            child.kill()
    marker.unlink(missing_ok=True)
    again = _worker_child(broker, tmp_path, "--once")
    _out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err.decode()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "k1"
    assert result.attempts == (2 if how == "kill" else 1)
    assert Widget.objects.filter(code="k1").count() == 1


@pytest.mark.amqp
def test_outbox_worker_processes_run_the_queue_and_sum_their_totals(broker, tmp_path):
    _declare_task_queue(broker)
    results = [make_widget.enqueue(f"p{i}") for i in range(6)]
    _relay_to(broker)
    child = _worker_child(broker, tmp_path, "--once", "--processes", "2", "--json")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err.decode()
    assert '"processed": 6' in out.decode()
    for result in results:
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL
    assert Widget.objects.count() == 6


@pytest.mark.amqp
@pytest.mark.parametrize("how", ["term", "kill the process", "kill the parent"])
def test_worker_processes_stopped_mid_task(broker, tmp_path, how):
    """--processes: SIGTERM to the parent finishes the task in hand (exit 0); a worker
    process killed -9 stops the rest (exit 1) and its task runs again later; a parent
    killed -9 leaves no worker process behind: it finishes its task, then exits."""
    import os

    _declare_task_queue(broker)
    marker = tmp_path / "running"
    result = slow_widget.enqueue("k2", str(marker), 3.0)
    _relay_to(broker)
    child = _worker_child(broker, tmp_path, "--processes", "2")
    try:
        assert wait_for(marker.exists, timeout=60), child.stderr.read1().decode()  # type: ignore[union-attr]
        worker = int(marker.read_text())
        assert worker != child.pid
        if how == "term":
            child.send_signal(signal.SIGTERM)
            _out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err.decode()
        elif how == "kill the process":
            os.kill(worker, signal.SIGKILL)
            _out, err = child.communicate(timeout=60)
            assert child.returncode == 1
            assert "was killed by SIGKILL" in err.decode()
            # Its task came back to the broker: the other process, not stopped yet, may
            # have taken it and finished it before it stopped; else the next worker runs it.
        else:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            assert wait_for(lambda: _ended(worker), timeout=60)
        if how != "kill the process":
            result.refresh()
            assert result.status == TaskResultStatus.SUCCESSFUL
    finally:
        if child.poll() is None:
            child.kill()
    marker.unlink(missing_ok=True)
    again = _worker_child(broker, tmp_path, "--once")
    _out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err.decode()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.attempts == (2 if how == "kill the process" else 1)
    assert Widget.objects.filter(code="k2").count() == 1


def _ended(pid: int) -> bool:
    """The process has exited (gone, or a zombie its new parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# -- the admin --------------------------------------------------------------------------------
@pytest.mark.skipif(not TASK_OPTIONS, reason="@task(max_retries=) needs Django 6.1+")
@override_settings(OUTBOX_RETRY_SCHEDULE=[0])
def test_admin_lists_filters_and_requeues_a_failed_task(superuser_client):
    from django.urls import reverse

    ok = add.enqueue(1, 2)
    bad = make_widget_then_fail.enqueue("a1")  # max_retries=1: FAILED after two attempts
    _run_due()
    _run_due()
    bad.refresh()
    assert bad.status == TaskResultStatus.FAILED
    url = reverse("admin:django_outbox_outboxtaskresult_changelist")
    page = superuser_client.get(url, {"status__exact": "FAILED"})
    assert page.status_code == 200
    assert bad.id in page.content.decode()
    assert ok.id not in page.content.decode()
    assert superuser_client.get(url, {"queue_name": "default"}).status_code == 200
    change = reverse("admin:django_outbox_outboxtaskresult_change", args=[bad.id])
    assert "ValueError" in superuser_client.get(change).content.decode()
    response = superuser_client.post(
        url,
        {"action": "requeue", "_selected_action": [bad.id, ok.id]},
        follow=True,
    )
    text = response.content.decode()
    assert "1 failed task requeued." in text
    assert "1 task was not FAILED" in text
    bad.refresh()
    assert bad.status == TaskResultStatus.READY
    assert OutboxEvent.objects.filter(event_id=f"{bad.id}.3", status=Status.PENDING).exists()
    (decision,) = _run_due()  # the requeued attempt runs (and fails again: it always does)
    assert decision.action is Action.DEAD_LETTER
    bad.refresh()
    assert bad.attempts == 3
    assert bad.status == TaskResultStatus.FAILED
