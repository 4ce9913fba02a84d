"""NATS JetStream: a relay killed in the middle of a drain and another started after it
leave exactly one message in the stream per event.

JetStream drops a message whose ``Nats-Msg-Id`` it has stored within the duplicate window:
what the killed relay had had acked but not yet marked SENT is published again by the next
relay once its lease has run out (3 s here), and acked as a duplicate without being
stored. On RabbitMQ the same kill leaves duplicates in the queue (test_crashes.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from django_outbox.models import OutboxEvent
from tests.utils.nats import NatsBroker, relay_settings

from .harness import Processes, counts, emit, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.transport, pytest.mark.django_db(transaction=True)]

EVENTS = 20_000


@pytest.fixture
def nats_procs(tmp_path: Path, nats_broker: NatsBroker) -> Any:
    p = Processes(tmp_path, nats_broker)  # type: ignore[arg-type]  # its url and exchange
    yield p
    p.cleanup()


def test_a_relay_killed_mid_drain_and_restarted_leaves_exactly_n_messages(nats_broker, nats_procs):
    ids = emit(EVENTS)
    settings = relay_settings(nats_broker)
    relay = nats_procs.relay("--batch-size", "200", name="relay-1", **settings)
    wait_for(
        lambda: counts()["sent"] >= EVENTS // 4,
        timeout=120,
        what="the first relay draining",
        processes=nats_procs,
        every=0.005,
    )
    relay.kill9()
    sent_at_kill = counts()["sent"]
    stored_at_kill = nats_broker.count()
    # In flight when it died: acked by JetStream, not marked SENT. The next relay
    # publishes them again.
    assert stored_at_kill > sent_at_kill, (stored_at_kill, sent_at_kill)
    assert sent_at_kill < EVENTS

    again = nats_procs.relay(name="relay-2", **settings)
    wait_for(
        lambda: counts()["sent"] == EVENTS,
        timeout=180,
        what="the second relay finishing the drain",
        processes=nats_procs,
    )
    assert again.stop() == 0, again.tail()

    stored = nats_broker.collect()
    assert nats_broker.count() == EVENTS
    assert sorted(stored) == sorted(ids)
    assert set(stored.values()) == {1}
    # Nothing failed on the way: the republished events were acked (as duplicates).
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
