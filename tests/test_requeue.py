"""Bulk redrive and replay: requeue()/requeue_in_batches(), django_outbox.requeue and
manage.py outbox_requeue, on the real database DATABASE_URL names (issue 17, item 3)."""

from __future__ import annotations

from datetime import timedelta
from datetime import timezone as dt_timezone
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_outbox.backends import locmem
from django_outbox.backends.pika import PikaBackend
from django_outbox.consumer import Dispatcher, Outcome, process_messages
from django_outbox.db import db_now
from django_outbox.message import REPLAY_HEADER, decode
from django_outbox.models import InboxMessage, OutboxEvent, Status
from django_outbox.requeue import Selection, requeue
from django_outbox.stats import gauges
from points.models import PointsLedger
from tests.utils.amqp import make_consumer
from tests.utils.relay import make_relay
from tests.utils.rows import expire_leases, make_events

pytestmark = pytest.mark.django_db(transaction=True)

DAY = 86400.0


def run(*args: str) -> str:
    out = StringIO()
    call_command("outbox_requeue", *args, stdout=out)
    return out.getvalue()


def states(*rows: OutboxEvent) -> list[tuple[int, int, int]]:
    """(status, retry_count, replay_count) of each row, read back."""
    found = {
        pk: (status, retries, replays)
        for pk, status, retries, replays in OutboxEvent.objects.filter(
            pk__in=[r.pk for r in rows]
        ).values_list("pk", "status", "retry_count", "replay_count")
    }
    return [found[r.pk] for r in rows]


