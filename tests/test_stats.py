"""django_outbox.stats: every figure equals what the table holds, by the database clock."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_outbox import outbox, stats
from django_outbox.models import OutboxEvent, Status
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db


def test_empty_table():
    snapshot = stats.collect()
    assert (snapshot.pending, snapshot.dead, snapshot.oldest_pending_age) == (0, 0, 0.0)
    assert snapshot.gauges.oldest_pending_due_since is None
    assert snapshot.triage == []
    assert snapshot.top_dead_types == []
    assert len(snapshot.trend) == stats.TREND_BUCKETS
    assert all(b.created == b.sent == 0 for b in snapshot.trend)


def test_gauges_match_the_rows_emitted_and_updated():
    with transaction.atomic():
        for i in range(5):
            outbox.emit("ORDER_CREATED", payload={"i": i}, aggregate_type="ORDER", aggregate_id=i)
    ids = list(OutboxEvent.objects.order_by("id").values_list("id", flat=True))
    OutboxEvent.objects.filter(id__in=ids[:2]).update(status=Status.SENT)
    OutboxEvent.objects.filter(id=ids[2]).update(status=Status.DEAD)
    g = stats.gauges()
    assert g.pending == OutboxEvent.objects.pending().count() == 2
    assert g.dead == OutboxEvent.objects.dead().count() == 1
    assert g.oldest_pending_due_since == OutboxEvent.objects.get(id=ids[3]).created_at


def test_oldest_pending_age_ignores_sent_and_dead_rows():
    make_events(
        {"status": Status.SENT, "age": 9000},
        {"status": Status.DEAD, "age": 8000},
        {"age": 300},
        {"age": 20},
    )
    g = stats.gauges()
    assert 300 <= g.oldest_pending_age < 360


def test_triage_table_is_status_by_retry_count_over_the_window():
    make_events(
        {"retry_count": 0},
        {"retry_count": 0},
        {"retry_count": 4},
        {"status": Status.DEAD, "retry_count": 7},
        {"status": Status.SENT, "retry_count": 1},
        {"retry_count": 9, "age": 7200},  # created before the window
    )
    snapshot = stats.collect(window=3600)
    expected = {
        (int(status), retry): n
        for status, retry, n in [
            (Status.PENDING, 0, 2),
            (Status.PENDING, 4, 1),
            (Status.SENT, 1, 1),
            (Status.DEAD, 7, 1),
        ]
    }
    assert {(r.status, r.retry_count): r.count for r in snapshot.triage} == expected
    assert snapshot.created_in_window == 5
    retries, table = snapshot.triage_matrix()
    assert retries == [0, 1, 4, 7]
    assert table == [
        ("pending", [2, 0, 1, 0]),
        ("sent", [0, 1, 0, 0]),
        ("dead", [0, 0, 0, 1]),
    ]
    # a wider window takes the old row in
    assert stats.collect(window=3 * 3600).created_in_window == 6


def test_sent_in_window_counts_by_sent_at():
    make_events(
        {"status": Status.SENT, "age": 100, "sent_age": 50},
        {"status": Status.SENT, "age": 5000, "sent_age": 1000},  # created before, sent inside
        {"status": Status.SENT, "age": 5000, "sent_age": 4000},  # sent before the window
        {"status": Status.PENDING, "age": 10},
    )
    assert stats.collect(window=3600).sent_in_window == 2


def test_top_dead_types_most_frequent_first():
    make_events(
        *[{"status": Status.DEAD, "event_type": "B"}] * 3,
        *[{"status": Status.DEAD, "event_type": "A"}] * 3,
        {"status": Status.DEAD, "event_type": "C", "age": 90000},  # old dead letters count too
        {"status": Status.PENDING, "event_type": "Z"},
    )
    assert stats.collect(top=2).top_dead_types == [("A", 3), ("B", 3)]
    assert stats.collect().top_dead_types == [("A", 3), ("B", 3), ("C", 1)]


def test_trend_buckets_created_and_sent_per_minute():
    make_events(
        {"age": 5},
        {"age": 5},
        {"age": 30 * 60},
        {"status": Status.SENT, "age": 40 * 60, "sent_age": 5},
        {"age": 2 * 3600},  # outside the hour
    )
    snapshot = stats.collect(window=3600)
    trend = snapshot.trend
    assert snapshot.trend_bucket_seconds == 60
    assert sum(b.created for b in trend) == 4
    assert sum(b.sent for b in trend) == 1
    assert trend[-1].start <= snapshot.gauges.now < trend[-1].start + timedelta(minutes=1)
    last_two = trend[-1].created + trend[-2].created  # the two "5 s ago" rows
    assert last_two == 2
    assert trend[-1].sent + trend[-2].sent == 1
    for a, b in itertools.pairwise(trend):
        assert b.start - a.start == timedelta(minutes=1)


def test_trend_of_a_long_window_has_wider_buckets():
    make_events({"age": 5 * 3600})
    snapshot = stats.collect(window=24 * 3600)
    assert snapshot.trend_bucket_seconds == 24 * 60
    assert len(snapshot.trend) == stats.TREND_BUCKETS
    assert sum(b.created for b in snapshot.trend) == 1


def test_gauges_cost_a_few_bounded_queries_and_collect_a_handful():
    make_events({}, {"status": Status.DEAD})
    with CaptureQueriesContext(connection) as queries:
        stats.gauges()
    # The clock, three counts that stop at counting.EXACT_UP_TO rows (an estimate above
    # it: tests/test_counting.py) and two for the oldest PENDING row: none reads every
    # PENDING row.
    assert len(queries) == 6
    with CaptureQueriesContext(connection) as queries:
        stats.collect()
    assert len(queries) <= 10


def test_as_dict_is_json_ready():
    import json

    make_events({"status": Status.DEAD, "event_type": "X"})
    data = json.loads(json.dumps(stats.collect().as_dict()))
    assert data["dead"] == 1
    assert data["triage"][0]["status"] == "dead"


@pytest.mark.once
def test_window_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        stats.collect(window=0)


def test_thresholds_name_each_limit_the_figures_are_over():
    make_events({"age": 900}, {"age": 10}, {"status": Status.DEAD})
    snapshot = stats.collect()
    assert stats.Thresholds().crossed(snapshot) == []
    kept = stats.Thresholds(max_pending=2, max_oldest_age=3600, max_dead=1, max_blocked=0)
    assert kept.crossed(snapshot) == []
    over = stats.Thresholds(max_pending=1, max_oldest_age=600, max_dead=0)
    assert [sentence.split()[-2] for sentence in over.crossed(snapshot)] == [
        "--max-pending",
        "--max-oldest-age",
        "--max-dead",
    ]
