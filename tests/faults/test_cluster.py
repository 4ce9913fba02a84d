"""A real three-node RabbitMQ cluster: one node stopped under a draining relay and consumer.

Optional: it needs a cluster, which ``bash scripts/rabbitmq-cluster start`` runs on loopback
ports (three nodes with their own names, ports, data directories and Erlang cookie) and
whose output sets ``AMQP_CLUSTER`` (the nodes' URLs, ``;`` between them) and
``AMQP_CLUSTER_STOP`` / ``AMQP_CLUSTER_START`` (a shell command that stops or starts node
``{n}``, 1-based). Without them every test here is skipped. The TcpProxy scenarios of
test_failover.py cover the same failover on every run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import pytest

from django_outbox.consumer import Outcome
from django_outbox.masking import mask_url
from django_outbox.models import OutboxEvent
from points.models import PointsLedger
from tests.utils.amqp import Broker, make_consumer, serving
from tests.utils.cluster import Cluster
from tests.utils.rows import unsaved_event
from tests.utils.waiting import wait_for as wait_until

from .harness import check_invariants, drain_while_node_1_stops, emit

CLUSTER_ENV = Cluster("AMQP_CLUSTER", "scripts/rabbitmq-cluster")
CLUSTER = CLUSTER_ENV.urls
QUORUM = {"x-queue-type": "quorum"}

pytestmark = [
    pytest.mark.amqp,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    CLUSTER_ENV.skip_unless_up,
]


@pytest.fixture
def cluster() -> Iterator[Broker]:
    """The test's exchange and queues on the cluster, through node 3 (never stopped)."""
    with closing(Broker(CLUSTER[2])) as broker:
        yield broker


@pytest.fixture
def broker(cluster: Broker) -> Broker:
    """The broker of ``procs`` (tests/faults/conftest.py): the cluster."""
    return cluster


def test_a_node_stopped_mid_drain_the_relay_goes_on_through_the_next(cluster, procs, record):
    """The relay publishes through node 1; node 1 is stopped (rabbitmqctl stop_app: its
    connections are closed, new ones refused) while a backlog drains into a quorum queue.
    The relay goes on through node 2; every event is in the queue once at least, none SENT
    without a confirm, no attempt counted."""
    # Declared through node 3: the queue's leader is there, and a majority stays up.
    cluster.declare_queue("#", name=cluster.queue, durable=True, arguments=QUORUM)
    emit(3000)
    relay = procs.relay("--batch-size", "25", name="relay", BROKER_URL=CLUSTER)
    drain_while_node_1_stops(CLUSTER_ENV, procs, relay, stop_at=300, total=3000, timeout=90)
    log = relay.stderr()
    assert f"connected to {mask_url(CLUSTER[1])} (node 2 of 3)" in log, relay.tail()
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
    check_invariants("cluster: node 1 stopped mid-drain", cluster, record, crashed=True)


def test_a_node_stopped_under_the_consumer_it_goes_on_through_the_next(cluster):
    """consume_outbox's loop declares its quorum queue and reads it through node 1 (the
    queue's leader is there); node 1 is stopped: a new leader is elected among the other
    two, the consumer reads on through node 2, and each event is handled once."""
    consumer = make_consumer(cluster, url=CLUSTER)
    assert consumer.arguments["x-queue-type"] == "quorum"
    try:
        with serving(consumer) as results:
            events = [unsaved_event(pk=n) for n in range(1, 21)]
            for event in events[:10]:
                cluster.publish(event)
            assert wait_until(lambda: PointsLedger.objects.count() == 10, timeout=30)
            CLUSTER_ENV.node("stop", 1)
            for event in events[10:]:
                cluster.publish(event)
            assert wait_until(lambda: PointsLedger.objects.count() == 20, timeout=60)
            assert consumer.url == CLUSTER[1]
    finally:
        CLUSTER_ENV.node("start", 1)
    assert results[0].counts[Outcome.PROCESSED] == 20
    assert PointsLedger.objects.count() == 20
