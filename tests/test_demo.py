"""``manage.py demo``: the README's first command, in both modes, and its reconciliation."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence

import pika
import pytest

from demo import backends
from demo.backends import DemoRelayBackend
from demo.broker import TASKS, InProcessBroker, InProcessBrokerBackend
from demo.models import Receipt
from demo.scenario import MESSAGE_FORMATS, Figures, Tally, reconcile
from django_outbox import outbox
from django_outbox.backends.base import BaseBackend, BrokerUnavailable, PublishResult
from django_outbox.consumer import ConsumeResult, Outcome
from django_outbox.models import OutboxEvent, OutboxTaskResult, Status
from django_outbox.relay import Relay
from points.models import PointsLedger
from tests.utils.rows import decided, unsaved_event
from tests.utils.subprocess import MANAGE, django_env

TIMEOUT = 180


def run_demo(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(MANAGE), "demo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def figure(out: str, label: str) -> str:
    """The value of one reconciliation row, e.g. ``figure(out, "lost") == "0"``."""
    match = re.search(rf"^  {re.escape(label)} +(\S+(?: / \S+)*)", out, re.MULTILINE)
    assert match, f"no {label!r} row in:\n{out}"
    return match.group(1)


def embedded_env(tmp_path) -> dict[str, str]:
    """What a newcomer has after `pip install -e '.[dev]'`: no services configured."""
    env = {k: v for k, v in os.environ.items() if k not in {"AMQP_URL", "DJANGO_SETTINGS_MODULE"}}
    env.pop("TEST_DATABASE_NAME", None)
    env.update(DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.once
@pytest.mark.slow
def test_embedded_demo_migrates_a_fresh_database_and_reconciles(tmp_path):
    env = embedded_env(tmp_path)
    done = run_demo(env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    prose = " ".join(out.split())  # the story is wrapped at 92 columns
    assert "in-process broker, native messages" in prose
    assert "The database was migrated first" in prose
    assert "killed with SIGKILL" in prose
    assert figure(out, "orders created") == "100"
    assert figure(out, "events SENT") == "100"
    assert figure(out, "points rows") == "100"
    # 5 lost acks + the killed batch (10 of 100) delivered twice, each suppressed.
    assert figure(out, "duplicates suppressed") == "15"
    assert figure(out, "messages handled") == "115"
    assert figure(out, "lost") == "0"
    assert figure(out, "message formats") == "native=115"
    assert figure(out, "PENDING / SENT / DEAD") == "0 / 100 / 0"
    # Each order enqueued a send_receipt task in its transaction: one receipt per order,
    # none for the rolled-back one (its number has the run's prefix too: it would be 101),
    # and the killed batch's 10 tasks were delivered twice but ran once.
    assert "its event and its send_receipt task went with it" in prose
    assert "7. Task worker." in out
    assert figure(out, "receipts sent") == "100"
    assert "(expected 100; 110 task messages, 10 duplicates)" in out
    assert "its receipt was sent once" in prose
    assert "OK: every order got its points exactly once" in prose


@pytest.mark.once
@pytest.mark.slow
@pytest.mark.parametrize(
    ("message_format", "told"),
    [
        ("cloudevents", "messages as CloudEvents (binary content mode)"),
        ("cloudevents-structured", "messages as CloudEvents (structured"),
    ],
)
def test_embedded_demo_in_a_cloudevents_format(tmp_path, message_format, told):
    """OUTBOX_MESSAGE_FORMAT from the environment: the relay children publish CloudEvents
    and the demo's consumer reads them, with the same story and figures."""
    env = embedded_env(tmp_path)
    env["OUTBOX_MESSAGE_FORMAT"] = message_format
    done = run_demo("--orders", "30", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    prose = " ".join(done.stdout.split())
    assert told in prose
    handled = figure(done.stdout, "messages handled")
    assert figure(done.stdout, "message formats") == f"{message_format}={handled}"
    assert figure(done.stdout, "points rows") == "30"
    assert figure(done.stdout, "lost") == "0"
    assert figure(done.stdout, "PENDING / SENT / DEAD") == "0 / 30 / 0"
    assert "OK: every order got its points exactly once" in prose


@pytest.mark.once
@pytest.mark.slow
def test_embedded_demo_exits_1_when_messages_are_lost(tmp_path):
    """--inject-loss acks messages unhandled: the reconciliation must catch it."""
    env = embedded_env(tmp_path)
    done = run_demo("--orders", "20", "--duplicates", "3", "--inject-loss", "2", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "FAULT INJECTED" in out
    prose = " ".join(out.split())
    assert figure(out, "orders created") == "20"
    assert figure(out, "events SENT") == "20"  # the outbox did its part...
    assert figure(out, "points rows") == "18"  # ...the consumer lost two
    assert figure(out, "lost") == "2"
    assert "FAILED: 2 order(s) never got their points: lost" in prose
    assert "reconciliation does not add up" in done.stderr
    # A second run on the same database starts clean and no longer needs migrating.
    again = run_demo("--orders", "10", "--duplicates", "1", env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "migrated" not in again.stdout
    assert figure(again.stdout, "orders created") == "10"
    assert figure(again.stdout, "lost") == "0"


@pytest.mark.amqp
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("message_format", "nodes"),
    [
        ("native", "one"),
        # What changes here is the broker's side: the story runs on every database, its
        # variations on PostgreSQL's (scripts/test runs every database in turn).
        pytest.param("cloudevents", "one", marks=pytest.mark.transport),
        pytest.param("native", "two, the first down", marks=pytest.mark.transport),
    ],
)
def test_demo_on_the_test_database_and_rabbitmq(amqp_url, message_format, nodes):
    """The same story on this run's database (SQLite, PostgreSQL or MariaDB) and real
    RabbitMQ, the relays publishing native messages or CloudEvents for consume_outbox to
    read, and the receipts run by an outbox_worker child from the run's own task queue;
    also with AMQP_URL naming two nodes, the first of which does not answer: the demo, its
    relays, consume_outbox and outbox_worker all connect to the second."""
    url = amqp_url
    if nodes != "one":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        url = f"amqp://guest:guest@127.0.0.1:{closed}/%2F;{amqp_url}"
    env = django_env(
        AMQP_URL=url,
        DJANGO_SETTINGS_MODULE="config.settings",
        OUTBOX_MESSAGE_FORMAT=message_format,
    )
    done = run_demo("--orders", "40", "--duplicates", "3", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    prose = " ".join(out.split())  # the story is wrapped at 92 columns
    assert "RabbitMQ at amqp://guest:***@" in prose
    assert MESSAGE_FORMATS[message_format] in prose
    # Counted by consume_outbox (--json) and the demo's own crashed consumer alike.
    assert figure(out, "message formats") == f"{message_format}={figure(out, 'messages handled')}"
    assert "consume_outbox (a child process)" in prose
    assert figure(out, "orders created") == "40"
    assert figure(out, "points rows") == "40"
    # Batches of 8 rows (4 orders' event and task); batch 5 is confirmed, then the relay
    # is killed: 3 + 4 duplicates.
    assert figure(out, "duplicates suppressed") == "7"
    assert figure(out, "lost") == "0"
    assert figure(out, "PENDING / SENT / DEAD") == "0 / 40 / 0"
    assert PointsLedger.objects.count() == 40
    # The receipts, from the run's own task queue, by outbox_worker --once: the killed
    # batch's 4 tasks came twice and ran once.
    assert "outbox_worker --once (a child process) read the send_receipt tasks" in prose
    assert figure(out, "receipts sent") == "40"
    assert "(expected 40; 44 task messages, 4 duplicates)" in out
    assert Receipt.objects.count() == 40
    assert OutboxTaskResult.objects.filter(status="SUCCESSFUL").count() == 40
    assert OutboxEvent.objects.filter(status=Status.SENT).count() == 80  # events and tasks
    exchange = re.search(r"exchange (demo\.[0-9a-f]+)", prose).group(1)
    assert f"queues {exchange}.points and {exchange}.tasks.default" in prose
    assert_rabbitmq_run_deleted(amqp_url, exchange)


def assert_rabbitmq_run_deleted(amqp_url: str, exchange: str) -> None:
    """The run's exchange and queues (points, tasks, their dead letters) are gone."""
    queues = [f"{exchange}.points", f"{exchange}.tasks.default"]
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        for name, declare in [
            (exchange, lambda ch, n: ch.exchange_declare(n, passive=True)),
            *[(q, lambda ch, n: ch.queue_declare(n, passive=True)) for q in queues],
            *[(f"{q}.dlq", lambda ch, n: ch.queue_declare(n, passive=True)) for q in queues],
        ]:
            channel = connection.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
                declare(channel, name)
            assert info.value.reply_code == 404, name
    finally:
        connection.close()


@pytest.mark.amqp
@pytest.mark.slow
@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
def test_a_failed_demo_on_rabbitmq_leaves_nothing_behind(amqp_url):
    """A run whose reconciliation fails (--inject-loss) still deletes its exchange and
    queues, the task queue among them; its receipts were all sent all the same."""
    env = django_env(AMQP_URL=amqp_url, DJANGO_SETTINGS_MODULE="config.settings")
    done = run_demo("--orders", "20", "--duplicates", "2", "--inject-loss", "1", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    prose = " ".join(out.split())
    assert figure(out, "lost") == "1"
    assert figure(out, "receipts sent") == "20"
    assert "FAILED: 1 order(s) never got their points: lost" in prose
    exchange = re.search(r"exchange (demo\.[0-9a-f]+)", prose).group(1)
    assert_rabbitmq_run_deleted(amqp_url, exchange)


@pytest.mark.slow
@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("message_format", ["native", "cloudevents"])
def test_demo_on_the_test_database_and_nats(nats_url, message_format):
    """The same story on NATS JetStream (BROKER_URL=nats://...): JetStream drops the killed
    batch's second copy by its Nats-Msg-Id, so only the crashed consumer's messages come
    back as duplicates."""
    env = django_env(
        BROKER_URL=nats_url,
        DJANGO_SETTINGS_MODULE="config.settings",
        OUTBOX_MESSAGE_FORMAT=message_format,
    )
    env.pop("AMQP_URL", None)
    done = run_demo("--orders", "40", "--duplicates", "3", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    prose = " ".join(out.split())
    assert f"NATS JetStream at {nats_url}" in prose
    assert "JetStream had stored it already" in prose
    assert figure(out, "message formats") == f"{message_format}={figure(out, 'messages handled')}"
    assert figure(out, "orders created") == "40"
    assert figure(out, "points rows") == "40"
    # The 3 the crashed consumer committed without acking; none of the killed batch.
    assert figure(out, "duplicates suppressed") == "3"
    assert figure(out, "lost") == "0"
    assert figure(out, "PENDING / SENT / DEAD") == "0 / 40 / 0"
    # outbox_worker read each task once: JetStream stored the killed batch's tasks once.
    assert "outbox_worker --once (a child process)" in prose
    assert "JetStream had dropped the killed batch's second copy" in prose
    assert figure(out, "receipts sent") == "40"
    assert "(expected 40; 40 task messages, 0 duplicates)" in out
    # The run's streams are gone: its own (with the durable consumers) and the dead
    # letters' of the points and the task queue.
    stream = re.search(r"stream (DEMO_[0-9a-f]+)", prose).group(1)
    import nats.js.errors

    from tests.utils.nats import NatsBroker

    broker = NatsBroker(nats_url)
    try:
        for name in (
            stream,
            f"demo_{stream[5:]}_points_dlq",
            f"demo_{stream[5:]}_tasks_default_dlq",
        ):
            with pytest.raises(nats.js.errors.NotFoundError):
                broker.run(broker.js.stream_info(name))
    finally:
        broker.close()


@pytest.mark.slow
@pytest.mark.transport
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("message_format", ["native", "cloudevents"])
def test_demo_on_the_test_database_and_redis(redis_url, message_format):
    """The same story on Redis Streams (BROKER_URL=redis://...): Redis keeps no message id,
    so the killed batch is added again and suppressed by the consumer, as on RabbitMQ; the
    crashed consumer's entries are claimed after the visibility timeout."""
    env = django_env(
        BROKER_URL=redis_url,
        DJANGO_SETTINGS_MODULE="config.settings",
        OUTBOX_MESSAGE_FORMAT=message_format,
    )
    env.pop("AMQP_URL", None)
    done = run_demo("--orders", "40", "--duplicates", "3", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    prose = " ".join(out.split())
    assert f"Redis Streams at {redis_url}" in prose
    assert figure(out, "message formats") == f"{message_format}={figure(out, 'messages handled')}"
    assert figure(out, "orders created") == "40"
    assert figure(out, "points rows") == "40"
    assert figure(out, "lost") == "0"
    assert figure(out, "PENDING / SENT / DEAD") == "0 / 40 / 0"
    # outbox_worker read the tasks' stream; the killed batch's 4 tasks were added twice.
    assert "outbox_worker --once (a child process)" in prose
    assert figure(out, "receipts sent") == "40"
    assert "(expected 40; 44 task messages, 4 duplicates)" in out
    # The run's streams are gone.
    run = re.search(r"streams demo-([0-9a-f]+)\.ORDER_CREATED", prose).group(1)
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        for key in (
            f"demo-{run}.ORDER_CREATED",
            f"demo-{run}.django.tasks.default",
            f"demo.{run}.points.dlq",
            f"demo.{run}.tasks.default.dlq",
        ):
            assert client.exists(key) == 0, key
    finally:
        client.close()


# -- the pieces ----------------------------------------------------------------------------
def good_figures(**changes) -> Figures:
    values = dict(
        orders=10,
        events=10,
        sent=10,
        pending=0,
        dead=0,
        points_rows=10,
        lost=0,
        extra_points=0,
        consumer=Tally(handled=13, processed=10, duplicates=3),
        lost_acks=1,
        killed_batch=2,
    )
    values.update(changes)
    return Figures(**values)


@pytest.mark.once
def test_reconcile_accepts_a_story_that_adds_up():
    assert reconcile(good_figures()) == []
    assert reconcile(good_figures(receipts=10)) == []
    tasks = Tally(handled=12, processed=10, duplicates=2)
    assert reconcile(good_figures(receipts=10, tasks=tasks, killed_tasks=2)) == []


@pytest.mark.once
@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"lost": 1, "points_rows": 9}, "1 order(s) never got their points: lost"),
        ({"extra_points": 1, "points_rows": 11}, "1 order(s) got their points more than once"),
        ({"points_rows": 9}, "9 points rows for 10 orders"),
        ({"events": 11, "sent": 11}, "11 outbox events for 10 orders"),
        ({"sent": 9, "pending": 1}, "outbox not fully sent: PENDING 1, SENT 9, DEAD 0"),
        ({"sent": 9, "dead": 1}, "outbox not fully sent: PENDING 0, SENT 9, DEAD 1"),
        (
            {"consumer": Tally(handled=13, processed=9, duplicates=3, failed=1)},
            "the consumer failed on 1 message(s)",
        ),
        ({"consumer": Tally(handled=12, processed=10, duplicates=2)}, "2 duplicates suppressed"),
        ({"receipts": 9}, "9 receipts sent for 10 orders"),
        ({"receipts": 11}, "11 receipts sent for 10 orders"),
        (
            {"receipts": 10, "tasks": Tally(handled=11, processed=10, duplicates=1)},
            "1 task duplicates, 0 expected",
        ),
        (
            {"receipts": 10, "tasks": Tally(handled=10, processed=10), "killed_tasks": 2},
            "0 task duplicates, 2 expected",
        ),
        (
            {"receipts": 10, "tasks": Tally(handled=11, processed=10, failed=1)},
            "the task worker failed on 1 message(s)",
        ),
    ],
)
def test_reconcile_names_what_does_not_add_up(changes, expected):
    problems = reconcile(good_figures(**changes))
    assert any(expected in p for p in problems), problems


@pytest.mark.once
def test_tally_reads_the_consume_outbox_totals():
    result = ConsumeResult()
    outcomes = [Outcome.PROCESSED] * 4 + [Outcome.DUPLICATE] * 2 + [Outcome.FAILED]
    for outcome in outcomes:
        result.add(decided(outcome, "cloudevents"))
    result.add(decided(Outcome.UNDECODABLE))
    tally = Tally.from_totals(json.loads(json.dumps(result.as_dict())))  # as --json prints it
    assert tally == Tally(
        handled=8, processed=4, duplicates=2, failed=1, other=1, formats={"cloudevents": 7}
    )
    assert (tally + Tally(formats={"native": 1, "cloudevents": 1})).formats == {
        "cloudevents": 8,
        "native": 1,
    }


@pytest.mark.once
def test_in_process_broker_confirms_and_redelivers_what_was_not_acked():
    broker = InProcessBroker()
    backend = InProcessBrokerBackend(**_client(broker))
    try:
        first, second = unsaved_event(pk=1), unsaved_event(pk=2)
        results = backend.publish([first, second])
        assert [r.ok for r in results] == [True, True]
        assert len(broker) == 2
        taken = broker.get()
        assert taken.message_id == first.event_id and taken.headers["sequence"] == 1
        broker.recover()  # the consumer's connection dropped before its ack
        again = broker.get()
        assert (again.message_id, again.redelivered) == (first.event_id, True)
        broker.ack(again.tag)
        assert broker.get().message_id == second.event_id
    finally:
        backend.close()
        broker.close()


@pytest.mark.once
def test_in_process_broker_routes_django_tasks_to_their_own_queue():
    """The points consumer never sees a task: as on RabbitMQ, tasks have their queue."""
    broker = InProcessBroker()
    backend = InProcessBrokerBackend(**_client(broker))
    try:
        from django_outbox.tasks_backend import task_event_type

        # The backend's own routing key: the broker's copy of its prefix must match it.
        event, task = unsaved_event(pk=1), unsaved_event(task_event_type("default"), pk=2)
        assert [r.ok for r in backend.publish([event, task])] == [True, True]
        assert (len(broker), broker.waiting(TASKS)) == (1, 1)
        taken = broker.get(TASKS)
        assert taken.message_id == task.event_id
        broker.recover()
        assert broker.get(TASKS).redelivered  # back in its own queue
        assert broker.get().message_id == event.event_id
        assert broker.get() is None
    finally:
        backend.close()
        broker.close()


@pytest.mark.once
def test_in_process_broker_backend_failures():
    broker = InProcessBroker()
    wrong_key = InProcessBrokerBackend(address=broker.address, authkey="00" * 16)
    with pytest.raises(BrokerUnavailable):
        wrong_key.open()
    backend = InProcessBrokerBackend(**_client(broker))
    backend.open()
    broker.close()
    with pytest.raises(BrokerUnavailable):
        InProcessBrokerBackend(**_client(broker)).open()
    backend.close()
    with pytest.raises(BrokerUnavailable, match="only works in the relay processes"):
        InProcessBrokerBackend(address="", authkey="").open()


class Pipelined(BaseBackend):
    """A pipelined inner backend that notes each call, and whether the demo's pause file
    existed by then."""

    pause_file = ""
    confirm_timeout = 4.0

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.batches: list[list[str]] = []
        self.calls: list[tuple[str, bool]] = []

    def _note(self, call: str) -> None:
        self.calls.append((call, os.path.exists(self.pause_file)))

    def send(self, events: Sequence[OutboxEvent]) -> None:
        self._note("send")
        self.batches.append([e.event_id for e in events])

    def wait(self) -> list[PublishResult]:
        self._note("wait")
        return [PublishResult.sent() for _ in self.batches.pop(0)] if self.batches else []

    def abandon(self) -> None:
        self.batches.clear()


@pytest.mark.django_db
def test_demo_relay_backend_keeps_the_pipeline_and_pauses_once_batch_n_is_confirmed(
    monkeypatch, tmp_path
):
    """The relay sends batch N+1 before it waits for N: the demo's backend waits for N
    itself and pauses before N+1 reaches the broker, so the killed relay leaves exactly
    batch N confirmed and unsettled."""
    paused = tmp_path / "relay.paused"
    monkeypatch.setenv(backends.INNER_ENV, f"{__name__}.Pipelined")
    monkeypatch.setenv(backends.PAUSE_AFTER_ENV, "2")
    monkeypatch.setenv(backends.PAUSE_FILE_ENV, str(paused))
    monkeypatch.setattr(backends, "PAUSE_LIMIT", 0)  # nobody kills this one: go on
    monkeypatch.setattr(Pipelined, "pause_file", str(paused))
    with outbox.atomic() as box:
        for i in range(50):
            box.emit("ORDER_CREATED", aggregate_type="ORDER", aggregate_id=str(i), payload={})
    backend = DemoRelayBackend()
    inner = backend.inner
    assert isinstance(inner, Pipelined)
    assert backend.confirm_timeout == 4.0
    result = Relay(backend=backend, batch_size=10, lease_seconds=60, db_thread=False).drain()
    assert (result.sent, result.batches) == (50, 5)
    calls = [call for call, _ in inner.calls]
    assert calls[:3] == ["send", "send", "wait"]  # two batches in flight: the pipeline
    before = [call for call, after in inner.calls if not after]
    assert before == ["send", "send", "wait", "wait"]  # batches 1 and 2 confirmed, 3 unsent
    report = json.loads(paused.read_text())
    second = OutboxEvent.objects.order_by("id").values_list("event_id", flat=True)[10:20]
    assert report["batch"] == 2
    assert report["confirmed"] == list(second)


def _client(broker: InProcessBroker) -> dict[str, str]:
    return {"address": broker.address, "authkey": broker.authkey.hex()}
