"""Ordered runs (OUTBOX_ORDERED_RUN): a claim takes a head with the next events of its
aggregate, and the relay publishes each only after the previous one's confirm. Every
database; tests/test_ordered_relays.py runs them across relays over RabbitMQ."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from django_outbox.backends import locmem
from django_outbox.backends.base import PublishResult, Reason
from django_outbox.db import db_now
from django_outbox.models import OutboxEvent, Status
from django_outbox.relay import runs
from django_outbox.relay.batch import Batch
from tests.utils.relay import make_relay
from tests.utils.rows import expire_leases, make_events

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _ordered(settings: Any) -> None:
    settings.OUTBOX_ORDERED = True
    locmem.reset()


def rows(*specs: tuple[str, str] | dict[str, Any]) -> list[OutboxEvent]:
    return make_events(*specs, event_type="E", payload={}, due_age=1)


def hot(count: int, aggregate: str = "a", **fields: Any) -> list[OutboxEvent]:
    return rows(*({"aggregate_type": "O", "aggregate_id": aggregate, **fields},) * count)


def claim(limit: int = 100, run: int = 100, **kwargs: Any) -> list[OutboxEvent]:
    kwargs.setdefault("ordered", True)
    _token, claimed = OutboxEvent.objects.due().claim(limit, lease_seconds=60, run=run, **kwargs)
    return claimed


def ids(claimed: Sequence[OutboxEvent]) -> list[int]:
    return [row.pk for row in claimed]


# -- the claim ---------------------------------------------------------------------------------
def test_a_head_brings_its_run_leased_under_the_same_token_with_chained_sequences():
    made = hot(4)
    other = rows(("O", "b"))[0]
    claimed = claim()
    assert ids(claimed) == sorted([*ids(made), other.pk])
    assert len({row.lease_token for row in claimed}) == 1
    by_id = {row.pk: row for row in claimed}
    # The head: the last SENT before it (none); each follower: the event before it.
    assert [by_id[r.pk].previous_sequence for r in made] == [0, *ids(made)[:3]]
    assert [by_id[r.pk].run_follows for r in made] == [None, *ids(made)[:3]]
    leased = OutboxEvent.objects.filter(pk__in=ids(made), lease_token=claimed[0].lease_token)
    assert leased.count() == 4
    assert claim() == []  # all leased


def test_run_1_is_heads_only_and_the_run_is_capped():
    made = hot(5)
    assert ids(claim(run=1)) == [made[0].pk]
    expire_leases()
    assert ids(claim(run=3)) == ids(made[:3])


def test_runs_only_fill_the_room_the_heads_leave():
    a = hot(5, "a")
    b = hot(5, "b")
    # Two heads, room for two more: the oldest followers, by id, in run order.
    claimed = claim(limit=4)
    assert ids(claimed) == sorted([a[0].pk, b[0].pk, a[1].pk, a[2].pk])


def test_a_run_stops_before_an_event_that_is_not_due():
    made = hot(4)
    OutboxEvent.objects.filter(pk=made[2].pk).update(
        next_retry_time=db_now() + timedelta(seconds=30)
    )
    assert ids(claim()) == ids(made[:2])


def test_a_run_stops_before_a_dead_event_unless_dead_heads_are_skipped():
    made = hot(4)
    OutboxEvent.objects.filter(pk=made[2].pk).update(status=Status.DEAD)
    assert ids(claim()) == ids(made[:2])
    expire_leases()
    claimed = claim(dead_head="skip")
    assert ids(claimed) == [made[0].pk, made[1].pk, made[3].pk]
    # A skipped DEAD event was never delivered: the one after it follows the one before.
    assert claimed[2].previous_sequence == made[1].pk


def test_no_run_behind_a_head_that_is_not_claimed():
    made = hot(3)
    OutboxEvent.objects.filter(pk=made[0].pk).update(
        next_retry_time=db_now() + timedelta(seconds=30)
    )
    assert claim() == []


def test_unordered_events_bring_no_run():
    made = rows(*({"aggregate_type": "O", "aggregate_id": "a", "event_type": "N"},) * 3)
    claimed = claim(ordered=["E"])
    assert ids(claimed) == ids(made)
    assert {(row.run_follows, row.previous_sequence) for row in claimed} == {(None, None)}


def test_the_compensator_takes_stale_followers_only():
    old = make_events(*({"aggregate_id": "a", "age": 3600},) * 2, event_type="E", payload={})
    make_events({"aggregate_id": "a", "age": 0}, event_type="E", payload={})
    _token, claimed = (
        OutboxEvent.objects.due().stale(600).claim(100, lease_seconds=60, run=100, ordered=True)
    )
    assert ids(claimed) == ids(old)


def test_a_claim_after_confirmed_rows_continues_their_runs():
    made = hot(6)
    first = claim(run=3)
    assert ids(first) == ids(made[:3])
    # made[2] confirmed (not settled yet: still PENDING under the first lease).
    _token, more = OutboxEvent.objects.due().claim(
        100, lease_seconds=60, run=3, ordered=True, after=[first[-1]]
    )
    assert ids(more) == ids(made[3:6])
    assert [row.run_follows for row in more] == ids(made[2:5])
    assert [row.previous_sequence for row in more] == ids(made[2:5])


def test_a_claim_without_heads_only_continues_the_runs_behind_after():
    made = hot(6)
    first = claim(run=3)
    waiting = [*rows(("O", "b")), *rows({"aggregate_id": ""})]  # a head, an unordered event
    _token, more = OutboxEvent.objects.due().claim(
        100, lease_seconds=60, run=3, ordered=True, after=[first[-1]], heads=False
    )
    assert ids(more) == ids(made[3:6])
    assert ids(claim()) == ids(waiting)  # left due for a claim that looks for heads


def test_a_claim_without_heads_and_nothing_to_continue_takes_nothing():
    hot(2)
    _token, claimed = OutboxEvent.objects.due().claim(
        100, lease_seconds=60, run=3, ordered=True, heads=False
    )
    assert claimed == []
    assert OutboxEvent.objects.leased().count() == 0


# -- the relay ---------------------------------------------------------------------------------
class Recording(locmem.LocmemBackend):
    """Locmem that records every send (one list per part) and fails the events whose
    payload says so: ``{"fail": "unroutable" | "nacked" | "timeout"}``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sends: list[list[int]] = []

    def send(self, events: Sequence[OutboxEvent]) -> None:
        self.sends.append([event.pk for event in events])
        super().send(events)

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        results = []
        for event in events:
            fail = event.payload.get("fail") if isinstance(event.payload, dict) else None
            if fail:
                results.append(PublishResult.failed(Reason(fail), f"test: {fail}"))
            else:
                results.extend(super().publish([event]))
        return results


