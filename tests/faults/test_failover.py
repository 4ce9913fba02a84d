"""A broker node dies under a draining relay; the relay goes on through another node.

Two loopback TcpProxy instances in front of the real RabbitMQ stand for two nodes of a
cluster: the relay is given both URLs, and a node "dies" when its proxy cuts every
connection and refuses new ones.
"""

from __future__ import annotations

import time

import pytest

from django_outbox.masking import mask_url
from django_outbox.models import OutboxEvent
from tests.utils.proxy import TcpProxy

from .harness import Processes, check_invariants, counts, emit, wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

#: How long the relay may take to go on through the other node once one has died. The
#: failover itself is immediate; the rest is settling the lost batches and connecting.
FAILOVER_WITHIN = 5.0


def progress(events: int, *, what: str, procs: Processes) -> float:
    """Wait until ``events`` more rows are SENT; return how long that took."""
    started = time.monotonic()
    target = counts()["sent"] + events
    wait_for(lambda: counts()["sent"] >= target, timeout=60, what=what, processes=procs, every=0.01)
    return time.monotonic() - started


def kill(node: TcpProxy) -> None:
    """The node dies: connections through it are cut and new ones refused."""
    node.refuse()
    node.cut()


def test_a_node_dies_mid_drain_and_the_relay_goes_on_through_the_other(broker, procs, record):
    """Node A dies while the relay drains a backlog: the batches in flight are
    settled (confirmed rows SENT, the rest released without an attempt), the relay goes on
    through node B within seconds. Then A comes back and B dies: every node has failed in
    this round, so the relay pauses with its backoff once and goes on through A. Every event
    arrives, none is SENT without a confirm, no attempt is counted."""
    broker.bind_all()
    node_a, url_a = TcpProxy.for_url(broker.url)
    node_b, url_b = TcpProxy.for_url(broker.url)
    try:
        emit(3000)
        # The form an environment variable gives: one string, ';' between the URLs.
        relay = procs.relay("--batch-size", "25", name="relay", BROKER_URL=f"{url_a};{url_b}")
        progress(300, what="draining through A", procs=procs)
        through_b = node_b.downstream_bytes
        kill(node_a)  # batches are in flight: the backlog is far from drained
        to_b = progress(300, what="failing over to B", procs=procs)
        assert node_b.downstream_bytes > through_b, "B carried nothing"
        emit(3000)
        progress(300, what="draining through B", procs=procs)
        node_a.allow()
        kill(node_b)
        to_a = progress(300, what="failing over back to A", procs=procs)
        node_b.allow()
        wait_for(lambda: counts()["sent"] == 6000, timeout=60, what="the rest", processes=procs)
        assert relay.stop() == 0, relay.tail()
    finally:
        node_a.close()
        node_b.close()
    log = relay.stderr()
    assert f"failing over to {mask_url(url_b)} (node 2 of 2)" in log
    assert f"connected to {mask_url(url_a)} (node 1 of 2)" in log
    assert "guest:guest@" not in log
    assert "trying the next broker node at once" in log  # A died: no pause
    assert "retrying in" in log  # B died after A: a full round, the backoff's pause
    assert to_b < FAILOVER_WITHIN, f"{to_b:.1f} s to go on through B"
    assert to_a < FAILOVER_WITHIN, f"{to_a:.1f} s to go on through A"
    # No attempt counted: a node's loss is never the events' fault.
    counted = set(
        OutboxEvent.objects.filter(retry_count__gt=0).values_list("last_error", flat=True)
    )
    assert not counted, f"attempts counted, last_error: {sorted(counted)}"
    check_invariants("broker node A, then B, dies mid-drain", broker, record, crashed=True)


def test_the_first_node_down_at_start_the_relay_connects_to_the_next(broker, procs, record):
    """The first URL does not answer when the relay starts: it connects to the second at
    once and drains everything, without a pause and without counting an attempt."""
    broker.bind_all()
    node_a, url_a = TcpProxy.for_url(broker.url)
    node_b, url_b = TcpProxy.for_url(broker.url)
    kill(node_a)
    try:
        emit(500)
        started = time.monotonic()
        relay = procs.relay("--batch-size", "50", name="relay", BROKER_URL=[url_a, url_b])
        wait_for(lambda: counts()["sent"] == 500, timeout=60, what="the backlog", processes=procs)
        took = time.monotonic() - started
        assert relay.stop() == 0, relay.tail()
    finally:
        node_a.close()
        node_b.close()
    log = relay.stderr()
    assert f"cannot connect to RabbitMQ at {mask_url(url_a)} (node 1 of 2)" in log
    assert f"connected to {mask_url(url_b)} (node 2 of 2)" in log
    assert "broker unavailable" not in log
    assert took < 30, f"{took:.1f} s"
    check_invariants("first broker node down at start", broker, record, crashed=False)