def updates(ctx: CaptureQueriesContext) -> int:
    return sum(1 for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE"))


# -- the lifecycle methods -------------------------------------------------------------------
def test_replay_puts_sent_rows_back_counts_the_replay_and_keeps_the_rest():
    (sent,) = make_events(
        {"status": Status.SENT, "retry_count": 2, "last_error": "[nacked] once", "age": DAY}
    )
    events = OutboxEvent.objects.filter(pk=sent.pk)
    assert events.requeue() == 0  # a SENT row needs replay=True
    assert events.requeue(replay=True) == 1
    row = OutboxEvent.objects.get(pk=sent.pk)
    assert (row.status, row.retry_count, row.replay_count) == (Status.PENDING, 0, 1)
    assert (row.event_id, row.last_error, row.lease_token) == (
        sent.event_id,
        "[nacked] once",
        "",
    )
    assert row.sent_at == sent.sent_at  # the last delivery, until the next one
    assert abs((db_now() - row.updated_at).total_seconds()) < 60
    assert OutboxEvent.objects.due().filter(pk=sent.pk).exists()


def test_replay_counts_only_the_rows_that_were_sent():
    """One UPDATE for a mixed queryset; on MySQL/MariaDB its SET clauses run left to right,
    so the count must be read before the status changes."""
    sent, dead, pending = make_events(
        {"status": Status.SENT, "replay_count": 1},
        {"status": Status.DEAD, "replay_count": 1, "retry_count": 11},
        {"status": Status.PENDING, "retry_count": 3},
    )
    with CaptureQueriesContext(connection) as ctx:
        assert OutboxEvent.objects.all().requeue(replay=True) == 3
    assert updates(ctx) == 1
    assert states(sent, dead, pending) == [
        (Status.PENDING, 0, 2),
        (Status.PENDING, 0, 1),  # a requeued replay is still that replay
        (Status.PENDING, 0, 0),
    ]


def test_requeue_in_batches_walks_the_rows_oldest_first_up_to_the_limit():
    rows = make_events(*[{"status": Status.DEAD, "retry_count": 11}] * 7)
    dead = OutboxEvent.objects.dead()
    with CaptureQueriesContext(connection) as ctx:
        assert dead.requeue_in_batches(3, limit=5) == (5, 2)
    assert updates(ctx) == 2
    assert [s for s, _, _ in states(*rows)] == [Status.PENDING] * 5 + [Status.DEAD] * 2
    assert dead.requeue_in_batches(3) == (2, 1)
    assert OutboxEvent.objects.dead().count() == 0


def test_exclude_in_flight_leaves_out_rows_a_relay_holds():
    held, backoff, expired = make_events({}, {"due_age": -600, "retry_count": 2}, {})
    OutboxEvent.objects.filter(pk=held.pk).claim(1, lease_seconds=600)
    OutboxEvent.objects.filter(pk=expired.pk).claim(1, lease_seconds=600)
    # A lease that ran out (its relay died) is no longer in flight.
    expire_leases(OutboxEvent.objects.filter(pk=expired.pk))
    left = OutboxEvent.objects.pending().exclude_in_flight()
    assert sorted(left.values_list("pk", flat=True)) == [backoff.pk, expired.pk]


# -- the replay on the wire and at the consumer ------------------------------------------------
def test_a_replay_keeps_its_event_id_and_says_it_is_one():
    first, other = make_events({}, {})
    make_relay().drain()
    assert REPLAY_HEADER not in locmem.outbox[0].headers
    for _ in range(2):
        run("--status", "sent", "--limit", "1")
        make_relay().drain()
    replayed = locmem.outbox[2:]
    assert [m.message_id for m in replayed] == [first.event_id, first.event_id]
    assert [m.headers[REPLAY_HEADER] for m in replayed] == [1, 2]
    assert replayed[1].headers["attempt"] == 1
    event = decode(replayed[1].delivery())
    assert event.replay == 2
    assert REPLAY_HEADER not in event.headers  # the relay's header, not the event's own
    assert OutboxEvent.objects.get(pk=other.pk).replay_count == 0


def test_an_inbox_suppresses_a_replay_until_the_consumer_lost_the_event():
    """docs/operations.md, "Replay to a consumer that lost its data"."""
    dispatcher = Dispatcher(handlers=["tests.consumer_handlers.InboxPointsHandler"])
    (event,) = make_events({"payload": {"order_id": 1}})
    make_relay().drain()
    assert process_messages(locmem.outbox, dispatcher=dispatcher)[0][0].outcome is Outcome.PROCESSED

    locmem.reset()
    run("--status", "sent")
    make_relay().drain()
    # The consumer still has it: a duplicate, acknowledged, handler not run.
    assert process_messages(locmem.outbox, dispatcher=dispatcher)[0][0].outcome is Outcome.DUPLICATE
    assert PointsLedger.objects.count() == 1

    # The consumer's database is restored from before the event: data and inbox row gone.
    PointsLedger.objects.all().delete()
    InboxMessage.objects.filter(source_event_id=event.event_id).delete()
    locmem.reset()
    run("--status", "sent", "--since", "1h")
    make_relay().drain()
    (message,) = locmem.outbox
    assert message.headers[REPLAY_HEADER] == 2
    assert process_messages(locmem.outbox, dispatcher=dispatcher)[0][0].outcome is Outcome.PROCESSED
    assert PointsLedger.objects.count() == 1


# -- the selection -----------------------------------------------------------------------------
def test_dead_by_default_and_each_filter_narrows():
    rows = make_events(
        {"status": Status.DEAD, "event_type": "A", "last_error": "[unroutable] NO_ROUTE"},
        {"status": Status.DEAD, "event_type": "B", "last_error": "[nacked] full"},
        {"status": Status.DEAD, "event_type": "A", "aggregate_type": "X", "aggregate_id": "9"},
        {"status": Status.DEAD, "event_type": "A", "age": 3 * DAY},
        {"status": Status.PENDING, "event_type": "A", "retry_count": 1, "due_age": -600},
        {"status": Status.SENT, "event_type": "A"},
    )

    def selected(**fields) -> list[int]:
        chosen = Selection(**fields).resolved(db_now()).queryset()
        return [rows.index(r) for r in sorted(chosen, key=lambda r: r.pk)]

    assert selected() == [0, 1, 2, 3]
    assert selected(event_types=("A",)) == [0, 2, 3]
    assert selected(event_types=("A", "B")) == [0, 1, 2, 3]
    assert selected(aggregate_type="X", aggregate_id="9") == [2]
    assert selected(aggregate_id="A-1") == [0, 1, 3]
    assert selected(error_contains="[UNROUTABLE]") == [0]  # case-insensitive everywhere
    assert selected(since=timedelta(days=1)) == [0, 1, 2]
    assert selected(until=timedelta(days=1)) == [3]
    assert selected(since=rows[3].created_at, until=rows[0].created_at) == [3]
    assert selected(since=rows[0].created_at) == [0, 1, 2]  # since is inclusive
    assert selected(status=Status.PENDING) == [4]
    assert selected(status=Status.SENT) == [5]


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        (Selection(aggregate_id=""), "aggregate_id is empty"),
        (Selection(event_types=("",)), "an event type is empty"),
        (Selection(since=timedelta(hours=1), until=timedelta(hours=2)), "is not before until"),
        (Selection(since=timedelta(hours=-1)), "negative duration"),
    ],
)
def test_a_selection_that_cannot_match_is_refused(selection, message):
    with pytest.raises(ValueError, match=message):
        requeue(selection)


