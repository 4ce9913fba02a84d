"""A real browser (Debian's headless Chromium, driven by Playwright) in the outbox admin.

Logs into the admin of a live test server, reads the dashboard's figures, requeues a dead
letter through the changelist action and takes screenshots. Screenshots go to pytest's
temporary directory, or to ``OUTBOX_SCREENSHOT_DIR`` when set (``docs/img`` refreshes the
ones in the documentation):

    OUTBOX_SCREENSHOT_DIR=docs/img python -m pytest tests/test_browser.py -m browser
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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


@pytest.fixture
def browser_page(monkeypatch):
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
            page = browser.new_page(viewport={"width": 1280, "height": 900})
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
            "last_error": "unroutable: NO_ROUTE",
        }
        for i in range(3)
    ]
    specs.append(
        {
            "status": Status.DEAD,
            "retry_count": 7,
            "event_type": "POINTS_GRANTED",
            "age": 3000,
            "last_error": "nacked by the broker",
        }
    )
    specs.append({"status": Status.PENDING, "retry_count": 3, "age": 1500, "last_error": "timeout"})
    make_events(*specs)


def test_dashboard_figures_and_requeue_a_dead_letter(
    live_server, browser_page, screenshot_dir, settings
):
    settings.OUTBOX_ALERT_PENDING_AGE = 300
    User.objects.create_superuser("admin", "admin@example.com", "s3cret-pass")
    _incident_rows()
    pending = OutboxEvent.objects.pending().count()
    dead = OutboxEvent.objects.dead().count()
    page = browser_page

    page.goto(f"{live_server.url}/admin/login/?next=/admin/django_outbox/outboxevent/dashboard/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#figure-pending")

    assert page.text_content("#figure-pending .value").strip() == str(pending)
    assert page.text_content("#figure-dead .value").strip() == str(dead)
    assert "25 min" in page.text_content("#figure-oldest .value")  # the retrying row, 1500 s
    assert page.locator(".outbox-banner li").count() == 2
    assert page.locator("svg.outbox-chart rect.created").count() >= 55
    assert page.locator("svg.outbox-chart polyline.sent").count() == 1
    top = page.locator("#top-dead tbody tr").all_text_contents()
    assert "ORDER_PAID" in top[0] and "3" in top[0]
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
    page.wait_for_selector("ul.messagelist li.success")
    assert "1 event requeued" in page.text_content("ul.messagelist li.success")
    page.screenshot(path=str(screenshot_dir / "requeue.png"), full_page=False)

    target.refresh_from_db()
    assert (target.status, target.retry_count, target.lease_token) == (Status.PENDING, 0, "")
    assert target.last_error == "unroutable: NO_ROUTE"  # kept for the record
    assert OutboxEvent.objects.dead().count() == dead - 1

    page.goto(f"{live_server.url}/admin/django_outbox/outboxevent/dashboard/")
    assert page.text_content("#figure-dead .value").strip() == str(dead - 1)
    assert page.text_content("#figure-pending .value").strip() == str(pending + 1)
