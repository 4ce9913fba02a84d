"""Relays that die, freeze or are told to stop: nothing committed is lost, nothing is faked.

Duplicates are allowed only where a relay crashed or froze past its lease: what it had
published but not yet settled is published again by whoever takes the rows over.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest

from django_outbox.db import DbNow
from django_outbox.models import OutboxEvent, Status
from tests.utils.proxy import TcpProxy

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


def test_kill_9_around_settle_with_delete_on_confirm_loses_nothing(broker, procs, record):
    """OUTBOX_RETENTION_DAYS = 0: the settle deletes the rows the broker confirmed. Relays
    killed with SIGKILL at a random point of their drain (between confirm and settle among
    them), then one that is not: every committed event reached the broker, no row is left."""
    broker.bind_all()
    seed = int(os.environ.get("FAULTS_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    emitted: list[str] = []
    mid_batch = 0
    for round_ in range(KILLS):
        backlog = OutboxEvent.objects.count()
        if backlog < 400:
            emitted += emit(400 - backlog + rng.randrange(200))
        target = OutboxEvent.objects.count() - rng.randrange(1, 150)
        relay = procs.relay(
            "--batch-size",
            str(rng.choice([10, 50, 100])),
            name=f"kill-{round_}",
            RETENTION_DAYS=0,
        )
        wait_for(
            lambda: OutboxEvent.objects.count() <= target,  # noqa: B023 (within this round)
            timeout=60,
            what=f"relay {round_} to make progress (seed {seed})",
            processes=procs,
            every=0.01,
        )
        relay.kill9()
        mid_batch += counts()["leased"] > 0
    assert mid_batch, f"no kill landed mid-batch in {KILLS} tries (seed {seed})"
    survivor = procs.relay(name="survivor", RETENTION_DAYS=0)
    wait_for(
        lambda: not OutboxEvent.objects.exists(),
        timeout=60,
        what="the survivor to drain",
        processes=procs,
    )
    assert survivor.stop() == 0, procs.tails()
    check_invariants(
        f"delete on confirm, kill -9 x{KILLS} mid-drain, restart ({mid_batch} mid-batch, "
        f"seed {seed})",
        broker,
        record,
        crashed=True,
        emitted=emitted,
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
    assert all(run["found"] <= 500 for run in runs), runs
    check_invariants(
        f"relay killed, compensate_outbox alone ({len(runs)} runs)", broker, record, crashed=True
    )


@dataclass
class Held:
    """What a relay waiting for confirms holds: the batches it published (two in flight),
    and the next one, claimed ahead while those are confirmed (not published)."""

    published: set[str]
    ahead: set[str]

    @property
    def all(self) -> set[str]:
        return self.published | self.ahead


WAITING_BACKLOG = 400  # the waiting relay holds 300 (three batches of 100); 100 are free


def _leased_by_a_waiting_relay(proxied, procs, *, relay_args=(), **outbox_settings):
    """A relay holding published batches whose confirms the proxy holds back.

    The relay first delivers one event (so it is connected), then the proxy stops passing
    the broker's answers and 400 events are committed: the relay claims batches, writes two
    to the broker (the messages do reach the queue), claims a third ahead and waits for
    confirms.
    """
    tcp, url = proxied
    emit(1)
    relay = procs.relay(
        "--batch-size", "100", *relay_args, name="waiting", BROKER_URL=url, **outbox_settings
    )
    wait_for(lambda: counts()["sent"] == 1, timeout=60, what="relay connected", processes=procs)
    tcp.pause()
    emit(WAITING_BACKLOG)
    wait_for(lambda: counts()["leased"] == 300, timeout=30, what="three claims", processes=procs)
    time.sleep(0.3)  # the claimed batches are written to the socket right after the claim
    claims: dict[str, set[str]] = {}
    leased = OutboxEvent.objects.pending().exclude(lease_token="").order_by("id")
    for token, event_id in leased.values_list("lease_token", "event_id"):
        claims.setdefault(token, set()).add(event_id)
    first, second, ahead = claims.values()  # in id order: the first two are published
    return relay, Held(published=first | second, ahead=ahead)


def leases(event_ids: set[str]) -> list[str]:
    """The lease tokens the rows are held under ('' for none)."""
    return list(
        OutboxEvent.objects.filter(event_id__in=event_ids).values_list("lease_token", flat=True)
    )


@pytest.mark.parametrize("freeze", ["confirms in hand", "confirm wait expired"])
def test_sigstop_past_the_lease_then_sigcont_changes_nothing(
    broker, proxied, procs, record, freeze
):
    """Relay A is frozen (SIGSTOP) with a batch in flight and the next claimed ahead. Once
    its lease has run out relay B claims those rows and is itself waiting for their
    confirms when A is resumed (SIGCONT) and settles its stale batch: that must change no
    row, B's claim included.

    "confirms in hand": A's confirm timeout is longer than the freeze (hence --skip-checks:
    the system check rightly wants the lease longer than the confirm timeout), so A finds
    its confirms on resuming and tries to mark the rows SENT, as after a GC pause between
    the confirms and the settle. "confirm wait expired": the default timings; A's wait has
    run out, so it tries to count a failed attempt against each row.
    """
    broker.bind_all()
    tcp_a, _ = proxied
    # A 6 s lease: B starts and delivers the rows A did not claim before A's lease ends.
    options: dict[str, Any] = {"LEASE_SECONDS": 6.0}
    if freeze == "confirms in hand":
        options.update(relay_args=("--skip-checks",), CONFIRM_TIMEOUT=60.0)
    frozen, held = _leased_by_a_waiting_relay(proxied, procs, **options)
    frozen.signal(signal.SIGSTOP)
    tcp_a.resume()  # A's confirms now wait in its socket
    batch = held.all
    tokens_a = set(leases(batch))
    assert len(tokens_a) == 3
    tcp_b, url_b = TcpProxy.for_url(broker.url)
    try:
        taker = procs.relay(
            "--batch-size",
            "500",
            name="taker",
            BROKER_URL=url_b,
            LEASE_SECONDS=20.0,
            CONFIRM_TIMEOUT=10.0,
        )
        # B delivers what A had not claimed, then is held waiting for confirms of A's rows.
        wait_for(
            lambda: counts()["sent"] == 101, timeout=60, what="B's first pass", processes=procs
        )
        tcp_b.pause()
        # A's three claims run out a few milliseconds apart: B is frozen until all have, so
        # it takes them in one claim (batch 500) rather than time out on them one by one.
        taker.signal(signal.SIGSTOP)
        wait_for(
            lambda: OutboxEvent.objects.filter(event_id__in=batch).due().count() == len(batch),
            timeout=30,
            what="A's leases to run out",
            processes=procs,
        )
        taker.signal(signal.SIGCONT)
        wait_for(
            lambda: "" not in (now := set(leases(batch))) and not now & tokens_a,
            timeout=30,
            what="B to take A's rows over",
            processes=procs,
        )
        before = snapshot()
        passes = frozen.stderr().count("] found=")
        frozen.signal(signal.SIGCONT)
        wait_for(
            lambda: frozen.stderr().count("] found=") > passes,
            timeout=30,
            what="A to settle its stale batch",
            processes=procs,
        )
        assert snapshot() == before, "the resumed relay changed rows another relay holds"
        if freeze == "confirms in hand":
            assert "taken over by another relay" in frozen.stderr()
        tcp_b.resume()
        wait_for(lambda: counts()["sent"] == 401, timeout=30, what="B's settle", processes=procs)
        assert frozen.stop() == 0, frozen.tail()
        assert taker.stop() == 0, taker.tail()
    finally:
        tcp_b.close()
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
    verdict = check_invariants(
        f"SIGSTOP past the lease, takeover, SIGCONT ({freeze})", broker, record, crashed=True
    )
    # Only A's published batches went out twice (they had reached the broker before the
    # freeze); the batch A claimed ahead was given back unpublished when it resumed.
    assert verdict.duplicates <= len(held.published)


def test_sigterm_with_confirms_outstanding_exits_0_and_settles(broker, proxied, procs, record):
    """SIGTERM while a batch waits for confirms: they are awaited, settled, then exit 0."""
    broker.bind_all()
    tcp, _ = proxied
    # A roomy confirm timeout: the confirms must come in time even on a loaded machine.
    relay, held = _leased_by_a_waiting_relay(
        proxied, procs, LEASE_SECONDS=20.0, CONFIRM_TIMEOUT=10.0
    )
    relay.signal(signal.SIGTERM)
    time.sleep(0.5)
    assert relay.alive(), "the relay exited without waiting for its confirms"
    tcp.resume()
    assert relay.wait(30) == 0, relay.tail()
    sent = set(OutboxEvent.objects.sent().values_list("event_id", flat=True))
    assert held.published <= sent, "a confirmed row of the batch in flight is not SENT"
    assert not held.ahead & sent, "the batch claimed ahead was published after SIGTERM"
    # No row stuck under a dead claim: what was not sent is due now, with no attempt lost.
    stuck = OutboxEvent.objects.pending().exclude(lease_token="")
    assert not stuck.exists()
    assert not OutboxEvent.objects.leased().exists()
    assert not OutboxEvent.objects.pending().filter(next_retry_time__gt=DbNow()).exists()
    assert not OutboxEvent.objects.exclude(retry_count=0).exists()
    assert set(broker.collect()) == sent  # confirmed <=> SENT, before anything else runs
    rest = procs.run("publish_outbox", "--once", name="rest")
    assert rest.popen.returncode == 0, rest.tail()
    assert OutboxEvent.objects.filter(status=Status.SENT).count() == 401
    check_invariants("SIGTERM with confirms outstanding", broker, record, crashed=False)


def test_second_sigterm_exits_1_and_the_batch_comes_back(broker, proxied, procs, record):
    """A second SIGTERM does not wait for the confirms: exit 1, the batch stays claimed
    until its lease runs out, then another relay delivers it."""
    broker.bind_all()
    tcp, _ = proxied
    relay, held = _leased_by_a_waiting_relay(proxied, procs)
    relay.signal(signal.SIGTERM)
    time.sleep(0.3)
    relay.signal(signal.SIGTERM)
    assert relay.wait(30) == 1, relay.tail()
    tcp.resume()
    assert not OutboxEvent.objects.filter(event_id__in=held.all).exclude(status=Status.PENDING)
    rest = procs.relay(name="rest")
    wait_for(lambda: counts()["sent"] == 401, timeout=30, what="the rest", processes=procs)
    assert rest.stop() == 0, rest.tail()
    check_invariants("second SIGTERM with confirms outstanding", broker, record, crashed=True)
