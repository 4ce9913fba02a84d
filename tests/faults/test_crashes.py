"""Relays that die, freeze or are told to stop: nothing committed is lost, nothing is faked.

Duplicates are allowed only where a relay crashed or froze past its lease: what it had
published but not yet settled is published again by whoever takes the rows over.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from django_outbox.db import DbNow
from django_outbox.models import OutboxEvent, Status

from .harness import check_invariants, counts, emit, snapshot, wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

KILLS = 12


def test_kill_9_at_random_moments_then_restart_loses_nothing(broker, procs, record):
    """12 relays killed with SIGKILL at a random point of their drain, then one that is not."""
    broker.bind_all()
    seed = int(os.environ.get("FAULTS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    mid_batch = 0
    for round_ in range(KILLS):
        # Keep a backlog, so every relay is killed while draining, never while idle.
        backlog = counts()["pending"]
        if backlog < 400:
            emit(400 - backlog + rng.randrange(200))
        sent_before = counts()["sent"]
        target = sent_before + rng.randrange(1, 150)
        relay = procs.relay("--batch-size", str(rng.choice([10, 50, 100])), name=f"kill-{round_}")
        wait_for(
            lambda: counts()["sent"] >= target,  # noqa: B023 (called within this round)
            timeout=60,
            what=f"relay {round_} to make progress (seed {seed})",
            processes=procs,
            every=0.01,
        )
        relay.kill9()
        mid_batch += counts()["leased"] > 0
    # A kill that lands between claim and settle leaves leased rows behind: the case that
    # matters. Random kill points in a draining relay land there most of the time.
    assert mid_batch, f"no kill landed mid-batch in {KILLS} tries (seed {seed})"
    survivor = procs.relay(name="survivor")
    total = OutboxEvent.objects.count()
    wait_for(
        lambda: counts()["sent"] == total, timeout=60, what="the survivor to drain", processes=procs
    )
    assert survivor.stop() == 0, procs.tails()
    check_invariants(
        f"kill -9 x{KILLS} mid-drain, restart ({mid_batch} mid-batch, seed {seed})",
        broker,
        record,
        crashed=True,
    )


def test_relay_dead_for_good_compensator_alone_delivers_every_stale_row(broker, procs, record):
    broker.bind_all()
    emit(1500)
    relay = procs.relay("--batch-size", "50", name="doomed")
    wait_for(lambda: counts()["sent"] >= 100, timeout=60, what="relay progress", processes=procs)
    relay.kill9()
    left = counts()["pending"]
    assert left, "the relay drained everything before it was killed"
    # Nobody restarts the relay: only the CronJob runs, again and again.
    runs = []
    deadline = time.monotonic() + 90
    while counts()["pending"] and time.monotonic() < deadline:
        child = procs.run("compensate_outbox", "--stale-after", "1s", "--max-batch", "500")
        assert child.popen.returncode == 0, child.tail()
        runs.append(child.summary())
        if not runs[-1]["found"]:
            time.sleep(0.5)  # the killed relay's lease has not run out yet
    assert counts()["pending"] == 0, procs.tails()
    assert sum(run["sent"] for run in runs) == left
    assert all(run["found"] <= 500 for run in runs)
    check_invariants(
        f"relay killed, compensate_outbox alone ({len(runs)} runs)", broker, record, crashed=True
    )


def _leased_by_a_waiting_relay(proxy, procs, *, relay_args=(), **outbox_settings):
    """A relay holding one claimed batch whose confirms the proxy holds back.

    The relay first delivers one event (so it is connected), then the proxy stops passing
    the broker's answers and 300 events are committed: the relay claims a batch, writes it
    to the broker (the messages do reach the queue) and waits for confirms.
    """
    tcp, url = proxy
    emit(1)
    relay = procs.relay(
        "--batch-size", "100", *relay_args, name="waiting", BROKER_URL=url, **outbox_settings
    )
    wait_for(lambda: counts()["sent"] == 1, timeout=60, what="relay connected", processes=procs)
    tcp.pause()
    emit(300)
    wait_for(lambda: counts()["leased"] > 0, timeout=30, what="a claimed batch", processes=procs)
    time.sleep(0.3)  # the claimed batch is written to the socket right after the claim
    return relay, set(
        OutboxEvent.objects.pending().exclude(lease_token="").values_list("event_id", flat=True)
    )


def lease_expired(event_ids: set[str]) -> bool:
    return not OutboxEvent.objects.filter(
        event_id__in=event_ids, next_retry_time__gt=DbNow()
    ).exists()


def test_sigstop_past_the_lease_then_sigcont_changes_nothing(broker, proxy, procs, record):
    """A relay frozen with confirms outstanding; another relay takes its rows over.

    The frozen relay's confirm timeout is longer than the freeze (hence --skip-checks: the
    system check rightly wants the lease longer than the confirm timeout), so when it
    resumes the confirms are there and it tries to mark its batch SENT: as after a GC pause
    between the confirms and the settle. The fence must make that a no-op.
    """
    broker.bind_all()
    tcp, _ = proxy
    frozen, batch = _leased_by_a_waiting_relay(
        proxy, procs, relay_args=("--skip-checks",), CONFIRM_TIMEOUT=60.0
    )
    frozen.signal(signal.SIGSTOP)
    tcp.resume()  # the confirms now wait in the frozen relay's socket
    wait_for(lambda: lease_expired(batch), timeout=30, what="the frozen relay's lease to end")
    taker = procs.run("publish_outbox", "--once", name="taker")
    assert taker.popen.returncode == 0, taker.tail()
    assert counts()["sent"] == 301
    before = snapshot()
    frozen.signal(signal.SIGCONT)
    wait_for(
        lambda: "taken over by another relay" in frozen.stderr(),
        timeout=30,
        what="the resumed relay to settle its stale batch",
        processes=procs,
    )
    assert frozen.stop() == 0, frozen.tail()
    assert snapshot() == before
    verdict = check_invariants(
        "SIGSTOP past the lease, takeover, SIGCONT", broker, record, crashed=True
    )
    # Only the frozen relay's batch went out twice (it had reached the broker).
    assert 0 < verdict.duplicates <= len(batch)


def test_sigstop_while_awaiting_confirms_changes_nothing(broker, proxy, procs, record):
    """The same freeze with the default timings: the confirm wait has expired on resume."""
    broker.bind_all()
    tcp, _ = proxy
    frozen, batch = _leased_by_a_waiting_relay(proxy, procs)
    frozen.signal(signal.SIGSTOP)
    tcp.resume()
    wait_for(lambda: lease_expired(batch), timeout=30, what="the frozen relay's lease to end")
    taker = procs.run("publish_outbox", "--once", name="taker")
    assert taker.popen.returncode == 0, taker.tail()
    before = snapshot()
    frozen.signal(signal.SIGCONT)
    time.sleep(1.0)  # it settles its expired batch (fenced) and polls again
    assert frozen.stop() == 0, frozen.tail()
    assert snapshot() == before
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
    verdict = check_invariants(
        "SIGSTOP awaiting confirms, takeover, SIGCONT", broker, record, crashed=True
    )
    assert verdict.duplicates <= len(batch)


def test_sigterm_with_confirms_outstanding_exits_0_and_settles(broker, proxy, procs, record):
    """SIGTERM while a batch waits for confirms: they are awaited, settled, then exit 0."""
    broker.bind_all()
    tcp, _ = proxy
    # A roomy confirm timeout: the confirms must come in time even on a loaded machine.
    relay, batch = _leased_by_a_waiting_relay(
        proxy, procs, LEASE_SECONDS=20.0, CONFIRM_TIMEOUT=10.0
    )
    relay.signal(signal.SIGTERM)
    time.sleep(0.5)
    assert relay.alive(), "the relay exited without waiting for its confirms"
    tcp.resume()
    assert relay.wait(30) == 0, relay.tail()
    sent = set(OutboxEvent.objects.sent().values_list("event_id", flat=True))
    assert batch <= sent, "a confirmed row of the batch in flight is not SENT"
    # No row stuck under a dead claim: what was not sent is due now, with no attempt lost.
    stuck = OutboxEvent.objects.pending().exclude(lease_token="")
    assert not stuck.exists()
    assert not OutboxEvent.objects.pending().filter(next_retry_time__gt=DbNow()).exists()
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
    assert set(broker.collect()) == sent  # confirmed <=> SENT, before anything else runs
    rest = procs.run("publish_outbox", "--once", name="rest")
    assert rest.popen.returncode == 0, rest.tail()
    assert OutboxEvent.objects.filter(status=Status.SENT).count() == 301
    check_invariants("SIGTERM with confirms outstanding", broker, record, crashed=False)


def test_second_sigterm_exits_1_and_the_batch_comes_back(broker, proxy, procs, record):
    """A second SIGTERM does not wait for the confirms: exit 1, the batch stays claimed
    until its lease runs out, then another relay delivers it."""
    broker.bind_all()
    tcp, _ = proxy
    relay, batch = _leased_by_a_waiting_relay(proxy, procs)
    relay.signal(signal.SIGTERM)
    time.sleep(0.3)
    relay.signal(signal.SIGTERM)
    assert relay.wait(30) == 1, relay.tail()
    tcp.resume()
    assert not OutboxEvent.objects.filter(event_id__in=batch).exclude(status=Status.PENDING)
    rest = procs.relay(name="rest")
    wait_for(lambda: counts()["sent"] == 301, timeout=30, what="the rest", processes=procs)
    assert rest.stop() == 0, rest.tail()
    check_invariants("second SIGTERM with confirms outstanding", broker, record, crashed=True)
