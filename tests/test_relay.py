"""The relay engine over the in-memory backend: claim, lease, settle, retry, DEAD, fencing."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_outbox import outbox
from django_outbox.backends import locmem
from django_outbox.backends.base import BrokerUnavailable, PublishResult, Reason
from django_outbox.models import OutboxEvent, Status
from django_outbox.querysets import CLAIM_FIELDS
from django_outbox.relay import BrokerOutage, Stage
from django_outbox.relay.wake import Waker
from django_outbox.retry import FixedRetryPolicy, ScheduleRetryPolicy
from tests.utils.relay import make_relay
from tests.utils.rows import expire_leases
from tests.utils.threads import db_thread
from tests.utils.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def emit_many(n: int, event_type: str = "E") -> list[OutboxEvent]:
    with outbox.atomic() as box:
        for i in range(n):
            box.emit(event_type, aggregate_type="T", aggregate_id=str(i), payload={"i": i})
        events = list(box.events)
    return events


def test_drain_publishes_in_id_order_and_marks_sent():
    emit_many(250)
    result = make_relay(batch_size=100).drain()
    assert (result.found, result.sent, result.failed, result.batches) == (250, 250, 0, 3)
    assert OutboxEvent.objects.sent().count() == 250
    assert [m.headers["sequence"] for m in locmem.outbox] == sorted(
        OutboxEvent.objects.values_list("id", flat=True)
    )
    event = OutboxEvent.objects.order_by("id").first()
    assert event.sent_at is not None and event.lease_token == ""


def test_message_carries_the_wire_format():
    with outbox.atomic() as box:
        box.emit(
            "ORDER_CREATED",
            aggregate_type="ORDER",
            aggregate_id="42",
            payload={"a": 1},
            headers={"trace": "t"},
        )
    make_relay().drain()
    (message,) = locmem.outbox
    event = OutboxEvent.objects.get()
    assert message.message_id == event.event_id
    assert message.routing_key == "ORDER_CREATED"
    assert message.body == b'{"a":1}'
    assert message.headers == {
        "trace": "t",
        "aggregate_type": "ORDER",
        "aggregate_id": "42",
        "occurred_at": event.occurred_at.isoformat(),
        "attempt": 1,
        "sequence": event.pk,
    }


def test_routing_key_map_and_func(settings):
    settings.OUTBOX_ROUTING_KEYS = {"A": "orders.a"}
    emit_many(1, "A")
    emit_many(1, "B")
    make_relay().drain()
    assert [m.routing_key for m in locmem.outbox] == ["orders.a", "B"]


def test_claim_leases_rows_so_a_second_claim_skips_them():
    emit_many(10)
    qs = OutboxEvent.objects.due()
    token, rows = qs.claim(6, lease_seconds=60)
    assert len(rows) == 6
    assert OutboxEvent.objects.due().count() == 4
    _, others = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    assert {r.pk for r in rows}.isdisjoint({r.pk for r in others})
    assert OutboxEvent.objects.held_by(token).count() == 6


def test_claim_locks_and_leases_in_one_transaction():
    """PostgreSQL: one UPDATE ... RETURNING; elsewhere a locking SELECT, then an UPDATE."""
    emit_many(5)
    with CaptureQueriesContext(connection) as queries:
        token, rows = OutboxEvent.objects.due().claim(5, lease_seconds=60)
    assert [r.pk for r in rows] == sorted(OutboxEvent.objects.values_list("pk", flat=True))
    assert [r.payload for r in rows] == [{"i": i} for i in range(5)]
    assert all(r.lease_token == token for r in rows)
    sql = [q["sql"].upper() for q in queries.captured_queries]
    selects = [s for s in sql if s.startswith("SELECT")]
    updates = [s for s in sql if s.startswith("UPDATE")]
    if connection.vendor == "postgresql":
        assert not selects and len(updates) == 1
        assert "RETURNING" in updates[0] and "SKIP LOCKED" in updates[0]
    else:
        assert len(selects) == 1 and len(updates) == 1
        if connection.vendor != "sqlite":
            assert "SKIP LOCKED" in selects[0]


def test_failed_publish_follows_the_schedule_then_dead(settings):
    settings.OUTBOX_RETRY_SCHEDULE = [1, 5]
    emit_many(1)
    relay = make_relay()
    row = OutboxEvent.objects.get()
    for attempt, delay in [(1, 1), (2, 5)]:
        OutboxEvent.objects.update(next_retry_time=timezone.now() - timedelta(seconds=1))
        locmem.fail_next.append(Reason.NACKED)
        before = timezone.now()
        result = relay.drain()
        assert result.failed == 1 and result.dead == 0
        row.refresh_from_db()
        assert row.status == Status.PENDING
        assert row.retry_count == attempt
        assert "[nacked]" in row.last_error
        assert row.lease_token == ""
        assert before + timedelta(seconds=delay - 1) < row.next_retry_time
        assert row.next_retry_time < before + timedelta(seconds=delay + 2)
    OutboxEvent.objects.update(next_retry_time=timezone.now() - timedelta(seconds=1))
    locmem.fail_next.append(Reason.UNROUTABLE)
    result = relay.drain()
    assert result.dead == 1
    row.refresh_from_db()
    assert row.status == Status.DEAD and row.retry_count == 3
    assert "[unroutable]" in row.last_error
    assert locmem.outbox == []


def test_dead_letters_alert_once_per_pass(caplog, settings):
    settings.OUTBOX_RETRY_SCHEDULE = [1]
    emit_many(3)
    OutboxEvent.objects.update(retry_count=1)
    locmem.fail_next.extend([Reason.NACKED] * 3)
    with caplog.at_level("ERROR", logger="django_outbox.alerts"):
        result = make_relay().drain()
    assert result.dead == 3
    alerts = [r for r in caplog.records if r.name == "django_outbox.alerts"]
    assert len(alerts) == 1
    for event in OutboxEvent.objects.all():
        assert event.event_id in alerts[0].getMessage()


def test_default_schedule_is_the_articles():
    policy = ScheduleRetryPolicy.from_settings()
    assert [policy.delay_after(n) for n in range(1, 9)] == [
        1,
        5,
        30,
        120,
        900,
        3600,
        21600,
        None,
    ]
    fixed = FixedRetryPolicy.compensation()
    assert fixed.delay_after(10) == 60 and fixed.delay_after(11) is None


def test_broker_unavailable_releases_rows_without_counting_an_attempt():
    emit_many(3)
    locmem.unavailable = True
    relay = make_relay()
    with pytest.raises(BrokerOutage):
        relay.drain()
    for event in OutboxEvent.objects.all():
        assert event.status == Status.PENDING
        assert event.retry_count == 0
        assert event.lease_token == ""
        assert "broker unavailable" in event.last_error
    assert OutboxEvent.objects.due().count() == 3  # due again at once
    locmem.unavailable = False
    relay.close()
    assert relay.drain().sent == 3


class PartlyLost(locmem.LocmemBackend):
    """Confirms the first event, then the connection 'drops' with the rest in flight."""

    def publish(self, events):
        results = super().publish(events[:1])
        lost = PublishResult.failed(Reason.CONNECTION_LOST, "socket closed")
        return results + [lost] * (len(events) - 1)


def test_connection_lost_mid_batch_keeps_confirmed_and_releases_the_rest():
    emit_many(4)
    relay = make_relay(backend=PartlyLost())
    with pytest.raises(BrokerOutage) as info:
        relay.drain()
    assert info.value.result.sent == 1
    assert OutboxEvent.objects.sent().count() == 1
    pending = OutboxEvent.objects.pending()
    assert pending.count() == 3
    assert all(e.retry_count == 0 for e in pending)
    assert pending.filter(next_retry_time__lte=timezone.now()).count() == 3


def test_settle_is_fenced_on_the_lease_token():
    """A relay frozen past its lease cannot overwrite what another relay settled."""
    emit_many(2)
    stale = make_relay(lease_seconds=60)
    batch = stale.claim(10)
    # The lease runs out while the first relay is frozen; a second relay takes the rows.
    expire_leases()
    assert make_relay().drain().sent == 2
    # The stale relay wakes up and reports a failure for one row and success for the other.
    batch.results = [PublishResult.failed(Reason.NACKED, "late"), PublishResult.sent()]
    result = stale.settle(batch)
    assert (result.sent, result.failed, result.dead) == (0, 0, 0)
    for event in OutboxEvent.objects.all():
        assert event.status == Status.SENT and event.retry_count == 0 and event.last_error == ""


def test_stale_relay_says_its_failed_and_unconfirmed_rows_were_taken_over(caplog):
    """Its confirms never came (say the broker closed its connection while it was frozen):
    the rows stay as the other relay settled them, and the log says why nothing changed."""
    emit_many(2)
    stale = make_relay(lease_seconds=60)
    batch = stale.claim(10)
    expire_leases()
    assert make_relay().drain().sent == 2
    batch.results = [
        PublishResult.failed(Reason.TIMEOUT, "late"),
        PublishResult.failed(Reason.CONNECTION_LOST, "heartbeat"),
    ]
    with caplog.at_level(logging.WARNING, logger="django_outbox.relay"):
        result = stale.settle(batch)
    assert (result.sent, result.failed, result.released) == (0, 0, 0)
    assert "2 of 2 failed or unconfirmed events had been taken over" in caplog.text
    assert set(OutboxEvent.objects.values_list("status", flat=True)) == {Status.SENT}


def test_settle_uses_few_statements():
    emit_many(100)
    relay = make_relay()
    batch = relay.claim(100)
    batch.results = [PublishResult.sent()] * 100
    with CaptureQueriesContext(connection) as queries:
        relay.settle(batch)
    writes = [q for q in queries.captured_queries if q["sql"].upper().startswith("UPDATE")]
    assert len(writes) == 1


def test_claimed_rows_are_what_loading_them_gives():
    """The claim builds its rows without Model.__init__: same values and types as a query,
    on a fresh connection too (its type loaders are set up anew), the rest deferred."""
    with outbox.atomic() as box:
        box.emit(
            "E",
            payload={"total": Decimal("9.90"), "items": [1, "two"], "ünï": None},
            headers={"tenant": "t-1"},
            aggregate_type="orders.Order",
            aggregate_id=7,
        )
    connection.close()
    (row,) = make_relay().claim(10).rows
    loaded = OutboxEvent.objects.get(pk=row.pk)
    for name in CLAIM_FIELDS:
        assert getattr(row, name) == getattr(loaded, name), name
        assert type(getattr(row, name)) is type(getattr(loaded, name)), name
    assert row.occurred_at.tzinfo is not None and row.created_at.tzinfo is not None
    assert row.payload == {"total": "9.90", "items": [1, "two"], "ünï": None}
    assert row._state.db == "default" and not row._state.adding
    assert row.get_deferred_fields() == {
        "next_retry_time",
        "leased_until",
        "last_error",
        "sent_at",
        "updated_at",
    }
    assert row.next_retry_time == loaded.next_retry_time  # a deferred column loads on access
    row.last_error = "edited"
    row.save(update_fields=["last_error"])
    assert OutboxEvent.objects.get(pk=row.pk).last_error == "edited"


def test_with_ids_selects_exactly_those_rows():
    events = emit_many(5)
    chosen = [events[0].pk, events[3].pk, 10**12]  # an id that does not exist
    qs = OutboxEvent.objects.with_ids(chosen)
    assert sorted(qs.values_list("pk", flat=True)) == [events[0].pk, events[3].pk]
    assert OutboxEvent.objects.with_ids([]).count() == 0
    assert qs.update(last_error="x") == 2


def test_with_ids_sends_one_array_on_postgresql():
    """The settle's statement does not grow with the batch: psycopg caches it parsed."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: other databases get pk__in")
    sql, params = OutboxEvent.objects.with_ids(list(range(1, 501))).query.sql_with_params()
    assert "= ANY(%s)" in sql
    assert len(params) == 1 and list(params[0]) == list(range(1, 501))