def test_a_naive_moment_is_refused_under_use_tz():
    with pytest.raises(ValueError, match="has no time zone; give one"):
        requeue(Selection(since=timezone.now().replace(tzinfo=None)))


# -- manage.py outbox_requeue ------------------------------------------------------------------
def test_dry_run_prints_the_count_and_a_sample_and_changes_nothing():
    rows = make_events(
        *[{"status": Status.DEAD, "retry_count": 11, "last_error": "[nacked] x"}] * 12
    )
    before = list(OutboxEvent.objects.order_by("pk").values_list("status", "updated_at"))
    out = run("--dry-run")
    assert out.splitlines()[0] == (
        "outbox_requeue: would requeue 12 dead event(s) (no other filter); dry run, nothing changed"
    )
    assert "the first 10, oldest first:" in out
    assert f"id={rows[0].pk} ORDER_CREATED event_id={rows[0].event_id}" in out
    assert f"id={rows[10].pk} " not in out
    assert "last_error=[nacked] x" in out
    assert list(OutboxEvent.objects.order_by("pk").values_list("status", "updated_at")) == before
    assert "would requeue 5 dead event(s) (no other filter) (of 12 matching; --limit 5)" in run(
        "--dry-run", "--limit", "5"
    )


def test_a_run_requeues_in_batches_and_prints_the_count():
    rows = make_events(
        *[{"status": Status.DEAD, "retry_count": 11, "event_type": "A", "last_error": "e"}] * 5,
        {"status": Status.DEAD, "event_type": "B"},
    )
    with CaptureQueriesContext(connection) as ctx:
        out = run("--event-type", "A", "--batch-size", "2")
    assert out.strip() == (
        "outbox_requeue: requeued 5 dead event(s) (event_type A) in 3 batch(es): due now, "
        "retry_count 0"
    )
    assert updates(ctx) == 3
    assert states(*rows) == [(Status.PENDING, 0, 0)] * 5 + [(Status.DEAD, 0, 0)]
    assert OutboxEvent.objects.get(pk=rows[0].pk).last_error == "e"  # until the next attempt
    assert make_relay().drain().sent == 5


def test_pending_requeue_makes_backoff_due_and_leaves_rows_in_flight_alone():
    backoff, held = make_events({"retry_count": 3, "due_age": -3600}, {})
    OutboxEvent.objects.filter(pk=held.pk).claim(1, lease_seconds=600)
    out = run("--status", "pending")
    assert "requeued 1 pending event(s)" in out
    assert states(backoff) == [(Status.PENDING, 0, 0)]
    assert OutboxEvent.objects.due().filter(pk=backoff.pk).exists()
    assert OutboxEvent.objects.get(pk=held.pk).lease_token != ""


