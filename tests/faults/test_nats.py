"""NATS JetStream: a relay killed in the middle of a drain and another started after it
leave exactly one message in the stream per event.

JetStream drops a message whose ``Nats-Msg-Id`` it has stored within the duplicate window:
what the killed relay had had acked but not yet marked SENT is published again by the next
relay once its lease has run out (3 s here), and acked as a duplicate without being
stored. On RabbitMQ the same kill leaves duplicates in the queue (test_crashes.py).
"""

from __future__ import annotations

import pytest

from django_outbox.models import OutboxEvent
from tests.utils.nats import NatsBroker, relay_settings

from .harness import emit, finish_the_drain, kill_a_relay_mid_drain

pytestmark = [pytest.mark.slow, pytest.mark.transport, pytest.mark.django_db(transaction=True)]

EVENTS = 20_000


@pytest.fixture
def broker(nats_broker: NatsBroker) -> NatsBroker:
    """The broker of ``procs`` (tests/faults/conftest.py): this test's NATS stream."""
    return nats_broker


def test_a_relay_killed_mid_drain_and_restarted_leaves_exactly_n_messages(nats_broker, procs):
    ids = emit(EVENTS)
    settings = relay_settings(nats_broker)
    sent_at_kill = kill_a_relay_mid_drain(procs, EVENTS, **settings)
    stored_at_kill = nats_broker.count()
    # In flight when it died: acked by JetStream, not marked SENT. The next relay
    # publishes them again.
    assert stored_at_kill > sent_at_kill, (stored_at_kill, sent_at_kill)

    finish_the_drain(procs, EVENTS, **settings)
    stored = nats_broker.collect()
    assert nats_broker.count() == EVENTS
    assert sorted(stored) == sorted(ids)
    assert set(stored.values()) == {1}
    # Nothing failed on the way: the republished events were acked (as duplicates).
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