def test_backend_bug_counts_as_a_failed_attempt():
    class Broken(locmem.LocmemBackend):
        def publish(self, events):
            raise RuntimeError("bug")

    emit_many(1)
    result = make_relay(backend=Broken()).drain()
    assert result.failed == 1
    assert "RuntimeError: bug" in OutboxEvent.objects.get().last_error


def test_serve_stops_on_event_and_beats(tmp_path):
    emit_many(5)
    stop = threading.Event()
    heartbeat = tmp_path / "hb" / "beat"
    relay = make_relay(heartbeat_file=str(heartbeat))
    thread = db_thread(relay.serve, stop=stop, interval=0.05)
    thread.start()
    try:
        for _ in range(100):
            if OutboxEvent.objects.sent().count() == 5:
                break
            threading.Event().wait(0.05)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()
    assert OutboxEvent.objects.sent().count() == 5
    assert heartbeat.exists()


def test_compensation_source_takes_only_stale_rows():
    emit_many(3)
    old = list(OutboxEvent.objects.order_by("id").values_list("id", flat=True)[:2])
    OutboxEvent.objects.filter(id__in=old).update(created_at=timezone.now() - timedelta(minutes=11))
    assert set(OutboxEvent.objects.due().stale(600).values_list("id", flat=True)) == set(old)


