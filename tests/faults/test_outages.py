"""The broker or the database goes away under a running relay; a poison event among good ones."""

from __future__ import annotations

import re
import time

import pytest
from django.db.models import Max

from django_outbox import outbox
from django_outbox.models import OutboxEvent, Status
from tests.utils.proxy import TcpProxy
from tests.utils.subprocess import database_url

from .harness import check_invariants, counts, emit, kill_database_connections, wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Three quick retry steps, then DEAD: an outage that burned attempts would kill rows fast.
SHORT_SCHEDULE = [0.2, 0.2, 0.2]


def test_broker_cut_longer_than_the_schedule_burns_no_retries(broker, proxied, procs, record):
    """Events keep being committed while the relay's broker connections are cut and refused
    for 4 s: several times the whole retry schedule. Nothing goes DEAD, no attempt is
    counted, and the backlog drains once the broker is back."""
    broker.bind_all()
    tcp, url = proxied
    relay = procs.relay(
        "--batch-size", "50", name="relay", BROKER_URL=url, RETRY_SCHEDULE=SHORT_SCHEDULE
    )
    emitted = 0

    def produce(seconds: float) -> None:
        nonlocal emitted
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            emitted += len(emit(25))
            time.sleep(0.05)

    emit(1)
    wait_for(lambda: counts()["sent"] == 1, timeout=60, what="relay connected", processes=procs)
    produce(1.0)
    tcp.refuse()
    tcp.cut()  # mid-stream: batches are in flight
    produce(4.0)
    backlog = counts()["pending"]
    tcp.allow()
    produce(1.0)
    total = OutboxEvent.objects.count()
    wait_for(lambda: counts()["sent"] == total, timeout=60, what="the backlog", processes=procs)
    assert relay.stop() == 0, relay.tail()
    assert backlog > 100, "the outage held nothing back"
    assert "broker unavailable" in relay.stderr()
    assert OutboxEvent.objects.aggregate(m=Max("retry_count"))["m"] == 0
    check_invariants("broker connection cut for 4 s mid-stream", broker, record, crashed=True)


def test_broker_that_stops_answering_confirms_nothing_falsely(broker, proxied, procs, record):
    """The broker keeps receiving but its answers are held back for 5 s: batches time out
    (an attempt each, by design) and the held confirms of those old batches all arrive at
    once afterwards, mixed with the new batches' ones. No late confirm may be matched to a
    row it does not belong to, and the backlog drains after."""
    broker.bind_all()
    tcp, url = proxied
    relay = procs.relay(
        "--batch-size", "50", name="relay", BROKER_URL=url, RETRY_SCHEDULE=[0.5] * 10
    )
    emit(1)
    wait_for(lambda: counts()["sent"] == 1, timeout=60, what="relay connected", processes=procs)
    emit(500)
    tcp.pause()
    emit(500)
    time.sleep(5)  # two batches time out (2 s confirm timeout), a third waits
    tcp.resume()
    emit(500)
    wait_for(lambda: counts()["sent"] == 1501, timeout=60, what="the backlog", processes=procs)
    assert relay.stop() == 0, relay.tail()
    assert re.search(r"events failed: \d+ timeout: ", relay.stderr()), relay.tail()
    # A timed-out message did reach the queue: its retry is a duplicate, as after a crash.
    check_invariants("broker answers held for 5 s (late confirms)", broker, record, crashed=True)


def test_compensator_during_an_outage_exits_2_and_burns_nothing(broker, proxied, procs, record):
    broker.bind_all()
    tcp, url = proxied
    emit(200)
    tcp.refuse()
    time.sleep(0.2)  # older than --stale-after
    down = procs.run("compensate_outbox", "--stale-after", "100ms", BROKER_URL=url)
    assert down.popen.returncode == 2, down.tail()
    assert "the rows stay PENDING" in down.stderr()
    assert OutboxEvent.objects.due().filter(retry_count=0, lease_token="").count() == 200
    tcp.allow()
    up = procs.run("compensate_outbox", "--stale-after", "100ms", BROKER_URL=url)
    assert up.popen.returncode == 0, up.tail()
    assert up.summary() == {"found": 200, "sent": 200, "failed": 0, "dead": 0}
    check_invariants("compensate_outbox during a broker outage", broker, record, crashed=False)