def published() -> list[int]:
    by_event_id = dict(OutboxEvent.objects.values_list("event_id", "pk"))
    return [by_event_id[m.message_id] for m in locmem.outbox]


def test_a_hot_aggregate_drains_in_few_batches_one_event_per_send_in_order():
    made = hot(250)
    backend = Recording()
    result = make_relay(backend=backend, batch_size=100, db_thread=False).drain()
    assert result.sent == 250
    assert published() == ids(made)
    # Each event was sent on its own, after the one before it was confirmed.
    assert backend.sends == [[pk] for pk in ids(made)]
    assert result.batches <= 4
    headers = [m.headers["previous_sequence"] for m in locmem.outbox]
    assert headers == [0, *ids(made)[:-1]]


class WritesOnFirstSend(Recording):
    """Recording that writes one unordered event while its first batch is out."""

    written: OutboxEvent | None = None

    def send(self, events: Sequence[OutboxEvent]) -> None:
        if self.written is None:
            (self.written,) = rows({"aggregate_id": ""})
        super().send(events)


@pytest.mark.parametrize("searched", [True, False])
def test_claims_behind_runs_look_for_new_heads_at_most_every_heads_every(monkeypatch, searched):
    # HEADS_EVERY 0 and the whole lane: every claim behind a run looks for heads; an hour:
    # none does, and an event written meanwhile waits for the claim after the runs end.
    monkeypatch.setattr(runs, "HEADS_EVERY", 0.0 if searched else 3600.0)
    monkeypatch.setattr(runs, "HEADS_SHARE", 1.0)
    made = hot(250)
    backend = WritesOnFirstSend()
    result = make_relay(backend=backend, batch_size=100, db_thread=False).drain()
    assert result.sent == 251
    order = published()
    assert [pk for pk in order if pk != backend.written.pk] == ids(made)
    if searched:  # taken by the claim behind the first batch's run
        assert 100 <= order.index(backend.written.pk) <= 101
    else:
        assert order[-1] == backend.written.pk