def test_compensate_outbox_command_sends_stale_rows_and_exits_1_on_a_failure():
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    emit_many(4)
    stale = list(OutboxEvent.objects.order_by("id").values_list("id", flat=True)[:3])
    OutboxEvent.objects.filter(id__in=stale).update(
        created_at=timezone.now() - timedelta(minutes=11)
    )
    locmem.fail_next.append(Reason.NACKED)
    out = StringIO()
    with pytest.raises(CommandError) as info:
        call_command("compensate_outbox", "--stale-after", "10m", "--max-batch", "2", stdout=out)
    assert info.value.returncode == 1
    assert "compensate_outbox: found=2 sent=1 failed=1 dead=0" in out.getvalue()
    failed = OutboxEvent.objects.get(id=stale[0])
    assert (failed.status, failed.retry_count) == (Status.PENDING, 1)
    assert list(OutboxEvent.objects.sent().values_list("id", flat=True)) == [stale[1]]


def test_publish_outbox_warns_when_debug_is_on(settings, caplog):
    from io import StringIO

    from django.core.management import call_command

    emit_many(1)
    for debug in (False, True):
        settings.DEBUG = debug
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="django_outbox.relay"):
            call_command("publish_outbox", "--once", stdout=StringIO())
        assert ("DEBUG is on" in caplog.text) is debug
    assert OutboxEvent.objects.sent().count() == 1


