"""Celery is an optional extra: nothing but the Celery modules imports it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.utils.subprocess import ROOT, django_env

pytestmark = pytest.mark.once

CELERY_MODULES = {
    "django_outbox.celery",
    "django_outbox.tasks",
    "django_outbox.backends.celery",
    "django_outbox._compat.celery",
}


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = django_env(DATABASE_URL="sqlite://:memory:")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_app_and_the_relay_run_without_importing_celery():
    done = run_python(
        f"""
        import importlib, pkgutil, sys
        from decimal import Decimal
        import django
        django.setup()
        import django_outbox
        skipped = {sorted(CELERY_MODULES)!r}
        for info in pkgutil.walk_packages(django_outbox.__path__, "django_outbox."):
            if info.name not in skipped:
                importlib.import_module(info.name)
        from django.core.management import call_command
        call_command("migrate", verbosity=0)
        call_command("check")
        from orders.services import create_order
        create_order(user_id=1, amount=Decimal("3"))
        call_command("publish_outbox", "--once")
        from django_outbox.models import OutboxEvent
        assert OutboxEvent.objects.sent().count() == 1
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("celery", "kombu"))
        print("LOADED", loaded)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout, done.stdout


def test_the_celery_backend_without_celery_says_how_to_install_it():
    done = run_python(
        """
        import sys
        sys.modules["celery"] = None  # as if the extra were not installed
        import django
        django.setup()
        try:
            import django_outbox.backends.celery
        except ImportError as exc:
            print("ERROR", exc)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'django-transactional-outbox[celery]'" in done.stdout