def test_database_connection_killed_mid_batch_relay_recovers(broker, procs, record, db_vendor):
    """The relay's database sessions are killed 5 times while it drains (pg_terminate_backend
    on PostgreSQL, KILL on MariaDB); it reconnects by itself and delivers everything."""
    broker.bind_all()
    emit(3000)
    relay = procs.relay("--batch-size", "25", name="relay")
    killed = 0
    for round_ in range(5):
        target = counts()["sent"] + 150
        wait_for(
            lambda: counts()["sent"] >= target,  # noqa: B023 (called within this round)
            timeout=60,
            what=f"progress before kill {round_}",
            processes=procs,
            every=0.01,
        )
        killed += kill_database_connections()
    assert killed >= 5
    wait_for(lambda: counts()["sent"] == 3000, timeout=60, what="recovery", processes=procs)
    assert relay.alive()
    assert relay.stop() == 0, relay.tail()
    assert "relay pass failed" in relay.stderr()  # it did see the connection die
    check_invariants(
        f"database sessions killed x5 mid-drain ({db_vendor})", broker, record, crashed=True
    )


def test_database_unreachable_for_a_while_relay_survives(broker, procs, record, db_vendor):
    """The relay's database connections go through a TcpProxy that cuts them and refuses
    new ones for 3 s while it drains: the relay keeps retrying and finishes the backlog."""
    broker.bind_all()
    proxy, url = TcpProxy.for_url(database_url())
    try:
        emit(3000)
        relay = procs.relay("--batch-size", "25", name="relay", database_url=url)
        wait_for(lambda: counts()["sent"] >= 300, timeout=60, what="progress", processes=procs)
        proxy.refuse()
        proxy.cut()
        time.sleep(3)
        assert relay.alive(), relay.tail()
        proxy.allow()
        wait_for(lambda: counts()["sent"] == 3000, timeout=60, what="recovery", processes=procs)
        assert relay.stop() == 0, relay.tail()
    finally:
        proxy.close()
    assert "relay pass failed" in relay.stderr()
    check_invariants(f"database unreachable for 3 s ({db_vendor})", broker, record, crashed=True)


# How each poison is made, and the reason its last_error names.
POISONS = {
    "unroutable": ({}, "unroutable"),  # no queue is bound for its routing key
    "nacked": ({}, "nacked"),  # routed only to a full reject-publish queue
    # Headers that JSON and the table accept but AMQP cannot encode: pika raises while
    # building the frame, on a channel that is perfectly fine. emit() refuses them, so the
    # row is given them afterwards, as a row written by raw SQL or an older version would.
    "float header": ({"headers": {"schema_version": 1.5}}, "serialisation"),
    "64-bit overflow header": ({"headers": {"big": 2**64}}, "serialisation"),
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_poison_event_goes_dead_with_one_alert_while_others_flow(broker, procs, record, poison):
    """The broker refuses one event every time. It goes DEAD after the schedule with
    exactly one alert; every event behind it, in its batch or later, is delivered."""
    fields, reason = POISONS[poison]
    routable = poison not in {"unroutable", "nacked"}
    broker.bind_all("#" if routable else "EV")
    if poison == "nacked":
        broker.declare_queue(
            "POISON",
            name=f"{broker.queue}.full",
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
    emit(20)
    with outbox.atomic() as box:
        poison_id = box.emit("POISON", aggregate_type="FAULT", payload={}).event_id
    OutboxEvent.objects.filter(event_id=poison_id).update(**fields)
    emit(480)
    relay = procs.relay("--batch-size", "100", name="relay", RETRY_SCHEDULE=SHORT_SCHEDULE)
    emit(500)
    wait_for(
        lambda: counts() == {"sent": 1000, "dead": 1, "pending": 0, "leased": 0},
        timeout=30,
        what="1000 SENT and the poison DEAD",
        processes=procs,
    )
    time.sleep(0.5)  # an alert is sent after the pass that killed the row
    assert relay.stop() == 0, relay.tail()
    dead = OutboxEvent.objects.get(status=Status.DEAD)
    assert dead.event_id == poison_id
    assert dead.retry_count == len(SHORT_SCHEDULE) + 1
    assert f"[{reason}]" in dead.last_error
    assert not OutboxEvent.objects.sent().exclude(retry_count=0).exists()
    alerts, named = procs.alerts()
    assert (alerts, dict(named)) == (1, {poison_id: 1})
    check_invariants(
        f"poison event ({poison}) among 1000", broker, record, crashed=False, alerted=named
    )