# -- the pipelined drain -----------------------------------------------------------------------
class Observing(locmem.LocmemBackend):
    """Records, each time the relay waits for confirms, what the database holds."""

    def __init__(self, on_wait=None, **options):
        super().__init__(**options)
        self.on_wait = on_wait or (lambda: None)
        self.seen: list[tuple[int, bool]] = []

    def wait(self):
        leased = OutboxEvent.objects.pending().exclude(lease_token="").count()
        self.seen.append((leased, connection.in_atomic_block))
        self.on_wait()
        return super().wait()


def test_drain_claims_the_next_batch_before_waiting_for_confirms():
    emit_many(250)
    backend = Observing()
    # On one thread, so what the database holds at each wait is exact.
    result = make_relay(backend=backend, batch_size=100, db_thread=False).drain()
    assert (result.sent, result.batches) == (250, 3)
    # Batches 1 and 2 are written before the relay waits for batch 1, and batch 3 is
    # claimed (250 leased); no claim's transaction is open while waiting for the broker.
    assert backend.seen == [(250, False), (150, False), (50, False)]
    assert [m.headers["sequence"] for m in locmem.outbox] == sorted(
        OutboxEvent.objects.values_list("id", flat=True)
    )


@pytest.mark.parametrize("db_thread", [False, True], ids=["one thread", "db thread"])
def test_a_claim_made_ahead_is_given_back_when_the_relay_stops(db_thread):
    emit_many(250)
    stop = threading.Event()
    relay = make_relay(backend=Observing(on_wait=stop.set), batch_size=100, db_thread=db_thread)
    result = relay.drain(should_stop=stop.is_set)
    # The two batches already handed to the backend are finished; the third, claimed
    # ahead, is given back.
    assert (result.sent, result.batches) == (200, 2)
    waiting = OutboxEvent.objects.pending()
    assert waiting.count() == 50
    assert not waiting.exclude(lease_token="").exists()
    assert OutboxEvent.objects.due().count() == 50  # due again at once
    assert all(e.retry_count == 0 and e.last_error == "" for e in waiting)


