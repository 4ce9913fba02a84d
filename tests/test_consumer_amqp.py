"""The consumer against a real RabbitMQ and the test database."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from contextlib import contextmanager
from io import StringIO

import pika
import pytest
from django.core.management import call_command

from django_outbox.consumer import Outcome
from django_outbox.message import encode_body
from points.models import PointsLedger
from tests.utils.amqp import (
    AWARD,
    consume,
    consume_outbox_command,
    make_consumer,
    properties,
    serving,
)
from tests.utils.rows import unsaved_event
from tests.utils.subprocess import database_url, django_env, manage_command
from tests.utils.threads import db_thread
from tests.utils.waiting import wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.django_db(transaction=True)]

FAILING = "tests.consumer_handlers.FailingHandler"
BLOCKING = "tests.consumer_handlers.BlockingPointsHandler"
# The queue type is the broker's side: the default on every database, the other on one.
QUEUE_TYPES = ["quorum", pytest.param("classic", marks=pytest.mark.transport)]


def test_same_message_twice_one_row_two_acks(broker):
    event = unsaved_event()
    result = consume(broker, event, event)
    assert result.counts[Outcome.PROCESSED] == 1
    assert result.counts[Outcome.DUPLICATE] == 1
    assert PointsLedger.objects.filter(source_event_id=event.event_id).count() == 1
    assert broker.count(broker.queue) == 0
    assert broker.count(broker.dlq) == 0


@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_failing_handler_rolls_back_is_retried_then_dead_lettered(broker, queue_type):
    event = unsaved_event()
    result = consume(broker, event, handlers=[FAILING], queue_type=queue_type, max_retries=2)
    # 1 delivery + 2 retries, each rolled back; then the dead-letter queue.
    assert result.counts[Outcome.FAILED] == 3
    assert result.dead_lettered == 1
    assert PointsLedger.objects.count() == 0
    assert wait_for(lambda: broker.count(broker.dlq) == 1)
    _method, props, _body = broker.get(broker.dlq)
    assert props.message_id == event.event_id
    assert props.headers["x-outbox-reason"] == (
        "failed 3 time(s): RuntimeError: boom after the write"
    )
    assert broker.count(broker.queue) == 0


def test_failure_then_success_on_redelivery(broker):
    consumer = make_consumer(broker, handlers=[FAILING])
    event = unsaved_event()
    broker.publish(event)
    result = consumer.serve(max_messages=1)
    assert result.counts[Outcome.FAILED] == 1
    assert PointsLedger.objects.count() == 0
    # The message came back; a fixed handler processes it.
    result = make_consumer(broker).serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 1
    assert PointsLedger.objects.get().source_event_id == event.event_id


def test_a_stop_hands_each_prefetched_message_back_once(broker):
    """A consumer that stops (SIGTERM, a deploy) with messages prefetched returns each one
    once: one delivery counted on a quorum queue before RabbitMQ 4.3, none from 4.3. pika's
    own cancel rejected them while the consumer was still subscribed: RabbitMQ sent them
    straight back and they were rejected again, two deliveries of the limit per stop (with
    a limit of 1: dead-lettered after one stop, never handled)."""
    consumer = make_consumer(broker, max_retries=1, prefetch=10)
    events = [unsaved_event(pk=i) for i in range(1, 7)]
    for event in events:
        broker.publish(event)
    result = consumer.serve(max_messages=1)  # stops with five in hand
    assert result.counts[Outcome.PROCESSED] == 1
    result = make_consumer(broker, max_retries=1).serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 5
    assert PointsLedger.objects.count() == 6
    assert broker.count(broker.dlq) == 0


def test_undecodable_goes_to_the_dead_letter_queue_at_once(broker):
    consumer = make_consumer(broker, max_retries=5)
    broker.publish_raw(
        b"\xff not json",
        pika.BasicProperties(message_id="bad-1", type="ORDER_CREATED", delivery_mode=2),
        "ORDER_CREATED",
    )
    broker.publish_raw(b"{}", pika.BasicProperties(delivery_mode=2), "ORDER_CREATED")
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.UNDECODABLE] == 2
    assert wait_for(lambda: broker.count(broker.dlq) == 2)


# The messages of issue 19 that stopped consume_outbox (on a classic queue for good: the
# message stayed at the head and every restart crashed on it), and what the reason names.
ISSUE_19_MALFORMED = [
    ({"attempt": "abc"}, b"", "header attempt"),
    ({"sequence": "x"}, b"", "header sequence"),
    ({"sequence": [1, 2]}, b"", "header sequence"),
    ({"previous_sequence": "zz"}, b"", "header previous_sequence"),
    ({"occurred_at": "2024-13-45T00:00:00"}, b"", "header occurred_at"),
    ({}, b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
]


@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_malformed_messages_go_to_the_dlq_with_a_reason_and_the_rest_flow(broker, queue_type):
    from django_outbox.consumer import REASON_HEADER

    consumer = make_consumer(broker, queue_type=queue_type, max_retries=5)
    good = []
    for i, (headers, body, _named) in enumerate(ISSUE_19_MALFORMED):
        event = unsaved_event(pk=100 + i)
        props = properties(event)
        props.headers.update(headers)
        broker.publish_raw(body or encode_body(event), props, "ORDER_CREATED")
        good.append(unsaved_event(pk=i + 1))
        broker.publish(good[-1])
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.UNDECODABLE] == len(ISSUE_19_MALFORMED)
    assert result.counts[Outcome.PROCESSED] == len(good)
    assert set(PointsLedger.objects.values_list("source_event_id", flat=True)) == {
        e.event_id for e in good
    }
    assert broker.count(broker.queue) == 0
    dead = broker.drain(broker.dlq)
    reasons = [props.headers[REASON_HEADER] for props, _body in dead]
    assert len(reasons) == len(ISSUE_19_MALFORMED)
    for (_headers, _body, named), reason in zip(ISSUE_19_MALFORMED, reasons, strict=True):
        assert reason.startswith("undecodable: ") and named in reason


@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_a_delivery_count_that_is_not_one_dead_letters_a_failing_message(broker, queue_type):
    """A publisher's own x-delivery-count / x-outbox-delivery cannot be counted on: a
    failing message carrying one goes to the dead-letter queue at once, with the reason."""
    from django_outbox.consumer import DELIVERY_HEADER, REASON_HEADER

    consumer = make_consumer(broker, handlers=[FAILING], queue_type=queue_type, max_retries=5)
    event = unsaved_event()
    props = properties(event)
    name = "x-delivery-count" if queue_type == "quorum" else DELIVERY_HEADER
    props.headers[name] = "abc"
    broker.publish_raw(encode_body(event), props, "ORDER_CREATED")
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.FAILED] == 1
    assert result.dead_lettered == 1
    [(dead, _body)] = broker.drain(broker.dlq)
    assert dead.message_id == event.event_id
    assert "boom after the write" in dead.headers[REASON_HEADER]
    assert f"header {name} is 'abc'" in dead.headers[REASON_HEADER]


def test_unknown_event_type_is_acked(broker):
    consumer = make_consumer(broker)
    broker.publish(unsaved_event("ORDER_SHIPPED"), routing_key="ORDER_CREATED")
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.UNKNOWN_TYPE] == 1
    assert broker.count(broker.queue) == 0
    assert broker.count(broker.dlq) == 0


@pytest.mark.slow
def test_thousand_events_with_redeliveries_exactly_once(broker, db_vendor):
    if db_vendor == "sqlite":
        pytest.skip("two concurrent consumers need PostgreSQL or MariaDB")
    make_consumer(broker).close()
    events = [unsaved_event(pk=i) for i in range(1, 1001)]
    for event in events:
        broker.publish(event)
    for event in events[::5]:  # 200 injected redeliveries
        broker.publish(event)
    results = []

    def consume():
        results.append(make_consumer(broker, prefetch=20).serve(until_idle=True))

    threads = [db_thread(consume) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert PointsLedger.objects.count() == 1000
    assert sum(r.messages for r in results) == 1200
    assert sum(r.counts[Outcome.DUPLICATE] for r in results) == 200
    assert sum(r.counts[Outcome.FAILED] for r in results) == 0
    assert broker.count(broker.queue) == 0


@contextmanager
def blocked_in_a_handler(broker, tmp_path, *events):
    """consume_outbox in a child process, given ``events``, its handler stopped after
    writing its row of the first (until the marker file it yields is removed)."""
    make_consumer(broker).close()  # the queue and its bindings
    for event in events:
        broker.publish(event)
    marker = tmp_path / "blocked"
    env = django_env(AMQP_URL=broker.url, H3_BLOCK_FILE=str(marker))
    command = consume_outbox_command(broker, "--handler", BLOCKING)
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_for(marker.exists, timeout=60), child.stderr.read1().decode()
        yield child, marker
    finally:
        if child.poll() is None:
            child.kill()


def test_killed_between_handle_and_commit_the_message_comes_back(broker, tmp_path):
    """kill -9 while the handler's row is written but not committed: nothing is acked."""
    event = unsaved_event()
    with blocked_in_a_handler(broker, tmp_path, event) as (child, _marker):
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert PointsLedger.objects.count() == 0
    result = make_consumer(broker).serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 1
    assert PointsLedger.objects.get().source_event_id == event.event_id


