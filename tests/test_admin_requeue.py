"""The dashboard's "requeue all N" (issue 17, item 4): dead letters by event type and by
failure reason, a confirmation page, the change permission and CSRF."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from django_outbox.backends.base import Reason
from django_outbox.models import OutboxEvent, Status
from django_outbox.stats import DeadReason, dead_reasons
from tests.utils.admin import staff_client
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db

DASHBOARD = "admin:django_outbox_outboxevent_dashboard"
REQUEUE = "admin:django_outbox_outboxevent_requeue"


@pytest.fixture
def changer() -> Client:
    """Staff with the change permission (and view): may triage."""
    return staff_client("changer", "view_outboxevent", "change_outboxevent")


@pytest.fixture
def viewer() -> Client:
    return staff_client("viewer", "view_outboxevent")


@pytest.fixture
def dead_letters() -> list[OutboxEvent]:
    dead = {"status": Status.DEAD, "event_type": "ORDER_PAID"}
    return make_events(
        {**dead, "last_error": "[unroutable] NO_ROUTE"},
        {**dead, "last_error": "[nacked] full", "age": 9},
        {**dead, "last_error": "[nacked] full again"},
        {**dead, "event_type": "ORDER_SHIPPED", "last_error": "marked by hand"},
        {"status": Status.SENT, "event_type": "ORDER_PAID", "last_error": "[nacked] once"},
    )


def statuses(rows: list[OutboxEvent]) -> list[int]:
    by_pk = dict(OutboxEvent.objects.values_list("pk", "status"))
    return [by_pk[r.pk] for r in rows]


def test_dead_letters_are_grouped_by_the_reason_of_their_last_failure(dead_letters):
    assert dead_reasons([r.value for r in Reason]) == [
        DeadReason("nacked", 2, "[nacked] full again"),  # the most recently created
        DeadReason("unroutable", 1, "[unroutable] NO_ROUTE"),
        DeadReason("", 1, "marked by hand"),  # any other last_error: last among equals
    ]


def test_the_dashboard_offers_requeue_all_per_event_type_and_reason(changer, dead_letters):
    body = changer.get(reverse(DASHBOARD)).content.decode()
    url = reverse(REQUEUE)
    assert f'href="{url}?event_type=ORDER_PAID">requeue all 3</a>' in body
    assert f'href="{url}?event_type=ORDER_SHIPPED">requeue 1</a>' in body
    assert f'href="{url}?reason=nacked">requeue all 2</a>' in body
    assert f'href="{url}?reason=unroutable">requeue 1</a>' in body
    assert 'id="dead-reasons"' in body
    assert "marked by hand" in body  # the "other" group: shown, nothing to select it by


def test_without_the_change_permission_no_link_and_no_requeue(viewer, dead_letters):
    body = viewer.get(reverse(DASHBOARD)).content.decode()
    assert 'id="dead-reasons"' in body
    assert reverse(REQUEUE) not in body
    # A crafted request, with or without the confirmation, is refused and changes nothing.
    assert viewer.get(reverse(REQUEUE), {"event_type": "ORDER_PAID"}).status_code == 403
    response = viewer.post(reverse(REQUEUE), {"event_type": "ORDER_PAID"})
    assert response.status_code == 403
    response = viewer.post(reverse(REQUEUE), {"reason": "nacked"})
    assert response.status_code == 403
    assert statuses(dead_letters) == [Status.DEAD] * 4 + [Status.SENT]
    nobody = staff_client("nobody")
    assert nobody.post(reverse(REQUEUE), {"event_type": "ORDER_PAID"}).status_code == 403
    anonymous = Client().post(reverse(REQUEUE), {"event_type": "ORDER_PAID"})
    assert anonymous.status_code == 302  # to the login page
    assert statuses(dead_letters) == [Status.DEAD] * 4 + [Status.SENT]


def test_the_confirmation_page_shows_the_count_and_changes_nothing(changer, dead_letters):
    response = changer.get(reverse(REQUEUE), {"event_type": "ORDER_PAID"})
    assert response.status_code == 200
    body = response.content.decode()
    assert "Requeue all 3 dead events (event_type ORDER_PAID)?" in body
    assert "python manage.py outbox_requeue --event-type ORDER_PAID" in body
    assert dead_letters[0].event_id in body
    assert 'name="csrfmiddlewaretoken"' in body
    assert '<input type="hidden" name="event_type" value="ORDER_PAID">' in body
    assert statuses(dead_letters) == [Status.DEAD] * 4 + [Status.SENT]


def test_confirming_requeues_them_as_the_command_does(changer, dead_letters):
    response = changer.post(reverse(REQUEUE), {"event_type": "ORDER_PAID"}, follow=True)
    assert response.redirect_chain == [(reverse(DASHBOARD), 302)]
    messages = [str(m) for m in response.context["messages"]]
    assert messages == [
        "3 dead events requeued (event_type ORDER_PAID): they are due now and the relay "
        "will publish them."
    ]
    assert statuses(dead_letters) == [Status.PENDING] * 3 + [Status.DEAD, Status.SENT]
    row = OutboxEvent.objects.get(pk=dead_letters[0].pk)
    assert (row.retry_count, row.replay_count, row.last_error) == (0, 0, "[unroutable] NO_ROUTE")
    assert OutboxEvent.objects.due().count() == 3


def test_requeue_all_of_one_failure_reason(changer, dead_letters):
    page = changer.get(reverse(REQUEUE), {"reason": "nacked"}).content.decode()
    assert "Requeue all 2 dead events (last_error containing &#x27;[nacked]&#x27;)?" in page
    assert "outbox_requeue --error-contains &#x27;[nacked]&#x27;" in page
    changer.post(reverse(REQUEUE), {"reason": "nacked"})
    assert statuses(dead_letters) == [
        Status.DEAD,
        Status.PENDING,
        Status.PENDING,
        Status.DEAD,
        Status.SENT,  # a SENT row is never requeued from here: replays are the command's
    ]


def test_the_post_is_csrf_protected(dead_letters):
    user = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.post(reverse(REQUEUE), {"event_type": "ORDER_PAID"}).status_code == 403
    assert statuses(dead_letters) == [Status.DEAD] * 4 + [Status.SENT]
    client.get(reverse(REQUEUE), {"event_type": "ORDER_PAID"})  # the page sets the token
    token = client.cookies["csrftoken"].value
    response = client.post(
        reverse(REQUEUE), {"event_type": "ORDER_PAID", "csrfmiddlewaretoken": token}
    )
    assert response.status_code == 302
    assert statuses(dead_letters)[:3] == [Status.PENDING] * 3


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "Name either an event type or a failure reason to requeue."),
        ({"event_type": "A", "reason": "nacked"}, "Name either an event type or a failure"),
        ({"reason": "bogus"}, "Unknown failure reason 'bogus'."),
    ],
)
def test_a_link_that_names_nothing_clear_is_refused(changer, dead_letters, params, message):
    response = changer.post(reverse(REQUEUE), params, follow=True)
    assert any(message in str(m) for m in response.context["messages"])
    assert statuses(dead_letters) == [Status.DEAD] * 4 + [Status.SENT]


def test_nothing_left_to_requeue_says_so(changer):
    body = changer.get(reverse(REQUEUE), {"event_type": "GONE"}).content.decode()
    assert "No dead event matches (event_type GONE): nothing to requeue." in body
    assert "Yes, requeue" not in body