@pytest.mark.parametrize("db_thread", [False, True], ids=["one thread", "db thread"])
def test_a_claim_made_ahead_is_given_back_when_the_broker_goes_away(db_thread):
    emit_many(250)

    class Outage(locmem.LocmemBackend):
        calls = 0

        def publish(self, events):
            self.calls += 1
            if self.calls == 2:  # batch 3 is claimed by now, batch 1 confirmed
                raise BrokerUnavailable("gone")
            return super().publish(events)

    relay = make_relay(backend=Outage(), batch_size=100, db_thread=db_thread)
    with pytest.raises(BrokerOutage):
        relay.drain()
    # Batch 1 was confirmed before the outage: it is SENT, not published again later.
    assert OutboxEvent.objects.sent().count() == 100
    waiting = OutboxEvent.objects.pending()
    assert waiting.count() == 150
    assert not waiting.exclude(lease_token="").exists()
    assert all(e.retry_count == 0 for e in waiting)
    assert relay.drain().sent == 150
    assert len({m.message_id for m in locmem.outbox}) == len(locmem.outbox) == 250


def test_the_database_work_runs_on_a_second_thread_where_it_can():
    emit_many(1000)
    threads: set[str] = set()
    relay = make_relay(batch_size=100, db_thread=True)
    settle = relay.settle

    def recording(*args):
        threads.add(threading.current_thread().name)
        return settle(*args)

    relay.settle = recording
    result = relay.drain()
    assert (result.sent, result.batches) == (1000, 10)
    assert OutboxEvent.objects.sent().count() == 1000
    # Published once each, oldest first.
    assert [m.headers["sequence"] for m in locmem.outbox] == sorted(
        OutboxEvent.objects.values_list("id", flat=True)
    )
    if connection.vendor == "sqlite":
        assert threads == {threading.current_thread().name}  # SQLite: one writer, one thread
    else:
        (name,) = threads
        assert name.startswith("outbox-publish-db")
    assert not [t for t in threading.enumerate() if t.name.startswith("outbox-")]


@pytest.mark.django_db(transaction=False)
def test_inside_a_transaction_the_relay_stays_on_its_thread():
    """Another connection could not see the caller's uncommitted rows."""
    emit_many(3)
    assert connection.in_atomic_block
    assert make_relay(db_thread=True).drain().sent == 3


class SlowConfirms(locmem.LocmemBackend):
    """With a lease of 10 s, no claim leaves room for a 5 s confirm wait (and the margin):
    the relay claims every batch again right before it sends it."""

    confirm_timeout = 5.0