def test_sigterm_finishes_the_message_in_hand_then_exits_0(broker, tmp_path):
    first, second = unsaved_event(pk=1), unsaved_event(pk=2)
    with blocked_in_a_handler(broker, tmp_path, first, second) as (child, marker):
        child.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        marker.unlink()  # let the handler return: it commits, acks, and the loop stops
        out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err.decode()
    assert b"processed 1" in out
    assert list(PointsLedger.objects.values_list("source_event_id", flat=True)) == [first.event_id]
    # The prefetched second message went back to the queue.
    assert wait_for(lambda: broker.count(broker.queue) == 1)


def test_json_prints_the_totals_as_one_object_instead_of_the_summary(broker, settings):
    make_consumer(broker).close()  # the queue and its bindings
    event = unsaved_event()
    broker.publish(event)
    broker.publish(event)
    settings.OUTBOX_BROKER_URL = broker.url
    out = StringIO()
    call_command(
        "consume_outbox",
        *("--once", "--json", "--queue", broker.queue, "--exchange", broker.exchange),
        *("--handler", AWARD),
        stdout=out,
        stderr=StringIO(),
    )
    totals = json.loads(out.getvalue())
    assert totals == {
        "messages": 2,
        "outcomes": {o.value: {"processed": 1, "duplicate": 1}.get(o.value, 0) for o in Outcome},
        "dead_lettered": 0,
        "formats": {"native": 2, "cloudevents": 0, "cloudevents-structured": 0},
    }


