"""Redis Streams: a relay killed in the middle of a drain, and connections cut under a
running relay, lose nothing and mark nothing SENT that Redis did not answer for.

Redis keeps no message id of its own (unlike JetStream's duplicate window): what the
killed relay had had answered but not yet marked SENT is added again by the next relay once
its lease has run out (3 s here), so the stream may hold an event twice; consumers
de-duplicate by event_id (tests/test_consumer_redis.py).
"""

from __future__ import annotations

import time

import pytest
from django.db.models import Max

from django_outbox.models import OutboxEvent
from tests.utils.proxy import TcpProxy
from tests.utils.redis import RedisBroker, relay_settings

from .harness import (
    check_invariants,
    counts,
    emit,
    finish_the_drain,
    kill_a_relay_mid_drain,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.transport, pytest.mark.django_db(transaction=True)]

EVENTS = 20_000


@pytest.fixture
def broker(redis_broker: RedisBroker) -> RedisBroker:
    """The broker of ``procs`` (tests/faults/conftest.py): this test's Redis streams."""
    return redis_broker


def test_a_relay_killed_mid_drain_and_restarted_loses_nothing(redis_broker, procs, record):
    ids = emit(EVENTS)
    settings = relay_settings(redis_broker)
    kill_a_relay_mid_drain(procs, EVENTS, **settings)
    # Every row SENT at the kill is in the stream: SENT only after Redis answered.
    stored = redis_broker.collect()
    sent = OutboxEvent.objects.filter(status=1).values_list("event_id", flat=True)
    assert all(stored[event_id] for event_id in sent)

    finish_the_drain(procs, EVENTS, **settings)
    assert sorted(redis_broker.collect()) == sorted(ids)
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
    check_invariants("redis: relay kill -9 mid-drain", redis_broker, record, crashed=True)  # type: ignore[arg-type]


def test_connections_cut_mid_batch_lose_nothing_and_burn_no_retries(redis_broker, procs, record):
    """The relay's connection is cut five times while it drains (batches in flight each
    time): every row whose answer was lost is released without an attempt and published
    again; nothing is SENT without Redis' answer."""
    proxy, url = TcpProxy.for_url(redis_broker.url)
    try:
        emit(EVENTS // 2)
        relay = procs.relay(
            "--batch-size", "200", name="relay", **relay_settings(redis_broker, BROKER_URL=url)
        )
        for cut in range(5):
            wait_for(
                lambda cut=cut: counts()["sent"] >= (cut + 1) * EVENTS // 14,
                timeout=120,
                what=f"draining before cut {cut + 1}",
                processes=procs,
                every=0.005,
            )
            proxy.cut()
            time.sleep(0.05)
        wait_for(
            lambda: counts()["sent"] == EVENTS // 2,
            timeout=180,
            what="the drain after the cuts",
            processes=procs,
        )
        assert relay.stop() == 0, relay.tail()
    finally:
        proxy.close()
    assert "lost" in relay.stderr()
    assert OutboxEvent.objects.aggregate(m=Max("retry_count"))["m"] == 0
    check_invariants("redis: connection cut mid-batch x5", redis_broker, record, crashed=True)  # type: ignore[arg-type]