def test_a_batch_claimed_ahead_too_long_ago_is_claimed_again():
    """Sent with less lease left than a confirm wait, another relay could take it over
    while its confirms are still coming: it is given back and claimed afresh."""
    emit_many(250)

    relay = make_relay(backend=SlowConfirms(), batch_size=100, lease_seconds=10, db_thread=False)
    claims = []
    claim = relay.claim

    def counting(limit):
        batch = claim(limit)
        claims.append(len(batch.rows))
        return batch

    relay.claim = counting
    result = relay.drain()
    assert (result.sent, result.batches) == (250, 3)
    # Each claim is made again right before it is sent (the lease leaves no time at all).
    assert claims == [100, 100, 100, 100, 50, 50]
    assert len({m.message_id for m in locmem.outbox}) == len(locmem.outbox) == 250
    assert not OutboxEvent.objects.exclude(lease_token="").exists()


def test_a_batch_claimed_again_keeps_within_max_events():
    """The compensator's max_events holds when a batch is claimed afresh and more rows
    have come due since its first claim (a killed relay's leases running out)."""
    emit_many(80)
    later = timezone.now() + timedelta(minutes=5)
    leased = list(OutboxEvent.objects.order_by("id").values_list("pk", flat=True)[10:])
    OutboxEvent.objects.filter(pk__in=leased).update(leased_until=later, lease_token="dead")

    relay = make_relay(backend=SlowConfirms(), batch_size=50, lease_seconds=10, db_thread=False)
    claim = relay.claim

    def leases_run_out(limit):
        batch = claim(limit)
        expire_leases(OutboxEvent.objects.filter(pk__in=leased))
        return batch

    relay.claim = leases_run_out
    result = relay.drain(max_events=50)
    assert (result.found, result.sent) == (50, 50)
    assert OutboxEvent.objects.sent().count() == 50


def test_default_backend_send_then_wait_is_publish_in_order():
    first, second = emit_many(2)
    backend = locmem.LocmemBackend()
    backend.send([first])
    backend.send([second])
    assert not locmem.outbox  # nothing is published before wait()
    assert [r.ok for r in backend.wait()] == [True]
    assert [m.message_id for m in locmem.outbox] == [first.event_id]
    assert [r.ok for r in backend.wait()] == [True]
    assert backend.wait() == []
    backend.send([first])
    backend.abandon()  # forgotten: never published
    assert backend.wait() == []
    assert [m.message_id for m in locmem.outbox] == [first.event_id, second.event_id]


def test_releasing_a_batch_another_relay_took_over_changes_nothing_and_says_so(caplog):
    emit_many(3)
    relay = make_relay()
    batch = relay.claim(3)
    OutboxEvent.objects.update(lease_token="another-relay")  # its lease ran out meanwhile
    with caplog.at_level(logging.WARNING, logger="django_outbox.relay"):
        assert relay.release(batch) == 0
    assert set(OutboxEvent.objects.values_list("lease_token", flat=True)) == {"another-relay"}
    assert "3 of 3 events being released had been taken over by another relay" in caplog.text
    assert batch.stage is Stage.RELEASED
    assert relay.release(batch) == 0  # once released, a batch holds nothing


class RecordingWaker(Waker):
    """Records each wait's timeout instead of sleeping; at the ``n``-th wait (from 1) runs
    ``at.get(n)``, says a wake-up ended it if ``n`` is in ``woken``, and stops the relay
    at ``stop_at``."""

    def __init__(
        self,
        stop: threading.Event,
        *,
        stop_at: int,
        recheck: float = math.inf,
        woken: Collection[int] = (),
        at: Mapping[int, Callable[[], object]] | None = None,
    ) -> None:
        super().__init__(stop)
        self.waits: list[float] = []
        self._recheck, self.stop_at, self.woken, self.at = recheck, stop_at, woken, at or {}

    @property
    def recheck(self) -> float:
        return self._recheck

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        n = len(self.waits)
        if n in self.at:
            self.at[n]()
        if n == self.stop_at:
            self.stop.set()
        return n in self.woken