def test_list_shows_handlers_and_bindings():
    env = django_env()
    out = subprocess.run(
        manage_command("consume_outbox", "--list"),
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    assert "points.award: ORDER_CREATED (binds ORDER_CREATED; dedup by points.PointsLedger" in out


def test_reconnects_after_the_connection_is_lost(broker):
    from tests.utils.proxy import TcpProxy

    proxy, url = TcpProxy.for_url(broker.url)
    try:
        with serving(make_consumer(broker, url=url)) as results:
            first, second = unsaved_event(pk=1), unsaved_event(pk=2)
            broker.publish(first)
            assert wait_for(lambda: PointsLedger.objects.count() == 1)
            proxy.cut()
            broker.publish(second)
            assert wait_for(lambda: PointsLedger.objects.count() == 2, timeout=30)
    finally:
        proxy.close()
    # The first message's ack may be what the cut lost: then it comes back after the
    # reconnect and is absorbed as a duplicate. Either way each event was handled once.
    counts = results[0].counts
    assert (counts[Outcome.PROCESSED], counts[Outcome.DUPLICATE]) in {(2, 0), (1, 1)}
    assert PointsLedger.objects.count() == 2
    assert broker.count(broker.queue) == 0


def test_fails_over_to_the_next_node_when_its_node_dies(broker, caplog):
    """Two proxies in front of RabbitMQ stand for two nodes of a cluster. The consumer reads
    through A; A dies (cut, refusing): it goes on through B at once, on the same quorum
    queue. Then A comes back and B dies: every node has failed in this round, so it pauses
    once, then goes on through A."""
    from django_outbox.masking import mask_url
    from tests.utils.proxy import TcpProxy

    caplog.set_level("INFO", logger="django_outbox")
    node_a, url_a = TcpProxy.for_url(broker.url)
    node_b, url_b = TcpProxy.for_url(broker.url)
    try:
        consumer = make_consumer(broker, url=[url_a, url_b])
        assert consumer.queue_type == "quorum"
        with serving(consumer) as results:
            events = [unsaved_event(pk=n) for n in range(1, 4)]
            broker.publish(events[0])
            assert wait_for(lambda: PointsLedger.objects.count() == 1)
            node_a.refuse()
            node_a.cut()
            started = time.monotonic()
            broker.publish(events[1])
            assert wait_for(lambda: PointsLedger.objects.count() == 2, timeout=30)
            to_b = time.monotonic() - started
            node_a.allow()
            node_b.refuse()
            node_b.cut()
            broker.publish(events[2])
            assert wait_for(lambda: PointsLedger.objects.count() == 3, timeout=30)
    finally:
        node_a.close()
        node_b.close()
    assert to_b < 5, f"{to_b:.1f} s to go on through B"
    text = caplog.text
    assert f"broker connection to {mask_url(url_a)} (node 1 of 2) lost" in text
    assert f"failing over to {mask_url(url_b)} (node 2 of 2)" in text
    assert f"at {mask_url(url_b)} (node 2 of 2)" in text  # "consuming ... at" B
    assert "reconnecting in" in text  # B died after A: the pause of a full round
    assert "guest:guest@" not in text
    # A cut may lose an ack: that message comes back as a duplicate, handled once.
    assert results[0].counts[Outcome.PROCESSED] == 3
    assert broker.count(broker.queue) == 0


def test_the_first_node_down_at_start_the_consumer_reads_from_the_next(broker, caplog):
    from tests.utils.proxy import TcpProxy

    caplog.set_level("INFO", logger="django_outbox")
    node_a, url_a = TcpProxy.for_url(broker.url)
    node_a.refuse()
    try:
        consumer = make_consumer(broker, url=f"{url_a};{broker.url}")
        broker.publish(unsaved_event())
        result = consumer.serve(until_idle=True)
    finally:
        node_a.close()
    assert result.counts[Outcome.PROCESSED] == 1
    assert "cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:" in caplog.text
    assert "trying the next node" in caplog.text


def needs_a_database_server(db_vendor: str) -> None:
    if db_vendor == "sqlite":
        pytest.skip("a database outage needs PostgreSQL or MariaDB (a server to cut off)")


def consumer_behind_a_database_proxy(broker, queue_type, stderr, max_retries=1):
    """consume_outbox in a child process whose database connections go through a TcpProxy
    (by default ``--max-retries 1``: a counted failure would dead-letter at once)."""
    from tests.utils.proxy import TcpProxy

    make_consumer(broker, queue_type=queue_type, max_retries=max_retries).close()
    proxy, url = TcpProxy.for_url(database_url())
    command = consume_outbox_command(
        broker,
        *("--queue-type", queue_type, "--max-retries", str(max_retries)),
        *("--retry-delay", "0", "--handler", AWARD),
    )
    env = django_env(AMQP_URL=broker.url, DATABASE_URL=url)
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr)
    return proxy, child