def test_the_search_for_heads_takes_at_most_its_share_of_the_claims_lane(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(runs.time, "monotonic", lambda: clock[0])
    search = runs.HeadSearch()
    assert search.due()  # never searched
    with search.timed():
        clock[0] += 0.01
    assert (search.searched_at, search.cost) == pytest.approx((1000.01, 0.01))
    assert not search.due()
    clock[0] += runs.HEADS_EVERY
    assert search.due()
    # A search that took 0.3 s (a large backlog): the next one at least 0.9 s later.
    search.searched_at, search.cost = clock[0], 0.3
    clock[0] += 0.89
    assert not search.due()
    clock[0] += 0.02
    assert search.due()


@pytest.mark.parametrize("reason", ["unroutable", "nacked", "timeout"])
def test_a_failed_event_holds_back_the_rest_of_its_run_only(reason):
    a = hot(2, "a") + hot(1, "a", payload={"fail": reason}) + hot(3, "a")
    b = hot(3, "b")
    backend = Recording()
    result = make_relay(backend=backend, batch_size=100, db_thread=False).drain()
    # Nothing behind the failed event reached the broker; the other aggregate went on,
    # its run interleaved with the first one's, each in order.
    assert published() == [a[0].pk, b[0].pk, a[1].pk, b[1].pk, b[2].pk]
    failed = OutboxEvent.objects.get(pk=a[2].pk)
    assert (failed.status, failed.retry_count) == (Status.PENDING, 1)
    assert failed.last_error.startswith(f"[{reason}]")
    behind = OutboxEvent.objects.filter(pk__in=ids(a[3:]))
    # Given back without an attempt: no retry counted, no error, no lease.
    assert {(r.status, r.retry_count, r.last_error, r.lease_token) for r in behind} == {
        (Status.PENDING, 0, "", "")
    }
    assert (result.held_back, result.released, result.lost) == (3, 3, 0)
    assert (result.found, result.sent, result.failed, result.dead) == (9, 5, 1, 0)
    # Once the failed event is due again, it goes first and its run follows it.
    OutboxEvent.objects.filter(pk=a[2].pk).update(
        next_retry_time=db_now() - timedelta(seconds=1), payload={}
    )
    locmem.outbox.clear()
    assert make_relay(backend=Recording(), db_thread=False).drain().sent == 4
    assert published() == ids(a[2:])


def test_a_lost_connection_mid_run_releases_the_rest_and_raises_the_outage():
    from django_outbox.relay.batch import BrokerOutage

    made = hot(2) + hot(1, payload={"fail": "connection_lost"}) + hot(2)
    with pytest.raises(BrokerOutage) as outage:
        make_relay(backend=Recording(), db_thread=False).drain()
    # The rest of the run is lost with the connection, not held back.
    assert (outage.value.result.released, outage.value.result.held_back) == (3, 0)
    assert published() == ids(made[:2])
    assert OutboxEvent.objects.sent().count() == 2
    rest = OutboxEvent.objects.filter(pk__in=ids(made[2:]))
    assert {(r.status, r.retry_count, r.lease_token) for r in rest} == {(Status.PENDING, 0, "")}


def test_a_run_whose_lease_runs_short_gives_the_rest_back():
    made = hot(5)
    relay = make_relay(backend=Recording(), db_thread=False)
    sends = 0
    covers = relay.lease_covers_a_send

    def two_sends_only(batch: Batch) -> bool:
        nonlocal sends
        sends += 1
        return sends <= 2 and covers(batch)

    relay.lease_covers_a_send = two_sends_only  # type: ignore[method-assign]
    result = relay.relay_batch()
    assert published() == ids(made[:3])  # the first wave, then two more
    assert (result.sent, result.held_back, result.released, result.failed) == (3, 2, 2, 0)
    given_back = OutboxEvent.objects.filter(pk__in=ids(made[3:]), lease_token="")
    assert given_back.filter(leased_until__isnull=True).count() == 2


def test_a_batch_claimed_behind_an_unconfirmed_event_is_given_back_unsent():
    made = hot(4)
    relay = make_relay(backend=Recording(), db_thread=False)
    first = relay.claim(2)  # the head and one follower
    assert ids(first.rows) == ids(made[:2])
    behind = relay.claim(10, after=first.rows[-1:])
    assert ids(behind.rows) == ids(made[2:])
    # made[1] was not confirmed (failed, or its batch was lost): nothing behind it is sent.
    assert behind.runs is not None
    behind.runs.after_ok = frozenset()
    relay.send(behind)
    assert relay.backend.sends == []
    result = relay.settle(relay.collect(behind))
    assert (result.sent, result.held_back, result.released, result.failed) == (0, 2, 2, 0)
    assert locmem.outbox == []


@pytest.mark.parametrize("value", [0, 2.5, "10"])
def test_ordered_run_must_be_a_positive_integer(settings, value):
    from django_outbox.checks import check_positive_numbers

    settings.OUTBOX_ORDERED_RUN = value
    (error,) = check_positive_numbers()
    assert error.id == "django_outbox.E007"
    assert "OUTBOX_ORDERED_RUN" in error.msg
