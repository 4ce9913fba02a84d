"""A real browser (Debian's headless Chromium, driven by Playwright) in the outbox admin, at
1,280 x 900 px: the dashboard's figures, the event list, triage from the list and from an
event's page (each through a confirmation), the link from the admin index, and breadcrumbs
that look as the admin's own on the Django that renders them.

Run it on the oldest and the newest supported Django (issue 28, item 5): here on this
environment's, and through tox for the oldest
(``tox -e django52-py310-sqlite -- tests/test_browser.py``).

The documentation's screenshots are taken by these tests, never by hand: they go to
pytest's temporary directory, or to ``OUTBOX_SCREENSHOT_DIR`` when set. On the newest
Django, ``docs/img`` refreshes the ones in the documentation:

    OUTBOX_SCREENSHOT_DIR=docs/img python -m pytest tests/test_browser.py -m browser
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections

from django_outbox.models import OutboxEvent, Status
from tests.conftest import IN_CI
from tests.utils.rows import make_events

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WIDTH = 1280
PASSWORD = "s3cret-pass"
LIST = "/admin/django_outbox/outboxevent/"
DASHBOARD = f"{LIST}dashboard/"


@pytest.fixture
def browser_page(monkeypatch) -> Iterator[Any]:
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        message = f"Chromium not found at {CHROMIUM}; install it with `apt-get install -y chromium`"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    playwright_sync = pytest.importorskip("playwright.sync_api")
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls
    # are still plain synchronous code, so Django's async-safety guard must stand aside.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.set_default_timeout(20_000)
            yield page
        finally:
            browser.close()
            # While Playwright's sync API has an event loop on this thread, Django keeps
            # connections per async context rather than per thread: the test's queries got
            # a connection of their own that the test database's teardown does not see,
            # and PostgreSQL refused to drop a database still in use.
            connections.close_all()


@pytest.fixture
def screenshot_dir(tmp_path) -> Path:
    path = Path(os.environ.get("OUTBOX_SCREENSHOT_DIR") or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def admin_page(live_server, browser_page) -> Any:
    """The browser, logged into the admin of the live server as a superuser."""
    User.objects.create_superuser("admin", "admin@example.com", PASSWORD)
    page = browser_page
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#content-main")
    page.base = live_server.url
    return page


def _incident_rows() -> None:
    """An hour of traffic: the relay stopped 12 minutes ago, and a few dead letters."""
    specs = []
    for minute in range(60, 0, -1):
        for k in range(3 + (minute % 5 == 0) + (minute % 7 == 0)):
            age = minute * 60 - k * 7
            if minute > 12:
                specs.append({"status": Status.SENT, "age": age, "sent_age": age - 1})
            else:
                specs.append({"status": Status.PENDING, "age": age, "retry_count": 0})
    specs += [
        {
            "status": Status.DEAD,
            "retry_count": 7,
            "event_type": "ORDER_PAID",
            "age": 2400,
            "aggregate_id": f"ORD-{i}",
            "last_error": "[unroutable] returned by RabbitMQ: 312 NO_ROUTE (no queue bound to "
            "exchange 'outbox' for routing key 'ORDER_PAID')",
        }
        for i in range(3)
    ]
    specs.append(
        {
            "status": Status.DEAD,
            "retry_count": 7,
            "event_type": "POINTS_GRANTED",
            "age": 3000,
            "last_error": "[nacked] RabbitMQ refused the message (basic.nack)",
        }
    )
    specs.append(
        {
            "status": Status.PENDING,
            "retry_count": 3,
            "age": 1500,
            "last_error": "[timeout] no publisher confirm from RabbitMQ within 10 s",
        }
    )
    make_events(*specs)


def _breadcrumbs(page: Any) -> dict[str, Any]:
    """The breadcrumbs' element, its look and its links, as the browser renders them."""
    return page.eval_on_selector(
        ".breadcrumbs",
        """el => {
            const s = getComputedStyle(el);
            return {
                tag: el.tagName,
                look: [s.backgroundColor, s.color, s.paddingTop, s.paddingLeft, s.fontSize,
                       s.display, s.listStyleType],
                links: [...el.querySelectorAll("a")].map(a => a.getAttribute("href")),
                // The space between one link and the next: the separator as drawn.
                gaps: [...el.querySelectorAll("a")].map(a => a.getBoundingClientRect())
                    .map((box, i, all) => i ? Math.round(box.left - all[i - 1].right) : null)
                    .slice(1),
            };
        }""",
    )


