"""The admin's triage on every supported Django (issue 28, item 5): the list's actions and the
change page's buttons confirm first, the list leaves empty what does not apply to a row, the
admin index links the dashboard, and the pages' breadcrumbs are the admin's own."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from django_outbox.db import db_now
from django_outbox.models import OutboxEvent, Status
from django_outbox.templatetags.outbox_admin import outbox_crumbs
from tests.utils.admin import staff_client
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:django_outbox_outboxevent_changelist"
DASHBOARD = "admin:django_outbox_outboxevent_dashboard"


@pytest.fixture
def viewer() -> Client:
    return staff_client("viewer", "view_outboxevent")


def statuses(*rows: OutboxEvent) -> list[int]:
    return [OutboxEvent.objects.get(pk=row.pk).status for row in rows]


def held_row(**fields: object) -> dict[str, object]:
    """A row a relay is publishing: claimed, its lease running for five more minutes."""
    return {"lease_token": "relay-1", "leased_until": db_now() + timedelta(minutes=5), **fields}


# -- the list's actions ask first ------------------------------------------------------------


@pytest.mark.parametrize("action", ["requeue", "mark_dead"])
def test_a_list_action_shows_what_it_would_do_and_changes_nothing(superuser_client, action):
    dead, pending, held, sent = make_events(
        {"status": Status.DEAD, "last_error": "[unroutable] NO_ROUTE"},
        {"retry_count": 2},
        held_row(),
        {"status": Status.SENT},
    )
    rows = [dead, pending, held, sent]
    selected = {"action": action, ACTION_CHECKBOX_NAME: [r.pk for r in rows], "index": 0}
    page = superuser_client.post(reverse(CHANGELIST), selected)
    assert page.status_code == 200
    body = page.content.decode()
    assert statuses(*rows) == [Status.DEAD, Status.PENDING, Status.PENDING, Status.SENT]
    if action == "requeue":
        assert "Requeue these 2 events?" in body
        assert "2 of them are left alone" not in body
        assert "1 of them is left alone: it is already sent." in body
        assert dead.event_id in body and pending.event_id in body
    else:
        assert "Mark this event dead?" in body
        assert "2 of them are left alone: they are not pending." in body
    assert "A relay is publishing this one right now" in body and held.event_id in body
    assert 'name="csrfmiddlewaretoken"' in body
    assert '<input type="hidden" name="post" value="yes">' in body
    assert f'<input type="hidden" name="action" value="{action}">' in body
    assert body.count(f'name="{ACTION_CHECKBOX_NAME}"') == 4
    assert 'class="button cancel-link"' in body


def test_confirming_the_list_action_requeues_and_says_what_it_left(superuser_client):
    dead, held = make_events({"status": Status.DEAD}, held_row())
    data = {"action": "requeue", ACTION_CHECKBOX_NAME: [dead.pk, held.pk], "post": "yes"}
    response = superuser_client.post(reverse(CHANGELIST), data, follow=True)
    messages = [str(m) for m in response.context["messages"]]
    assert messages[0] == "1 event requeued: it is due now and the relay will publish it."
    assert held.event_id in messages[1]
    assert statuses(dead, held) == [Status.PENDING, Status.PENDING]
    assert OutboxEvent.objects.get(pk=held.pk).lease_token == "relay-1"


def test_a_viewer_cannot_confirm_an_action(viewer):
    (dead,) = make_events({"status": Status.DEAD})
    data = {"action": "requeue", ACTION_CHECKBOX_NAME: [dead.pk], "post": "yes"}
    viewer.post(reverse(CHANGELIST), data)
    assert statuses(dead) == [Status.DEAD]


# -- the change page's buttons -----------------------------------------------------------------


def change_url(row: OutboxEvent) -> str:
    return reverse("admin:django_outbox_outboxevent_change", args=[row.pk])


def test_the_change_page_offers_what_applies_to_the_row(superuser_client, viewer):
    dead, pending, sent = make_events(
        {"status": Status.DEAD}, {"status": Status.PENDING}, {"status": Status.SENT}
    )
    requeue = reverse("admin:django_outbox_outboxevent_requeue", args=[dead.pk])
    body = superuser_client.get(change_url(dead)).content.decode()
    assert f'href="{requeue}" class="outbox-requeue"' in body
    assert "outbox-mark-dead" not in body
    body = superuser_client.get(change_url(pending)).content.decode()
    assert "outbox-requeue" in body and "outbox-mark-dead" in body
    body = superuser_client.get(change_url(sent)).content.decode()
    assert "outbox-requeue" not in body and "outbox-mark-dead" not in body
    assert "outbox-requeue" not in viewer.get(change_url(dead)).content.decode()


def test_a_change_page_button_confirms_then_requeues_and_comes_back(superuser_client):
    (dead,) = make_events({"status": Status.DEAD, "retry_count": 9})
    url = reverse("admin:django_outbox_outboxevent_requeue", args=[dead.pk])
    page = superuser_client.get(url)
    assert page.status_code == 200
    body = page.content.decode()
    assert "Requeue this event?" in body and dead.event_id in body
    assert f'<a href="{change_url(dead)}" class="button cancel-link">' in body
    assert statuses(dead) == [Status.DEAD]
    response = superuser_client.post(url, follow=True)
    assert response.redirect_chain == [(change_url(dead), 302)]
    assert statuses(dead) == [Status.PENDING]
    assert OutboxEvent.objects.get(pk=dead.pk).retry_count == 0


def test_mark_dead_from_the_change_page_leaves_a_row_a_relay_holds(superuser_client):
    (held,) = make_events(held_row())
    url = reverse("admin:django_outbox_outboxevent_mark_dead", args=[held.pk])
    body = superuser_client.get(url).content.decode()
    assert "Nothing to mark dead" in body and held.event_id in body
    assert 'value="Yes, mark' not in body
    superuser_client.post(url)
    assert statuses(held) == [Status.PENDING]


def test_the_buttons_need_the_change_permission_and_a_row(superuser_client, viewer):
    (dead,) = make_events({"status": Status.DEAD})
    url = reverse("admin:django_outbox_outboxevent_requeue", args=[dead.pk])
    assert viewer.get(url).status_code == 403
    assert viewer.post(url).status_code == 403
    assert statuses(dead) == [Status.DEAD]
    missing = reverse("admin:django_outbox_outboxevent_requeue", args=[dead.pk + 1000])
    assert superuser_client.get(missing).status_code == 404
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(User.objects.get(username="root"))
    assert strict.post(url).status_code == 403
    assert statuses(dead) == [Status.DEAD]


# -- the list ----------------------------------------------------------------------------------


def test_the_list_leaves_empty_what_does_not_apply_and_shortens_the_event_id(superuser_client):
    sent, pending = make_events(
        {"status": Status.SENT, "retry_count": 2, "last_error": "[timeout] earlier attempt"},
        {"retry_count": 1, "last_error": "[nacked] full"},
    )
    body = superuser_client.get(reverse(CHANGELIST)).content.decode()
    assert "earlier attempt" not in body  # a SENT row's old error
    assert "[nacked] full" in body
    rows = {
        row.pk: body.split(f'value="{row.pk}"', 1)[1].split("</tr>", 1)[0]
        for row in (sent, pending)
    }
    # Empty, as the admin shows an empty value.
    assert '<td class="field-next_retry">-</td>' in rows[sent.pk]
    assert '<td class="field-short_error">-</td>' in rows[sent.pk]
    assert '<td class="field-next_retry">-</td>' not in rows[pending.pk]
    assert f'title="{sent.event_id}">{sent.event_id[:8]}…</span>' in rows[sent.pk]


def test_a_sent_rows_page_says_its_error_is_an_earlier_attempts(superuser_client):
    (sent,) = make_events({"status": Status.SENT, "last_error": "[timeout] earlier"})
    body = superuser_client.get(change_url(sent)).content.decode()
    assert "An earlier attempt&#x27;s error; the event was sent since." in body


# -- the admin index, the breadcrumbs --------------------------------------------------------


def test_the_admin_index_lists_the_dashboard_for_who_sees_the_events(superuser_client, viewer):
    for client in (superuser_client, viewer):
        body = client.get(reverse("admin:index")).content.decode()
        assert f'<a href="{reverse(DASHBOARD)}"' in body
        assert "Outbox dashboard" in body
    nobody = staff_client("nobody")
    assert reverse(DASHBOARD) not in nobody.get(reverse("admin:index")).content.decode()


PAGES = {
    "dashboard": (DASHBOARD, ""),
    "requeue all": ("admin:django_outbox_outboxevent_requeue", "?event_type=ORDER_PAID"),
}


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_breadcrumbs_are_the_admins_own(superuser_client, page):
    """Each page's breadcrumbs in the markup the changelist (Django's own) has."""
    make_events({"status": Status.DEAD, "event_type": "ORDER_PAID"})
    own = _breadcrumbs(superuser_client.get(reverse(CHANGELIST)).content.decode())
    name, query = PAGES[page]
    ours = _breadcrumbs(superuser_client.get(reverse(name) + query).content.decode())
    assert ours.split(">", 1)[0] == own.split(">", 1)[0]  # the same wrapper element
    assert reverse("admin:app_list", args=["django_outbox"]) in ours
    assert reverse(CHANGELIST) in ours


def _breadcrumbs(body: str) -> str:
    start = body.index('class="breadcrumbs"')
    start = body.rindex("<", 0, start)
    tag = body[start + 1 : body.index(" ", start)]
    return body[start : body.index(f"</{tag}>", start)]


@pytest.mark.once
def test_the_crumbs_go_between_home_and_the_title_in_either_markup():
    trail = [("/admin/app/", "App"), ("/admin/app/model/", "Models <&>")]
    up_to_6_0 = '<div class="breadcrumbs">\n<a href="/admin/">Home</a>\n &rsaquo; Dashboard\n</div>'
    assert outbox_crumbs(up_to_6_0, trail) == (
        '<div class="breadcrumbs">\n<a href="/admin/">Home</a> &rsaquo; '
        '<a href="/admin/app/">App</a> &rsaquo; <a href="/admin/app/model/">Models &lt;&amp;&gt;'
        "</a>\n &rsaquo; Dashboard\n</div>"
    )
    from_6_1 = (
        '<ol class="breadcrumbs">\n<li><a href="/admin/">Home</a></li>\n'
        '<li aria-current="page">Dashboard</li>\n</ol>'
    )
    assert outbox_crumbs(from_6_1, trail) == (
        '<ol class="breadcrumbs">\n<li><a href="/admin/">Home</a></li>\n'
        '<li><a href="/admin/app/">App</a></li>\n<li><a href="/admin/app/model/">'
        'Models &lt;&amp;&gt;</a></li>\n<li aria-current="page">Dashboard</li>\n</ol>'
    )
    assert outbox_crumbs("<p>other</p>", trail) == "<p>other</p>"
