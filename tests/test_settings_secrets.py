"""The demo project shows no secret on an error page, and debug mode is opt-in."""

from __future__ import annotations

import os
import subprocess

import pytest
from django.test import RequestFactory
from django.views.debug import ExceptionReporter, get_default_exception_reporter_filter

from tests.utils.subprocess import ROOT, manage_command

SECRET = "s3cret-pw"

pytestmark = pytest.mark.once


@pytest.mark.parametrize(
    "name", ["OUTBOX_BROKER_URL", "AMQP_URL", "CELERY_BROKER_URL", "DATABASE_URL"]
)
def test_connection_urls_are_hidden_from_error_reports(settings, name):
    setattr(settings, name, f"amqp://app:{SECRET}@rabbit:5672/%2F")
    safe = get_default_exception_reporter_filter().get_safe_settings()
    assert SECRET not in str(safe[name])


def test_an_error_page_does_not_show_the_broker_password(settings):
    settings.OUTBOX_BROKER_URL = f"amqp://app:{SECRET}@rabbit:5672/%2F"
    settings.CELERY_BROKER_URL = settings.OUTBOX_BROKER_URL
    request = RequestFactory().get("/admin/")
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        html = ExceptionReporter(request, type(exc), exc, exc.__traceback__).get_traceback_html()
    assert "OUTBOX_BROKER_URL" in html
    assert SECRET not in html


def test_debug_is_off_unless_asked_for(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'testproject'}",
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
    }
    env.pop("DEBUG", None)
    show = "from django.conf import settings; print(settings.DEBUG)"
    off = subprocess.run(
        manage_command("shell", "-c", show), env=env, capture_output=True, text=True, check=True
    )
    assert off.stdout.strip().splitlines()[-1] == "False"
    env["DEBUG"] = "1"
    on = subprocess.run(
        manage_command("shell", "-c", show), env=env, capture_output=True, text=True, check=True
    )
    assert on.stdout.strip().splitlines()[-1] == "True"