def test_dashboard_figures_and_requeue_a_dead_letter(admin_page, screenshot_dir, settings):
    settings.OUTBOX_ALERT_PENDING_AGE = 300
    _incident_rows()
    pending = OutboxEvent.objects.pending().count()
    dead = OutboxEvent.objects.dead().count()
    page = admin_page

    # The admin index links the dashboard.
    page.click(f"a[href='{DASHBOARD}']")
    page.wait_for_selector("#figure-pending")
    assert page.text_content("#figure-pending .value").strip() == str(pending)
    assert page.text_content("#figure-dead .value").strip() == str(dead)
    assert "25 min" in page.text_content("#figure-oldest .value")  # the retrying row, 1500 s
    assert page.locator(".outbox-banner li").count() == 2
    assert page.locator("svg.outbox-chart rect.created").count() >= 55
    assert page.locator("svg.outbox-chart polyline.sent").count() == 1
    top = page.locator("#top-dead tbody tr").all_text_contents()
    assert "ORDER_PAID" in top[0] and "3" in top[0]
    assert page.locator("#dead-reasons tbody tr").count() == 2
    page.screenshot(path=str(screenshot_dir / "dashboard.png"), full_page=True)

    # Triage: open the dead letters of the top type from the dashboard and requeue one.
    page.click("#top-dead tbody tr:first-child a")
    page.wait_for_selector("#result_list")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 3
    target = OutboxEvent.objects.dead().filter(event_type="ORDER_PAID").order_by("-id").first()
    page.check(f"input.action-select[value='{target.pk}']")
    page.select_option("select[name=action]", "requeue")
    page.click("button[name=index]")
    # The action asks first, as the dashboard's "requeue all" does; nothing changed yet.
    page.wait_for_selector("#confirm-question")
    assert page.text_content("#confirm-question").strip() == "Requeue this event?"
    assert target.event_id in page.text_content(".outbox-sample")
    assert OutboxEvent.objects.dead().count() == dead
    page.screenshot(path=str(screenshot_dir / "requeue.png"), full_page=False)
    page.click("#content-main input[type=submit]")
    page.wait_for_selector("ul.messagelist li.success")
    assert "1 event requeued" in page.text_content("ul.messagelist li.success")

    target.refresh_from_db()
    assert (target.status, target.retry_count, target.lease_token) == (Status.PENDING, 0, "")
    assert target.last_error.startswith("[unroutable]")  # kept for the record
    assert OutboxEvent.objects.dead().count() == dead - 1

    page.goto(f"{page.base}{DASHBOARD}")
    assert page.text_content("#figure-dead .value").strip() == str(dead - 1)
    assert page.text_content("#figure-pending .value").strip() == str(pending + 1)


LAYOUT = """() => {
    const table = document.querySelector("#result_list");
    const heights = [...table.querySelectorAll("tbody tr")].map(
        r => r.getBoundingClientRect().height);
    const right = col => Math.max(...[...table.querySelectorAll("td.field-" + col)]
        .map(td => td.getBoundingClientRect().right));
    return {
        pageWidth: document.documentElement.scrollWidth,
        box: table.parentElement.getBoundingClientRect().right,
        tallest: Math.max(...heights),
        lowest: Math.min(...heights),
        createdRight: right("created"),
        errorRight: right("short_error"),
        errorCut: [...table.querySelectorAll("td.field-short_error span")]
            .some(span => span.parentElement.scrollWidth > span.parentElement.clientWidth),
    };
}"""


