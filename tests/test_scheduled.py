"""Scheduled events: ``emit(deliver_at=, delay=)``.

The event commits with the business write and becomes due later, by the database clock. The
relay does not publish it before; the compensator, the oldest PENDING age (figure, gauge,
banner) and the PENDING count do not take a scheduled backlog for an incident.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models.lookups import LessThanOrEqual
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from prometheus_client import REGISTRY

from django_outbox import outbox, stats
from django_outbox.backends import locmem
from django_outbox.backends.base import Reason
from django_outbox.db import DbNow, db_now
from django_outbox.exceptions import InvalidEvent
from django_outbox.models import OutboxEvent, Status
from django_outbox.relay import Relay
from django_outbox.retry import FixedRetryPolicy
from tests.testapp.models import Widget
from tests.utils.relay import make_relay

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = timedelta(hours=1)


def emit_one(**kwargs) -> OutboxEvent:
    with outbox.atomic() as box:
        box.emit("REMIND", payload={}, **kwargs)
    return OutboxEvent.objects.get(event_type="REMIND")


def shift_back(row: OutboxEvent, by: timedelta) -> None:
    """Move every time of ``row`` ``by`` into the past: as if it were emitted ``by`` ago."""
    row.refresh_from_db()
    OutboxEvent.objects.filter(pk=row.pk).update(
        created_at=row.created_at - by,
        next_retry_time=row.next_retry_time - by,
        due_at=row.due_at - by if row.due_at else None,
    )


def near(a: datetime, b: datetime, seconds: float = 0.01) -> bool:
    return abs((a - b).total_seconds()) <= seconds


# -- when the row is due -----------------------------------------------------------------------


@pytest.mark.parametrize("delay", [HOUR, 3600, 3600.0])
def test_delay_counts_from_the_insert_by_the_database_clock(delay):
    row = emit_one(delay=delay)
    # created_at, next_retry_time and due_at come from one clock reading of the INSERT.
    assert row.due_at == row.next_retry_time
    assert near(row.next_retry_time, row.created_at + HOUR)
    assert row.status == Status.PENDING
    assert not OutboxEvent.objects.due().exists()
    assert list(OutboxEvent.objects.scheduled()) == [row]


def test_deliver_at_in_the_future_is_kept_as_given():
    when = (db_now() + 2 * HOUR).replace(microsecond=123456)
    row = emit_one(deliver_at=when)
    assert row.next_retry_time == when
    assert row.due_at == when
    assert not OutboxEvent.objects.due().exists()
    assert OutboxEvent.objects.scheduled().count() == 1


def test_deliver_at_in_the_past_is_due_at_once_from_the_insert():
    """Due now, and due *since* now: not a row that has waited a day."""
    row = emit_one(deliver_at=db_now() - timedelta(days=1))
    assert near(row.due_at, row.created_at)
    assert near(row.next_retry_time, row.created_at)
    assert list(OutboxEvent.objects.due()) == [row]
    assert not OutboxEvent.objects.scheduled().exists()
    assert not OutboxEvent.objects.stale(60).exists()


def test_delay_zero_is_due_at_once():
    row = emit_one(delay=0)
    assert list(OutboxEvent.objects.due()) == [row]


def test_the_clock_plus_nothing_is_not_later_than_the_clock():
    """In one statement, so one clock reading. On SQLite, Django's Now() has milliseconds
    ('.123') and its date arithmetic microseconds ('.123000'): compared as text the sum was
    later, and a row emitted with delay=0 was not due until the next millisecond."""
    emit_one()
    clock_plus_nothing = DbNow() + timedelta(0)
    row = OutboxEvent.objects.annotate(ok=LessThanOrEqual(clock_plus_nothing, DbNow())).get()
    assert row.ok


def test_an_event_without_a_schedule_has_no_due_at():
    row = emit_one()
    assert row.due_at is None
    assert row.next_retry_time == row.created_at


def test_module_emit_in_a_plain_atomic_block_schedules_too():
    with transaction.atomic():
        outbox.emit("REMIND", payload={}, delay=60)
    assert OutboxEvent.objects.scheduled().count() == 1


def _inserts_of_a_block(**schedules) -> int:
    """INSERT statements of one block of 1,000 events, every third one delayed and every
    third one for a deliver_at when ``schedules`` says so."""
    with CaptureQueriesContext(connection) as queries, outbox.atomic() as box:
        for i in range(1000):
            kind = i % 3
            box.emit(
                "MANY",
                payload={"i": i},
                delay=schedules.get("delay") if kind == 1 else None,
                deliver_at=schedules.get("deliver_at") if kind == 2 else None,
            )
    return sum("INSERT" in q["sql"].upper() for q in queries.captured_queries)


def test_a_block_of_a_thousand_scheduled_and_unscheduled_events_is_one_insert():
    inserts = _inserts_of_a_block(delay=30, deliver_at=db_now() + HOUR)
    assert OutboxEvent.objects.count() == 1000
    assert OutboxEvent.objects.scheduled().count() == 666
    assert OutboxEvent.objects.due().count() == 334
    if connection.vendor == "sqlite":
        # Django splits a bulk insert at SQLite's limit of bound parameters, for events
        # without a schedule too: the schedule adds no statement of its own.
        assert inserts == _inserts_of_a_block()
    else:
        assert inserts == 1


# -- the relay and the compensator -------------------------------------------------------------


def test_the_relay_publishes_a_scheduled_event_when_it_is_due_and_not_before():
    row = emit_one(delay=1.5)
    relay = make_relay()
    assert relay.drain().sent == 0
    assert locmem.outbox == []
    deadline = time.monotonic() + 10
    while not locmem.outbox and time.monotonic() < deadline:
        time.sleep(0.2)
        make_relay().drain()
    row.refresh_from_db()
    assert row.status == Status.SENT
    # Published after it was due, by the database clock that decided it.
    assert row.sent_at >= row.due_at
    assert [m.message_id for m in locmem.outbox] == [row.event_id]


def test_the_relay_publishes_due_events_around_a_scheduled_one():
    with outbox.atomic() as box:
        box.emit("FIRST", payload={})
        box.emit("LATER", payload={}, delay=HOUR)
        box.emit("SECOND", payload={})
    assert make_relay().drain().sent == 2
    assert [m.routing_key for m in locmem.outbox] == ["FIRST", "SECOND"]
    assert OutboxEvent.objects.get(event_type="LATER").status == Status.PENDING


def test_the_compensator_counts_staleness_from_when_the_event_became_due():
    """Scheduled a day ahead, a day ago: it is due now, and fresh; stale 10 min later."""
    row = emit_one(delay=timedelta(days=1))
    shift_back(row, timedelta(days=1))
    assert OutboxEvent.objects.due().count() == 1
    compensator = Relay.compensator(stale_after=600, backend=locmem.LocmemBackend())
    assert compensator.drain().sent == 0
    assert not OutboxEvent.objects.stale(600).exists()
    shift_back(row, timedelta(minutes=11))
    assert list(OutboxEvent.objects.stale(600)) == [row]
    compensator = Relay.compensator(stale_after=600, backend=locmem.LocmemBackend())
    assert compensator.drain().sent == 1


def test_an_old_unscheduled_row_is_still_stale():
    row = emit_one()
    shift_back(row, timedelta(minutes=11))
    assert list(OutboxEvent.objects.stale(600)) == [row]


def test_a_retry_keeps_due_at_so_a_failing_scheduled_event_ages():
    row = emit_one(delay=timedelta(hours=2))
    shift_back(row, timedelta(hours=3))  # due an hour ago
    row.refresh_from_db()
    due_at = row.due_at
    locmem.fail_next.append(Reason.NACKED)
    make_relay(policy=FixedRetryPolicy(30, max_attempts=5)).drain()
    row.refresh_from_db()
    assert (row.retry_count, row.due_at) == (1, due_at)
    assert row.next_retry_time > db_now()  # in backoff: its own time, not the schedule's
    assert not OutboxEvent.objects.scheduled().exists()  # a failed delivery, not a schedule
    OutboxEvent.objects.filter(pk=row.pk).update(next_retry_time=db_now())
    assert list(OutboxEvent.objects.stale(600)) == [row]


def test_requeue_makes_a_scheduled_event_due_now():
    row = emit_one(delay=timedelta(days=3))
    assert OutboxEvent.objects.filter(pk=row.pk).requeue() == 1
    row.refresh_from_db()
    assert near(row.due_at, db_now(), 60)
    assert not OutboxEvent.objects.scheduled().exists()
    assert make_relay().drain().sent == 1


def test_requeue_of_an_old_dead_row_counts_staleness_from_the_requeue():
    row = emit_one()
    shift_back(row, timedelta(days=2))
    OutboxEvent.objects.filter(pk=row.pk).mark_dead()
    OutboxEvent.objects.filter(pk=row.pk).requeue()
    assert not OutboxEvent.objects.stale(600).exists()
    assert OutboxEvent.objects.due().count() == 1


# -- bad input: refused inside the caller's transaction ------------------------------------

NAIVE = datetime(2030, 1, 2, 3, 4, 5)
AWARE = NAIVE.replace(tzinfo=dt_timezone.utc)

BAD_SCHEDULES = [
    ({"deliver_at": AWARE, "delay": 5}, "not both"),
    ({"deliver_at": "tomorrow"}, "deliver_at must be a datetime"),
    ({"deliver_at": NAIVE.date()}, "deliver_at must be a datetime"),
    ({"delay": "5m"}, "timedelta or a number of seconds"),
    ({"delay": True}, "timedelta or a number of seconds"),
    ({"delay": -1}, "must not be negative"),
    ({"delay": timedelta(seconds=-1)}, "must not be negative"),
    ({"delay": float("nan")}, "finite"),
    ({"delay": float("inf")}, "finite"),
    ({"delay": timedelta(days=40_000)}, "longer than the outbox schedules"),
    ({"delay": 1e300}, "longer than the outbox schedules"),
    # Within Python's range as given, outside it in UTC (issue 32, item 6).
    (
        {"deliver_at": datetime(9999, 12, 31, 23, tzinfo=dt_timezone(-timedelta(hours=5)))},
        "outside years 1 to 9999 in UTC",
    ),
    (
        {"deliver_at": datetime(1, 1, 1, tzinfo=dt_timezone(timedelta(hours=14)))},
        "outside years 1 to 9999 in UTC",
    ),
]


@pytest.mark.parametrize(("kwargs", "text"), BAD_SCHEDULES)
def test_a_bad_schedule_is_refused_and_rolls_back_the_business_write(kwargs, text):
    with pytest.raises(InvalidEvent, match=text), outbox.atomic() as box:
        Widget.objects.create(code="rolled-back")
        box.emit("REMIND", payload={}, **kwargs)
    assert not Widget.objects.exists()
    assert not OutboxEvent.objects.exists()


@pytest.mark.parametrize(
    ("use_tz", "when", "text"),
    [
        (True, NAIVE, "deliver_at .* is naive.*USE_TZ = True"),
        (False, AWARE, "deliver_at .* is aware.*USE_TZ = False"),
    ],
)
def test_deliver_at_that_does_not_match_use_tz_is_refused(settings, use_tz, when, text):
    settings.USE_TZ = use_tz
    with pytest.raises(InvalidEvent, match=text), transaction.atomic():
        Widget.objects.create(code="rolled-back")
        outbox.emit("REMIND", payload={}, deliver_at=when)
    assert not Widget.objects.exists()
    assert not OutboxEvent.objects.exists()


@pytest.mark.parametrize(
    "when",
    [
        datetime(9999, 12, 31, 18, 59, tzinfo=dt_timezone(-timedelta(hours=5))),
        datetime(1, 1, 1, 23, tzinfo=dt_timezone(timedelta(hours=14))),
    ],
)
def test_deliver_at_at_the_ends_of_the_utc_range_is_stored_and_read_back(when):
    with outbox.atomic() as box:
        box.emit("REMIND", payload={}, deliver_at=when)
    row = OutboxEvent.objects.get()
    assert row.due_at == max(when, row.created_at)


def test_schedule_arguments_are_keyword_only():
    with pytest.raises(TypeError), transaction.atomic():
        outbox.emit("REMIND", {}, None)  # type: ignore[misc]


def test_the_confirm_latency_counts_from_when_the_event_became_due():
    before = (
        REGISTRY.get_sample_value(
            "django_outbox_commit_to_confirm_seconds_sum", {"database": "default"}
        )
        or 0.0
    )
    row = emit_one(delay=timedelta(days=1))
    shift_back(row, timedelta(days=1))
    assert make_relay().drain().sent == 1
    after = (
        REGISTRY.get_sample_value(
            "django_outbox_commit_to_confirm_seconds_sum", {"database": "default"}
        )
        or 0.0
    )
    assert 0 <= after - before < 60  # not the day it was scheduled for


# -- the figures: a scheduled backlog is not an incident --------------------------------------


def scheduled_backlog() -> None:
    """A hundred events scheduled a week ahead, emitted a day ago."""
    with outbox.atomic() as box:
        for i in range(100):
            box.emit("LATER", payload={"i": i}, delay=timedelta(days=7))
    for row in OutboxEvent.objects.all():
        shift_back(row, timedelta(days=1))


def test_a_scheduled_backlog_is_counted_apart_and_ages_nothing():
    scheduled_backlog()
    g = stats.gauges()
    assert (g.pending, g.scheduled, g.oldest_pending_age) == (0, 100, 0.0)
    assert g.oldest_pending_due_since is None


def test_oldest_pending_age_counts_from_when_a_scheduled_event_became_due():
    scheduled_backlog()
    row = emit_one(delay=timedelta(days=1))
    shift_back(row, timedelta(days=1, minutes=5))  # created a day ago, due 5 min ago
    g = stats.gauges()
    assert (g.pending, g.scheduled) == (1, 100)
    assert 300 <= g.oldest_pending_age < 360
    row.refresh_from_db()
    assert g.oldest_pending_due_since == row.due_at


def test_gauges_and_outbox_stats_leave_a_scheduled_backlog_out(settings):
    scheduled_backlog()
    assert (
        REGISTRY.get_sample_value("django_outbox_scheduled_events", {"database": "default"}) == 100
    )
    assert REGISTRY.get_sample_value("django_outbox_pending_events", {"database": "default"}) == 0
    assert (
        REGISTRY.get_sample_value(
            "django_outbox_oldest_pending_age_seconds", {"database": "default"}
        )
        == 0
    )
    out = StringIO()
    call_command(
        "outbox_stats", "--json", "--max-pending", "0", "--max-oldest-age", "60", stdout=out
    )
    data = json.loads(out.getvalue())
    assert (data["pending"], data["scheduled"], data["thresholds_crossed"]) == (0, 100, [])


@pytest.fixture
def admin_client_() -> Client:
    user = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def test_admin_shows_scheduled_events_apart_without_a_banner(admin_client_, settings):
    settings.OUTBOX_ALERT_PENDING_AGE = 60
    scheduled_backlog()
    due = emit_one()
    changelist = reverse("admin:django_outbox_outboxevent_changelist")
    response = admin_client_.get(changelist)
    assert response.context["outbox_warnings"] == []
    assert "?scheduled=yes" in response.content.decode()  # the filter
    scheduled = admin_client_.get(changelist, {"scheduled": "yes"}).context["cl"].queryset
    assert scheduled.count() == 100
    assert due not in scheduled
    not_scheduled = admin_client_.get(changelist, {"scheduled": "no"}).context["cl"].queryset
    assert list(not_scheduled) == [due]

    response = admin_client_.get(reverse("admin:django_outbox_outboxevent_dashboard"))
    assert (response.context["stats"].scheduled, response.context["stats"].pending) == (100, 1)
    body = response.content.decode()
    assert 'id="figure-scheduled"' in body
    assert "outbox-banner" not in body
    # The PENDING figure's link lists what it counts: due rows, scheduled ones left out.
    pending = admin_client_.get(response.context["pending_url"]).context["cl"].queryset
    assert list(pending) == [due]


def test_admin_banner_still_warns_when_a_due_scheduled_event_waits(admin_client_, settings):
    settings.OUTBOX_ALERT_PENDING_AGE = 60
    row = emit_one(delay=timedelta(hours=1))
    shift_back(row, timedelta(hours=1, minutes=10))
    body = admin_client_.get(reverse("admin:django_outbox_outboxevent_changelist")).content
    assert "The oldest PENDING event has waited 10 min" in body.decode()


# -- ordered mode: a scheduled event holds back its aggregate's later events ----------------


def test_ordered_a_scheduled_head_holds_back_later_events_of_its_aggregate(settings):
    settings.OUTBOX_ORDERED = True
    with outbox.atomic() as box:
        box.emit("E", payload={}, aggregate_type="O", aggregate_id="a", delay=HOUR)
        box.emit("E", payload={}, aggregate_type="O", aggregate_id="a")
        box.emit("E", payload={}, aggregate_type="O", aggregate_id="b")
        box.emit("E", payload={}, aggregate_type="O", aggregate_id="a")
    a1, a2, b1, a3 = OutboxEvent.objects.order_by("id")
    assert make_relay().drain().sent == 1
    assert [m.message_id for m in locmem.outbox] == [b1.event_id]
    # Waiting behind a schedule is not a blocked aggregate (that is a DEAD head).
    assert stats.gauges().blocked_aggregates == 0

    shift_back(a1, HOUR)
    assert make_relay().drain().sent == 3
    sent = [(m.headers["aggregate_id"], m.headers["sequence"]) for m in locmem.outbox[1:]]
    assert sent == [("a", a1.pk), ("a", a2.pk), ("a", a3.pk)]
    assert locmem.outbox[2].headers["previous_sequence"] == a1.pk


def test_ordered_a_scheduled_event_of_an_unordered_type_holds_nothing_back(settings):
    settings.OUTBOX_ORDERED = ["ORDER_SHIPPED"]
    with outbox.atomic() as box:
        box.emit("REMIND", payload={}, aggregate_type="O", aggregate_id="a", delay=HOUR)
        box.emit("ORDER_SHIPPED", payload={}, aggregate_type="O", aggregate_id="a")
    assert make_relay().drain().sent == 1
    assert [m.routing_key for m in locmem.outbox] == ["ORDER_SHIPPED"]


def test_a_claim_takes_the_lowest_ids_of_due_rows_scheduled_or_not():
    """The claim reads scheduled and unscheduled rows apart (PostgreSQL: two partial
    indexes) and leases the lowest ids of both."""
    with outbox.atomic() as box:
        box.emit("FIRST", payload={}, delay=HOUR)
        for _ in range(3):
            box.emit("NOW", payload={})
        box.emit("LATER", payload={}, delay=HOUR)
    first, now1, now2, _now3, later = OutboxEvent.objects.order_by("id")
    shift_back(first, HOUR)
    _token, rows = OutboxEvent.objects.due().claim(3, lease_seconds=60)
    assert [r.pk for r in rows] == [first.pk, now1.pk, now2.pk]
    shift_back(later, HOUR)
    _token, rows = OutboxEvent.objects.due().claim(3, lease_seconds=60)
    assert [r.event_type for r in rows] == ["NOW", "LATER"]


def test_a_replay_is_due_from_the_replay_not_from_its_first_delivery():
    row = emit_one()
    assert make_relay().drain().sent == 1
    shift_back(row, timedelta(days=2))
    assert OutboxEvent.objects.filter(pk=row.pk).requeue(replay=True) == 1
    row.refresh_from_db()
    assert near(row.due_at, db_now(), 60)
    g = stats.gauges()
    assert g.pending == 1 and g.oldest_pending_age < 60
    assert not OutboxEvent.objects.stale(600).exists()


def test_outbox_requeue_pending_leaves_scheduled_events_waiting():
    """A redrive of PENDING rows is for rows in retry backoff: a scheduled event is not
    late, and sending it early is what it must not be."""
    scheduled = emit_one(delay=HOUR)
    with outbox.atomic() as box:
        box.emit("RETRY", payload={})
    backoff = OutboxEvent.objects.get(event_type="RETRY")
    locmem.fail_next.append(Reason.NACKED)
    make_relay(policy=FixedRetryPolicy(3600, max_attempts=5)).drain()
    backoff.refresh_from_db()
    assert backoff.retry_count == 1
    out = StringIO()
    call_command("outbox_requeue", "--status", "pending", stdout=out)
    assert "requeued 1 pending event(s)" in out.getvalue()
    assert list(OutboxEvent.objects.due()) == [backoff]
    assert list(OutboxEvent.objects.scheduled()) == [scheduled]
