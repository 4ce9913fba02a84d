"""Several relays, and the compensator, over the same rows: each event is published once."""

from __future__ import annotations

import time

import pytest

from .harness import check_invariants, counts, emit, wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_two_relays_publish_each_of_5000_events_exactly_once(broker, procs, record, tmp_path):
    broker.bind_all()
    beats = [tmp_path / "a.beat", tmp_path / "b.beat"]
    relays = [
        procs.relay("--heartbeat-file", str(beat), name=f"relay-{n}")
        for n, beat in zip("ab", beats, strict=True)
    ]
    # Both relays are up and polling before the events commit, so both get work.
    wait_for(
        lambda: all(b.exists() for b in beats), timeout=60, what="both relays", processes=procs
    )
    emit(5000)
    wait_for(lambda: counts()["sent"] == 5000, timeout=90, what="5000 SENT", processes=procs)
    assert [relay.stop() for relay in relays] == [0, 0], procs.tails()
    sent = [relay.summary()["sent"] for relay in relays]
    assert sum(sent) == 5000
    assert all(n > 0 for n in sent), f"one relay did all the work: {sent}"
    check_invariants("two relays, 5000 events, exactly once", broker, record, crashed=False)


def test_two_relays_and_the_compensator_together(broker, procs, record):
    """Two relays and overlapping compensate_outbox runs over a backlog of 3000 rows while
    1000 more are committed: nobody crashes, so every event goes out exactly once."""
    broker.bind_all()
    emit(3000)
    relays = [procs.relay("--batch-size", "20", name=f"relay-{n}") for n in "ab"]
    compensators = []
    produced = 0
    deadline = time.monotonic() + 90
    while counts()["sent"] < 4000 and time.monotonic() < deadline:
        if produced < 1000:
            emit(250)
            produced += 250
        # Two at once, as when a CronJob run overlaps the previous one by accident.
        pair = [
            procs.start("compensate_outbox", "--stale-after", "100ms", "--max-batch", "300")
            for _ in range(2)
        ]
        for child in pair:
            assert child.wait(60) == 0, child.tail()
            compensators.append(child.summary()["sent"])
    assert counts()["sent"] == 4000, procs.tails()
    assert [relay.stop() for relay in relays] == [0, 0], procs.tails()
    sent = [relay.summary()["sent"] for relay in relays]
    assert sum(sent) + sum(compensators) == 4000
    check_invariants(
        f"2 relays ({sent[0]}+{sent[1]}) + compensators ({sum(compensators)} in "
        f"{len(compensators)} runs)",
        broker,
        record,
        crashed=False,
    )