def test_the_event_list_is_readable_at_1280_px(admin_page, screenshot_dir):
    _incident_rows()
    page = admin_page
    page.goto(f"{page.base}{LIST}?o=-1")
    page.wait_for_selector("#result_list")
    # With the admin's navigation sidebar open, the list has some 630 px beside the filters:
    # every row stays on one line (no id wrapped over five) and the rest scrolls sideways,
    # as any wide list of the admin does.
    layout = page.evaluate(LAYOUT)
    assert layout["pageWidth"] <= WIDTH, layout
    assert layout["tallest"] <= layout["lowest"] * 1.3, layout
    # Closed, everything fits: the times whole, the long errors cut with an ellipsis.
    if page.locator("#toggle-nav-sidebar").is_visible():
        page.click("#toggle-nav-sidebar")
    layout = page.evaluate(LAYOUT)
    assert layout["pageWidth"] <= WIDTH, layout
    assert layout["tallest"] <= layout["lowest"] * 1.3, layout
    assert layout["createdRight"] <= layout["box"] and layout["errorRight"] <= layout["box"], layout
    assert layout["errorCut"], layout
    # A SENT row shows no stale error or next retry time.
    sent = OutboxEvent.objects.sent().order_by("-id").first()
    row = page.locator(f"#result_list tr:has(input.action-select[value='{sent.pk}'])")
    assert row.locator("td.field-next_retry").text_content().strip() == "-"
    assert row.locator("td.field-short_error").text_content().strip() == "-"
    page.screenshot(path=str(screenshot_dir / "changelist.png"), full_page=False)


def test_an_events_page_requeues_after_the_same_confirmation(admin_page):
    (dead,) = make_events({"status": Status.DEAD, "retry_count": 7, "last_error": "[nacked] x"})
    page = admin_page
    page.goto(f"{page.base}{LIST}{dead.pk}/change/")
    assert page.locator("a.outbox-mark-dead").count() == 0  # only a PENDING row is marked
    page.click("a.outbox-requeue")
    page.wait_for_selector("#confirm-question")
    assert page.text_content("#confirm-question").strip() == "Requeue this event?"
    assert OutboxEvent.objects.get(pk=dead.pk).status == Status.DEAD
    page.click("#content-main input[type=submit]")
    page.wait_for_selector("ul.messagelist li.success")
    assert page.url.endswith(f"{LIST}{dead.pk}/change/")
    assert OutboxEvent.objects.get(pk=dead.pk).status == Status.PENDING
    # Pending now: it can be marked dead, through the same confirmation.
    page.click("a.outbox-mark-dead")
    page.wait_for_selector("#confirm-question")
    page.click("a.cancel-link")
    page.wait_for_selector("a.outbox-mark-dead")
    assert OutboxEvent.objects.get(pk=dead.pk).status == Status.PENDING


def test_every_page_has_the_breadcrumbs_of_the_admins_own(admin_page):
    (dead,) = make_events({"status": Status.DEAD, "event_type": "ORDER_PAID"})
    page = admin_page
    page.goto(f"{page.base}{LIST}")
    own = _breadcrumbs(page)  # Django's own changelist
    assert own["look"][0] not in {"rgba(0, 0, 0, 0)", "transparent"}, own  # styled
    app, events = "/admin/django_outbox/", LIST
    for path, trail in [
        (DASHBOARD, [app, events]),
        (f"{DASHBOARD}requeue/?event_type=ORDER_PAID", [app, events, DASHBOARD]),
        (f"{LIST}{dead.pk}/requeue/", [app, events, f"{LIST}{dead.pk}/change/"]),
    ]:
        page.goto(f"{page.base}{path}")
        ours = _breadcrumbs(page)
        assert (ours["tag"], ours["look"]) == (own["tag"], own["look"]), path
        assert set(ours["gaps"]) == set(own["gaps"]), (path, ours["gaps"], own["gaps"])
        assert ours["links"] == ["/admin/", *trail], path
