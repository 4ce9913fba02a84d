"""The outbox admin: read-only changelist, permissioned triage actions, banner, dashboard."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from django_outbox.db import db_now
from django_outbox.models import OutboxEvent, Status
from django_outbox.stats import format_age
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:django_outbox_outboxevent_changelist"
DASHBOARD = "admin:django_outbox_outboxevent_dashboard"


@pytest.fixture
def viewer_client() -> Client:
    """Staff with view permission only: may look, may not triage."""
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(codename="view_outboxevent", content_type__app_label="django_outbox")
    )
    client = Client()
    client.force_login(user)
    return client


def _post_action(client: Client, action: str, rows: list[OutboxEvent]) -> object:
    """Run a list action as a user does: select, run, then confirm on the page it shows."""
    selected = {"action": action, ACTION_CHECKBOX_NAME: [str(r.pk) for r in rows], "index": 0}
    page = client.post(reverse(CHANGELIST), selected)
    if page.status_code != 200 or "params" not in (page.context or {}):
        return page  # refused (no permission): no confirmation to give
    assert page.templates[0].name.endswith("action_confirmation.html")
    confirmation = {}
    for name, value in page.context["params"]:
        confirmation.setdefault(name, []).append(value)
    return client.post(reverse(CHANGELIST), confirmation, follow=True)


def test_changelist_lists_rows_with_filters_and_no_add(superuser_client):
    make_events({"event_type": "ORDER_PAID", "last_error": "x" * 200})
    response = superuser_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    body = response.content.decode()
    assert "ORDER_PAID" in body
    assert "x" * 79 + "…" in body  # last error shortened in the list
    assert "x" * 81 not in body
    assert "?age=1h" in body  # the age filter
    assert 'href="/admin/django_outbox/outboxevent/add/"' not in body
    actions = response.context["action_form"].fields["action"].choices
    names = [name for name, _ in actions]
    assert {"requeue", "mark_dead"} <= set(names)
    assert "delete_selected" not in names


def test_search_by_event_id_and_aggregate_id(superuser_client):
    a, b = make_events({"aggregate_id": "ORD-1"}, {"aggregate_id": "ORD-2"})
    rows = superuser_client.get(reverse(CHANGELIST), {"q": a.event_id}).context["cl"].result_list
    assert [r.pk for r in rows] == [a.pk]
    rows = superuser_client.get(reverse(CHANGELIST), {"q": "ORD-2"}).context["cl"].result_list
    assert [r.pk for r in rows] == [b.pk]


def test_age_filter_uses_row_age(superuser_client):
    old, new = make_events({"age": 7200}, {"age": 5})
    rows = superuser_client.get(reverse(CHANGELIST), {"age": "1h"}).context["cl"].result_list
    assert [r.pk for r in rows] == [old.pk]
    rows = superuser_client.get(reverse(CHANGELIST), {"age": "recent"}).context["cl"].result_list
    assert [r.pk for r in rows] == [new.pk]


def test_payload_and_headers_are_pretty_printed_and_escaped(superuser_client):
    (event,) = make_events(
        {
            "payload": {"note": "<script>alert(1)</script>", "n": 1},
            "headers": {"x-trace": "<b>t</b>"},
            "last_error": "<img src=x onerror=alert(2)>",
        }
    )
    url = reverse("admin:django_outbox_outboxevent_change", args=[event.pk])
    body = superuser_client.get(url).content.decode()
    assert "<script>alert(1)</script>" not in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "&lt;b&gt;t&lt;/b&gt;" in body
    assert "<img src=x" not in body
    assert '"n": 1' in body.replace("&quot;", '"')  # indented JSON, one key per line
    # read-only: no editable inputs for the fields, no save button
    assert 'name="payload"' not in body
    assert 'name="_save"' not in body


def test_change_form_post_does_not_modify_the_row(superuser_client):
    (event,) = make_events({"status": Status.DEAD, "retry_count": 8})
    url = reverse("admin:django_outbox_outboxevent_change", args=[event.pk])
    superuser_client.post(url, {"status": Status.SENT, "retry_count": 0})
    event.refresh_from_db()
    assert (event.status, event.retry_count) == (Status.DEAD, 8)


def test_requeue_dead_and_pending_resets_them_and_keeps_last_error(superuser_client):
    dead, pending, sent = make_events(
        {"status": Status.DEAD, "retry_count": 11, "last_error": "nacked", "age": 600},
        {"status": Status.PENDING, "retry_count": 3, "lease_token": "abc", "age": 600},
        {"status": Status.SENT},
    )
    response = _post_action(superuser_client, "requeue", [dead, pending, sent])
    messages = [str(m) for m in response.context["messages"]]
    assert any("2 events requeued" in m for m in messages), messages
    assert any("1 selected event was left alone" in m for m in messages), messages
    for row in (dead, pending):
        row.refresh_from_db()
        assert row.status == Status.PENDING
        assert row.retry_count == 0
        assert row.lease_token == ""
    assert dead.last_error == "nacked"
    assert OutboxEvent.objects.due().filter(pk__in=[dead.pk, pending.pk]).count() == 2
    sent.refresh_from_db()
    assert sent.status == Status.SENT


def test_requeue_leaves_the_rows_a_relay_holds_and_names_them(superuser_client):
    """Issue 32, item 4: a row a relay is publishing, requeued, is published twice (its
    lease cleared, the relay's settle fenced off). Left alone, as outbox_requeue does."""
    now = db_now()
    held, dead = make_events(
        {"retry_count": 2, "lease_token": "relay-1", "leased_until": now + timedelta(minutes=5)},
        {"status": Status.DEAD, "retry_count": 11},
    )
    response = _post_action(superuser_client, "requeue", [held, dead])
    messages = [str(m) for m in response.context["messages"]]
    assert any("1 event requeued" in m for m in messages), messages
    (skipped,) = [m for m in messages if "left alone" in m]
    assert "a relay is publishing it right now" in skipped
    assert held.event_id in skipped
    held.refresh_from_db()
    assert (held.lease_token, held.retry_count, held.leased_until) == (
        "relay-1",
        2,
        now + timedelta(minutes=5),
    )
    dead.refresh_from_db()
    assert (dead.status, dead.retry_count) == (Status.PENDING, 0)


def test_mark_dead_only_touches_pending(superuser_client):
    pending, sent = make_events({"status": Status.PENDING}, {"status": Status.SENT})
    response = _post_action(superuser_client, "mark_dead", [pending, sent])
    messages = [str(m) for m in response.context["messages"]]
    assert any("1 event marked dead" in m for m in messages), messages
    pending.refresh_from_db()
    sent.refresh_from_db()
    assert (pending.status, sent.status) == (Status.DEAD, Status.SENT)


def test_user_without_change_permission_sees_no_actions_and_cannot_post_them(viewer_client):
    (dead,) = make_events({"status": Status.DEAD, "retry_count": 11})
    response = viewer_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert response.context["action_form"] is None
    assert "Requeue selected" not in response.content.decode()

    response = _post_action(viewer_client, "requeue", [dead])
    dead.refresh_from_db()
    assert dead.status == Status.DEAD
    assert dead.retry_count == 11
    response = _post_action(viewer_client, "mark_dead", make_events({}))
    assert OutboxEvent.objects.filter(status=Status.DEAD).count() == 1


def test_banner_shows_old_pending_and_dead_rows(superuser_client, settings):
    settings.OUTBOX_ALERT_PENDING_AGE = 60
    response = superuser_client.get(reverse(CHANGELIST))
    assert response.context["outbox_warnings"] == []
    assert "outbox-banner" not in response.content.decode()

    make_events({"age": 30})
    assert superuser_client.get(reverse(CHANGELIST)).context["outbox_warnings"] == []

    make_events({"age": 600}, {"status": Status.DEAD})
    body = superuser_client.get(reverse(CHANGELIST)).content.decode()
    assert "outbox-banner" in body
    assert "The oldest PENDING event has waited 10 min" in body
    assert "1 dead letter is waiting for triage." in body
    assert reverse(DASHBOARD) in body  # the changelist links the dashboard


def test_dashboard_shows_the_figures(superuser_client):
    make_events(
        {"age": 125},
        {"age": 10, "retry_count": 2},
        {"status": Status.DEAD, "retry_count": 7, "event_type": "ORDER_PAID"},
        {"status": Status.DEAD, "retry_count": 7, "event_type": "ORDER_PAID"},
        {"status": Status.DEAD, "retry_count": 7, "event_type": "ORDER_CREATED"},
        {"status": Status.SENT, "age": 300, "sent_age": 290},
        {"status": Status.SENT, "age": 7200, "sent_age": 7100},  # outside the window
    )
    response = superuser_client.get(reverse(DASHBOARD))
    assert response.status_code == 200
    stats = response.context["stats"]
    assert (stats.pending, stats.dead, stats.sent_in_window) == (2, 3, 1)
    assert 125 <= stats.oldest_pending_age < 185
    assert stats.top_dead_types == [("ORDER_PAID", 2), ("ORDER_CREATED", 1)]
    retries, table = response.context["triage_retries"], response.context["triage_table"]
    assert retries == [0, 2, 7]
    assert table == [("pending", [1, 1, 0]), ("sent", [1, 0, 0]), ("dead", [0, 0, 3])]
    body = response.content.decode()
    assert '<svg class="outbox-chart"' in body
    assert "<script" not in body.split('id="content-main"')[1]  # no scripts in the dashboard
    assert 'id="figure-dead"' in body
    assert format_age(stats.oldest_pending_age) in body


def test_dashboard_needs_view_permission(viewer_client):
    assert viewer_client.get(reverse(DASHBOARD)).status_code == 200
    nobody = User.objects.create_user("nobody", password="pw", is_staff=True)
    client = Client()
    client.force_login(nobody)
    assert client.get(reverse(DASHBOARD)).status_code == 403
    anonymous = Client().get(reverse(DASHBOARD))
    assert anonymous.status_code == 302  # to the login page


def test_app_index_links_the_dashboard(superuser_client):
    body = superuser_client.get(reverse("admin:app_list", args=["django_outbox"])).content
    assert reverse(DASHBOARD).encode() in body


@pytest.mark.once
def test_format_age():
    assert format_age(9.7) == "9 s"
    assert format_age(252) == "4 min 12 s"
    assert format_age(7500) == "2 h 5 min"
    assert format_age(3 * 86400 + 4 * 3600) == "3 d 4 h"
    assert format_age(3600) == "1 h"
    assert format_age(600) == "10 min"


def test_get_actions_answers_both_djangos_calls(rf):
    """5.2 and 6.0 call get_actions(request); 6.1 adds action_location (the old signature
    is deprecated there, and the suite turns that warning into an error)."""
    request = rf.get(reverse(CHANGELIST))
    request.user = User.objects.create_superuser("root", "root@example.com", "pw")
    model_admin = admin.site.get_model_admin(OutboxEvent)
    calls = [{}]
    if hasattr(admin, "ActionLocation"):  # Django 6.1+
        calls.append({"action_location": admin.ActionLocation.CHANGE_LIST})
    for kwargs in calls:
        names = set(model_admin.get_actions(request, **kwargs))
        assert {"requeue", "mark_dead"} <= names
        assert "delete_selected" not in names


@pytest.mark.parametrize("status", [Status.PENDING, Status.DEAD])
def test_an_undelivered_event_cannot_be_deleted_from_the_admin(superuser_client, status):
    """Neither the change page's Delete link nor a crafted POST to the delete view."""
    (row,) = make_events({"status": status})
    change = superuser_client.get(reverse("admin:django_outbox_outboxevent_change", args=[row.pk]))
    assert change.status_code == 200
    delete_url = reverse("admin:django_outbox_outboxevent_delete", args=[row.pk])
    assert delete_url not in change.content.decode()
    assert superuser_client.get(delete_url).status_code == 403
    assert superuser_client.post(delete_url, {"post": "yes"}).status_code == 403
    assert OutboxEvent.objects.filter(pk=row.pk, status=status).exists()


def test_a_sent_event_can_be_deleted_by_a_user_with_the_delete_permission(superuser_client):
    (row,) = make_events({"status": Status.SENT})
    delete_url = reverse("admin:django_outbox_outboxevent_delete", args=[row.pk])
    response = superuser_client.post(delete_url, {"post": "yes"})
    assert response.status_code == 302
    assert not OutboxEvent.objects.filter(pk=row.pk).exists()
