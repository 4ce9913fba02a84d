"""Redis Streams: a relay killed in the middle of a drain, and connections cut under a
running relay, lose nothing and mark nothing SENT that Redis did not answer for.

Redis keeps no message id of its own (unlike JetStream's duplicate window): what the
killed relay had had answered but not yet marked SENT is added again by the next relay once
its lease has run out (3 s here), so the stream may hold an event twice; consumers
de-duplicate by event_id (tests/test_consumer_redis.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from django.db.models import Max

from django_outbox.models import OutboxEvent
from tests.utils.proxy import TcpProxy
from tests.utils.redis import RedisBroker, relay_settings

from .harness import Processes, check_invariants, counts, emit, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.transport, pytest.mark.django_db(transaction=True)]

EVENTS = 20_000


@pytest.fixture
def redis_procs(tmp_path: Path, redis_broker: RedisBroker) -> Any:
    p = Processes(tmp_path, redis_broker)  # type: ignore[arg-type]  # its url and exchange
    yield p
    p.cleanup()


def test_a_relay_killed_mid_drain_and_restarted_loses_nothing(redis_broker, redis_procs, record):
    ids = emit(EVENTS)
    settings = relay_settings(redis_broker)
    relay = redis_procs.relay("--batch-size", "200", name="relay-1", **settings)
    wait_for(
        lambda: counts()["sent"] >= EVENTS // 4,
        timeout=120,
        what="the first relay draining",
        processes=redis_procs,
        every=0.005,
    )
    relay.kill9()
    sent_at_kill = counts()["sent"]
    assert sent_at_kill < EVENTS
    # Every row SENT at the kill is in the stream: SENT only after Redis answered.
    stored = redis_broker.collect()
    sent = OutboxEvent.objects.filter(status=1).values_list("event_id", flat=True)
    assert all(stored[event_id] for event_id in sent)

    again = redis_procs.relay(name="relay-2", **settings)
    wait_for(
        lambda: counts()["sent"] == EVENTS,
        timeout=180,
        what="the second relay finishing the drain",
        processes=redis_procs,
    )
    assert again.stop() == 0, again.tail()
    assert sorted(redis_broker.collect()) == sorted(ids)
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
    check_invariants("redis: relay kill -9 mid-drain", redis_broker, record, crashed=True)  # type: ignore[arg-type]


def test_connections_cut_mid_batch_lose_nothing_and_burn_no_retries(
    redis_broker, redis_procs, record
):
    """The relay's connection is cut five times while it drains (batches in flight each
    time): every row whose answer was lost is released without an attempt and published
    again; nothing is SENT without Redis' answer."""
    proxy, url = TcpProxy.for_url(redis_broker.url)
    try:
        emit(EVENTS // 2)
        relay = redis_procs.relay(
            "--batch-size", "200", name="relay", **relay_settings(redis_broker, BROKER_URL=url)
        )
        for cut in range(5):
            wait_for(
                lambda cut=cut: counts()["sent"] >= (cut + 1) * EVENTS // 14,
                timeout=120,
                what=f"draining before cut {cut + 1}",
                processes=redis_procs,
                every=0.005,
            )
            proxy.cut()
            time.sleep(0.05)
        wait_for(
            lambda: counts()["sent"] == EVENTS // 2,
            timeout=180,
            what="the drain after the cuts",
            processes=redis_procs,
        )
        assert relay.stop() == 0, relay.tail()
    finally:
        proxy.close()
    assert "lost" in relay.stderr()
    assert OutboxEvent.objects.aggregate(m=Max("retry_count"))["m"] == 0
    check_invariants("redis: connection cut mid-batch x5", redis_broker, record, crashed=True)  # type: ignore[arg-type]
