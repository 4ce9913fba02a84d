"""Counts of a big outbox: exact up to counting.EXACT_UP_TO, the database's estimate above
it, said so ("about") by outbox_stats, the dashboard and the event list; the list makes no
unbounded COUNT(*) however many rows it has."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_outbox import counting, stats
from django_outbox.db import db_now
from django_outbox.models import OutboxEvent, Status
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:django_outbox_outboxevent_changelist"
DASHBOARD = "admin:django_outbox_outboxevent_dashboard"
#: Whether the database gives an estimate (SQLite, for development, counts exactly).
ESTIMATES = connection.vendor in ("postgresql", "mysql")


@pytest.fixture
def bound(monkeypatch):
    """Counts exact up to 5 rows: 12 PENDING rows are "a big outbox"."""
    monkeypatch.setattr(counting, "EXACT_UP_TO", 5)
    make_events(*({"age": 60} for _ in range(12)))


def test_a_count_under_the_bound_is_exact():
    make_events({}, {}, {"status": Status.DEAD})
    count = counting.count_rows(OutboxEvent.objects.filter(status=Status.PENDING))
    assert count == counting.RowCount(2, estimated=False)
    assert str(count) == "2"


def test_a_count_over_the_bound_is_the_databases_estimate(bound):
    count = counting.count_rows(OutboxEvent.objects.filter(status=Status.PENDING))
    if ESTIMATES:
        assert count.estimated
        assert count.value >= 6  # at least the rows counted before it stopped
        assert str(count).startswith("about ")
    else:
        assert count == counting.RowCount(12, estimated=False)


def test_an_estimate_is_shown_to_two_significant_digits():
    assert counting.rounded(1_034_567) == 1_000_000
    assert counting.rounded(98_765) == 99_000
    assert counting.rounded(42) == 42
    assert str(counting.RowCount(250_400, estimated=True)).replace(",", "") == "about 250000"
    assert str(counting.About(250_400)).replace(",", "") == "about 250000"
    assert counting.About(250_400) + 1 == 250_401  # still a number to the paginator


def test_gauges_name_the_estimated_counts(bound):
    make_events({"status": Status.DEAD})
    g = stats.gauges()
    assert g.estimated == (("pending",) if ESTIMATES else ())
    assert g.dead == 1 and g.shown("dead") == "1"
    assert g.shown("pending").startswith("about ") == ESTIMATES
    assert 60 <= g.oldest_pending_age < 120


def test_outbox_stats_says_about(bound):
    out = StringIO()
    call_command("outbox_stats", stdout=out)
    text = out.getvalue()
    assert ("about" in text.split("\n")[0]) == ESTIMATES
    assert ("the database's estimate" in text) == ESTIMATES
    out = StringIO()
    call_command("outbox_stats", "--json", stdout=out)
    figures = json.loads(out.getvalue())
    assert figures["estimated"] == (["pending"] if ESTIMATES else [])


def test_dashboard_says_about(superuser_client, bound):
    body = superuser_client.get(reverse(DASHBOARD)).content.decode()
    figure = body.split('id="figure-pending"')[1].split("</li>")[0]
    assert ("about " in figure) == ESTIMATES
    assert ('class="help outbox-estimated"' in body) == ESTIMATES


def test_changelist_makes_no_full_count_over_the_bound(superuser_client, bound):
    with CaptureQueriesContext(connection) as queries:
        response = superuser_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"].upper()]
    assert counts, "the list counts its rows"
    if ESTIMATES:
        # Every count stops at the bound: a LIMIT in its subquery.
        assert all("LIMIT" in sql.upper() for sql in counts), counts
        assert "about " in response.content.decode()
        assert str(response.context["cl"].result_count).startswith("about ")
    else:
        assert response.context["cl"].result_count == 12


def test_changelist_filtered_under_the_bound_is_exact(superuser_client, bound):
    make_events({"status": Status.DEAD}, {"status": Status.DEAD})
    response = superuser_client.get(reverse(CHANGELIST), {"status__exact": int(Status.DEAD)})
    assert response.context["cl"].result_count == 2
    assert type(response.context["cl"].result_count) is int


def test_oldest_pending_age_without_reading_every_pending_row():
    """The oldest of: the oldest row never scheduled nor requeued, and the earliest passed
    ``due_at`` of the rows created before it; not a row scheduled for later."""
    now = db_now()
    plain, requeued, scheduled, recent_requeue = make_events(
        {"age": 600}, {"age": 3600}, {"age": 7200}, {"age": 60}
    )
    OutboxEvent.objects.filter(pk=requeued.pk).update(due_at=now - timedelta(seconds=900))
    OutboxEvent.objects.filter(pk=scheduled.pk).update(
        due_at=now + timedelta(hours=1), next_retry_time=now + timedelta(hours=1)
    )
    OutboxEvent.objects.filter(pk=recent_requeue.pk).update(due_at=now)
    g = stats.gauges()
    assert 900 <= g.oldest_pending_age < 960  # the requeued row, due 900 s ago
    assert g.scheduled == 1 and g.pending == 3
    OutboxEvent.objects.filter(pk=requeued.pk).update(due_at=now - timedelta(seconds=300))
    assert 600 <= stats.gauges().oldest_pending_age < 660  # now the plain row is older
    OutboxEvent.objects.filter(pk=plain.pk).delete()
    assert 300 <= stats.gauges().oldest_pending_age < 360  # no plain row left


def test_type_filters_list_the_newest_rows_values_and_say_so(superuser_client, monkeypatch):
    make_events({"event_type": "OLD_TYPE"}, {"event_type": "ORDER_PAID"}, {})
    response = superuser_client.get(reverse(CHANGELIST))
    choices = _filter_choices(response, "event_type")
    assert choices == ["All", "OLD_TYPE", "ORDER_CREATED", "ORDER_PAID"]
    monkeypatch.setattr(counting, "EXACT_UP_TO", 2)  # OLD_TYPE is the third newest
    with CaptureQueriesContext(connection) as queries:
        response = superuser_client.get(reverse(CHANGELIST))
    assert not any("DISTINCT" in q["sql"] and "LIMIT" not in q["sql"] for q in queries)
    assert _filter_choices(response, "event_type") == ["All", "ORDER_CREATED", "ORDER_PAID"]
    assert "(of the newest 2 events)" in response.content.decode()
    # A value typed into the URL still filters every row, and shows as chosen.
    response = superuser_client.get(reverse(CHANGELIST), {"event_type": "OLD_TYPE"})
    assert response.context["cl"].result_count == 1
    assert "OLD_TYPE" in _filter_choices(response, "event_type")


def _filter_choices(response, parameter):
    for spec in response.context["cl"].filter_specs:
        if getattr(spec, "lookup_kwarg", None) == parameter:
            return [str(c["display"]) for c in spec.choices(response.context["cl"])]
    raise AssertionError(f"no filter on {parameter}")
