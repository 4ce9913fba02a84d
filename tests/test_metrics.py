"""Prometheus: relay counters, database gauges at scrape time, /metrics, --metrics-port,
and the deploy files naming only metrics we export."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from django.db import transaction
from django.test import Client
from prometheus_client import REGISTRY, CollectorRegistry

from django_outbox import metrics, outbox
from django_outbox.models import Status
from django_outbox.testing import relay_now
from tests.utils.rows import make_events

DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
SUFFIXES = {
    "counter": ["_total", "_created"],
    "histogram": ["_bucket", "_count", "_sum", "_created"],
    "gauge": [""],
}


def exported_names() -> set[str]:
    """Every sample name our metrics can expose, whether or not a sample exists yet."""
    names: set[str] = set()
    for collector in list(REGISTRY._collector_to_names):
        describe = getattr(collector, "describe", None)
        families = describe() if describe else collector.collect()
        for family in families:
            if family.name.startswith("django_outbox_"):
                names.update(family.name + s for s in SUFFIXES.get(family.type, [""]))
    return names


def value(name: str, **labels: str) -> float:
    """A sample of the default registry; ``database`` defaults to the outbox's alias."""
    labels.setdefault("database", "default")
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.django_db
def test_database_gauges_equal_the_table():
    make_events(
        {"age": 400},
        {"age": 10},
        {"status": Status.DEAD},
        {"status": Status.SENT},
    )
    assert value("django_outbox_pending_events") == 2
    assert value("django_outbox_dead_events") == 1
    assert 400 <= value("django_outbox_oldest_pending_age_seconds") < 460
    assert value("django_outbox_database_up") == 1


@pytest.mark.django_db
def test_gauges_follow_the_table_between_scrapes():
    assert value("django_outbox_pending_events") == 0
    (row,) = make_events({})
    assert value("django_outbox_pending_events") == 1
    row.status = Status.DEAD
    row.save(update_fields=["status"])
    assert value("django_outbox_pending_events") == 0
    assert value("django_outbox_dead_events") == 1
    assert value("django_outbox_oldest_pending_age_seconds") == 0


@pytest.mark.once
def test_unreadable_database_reports_down_without_failing_the_scrape():
    registry = CollectorRegistry()
    registry.register(metrics.OutboxCollector(using="no-such-database"))
    down = {"database": "no-such-database"}
    assert registry.get_sample_value("django_outbox_database_up", down) == 0
    assert registry.get_sample_value("django_outbox_pending_events", down) is None


@pytest.mark.django_db(transaction=True)
def test_relay_counters_increase_by_what_the_relay_did():
    before = {
        "published": value(
            "django_outbox_events_published_total", event_type="M_PING", job="publish"
        ),
        "batches": value("django_outbox_batch_duration_seconds_count", job="publish"),
        "latency": value("django_outbox_commit_to_confirm_seconds_count"),
    }
    with transaction.atomic():
        for i in range(3):
            outbox.emit("M_PING", payload={"i": i})
    result = relay_now()
    assert result.sent == 3
    assert (
        value("django_outbox_events_published_total", event_type="M_PING", job="publish")
        - before["published"]
        == 3
    )
    assert value("django_outbox_commit_to_confirm_seconds_count") - before["latency"] == 3
    assert value("django_outbox_batch_duration_seconds_count", job="publish") > before["batches"]
    assert value("django_outbox_pending_events") == 0


@pytest.mark.once
def test_counter_helpers():
    before = value("django_outbox_publish_failures_total", reason="nacked", job="t")
    metrics.failed("nacked", 2, "t", "default")
    metrics.failed("nacked", 0, "t", "default")
    assert value("django_outbox_publish_failures_total", reason="nacked", job="t") - before == 2
    before = value("django_outbox_events_dead_total", job="t")
    metrics.dead(1, "t", "default")
    assert value("django_outbox_events_dead_total", job="t") - before == 1
    # another database's relay counts under its own label
    metrics.dead(1, "t", "other")
    assert value("django_outbox_events_dead_total", job="t") - before == 1
    assert value("django_outbox_events_dead_total", job="t", database="other") >= 1


@pytest.mark.django_db
def test_web_metrics_view_serves_the_database_gauges():
    make_events({}, {}, {"status": Status.DEAD})
    body = Client().get("/metrics").content.decode()
    pending = r'^django_outbox_pending_events\{database="default"\} 2\.0$'
    assert re.search(pending, body, re.M), body[-2000:]
    assert re.search(r'^django_outbox_dead_events\{database="default"\} 1\.0$', body, re.M)
    assert "django_outbox_oldest_pending_age_seconds" in body


@pytest.mark.django_db(transaction=True)
def test_metrics_server_on_its_own_port():
    metrics.published(["SERVED"], "publish", "default")
    make_events({}, {"status": Status.DEAD})
    server = metrics.start_metrics_server(0, addr="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    served = (
        'django_outbox_events_published_total{database="default",event_type="SERVED",job="publish"}'
    )
    assert served in body
    # the scrape ran in the server's own thread, on its own database connection
    pending = r'^django_outbox_pending_events\{database="default"\} 1\.0$'
    assert re.search(pending, body, re.M), body[-2000:]
    assert re.search(r'^django_outbox_dead_events\{database="default"\} 1\.0$', body, re.M)
    assert 'django_outbox_database_up{database="default"} 1.0' in body


def test_register_collector_is_idempotent():
    assert metrics.register_collector() is metrics.register_collector()


def _promql(text: str) -> set[str]:
    return set(re.findall(r"\bdjango_outbox_[a-z_]+\b", text))


@pytest.mark.once
def test_alert_rules_name_only_exported_metrics():
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yaml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert {"OutboxOldestPendingTooOld", "OutboxPendingRising", "OutboxDeadLetters"} <= alerts
    named = set().union(*(_promql(e) for e in exprs))
    assert named, "the rules name no django_outbox metric"
    assert named <= exported_names(), named - exported_names()
    rising = next(
        r for g in rules["groups"] for r in g["rules"] if r["alert"] == "OutboxPendingRising"
    )
    assert rising["for"] == "10m"


@pytest.mark.once
def test_grafana_dashboard_has_the_three_panels_on_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    panels = dashboard["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    per_panel = [_promql(" ".join(t["expr"] for t in p["targets"])) for p in panels]
    assert per_panel == [
        {"django_outbox_pending_events"},
        {"django_outbox_oldest_pending_age_seconds"},
        {"django_outbox_dead_events"},
    ]
    named = set().union(*(_promql(e) for e in exprs))
    named |= _promql(json.dumps(dashboard["templating"]))
    assert named <= exported_names(), named - exported_names()
    # database gauges are never summed across replicas
    assert all("sum" not in e for e in exprs)


@pytest.mark.once
def test_metric_names_follow_the_conventions():
    names = exported_names()
    assert names
    for name in names:
        assert name.startswith("django_outbox_")
    families = {n for n in names if not n.endswith(("_bucket", "_count", "_sum", "_created"))}
    assert "django_outbox_events_published_total" in families
    assert "django_outbox_commit_to_confirm_seconds_bucket" in names