def test_pending_requeue_during_a_relay_outage_takes_only_rows_waiting_to_retry():
    """The relay is down: a backlog never attempted, one row whose backoff is over, one a
    relay (since frozen) holds, one scheduled for tomorrow, and two in a backoff. Before the
    fix every due row was "requeued" too, its due time reset: the oldest PENDING age fell to
    0 with nothing sent, silencing the age alert and the admin banner."""
    backlog = make_events(*[{"age": 3600} for _ in range(20)])
    due_again, held, scheduled, *backoff = make_events(
        {"retry_count": 2, "age": 3000, "due_age": 60},
        {"age": 1800},
        {"due_age": -DAY, "due_at": db_now() + timedelta(days=1)},
        {"retry_count": 1, "age": 2400, "due_age": -30},
        {"retry_count": 4, "age": 2400, "due_age": -900},
    )
    OutboxEvent.objects.filter(pk=held.pk).claim(1, lease_seconds=600)
    due_times = dict(OutboxEvent.objects.values_list("pk", "next_retry_time"))
    age = gauges().oldest_pending_age
    assert age >= 3600

    out = run("--status", "pending")

    assert out.strip() == (
        "outbox_requeue: requeued 2 pending event(s) (no other filter) in 1 batch(es): due "
        "now, retry_count 0; left alone 23 pending event(s) not waiting to retry: 21 due "
        "already (a relay takes them when one runs), 1 being published by a relay, 1 "
        "scheduled for later"
    )
    assert states(*backoff) == [(Status.PENDING, 0, 0)] * 2
    after = dict(OutboxEvent.objects.values_list("pk", "next_retry_time"))
    for row in [*backlog, due_again, held, scheduled]:
        assert after[row.pk] == due_times[row.pk]
    assert OutboxEvent.objects.get(pk=due_again.pk).retry_count == 2
    assert gauges().oldest_pending_age >= age  # the alert still fires

    assert run("--status", "pending").strip() == (
        "outbox_requeue: no pending event waits to retry (no other filter); nothing changed; "
        "left alone 25 pending event(s) not waiting to retry: 23 due already (a relay takes "
        "them when one runs), 1 being published by a relay, 1 scheduled for later"
    )


def test_pending_requeue_leaves_a_row_waiting_behind_its_aggregates_head(settings):
    """Ordered mode: aggregate A's head is scheduled for tomorrow, and a retried event of A
    waits behind it (its predecessor was replayed, say); requeued, it would still wait.
    Aggregate B's event in a backoff is its own head: requeued."""
    settings.OUTBOX_ORDERED = True
    head, behind, alone = make_events(
        {"aggregate_id": "A", "due_age": -DAY, "due_at": db_now() + timedelta(days=1)},
        {"aggregate_id": "A", "retry_count": 1, "due_age": -600},
        {"aggregate_id": "B", "retry_count": 1, "due_age": -600},
    )
    dry = run("--status", "pending", "--dry-run")
    assert dry.splitlines()[0] == (
        "outbox_requeue: would requeue 1 pending event(s) (no other filter); dry run, nothing "
        "changed; left alone 2 pending event(s) not waiting to retry: 1 scheduled for later, "
        "1 waiting behind an earlier event of their aggregate"
    )
    assert f"id={alone.pk} " in dry and f"id={behind.pk} " not in dry
    out = run("--status", "pending")
    assert "requeued 1 pending event(s)" in out
    assert states(head, behind, alone) == [
        (Status.PENDING, 0, 0),
        (Status.PENDING, 1, 0),
        (Status.PENDING, 0, 0),
    ]


def test_a_replay_says_what_consumers_do_with_it():
    make_events({"status": Status.SENT}, {"status": Status.SENT})
    out = run("--status", "sent", "--until", "2099-01-01T00:00Z")
    assert out.startswith("outbox_requeue: replayed 2 sent event(s) (created before 2099-01-01")
    assert "keep their event_id and carry the x-outbox-replay header" in out


def test_nothing_matching_is_exit_0():
    make_events({"status": Status.SENT})
    assert run().strip() == (
        "outbox_requeue: no dead event matches (no other filter); nothing changed"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "2026-12-03T10:00"], r"no time zone; give one, e\.g\. 2026-12-03T10:00:00Z"),
        (["--since", "1h", "--until", "2h"], "is not before until"),
        (["--aggregate-id", ""], "aggregate_id is empty"),
        (["--database", "nope"], "there is no database .nope. in DATABASES; pass --database"),
    ],
)
def test_bad_options_are_exit_2_and_change_nothing(args, message):
    (dead,) = make_events({"status": Status.DEAD})
    with pytest.raises(CommandError, match=message) as info:
        run(*args)
    assert info.value.returncode == 2
    assert states(dead) == [(Status.DEAD, 0, 0)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "yesterday"], "is neither a date and time"),
        (["--status", "all"], "invalid choice: 'all'"),
        (["--limit", "0"], "must be 1 or more"),
    ],
)
def test_options_argparse_refuses(args, message):
    """From a shell argparse exits 2 with this message; call_command raises it."""
    with pytest.raises(CommandError, match=message):
        run(*args)


def test_database_option_names_the_outbox_alias():
    make_events({"status": Status.DEAD})
    assert "requeued 1 dead event(s)" in run("--database", "default")


