"""Ordered mode (OUTBOX_ORDERED): the claim takes aggregate heads only, on every database."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_outbox import ordering
from django_outbox.backends import locmem
from django_outbox.backends.base import Reason
from django_outbox.db import db_now
from django_outbox.models import OutboxEvent, Status
from tests.utils.relay import make_relay
from tests.utils.rows import expire_leases, make_events

pytestmark = pytest.mark.django_db(transaction=True)


def rows(*specs: tuple[str, str] | dict[str, Any]) -> list[OutboxEvent]:
    """Insert due PENDING rows in the given order: ("ORDER", "1") or a dict of fields."""
    return make_events(*specs, event_type="E", aggregate_id="1", payload={}, due_age=1)


def claim_ids(limit: int = 100, **kwargs: Any) -> list[int]:
    kwargs.setdefault("ordered", True)
    _token, claimed = OutboxEvent.objects.due().claim(limit, lease_seconds=60, **kwargs)
    return [row.pk for row in claimed]


def test_claim_takes_only_the_head_of_each_aggregate():
    a1, b1, _a2, c1, _b2 = rows(("O", "a"), ("O", "b"), ("O", "a"), ("O", "c"), ("O", "b"))
    assert claim_ids() == [a1.pk, b1.pk, c1.pk]
    # The heads are leased (still PENDING): their successors wait, and nothing else is due.
    assert claim_ids() == []


def test_unordered_claim_takes_everything():
    made = rows(("O", "a"), ("O", "a"), ("O", "a"))
    assert claim_ids(ordered=False) == [r.pk for r in made]


def test_aggregate_type_is_part_of_the_key():
    order, customer = rows(("ORDER", "1"), ("CUSTOMER", "1"))
    assert claim_ids() == [order.pk, customer.pk]


def test_rows_without_aggregate_id_are_never_ordered():
    made = rows(("O", ""), ("O", ""))
    assert claim_ids() == [r.pk for r in made]


def test_a_head_in_retry_backoff_blocks_its_successors():
    head, _nxt = rows(("O", "a"), ("O", "a"))
    OutboxEvent.objects.filter(pk=head.pk).update(
        retry_count=1, next_retry_time=db_now() + timedelta(seconds=30)
    )
    assert claim_ids() == []
    OutboxEvent.objects.filter(pk=head.pk).update(next_retry_time=db_now())
    assert claim_ids() == [head.pk]


def test_sent_head_releases_the_successor():
    head, nxt, _last = rows(("O", "a"), ("O", "a"), ("O", "a"))
    assert claim_ids() == [head.pk]
    OutboxEvent.objects.filter(pk=head.pk).update(status=Status.SENT)
    assert claim_ids() == [nxt.pk]


def test_a_dead_head_blocks_by_default_and_skip_lets_successors_go():
    head, nxt = rows(("O", "a"), ("O", "a"))
    OutboxEvent.objects.filter(pk=head.pk).update(status=Status.DEAD)
    assert claim_ids() == []
    assert claim_ids(dead_head="skip") == [nxt.pk]


def test_settings_drive_the_claim(settings):
    head, nxt = rows(("O", "a"), ("O", "a"))
    settings.OUTBOX_ORDERED = False
    assert claim_ids(ordered=None, limit=1) == [head.pk]
    expire_leases()
    settings.OUTBOX_ORDERED = True
    assert claim_ids(ordered=None) == [head.pk]
    OutboxEvent.objects.filter(pk=head.pk).update(status=Status.DEAD)
    assert claim_ids(ordered=None) == []
    settings.OUTBOX_ORDERED_DEAD_HEAD = "skip"
    assert claim_ids(ordered=None) == [nxt.pk]


def test_a_list_orders_those_event_or_aggregate_types_only():
    created, note, _paid = rows(
        {"aggregate_id": "a", "event_type": "ORDER_CREATED"},
        {"aggregate_id": "a", "event_type": "NOTE_ADDED"},
        {"aggregate_id": "a", "event_type": "ORDER_PAID"},
    )
    # NOTE_ADDED is not ordered: it neither waits nor holds ORDER_PAID back.
    assert claim_ids(ordered=["ORDER_CREATED", "ORDER_PAID"]) == [created.pk, note.pk]
    expire_leases()
    # By aggregate type: every event of ORDER aggregates is ordered.
    assert claim_ids(ordered=["ORDER"]) == [created.pk]


def test_claim_is_still_few_statements():
    rows(("O", "a"), ("O", "b"))
    with CaptureQueriesContext(connection) as ctx:
        claim_ids()
    statements = [q["sql"] for q in ctx.captured_queries if "outbox" in q["sql"]]
    # select ... for update skip locked, the lease update, the heads' previous_sequence.
    # PostgreSQL locks and leases in one UPDATE ... RETURNING, on the oldest rows first,
    # then (the batch has room left) again, looking for heads aggregate by aggregate;
    # MariaDB looks at the oldest rows first too, then (room left) at every head, each
    # time listing the candidates first, then locking them by id.
    expected = {"postgresql": 3, "mysql": 6}.get(connection.vendor, 3)
    assert len(statements) == expected, statements
    if connection.vendor == "postgresql":
        assert "SKIP LOCKED" in statements[0].upper()
        assert "WITH RECURSIVE" in statements[1].upper()
        assert all("GROUP BY" not in sql.upper() for sql in statements[:2])
    elif connection.vendor == "mysql":
        assert "SKIP LOCKED" in statements[1].upper() and "SKIP LOCKED" in statements[4].upper()
        assert "GROUP BY" not in statements[0].upper()
        assert "GROUP BY" in statements[3].upper()
    else:
        assert "GROUP BY" in statements[0].upper()


def test_heads_behind_a_long_queue_of_one_aggregate_are_claimed(monkeypatch):
    """The claim looks at the oldest rows first (ordering.HEADS_WINDOW per event of the
    batch), then aggregate by aggregate: a head behind a hot aggregate's queue, longer than
    that, is found in the same claim."""
    monkeypatch.setattr(ordering, "HEADS_WINDOW", 2)
    queue = rows(*[("O", "hot")] * 10)
    behind, unordered = rows(("O", "b"), ("O", ""))
    assert claim_ids(limit=3) == [queue[0].pk, behind.pk, unordered.pk]
    assert claim_ids() == []


def test_behind_a_long_queue_dead_heads_and_a_list_of_types_still_hold(monkeypatch):
    monkeypatch.setattr(ordering, "HEADS_WINDOW", 1)
    queue = rows(*[("O", "hot")] * 5)
    dead, after, x1, x2 = rows(("O", "b"), ("O", "b"), ("X", "c"), ("X", "c"))
    OutboxEvent.objects.filter(pk=dead.pk).update(status=Status.DEAD)
    assert claim_ids(limit=4) == [queue[0].pk, x1.pk]
    expire_leases()
    assert claim_ids(limit=4, dead_head="skip") == [queue[0].pk, after.pk, x1.pk]
    expire_leases()
    # Only aggregate type O is ordered: X's events are not held back by each other.
    assert claim_ids(limit=5, ordered=["O"], dead_head="skip") == [
        queue[0].pk,
        after.pk,
        x1.pk,
        x2.pk,
    ]


def test_blocked_aggregates_lists_dead_heads_with_waiting_count():
    a1, _a2, _a3, b1, _c1, _c2 = rows(
        ("O", "a"), ("O", "a"), ("O", "a"), ("O", "b"), ("O", "c"), ("O", "c")
    )
    OutboxEvent.objects.filter(pk__in=[a1.pk, b1.pk]).update(status=Status.DEAD)
    blocked = list(OutboxEvent.objects.blocked_aggregates(ordered=True))
    # b1 is DEAD with nothing behind it: a dead letter, but it blocks nothing.
    assert [(r.pk, r.waiting) for r in blocked] == [(a1.pk, 2)]
    assert list(OutboxEvent.objects.blocked_aggregates(ordered=True, dead_head="skip")) == []
    assert list(OutboxEvent.objects.blocked_aggregates(ordered=False)) == []


def sequences() -> list[tuple[str, int]]:
    return [(m.headers["aggregate_id"], m.headers["sequence"]) for m in locmem.outbox]


def test_relay_keeps_order_through_a_failed_head_then_requeue(settings):
    settings.OUTBOX_ORDERED = True
    settings.OUTBOX_RETRY_SCHEDULE = [30]
    a1, b1, a2, b2 = rows(("O", "a"), ("O", "b"), ("O", "a"), ("O", "b"))
    locmem.fail_next.append(Reason.NACKED)  # a1's first attempt
    make_relay().drain()
    # b went through, a waits behind its head in backoff.
    assert sequences() == [("b", b1.pk), ("b", b2.pk)]
    OutboxEvent.objects.filter(pk=a1.pk).update(next_retry_time=db_now())
    make_relay().drain()
    assert sequences()[2:] == [("a", a1.pk), ("a", a2.pk)]


def test_hot_aggregate_drains_in_one_pass(settings):
    """Each batch frees the next head: drain() goes on while ordered rows were sent."""
    settings.OUTBOX_ORDERED = True
    made = rows(*[("O", "hot")] * 5)
    result = make_relay().drain()
    assert result.sent == 5
    assert [s for _, s in sequences()] == [r.pk for r in made]


def test_dead_head_blocks_until_requeued_from_the_admin(settings, client, django_user_model):
    settings.OUTBOX_ORDERED = True
    settings.OUTBOX_RETRY_SCHEDULE = [1]
    a1, a2, b1 = rows(("O", "a"), ("O", "a"), ("O", "b"))
    locmem.fail_next.extend([Reason.UNROUTABLE])
    make_relay().drain()
    OutboxEvent.objects.filter(pk=a1.pk).update(next_retry_time=db_now())
    locmem.fail_next.extend([Reason.UNROUTABLE])
    make_relay().drain()
    assert OutboxEvent.objects.get(pk=a1.pk).status == Status.DEAD
    assert [r.pk for r in OutboxEvent.objects.blocked_aggregates()] == [a1.pk]
    make_relay().drain()
    assert sequences() == [("b", b1.pk)]
    assert OutboxEvent.objects.get(pk=a2.pk).status == Status.PENDING

    from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
    from django.urls import reverse

    client.force_login(django_user_model.objects.create_superuser("root", "r@x.org", "pw"))
    client.post(
        reverse("admin:django_outbox_outboxevent_changelist"),
        {"action": "requeue", ACTION_CHECKBOX_NAME: [str(a1.pk)], "index": 0, "post": "yes"},
    )
    assert list(OutboxEvent.objects.blocked_aggregates()) == []
    make_relay().drain()
    assert sequences()[1:] == [("a", a1.pk), ("a", a2.pk)]


def kill_head(head: OutboxEvent, settings, caplog) -> None:
    """With a one-step schedule, two unroutable attempts make ``head`` DEAD (and alert)."""
    settings.OUTBOX_RETRY_SCHEDULE = [1]
    locmem.fail_next.append(Reason.UNROUTABLE)
    make_relay().drain()
    OutboxEvent.objects.filter(pk=head.pk).update(next_retry_time=db_now())
    locmem.fail_next.append(Reason.UNROUTABLE)
    with caplog.at_level("ERROR", logger="django_outbox.alerts"):
        make_relay().drain()


def test_skip_policy_lets_successors_go_and_says_so_in_the_alert(settings, caplog):
    settings.OUTBOX_ORDERED = True
    settings.OUTBOX_ORDERED_DEAD_HEAD = "skip"
    a1, a2 = rows(("O", "a"), ("O", "a"))
    kill_head(a1, settings, caplog)
    assert OutboxEvent.objects.get(pk=a1.pk).status == Status.DEAD
    assert sequences() == [("a", a2.pk)]
    assert a1.event_id in caplog.text
    assert "skipped" in caplog.text


def test_block_policy_alert_says_the_aggregate_waits(settings, caplog):
    settings.OUTBOX_ORDERED = True
    a1, _a2 = rows(("O", "a"), ("O", "a"))
    kill_head(a1, settings, caplog)
    assert "blocks" in caplog.text and "requeue" in caplog.text


# -- blocked aggregates: outbox_stats, the dashboard, the metric ------------------------------
@pytest.fixture
def blocked_aggregate(settings) -> OutboxEvent:
    settings.OUTBOX_ORDERED = True
    head, _a2, _a3, dead_alone = rows(("O", "a"), ("O", "a"), ("O", "a"), ("O", "b"))
    OutboxEvent.objects.filter(pk__in=[head.pk, dead_alone.pk]).update(
        status=Status.DEAD, last_error="[unroutable] no queue bound"
    )
    return head


def test_outbox_stats_shows_blocked_aggregates(blocked_aggregate):
    import json
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    out = StringIO()
    call_command("outbox_stats", stdout=out)
    text = out.getvalue()
    assert "blocked aggregates  1" in text
    assert f"O:a  head id={blocked_aggregate.pk}" in text and "2 waiting" in text
    out = StringIO()
    call_command("outbox_stats", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["blocked_aggregates"] == 1
    assert data["blocked"][0]["event_id"] == blocked_aggregate.event_id
    assert data["blocked"][0]["waiting"] == 2
    with pytest.raises(CommandError) as exc:
        call_command("outbox_stats", "--max-blocked", "0", stdout=StringIO())
    assert exc.value.returncode == 1


def test_outbox_stats_without_ordered_mode_has_no_blocked_line(blocked_aggregate, settings):
    from io import StringIO

    from django.core.management import call_command

    settings.OUTBOX_ORDERED = False
    out = StringIO()
    call_command("outbox_stats", stdout=out)
    assert "blocked" not in out.getvalue()


def test_metric_counts_blocked_aggregates(blocked_aggregate, settings):
    from prometheus_client import REGISTRY

    assert (
        REGISTRY.get_sample_value("django_outbox_blocked_aggregates", {"database": "default"}) == 1
    )
    settings.OUTBOX_ORDERED_DEAD_HEAD = "skip"
    assert (
        REGISTRY.get_sample_value("django_outbox_blocked_aggregates", {"database": "default"}) == 0
    )


def test_dashboard_and_banner_show_blocked_aggregates(blocked_aggregate, client, django_user_model):
    from django.urls import reverse

    client.force_login(django_user_model.objects.create_superuser("root", "r@x.org", "pw"))
    body = client.get(reverse("admin:django_outbox_outboxevent_dashboard")).content.decode()
    assert 'id="figure-blocked"' in body
    assert blocked_aggregate.event_id in body and "O:a" in body
    change = reverse("admin:django_outbox_outboxevent_change", args=[blocked_aggregate.pk])
    assert change in body
    banner = client.get(reverse("admin:django_outbox_outboxevent_changelist")).content.decode()
    assert "1 aggregate is blocked by a dead event" in banner


@pytest.mark.once
@pytest.mark.parametrize(("value", "expected"), [("1", "True"), ("0", "False"), (None, "False")])
def test_demo_project_turns_ordered_mode_on_from_the_environment(value, expected):
    import os
    import subprocess

    from tests.utils.subprocess import manage_command

    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_ORDERED"}
    env.update(DJANGO_SETTINGS_MODULE="config.settings", DATABASE_URL="sqlite://:memory:")
    if value is not None:
        env["OUTBOX_ORDERED"] = value
    code = "from django.conf import settings; print(settings.OUTBOX_ORDERED)"
    out = subprocess.run(
        manage_command("shell", "-c", code), env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == expected
