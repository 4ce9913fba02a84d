"""End to end with a real Celery worker: the testproject's app (config/celery.py) on RabbitMQ.

The worker is a child process (``celery -A config.celery worker --pool=solo``) reading a
queue of its own (CELERY_TASK_DEFAULT_QUEUE); the relay publishes through the
CeleryBackend. Needs a database the child can open (PostgreSQL, MariaDB, or a SQLite file
in TEST_DATABASE_NAME).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pika
import pytest

from django_outbox.backends.celery import CeleryBackend
from django_outbox.db import DbNow
from django_outbox.models import OutboxEvent, Status
from django_outbox.relay import Relay
from orders.services import create_order
from points.models import PointsLedger
from tests.utils.subprocess import ROOT, django_env, manage_command
from tests.utils.waiting import wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CELERY_BACKEND = "django_outbox.backends.celery.CeleryBackend"


class Worker:
    """``celery worker`` in a child process; its log lines are collected as they come."""

    def __init__(self, queue: str, amqp_url: str, **env: str) -> None:
        self.lines: list[str] = []
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config.celery",
            "worker",
            "-Q",
            queue,
            "-n",
            f"{queue}@%h",
            "--pool=solo",
            "--without-gossip",
            "--without-mingle",
            "--include=tests.celery_tasks",
            "-l",
            "INFO",
        ]
        self.process = subprocess.Popen(
            command,
            env=project_env(queue, amqp_url, **env),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        assert wait_for(self._ready_or_gone, 60), self.log()
        assert self.process.poll() is None, self.log()

    def _ready_or_gone(self) -> bool:
        return self.process.poll() is not None or any(" ready." in line for line in self.lines)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def count(self, pattern: str) -> int:
        return sum(1 for line in self.lines if re.search(pattern, line))

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """Warm shutdown: whatever the worker finished is acknowledged before it exits."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def project_env(queue: str, amqp_url: str, **extra: str) -> dict[str, str]:
    """The testproject's settings (config.settings, see tests.celery_settings) on this
    test's database."""
    return django_env(
        DJANGO_SETTINGS_MODULE="tests.celery_settings",
        CELERY_BROKER_URL=amqp_url,
        CELERY_TASK_DEFAULT_QUEUE=queue,
        OUTBOX_BACKEND=CELERY_BACKEND,
        **extra,
    )


@pytest.fixture
def queue(amqp_url: str) -> Iterator[str]:
    """The worker's queue; Celery declares it with a direct exchange of the same name."""
    name = f"test.celery.{uuid.uuid4().hex[:10]}"
    yield name
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.queue_delete(name)
        channel.exchange_delete(name)
        channel.exchange_delete(f"{name}.events")
    finally:
        connection.close()


def queue_length(amqp_url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def relay_once(queue: str, amqp_url: str) -> str:
    """``manage.py publish_outbox --once`` with OUTBOX_BACKEND=...CeleryBackend (env)."""
    done = subprocess.run(
        manage_command("publish_outbox", "--once"),
        env=project_env(queue, amqp_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_relayed_events_run_once_each_and_a_redelivery_is_a_duplicate(queue, amqp_url):
    orders = [create_order(user_id=7, amount=Decimal(f"1{i}.50")) for i in range(3)]
    events = list(OutboxEvent.objects.order_by("id"))
    assert [e.aggregate_id for e in events] == [o.number for o in orders]
    worker = Worker(queue, amqp_url)
    try:
        assert "sent=3" in relay_once(queue, amqp_url)
        assert wait_for(lambda: PointsLedger.objects.count() == 3, timeout=30), worker.log()
        assert set(PointsLedger.objects.values_list("source_event_id", flat=True)) == {
            e.event_id for e in events
        }
        assert OutboxEvent.objects.filter(status=Status.SENT).count() == 3
        # The relay died after the broker confirmed but before it settled: the row is
        # due again and its task is sent a second time.
        again = events[1]
        OutboxEvent.objects.filter(pk=again.pk).update(
            status=Status.PENDING, sent_at=None, next_retry_time=DbNow()
        )
        assert "sent=1" in relay_once(queue, amqp_url)
        assert wait_for(lambda: worker.count(f"{again.event_id} is a duplicate") == 1, timeout=30)
        assert wait_for(lambda: worker.count(rf"\[{again.event_id}\] succeeded") == 2, timeout=30)
        for event in events:
            assert worker.count(rf"points\.award_points\[{event.event_id}\] succeeded") == (
                2 if event == again else 1
            ), worker.log()
    finally:
        worker.stop()
    assert PointsLedger.objects.count() == 3
    assert sorted(PointsLedger.objects.values_list("points", flat=True)) == [10, 11, 12]
    assert queue_length(amqp_url, queue) == 0


def test_a_worker_killed_mid_task_gets_the_message_again(
    queue, amqp_url, tmp_path: Path, db_vendor
):
    """acks_late: kill -9 while the task's row is written but not committed."""
    if db_vendor == "sqlite":
        pytest.skip("SQLite has one writer: the blocked task's transaction locks out the relay")
    from celery import Celery

    marker = tmp_path / "blocked"
    order = create_order(user_id=3, amount=Decimal("5.00"))
    app = Celery("test-relay", broker=amqp_url, set_as_current=False)
    app.conf.task_default_queue = queue
    backend = CeleryBackend(app=app, tasks={"ORDER_CREATED": "tests.blocking_award"})
    worker = Worker(queue, amqp_url, CELERY_BLOCK_FILE=str(marker))
    try:
        relay = Relay(backend=backend)
        try:
            assert relay.drain().sent == 1
        finally:
            relay.close()
        assert wait_for(marker.exists, 60), worker.log()
        worker.kill()
        assert PointsLedger.objects.count() == 0
        assert queue_length(amqp_url, queue) == 1  # back in the queue, not acked
        worker = Worker(queue, amqp_url, CELERY_BLOCK_FILE=str(marker))
        assert wait_for(lambda: PointsLedger.objects.count() == 1, timeout=30), worker.log()
    finally:
        worker.stop()
    event = OutboxEvent.objects.get()
    assert PointsLedger.objects.get().source_event_id == event.event_id
    assert event.aggregate_id == order.number
    assert queue_length(amqp_url, queue) == 0
