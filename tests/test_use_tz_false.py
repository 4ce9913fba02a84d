"""``USE_TZ = False``: the figures, outbox_stats, the gauges and the admin, by the database clock.

Under ``USE_TZ = False`` Django stores and returns naive datetimes in local time
(``TIME_ZONE``); the database clock must be read the same way, or every age is a TypeError
(PostgreSQL) or a refused query (MySQL/MariaDB). Each test runs in UTC and in a zone eight
hours away from it, so a local time labelled as UTC shows.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from prometheus_client import CollectorRegistry

from django_outbox import db, metrics, outbox, stats
from django_outbox.exceptions import InvalidEvent
from django_outbox.models import OutboxEvent, Status
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db

#: Asia/Shanghai: UTC+8 all year (no DST to make a test flaky twice a year).
ZONES = ["UTC", "Asia/Shanghai"]


@pytest.fixture(params=ZONES)
def naive(request, settings):
    if request.param != "UTC" and connection.vendor == "mysql":
        # Django leaves MySQL's session time zone alone under USE_TZ = False, so the server's
        # clock reads in its own zone (UTC here); docs/settings.md says to make them agree.
        pytest.skip("MySQL/MariaDB: the server's time zone must be TIME_ZONE (UTC here)")
    settings.USE_TZ = False
    settings.TIME_ZONE = request.param
    return request.param


def utc_now() -> datetime:
    return datetime.now(dt_timezone.utc)


def test_db_now_is_naive_local_time_like_timezone_now(naive):
    now = db.db_now()
    assert timezone.is_naive(now)
    assert abs(now - timezone.now()) < timedelta(seconds=30)


def test_figures_with_pending_dead_and_sent_rows(naive):
    make_events(
        {"age": 300},
        {"status": Status.DEAD, "age": 100, "retry_count": 7},
        {"status": Status.SENT, "age": 200, "sent_age": 100},
    )
    with transaction.atomic():
        outbox.emit("PING", payload={})  # occurred_at: timezone.now(), naive here
    snapshot = stats.collect()
    assert (snapshot.pending, snapshot.dead, snapshot.sent_in_window) == (2, 1, 1)
    assert 300 <= snapshot.oldest_pending_age < 360
    assert snapshot.created_in_window == 4
    assert sum(b.created for b in snapshot.trend) == 4
    assert sum(b.sent for b in snapshot.trend) == 1
    emitted = OutboxEvent.objects.get(event_type="PING")
    assert abs(emitted.created_at - emitted.occurred_at) < timedelta(seconds=30)


def test_outbox_stats_text(naive):
    make_events({"age": 300})
    out = StringIO()
    call_command("outbox_stats", "--max-oldest-age", "1h", stdout=out)
    assert re.search(r"^PENDING\s+1$", out.getvalue(), re.MULTILINE)
    assert re.search(r"^oldest PENDING age\s+5 min$", out.getvalue(), re.MULTILINE)


def test_outbox_stats_json_times_are_utc(naive):
    make_events({"age": 300})
    out = StringIO()
    call_command("outbox_stats", "--json", stdout=out)
    data = json.loads(out.getvalue())
    now = datetime.fromisoformat(data["now"])
    assert now.utcoffset() == timedelta(0)
    assert abs(now - utc_now()) < timedelta(seconds=30)
    oldest = datetime.fromisoformat(data["oldest_pending_due_since"])
    assert abs(now - oldest - timedelta(seconds=300)) < timedelta(seconds=1)
    assert 300 <= data["oldest_pending_age_seconds"] < 360


def test_outbox_stats_on_an_empty_table(naive):
    out = StringIO()
    call_command("outbox_stats", "--json", stdout=out)
    assert json.loads(out.getvalue())["pending"] == 0


def test_gauges_read_the_database(naive):
    make_events({"age": 300}, {"status": Status.DEAD})
    registry = CollectorRegistry()
    registry.register(metrics.OutboxCollector())
    assert registry.get_sample_value("django_outbox_database_up", {"database": "default"}) == 1
    assert registry.get_sample_value("django_outbox_pending_events", {"database": "default"}) == 1
    assert registry.get_sample_value("django_outbox_dead_events", {"database": "default"}) == 1
    assert (
        300
        <= registry.get_sample_value(
            "django_outbox_oldest_pending_age_seconds", {"database": "default"}
        )
        < 360
    )


def test_admin_changelist_and_dashboard(naive, settings):
    settings.OUTBOX_ALERT_PENDING_AGE = 60
    make_events({"age": 600}, {"status": Status.SENT, "age": 300, "sent_age": 290})
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    changelist = client.get(reverse("admin:django_outbox_outboxevent_changelist"))
    assert changelist.status_code == 200
    assert "The oldest PENDING event has waited 10 min" in changelist.content.decode()
    for age in ("recent", "10m"):
        filtered = client.get(reverse("admin:django_outbox_outboxevent_changelist"), {"age": age})
        assert filtered.status_code == 200
    dashboard = client.get(reverse("admin:django_outbox_outboxevent_dashboard"))
    assert dashboard.status_code == 200
    snapshot = dashboard.context["stats"]
    assert (snapshot.pending, snapshot.sent_in_window) == (1, 1)
    assert 600 <= snapshot.oldest_pending_age < 660


def test_scheduled_events_in_local_time(naive):
    """deliver_at is a naive local time, delay counts on the database clock in local time:
    both land where the relay's clock (local time here) finds them due, and no earlier."""
    when = (timezone.now() + timedelta(hours=2)).replace(microsecond=250000)
    with transaction.atomic():
        outbox.emit("AT", payload={}, deliver_at=when)
        outbox.emit("AFTER", payload={}, delay=timedelta(hours=1))
        outbox.emit("PAST", payload={}, deliver_at=timezone.now() - timedelta(days=1))
    at, after, past = (OutboxEvent.objects.get(event_type=t) for t in ("AT", "AFTER", "PAST"))
    assert at.next_retry_time == at.due_at == when
    assert abs(after.due_at - after.created_at - timedelta(hours=1)) < timedelta(seconds=1)
    assert abs(past.due_at - past.created_at) < timedelta(seconds=1)
    assert list(OutboxEvent.objects.due()) == [past]
    assert stats.gauges().scheduled == 2
    with pytest.raises(InvalidEvent, match="aware"), transaction.atomic():
        outbox.emit("AT", payload={}, deliver_at=when.replace(tzinfo=dt_timezone.utc))