# -- ordered mode ------------------------------------------------------------------------------
def test_ordered_replay_goes_out_in_order_and_holds_back_the_aggregate(settings):
    """Replayed events are their aggregate's heads again: re-sent one at a time in id
    order, and the aggregate's unsent events wait behind them (docs/ordered.md)."""
    settings.OUTBOX_ORDERED = True
    a1, a2, a3 = make_events(*[("O", "a")] * 3)
    make_relay().drain()
    (a4,) = make_events(("O", "a"))
    locmem.reset()
    assert OutboxEvent.objects.filter(pk__in=[a2.pk, a3.pk]).requeue(replay=True) == 2
    _token, claimed = OutboxEvent.objects.due().claim(10, lease_seconds=60)
    assert [r.pk for r in claimed] == [a2.pk]  # a3 and a4 wait for it
    OutboxEvent.objects.all().release(_token, [a2.pk])
    make_relay().drain()
    assert [
        (m.headers["sequence"], m.headers["previous_sequence"], m.headers.get(REPLAY_HEADER))
        for m in locmem.outbox
    ] == [(a2.pk, a1.pk, 1), (a3.pk, a2.pk, 1), (a4.pk, a3.pk, None)]


def test_ordered_redrive_of_a_dead_head_resumes_its_aggregate_in_order(settings):
    settings.OUTBOX_ORDERED = True
    head, nxt = make_events({"aggregate_id": "b", "status": Status.DEAD}, {"aggregate_id": "b"})
    assert make_relay().drain().sent == 0  # blocked behind its dead head
    assert "requeued 1 dead event(s) (aggregate ORDER:b)" in run(
        "--aggregate-type", "ORDER", "--aggregate-id", "b"
    )
    make_relay().drain()
    assert [m.headers["sequence"] for m in locmem.outbox] == [head.pk, nxt.pk]


# -- over RabbitMQ -----------------------------------------------------------------------------
@pytest.mark.amqp
def test_a_replay_through_rabbitmq_is_a_duplicate_for_a_consumer_that_has_it(broker):
    """The header survives AMQP's encoding and the consumer's inbox absorbs the replay."""
    consumer = make_consumer(broker, handlers=["tests.consumer_handlers.InboxPointsHandler"])
    watch = broker.declare_queue("#")  # a copy of everything the relay publishes
    (event,) = make_events({"payload": {"order_id": 1}})

    def relay() -> None:
        relay = make_relay(backend=PikaBackend(broker_url=broker.url, exchange=broker.exchange))
        try:
            assert relay.drain().sent == 1
        finally:
            relay.close()

    relay()
    assert consumer.serve(until_idle=True).counts[Outcome.PROCESSED] == 1
    run("--status", "sent")
    relay()
    counts = consumer.serve(until_idle=True).counts
    assert (counts[Outcome.DUPLICATE], counts[Outcome.PROCESSED]) == (1, 0)
    assert PointsLedger.objects.count() == 1
    first, replay = broker.get_all(watch, 2)
    assert first[1].message_id == replay[1].message_id == event.event_id
    assert REPLAY_HEADER not in first[1].headers
    assert replay[1].headers[REPLAY_HEADER] == 1


@pytest.mark.parametrize("zone", ["UTC", "Asia/Shanghai"])
def test_since_and_until_without_time_zones(settings, zone):
    """USE_TZ = False: a moment without an offset is local time, as Django stores it; one
    with an offset is converted to it."""
    if zone != "UTC" and connection.vendor == "mysql":
        pytest.skip("MySQL/MariaDB: the server's time zone must be TIME_ZONE (UTC here)")
    settings.USE_TZ = False
    settings.TIME_ZONE = zone
    old, new = make_events({"status": Status.DEAD, "age": 7200}, {"status": Status.DEAD})
    assert "would requeue 1 dead event(s)" in run("--dry-run", "--since", "1h")
    cut = new.created_at - timedelta(hours=1)
    assert f"id={new.pk} " in run("--dry-run", "--since", cut.isoformat())
    in_utc = timezone.make_aware(cut).astimezone(dt_timezone.utc).isoformat()
    assert f"id={old.pk} " in run("--dry-run", "--until", in_utc)
    assert "would requeue 1 dead event(s)" in run("--dry-run", "--until", in_utc)