def test_after_a_pass_that_found_events_the_relay_looks_again_sooner():
    """Polling (MySQL/MariaDB, SQLite): events that keep coming wait a tenth of the poll
    interval, not all of it; an idle relay still sleeps the whole interval."""
    emit_many(3)
    stop = threading.Event()
    # One more event arrives while the relay sleeps the first time.
    waker = RecordingWaker(stop, stop_at=3, at={1: lambda: emit_many(1)})
    total = make_relay(db_thread=False).serve(stop=stop, interval=2.0, waker=waker)
    assert total.sent == 4
    assert waker.waits == [pytest.approx(0.2), pytest.approx(0.2), 2.0]


def test_after_a_wake_up_the_relay_looks_again_within_the_waker_s_recheck():
    """LISTEN/NOTIFY: after a pass that was woken (even one that found nothing, another
    relay having taken the events) or that found events, the relay looks again within the
    waker's ``recheck`` (the NOTIFY window): a commit that sent no NOTIFY because its
    process had just sent one is found that soon. Idle again, it sleeps the interval."""
    emit_many(2)
    stop = threading.Event()
    waker = RecordingWaker(stop, stop_at=3, recheck=0.05, woken={1})  # a NOTIFY ends sleep 1
    total = make_relay(db_thread=False).serve(stop=stop, interval=2.0, waker=waker)
    assert total.sent == 2
    # found events; woken, found nothing; idle
    assert waker.waits == [pytest.approx(0.05), pytest.approx(0.05), 2.0]


def test_a_commit_that_sent_no_notify_is_relayed_within_the_window(monkeypatch):
    """PostgreSQL, end to end: a process commits an event, then, once the relay has sent
    it and gone back to sleep, a second one within ``NOTIFY_WINDOW`` of the first: only the
    first commit sends a NOTIFY, and the relay (polling every 120 s, so every 12 s after a
    pass that found events) still publishes the second within about the window."""
    from django_outbox import notify
    from django_outbox.relay import wake

    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    monkeypatch.setattr(notify, "NOTIFY_WINDOW", 1.0)
    monkeypatch.setattr(notify, "_last_notify", {})
    listener = wake.PostgresNotifyWaker(threading.Event(), "default", "django_outbox")
    raw = listener._listen()
    relay, stop = make_relay(db_thread=False), threading.Event()
    thread = db_thread(
        relay.serve, stop=stop, interval=120.0, waker=wake.make_waker("default", stop)
    )
    thread.start()
    try:
        time.sleep(0.5)  # the relay's first pass found nothing: it listens and sleeps
        emit_many(1)
        assert wait_for(lambda: OutboxEvent.objects.sent().count() == 1, timeout=10)
        emit_many(1)  # within the window: no NOTIFY
        committed = time.monotonic()
        assert wait_for(lambda: OutboxEvent.objects.sent().count() == 2, timeout=20)
        took = time.monotonic() - committed
        notifies = sum(1 for _ in range(3) if listener._received(raw, 0.2))
    finally:
        stop.set()
        thread.join(10)
        listener.close()
    assert notifies == 1
    assert took < 5, f"{took:.1f} s: the second event waited for the busy poll"


def test_the_batch_size_is_chosen_per_database_when_unset(settings):
    """OUTBOX_BATCH_SIZE unset: the fastest measured for the database (docs/benchmarks.md);
    set, or given, it wins."""
    from django_outbox.relay.engine import DEFAULT_BATCH_SIZES

    settings.OUTBOX_BATCH_SIZE = None
    expected = DEFAULT_BATCH_SIZES.get(connection.vendor, 500)
    assert make_relay().batch_size == expected
    assert expected == (500 if connection.vendor == "sqlite" else 1000)
    settings.OUTBOX_BATCH_SIZE = 250
    assert make_relay().batch_size == 250
    assert make_relay(batch_size=40).batch_size == 40
