"""A real three-node NATS cluster, a stream of three replicas: one node stopped under a
draining relay and under a consumer.

Optional: it needs a cluster, which ``bash scripts/nats-cluster start`` runs on loopback
ports (three servers with their own stores) and whose output sets ``NATS_CLUSTER`` (the
nodes' URLs, ``;`` between them) and ``NATS_CLUSTER_STOP`` / ``NATS_CLUSTER_START`` (a
shell command that stops or starts node ``{n}``, 1-based). Without them every test here is
skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import pytest

from django_outbox.consumer import Outcome
from django_outbox.masking import mask_url
from django_outbox.models import OutboxEvent, Status
from points.models import PointsLedger
from tests.utils.amqp import serving
from tests.utils.cluster import Cluster
from tests.utils.nats import NatsBroker, make_nats_consumer, publish_events, relay_settings
from tests.utils.rows import unsaved_event
from tests.utils.waiting import wait_for as wait_until

from .harness import drain_while_node_1_stops, emit

CLUSTER_ENV = Cluster("NATS_CLUSTER", "scripts/nats-cluster")
CLUSTER = CLUSTER_ENV.urls

pytestmark = [
    pytest.mark.slow,
    pytest.mark.transport,
    pytest.mark.django_db(transaction=True),
    CLUSTER_ENV.skip_unless_up,
]


@pytest.fixture
def cluster() -> Iterator[NatsBroker]:
    """The test's stream, three replicas, through node 3 (never stopped)."""
    with closing(NatsBroker(CLUSTER[2])) as broker:
        broker.declare_stream(num_replicas=3, duplicate_window=120)
        yield broker


@pytest.fixture
def broker(cluster: NatsBroker) -> NatsBroker:
    """The broker of ``procs`` (tests/faults/conftest.py): the cluster's stream."""
    return cluster


def test_a_node_stopped_mid_drain_the_relay_goes_on_through_the_next(cluster, procs):
    """The relay publishes through node 1; node 1 is stopped while a backlog drains into a
    stream of three replicas. The relay goes on through node 2: every event is in the
    stream, once (the duplicate window drops what is published again), and no row is SENT
    that the stream did not ack."""
    total = 5000
    ids = emit(total)
    relay = procs.relay(
        "--batch-size",
        "100",
        name="relay",
        **relay_settings(cluster, BROKER_URL=CLUSTER, NATS_REPLICAS=3),
    )
    drain_while_node_1_stops(CLUSTER_ENV, procs, relay, stop_at=1000, total=total, timeout=120)
    assert f"connected to {mask_url(CLUSTER[1])} (node 2 of 3)" in relay.stderr(), relay.tail()
    stored = cluster.collect()
    sent = set(OutboxEvent.objects.filter(status=Status.SENT).values_list("event_id", flat=True))
    assert [i for i in ids if not stored[i]] == []  # 0 lost
    assert [i for i in sent if not stored[i]] == []  # 0 SENT without an ack
    assert set(stored) == set(ids)
    assert cluster.count() == total  # and each once


def test_a_node_stopped_under_the_consumer_it_goes_on_through_the_next(cluster):
    """The consumer reads its durable consumer through node 1; node 1 is stopped: it reads
    on through node 2, and each event is handled once."""
    consumer = make_nats_consumer(cluster, url=CLUSTER, reconnect_max=0.5)
    try:
        with serving(consumer) as results:
            events = [unsaved_event(pk=n) for n in range(1, 21)]
            publish_events(cluster, *events[:10], replicas=3)
            assert wait_until(lambda: PointsLedger.objects.count() == 10, timeout=30)
            CLUSTER_ENV.node("stop", 1)
            publish_events(cluster, *events[10:], replicas=3)
            assert wait_until(lambda: PointsLedger.objects.count() == 20, timeout=60)
            # Node 2, or node 3 when node 2 did not answer in time while the stream and the
            # consumer elected new leaders.
            assert consumer.url in CLUSTER[1:]
    finally:
        CLUSTER_ENV.node("start", 1)
    assert results[0].counts[Outcome.PROCESSED] == 20
    assert PointsLedger.objects.count() == 20