def wait_until_done(proxy, ledger_rows: int) -> bool:
    """Wait for the consumer to be done with its messages: the ledger rows are there and the
    consumer has read the database's answers. The rows alone are not enough: another
    connection sees a commit before its client has read the answer, and a cut in between
    makes that message a held one (then a duplicate) instead of a done one."""
    return wait_for(lambda: PointsLedger.objects.count() == ledger_rows, timeout=60) and (
        proxy.wait_quiet()
    )


@pytest.mark.slow
@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_database_outage_holds_messages_and_counts_no_delivery(
    broker, db_vendor, queue_type, tmp_path
):
    """Issue 19: the consumer's database unreachable with valid messages queued. Before, each
    failed with OperationalError, was retried and dead-lettered; now the consumer holds the
    message in hand unacknowledged, backs off until the database answers, and goes on."""
    needs_a_database_server(db_vendor)
    events = [unsaved_event(pk=i) for i in range(1, 5)]
    log = tmp_path / "stderr"
    with log.open("wb") as stderr:
        proxy, child = consumer_behind_a_database_proxy(broker, queue_type, stderr)
    try:
        broker.publish(events[0])
        assert wait_until_done(proxy, 1)
        proxy.refuse()
        proxy.cut()
        for event in events[1:]:
            broker.publish(event)
        time.sleep(4)  # the outage: several backoff steps (0.5 s, 1 s, 2 s)
        assert child.poll() is None
        assert broker.count(broker.dlq) == 0
        assert PointsLedger.objects.count() == 1
        proxy.allow()
        assert wait_for(lambda: PointsLedger.objects.count() == 4, timeout=60)
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=60)
    finally:
        proxy.close()
        if child.poll() is None:
            child.kill()
    text = log.read_text()
    assert child.returncode == 0, text
    assert "processed 4" in out.decode()
    assert "unavailable" in text and "holding message" in text
    assert "failed (delivery" not in text  # no delivery was counted as a failure
    assert broker.count(broker.dlq) == 0
    assert broker.count(broker.queue) == 0


@pytest.mark.slow
def test_sigterm_during_a_database_outage_hands_the_messages_back(broker, db_vendor, tmp_path):
    needs_a_database_server(db_vendor)
    log = tmp_path / "stderr"
    with log.open("wb") as stderr:
        # --max-retries 1: the stop returns each message once, within the limit.
        proxy, child = consumer_behind_a_database_proxy(broker, "quorum", stderr)
    try:
        broker.publish(unsaved_event(pk=1))
        assert wait_until_done(proxy, 1)
        proxy.refuse()
        proxy.cut()
        broker.publish(unsaved_event(pk=2))
        broker.publish(unsaved_event(pk=3))
        assert wait_for(lambda: "holding message" in log.read_text(), timeout=60)
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == 0, log.read_text()
    finally:
        proxy.close()
        if child.poll() is None:
            child.kill()
    # The held message and the prefetched one are back in the queue, none dead-lettered.
    assert wait_for(lambda: broker.count(broker.queue) == 2), log.read_text()
    assert broker.count(broker.dlq) == 0
    assert PointsLedger.objects.count() == 1


@pytest.mark.slow  # an outage scenario, like the two above: it needs a database server
@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_a_handler_that_breaks_its_own_connection_is_not_held_for_good(
    broker, db_vendor, queue_type, caplog
):
    """The connection is lost but the database answers: retried at once, uncounted, a few
    times; then it is a failure like any other and ends in the dead-letter queue."""
    from django_outbox.consumer import LOST_CONNECTION_RETRIES, REASON_HEADER

    needs_a_database_server(db_vendor)
    event = unsaved_event()
    handlers = ["tests.consumer_handlers.ConnectionBreakingHandler"]
    result = consume(broker, event, handlers=handlers, queue_type=queue_type, max_retries=1)
    # Each delivery: LOST_CONNECTION_RETRIES uncounted tries, then one counted failure.
    assert result.counts[Outcome.FAILED] == 2
    assert result.dead_lettered == 1
    assert PointsLedger.objects.count() == 0
    [(dead, _body)] = broker.drain(broker.dlq)
    assert dead.message_id == event.event_id
    assert dead.headers[REASON_HEADER].startswith("failed 2 time(s): ")
    again = [r for r in caplog.records if "trying the message again" in r.getMessage()]
    assert len(again) == 2 * LOST_CONNECTION_RETRIES
