"""OpenTelemetry is an optional extra: without it nothing imports it, with the API alone
(no SDK configured) tracing is a no-op."""

from __future__ import annotations

import textwrap

import pytest

from tests.test_celery_optional import run_python

pytestmark = pytest.mark.once

# The whole way of an event in one process: emit() inside what would be a request's span,
# the relay, and the handler (locmem backend, in-process consumer).
ROUND_TRIP = """
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from decimal import Decimal
    from django_outbox.backends import locmem
    from django_outbox.consumer import Dispatcher, Outcome, process_messages
    from django_outbox.models import OutboxEvent
    from django_outbox.relay import Relay
    from orders.services import create_order
    from points.models import PointsLedger

    with request_span():
        create_order(user_id=1, amount=Decimal("3"))
    assert Relay(backend=locmem.LocmemBackend()).drain().sent == 1
    (results,) = process_messages(
        locmem.outbox, dispatcher=Dispatcher(handlers=["points.handlers.AwardPointsHandler"])
    )
    assert [r.outcome for r in results] == [Outcome.PROCESSED], results
    assert PointsLedger.objects.count() == 1
    print("HEADERS", OutboxEvent.objects.get().headers, locmem.outbox[0].headers.get("traceparent"))
"""


def run(*parts: str):
    """``run_python`` of the parts, each dedented on its own."""
    return run_python("\n".join(textwrap.dedent(part) for part in parts))


def test_without_opentelemetry_nothing_imports_it_and_events_flow():
    done = run(
        """
        import contextlib, importlib, pkgutil, sys
        sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
        import django
        django.setup()
        import django_outbox
        for info in pkgutil.walk_packages(django_outbox.__path__, "django_outbox."):
            if info.name not in {"django_outbox.tasks", "django_outbox.backends.celery"}:
                importlib.import_module(info.name)
        from django_outbox import tracing
        assert tracing.AVAILABLE is False
        request_span = contextlib.nullcontext
        """,
        ROUND_TRIP,
        """
        from django.core.management import call_command
        call_command("check")
        from django.test import override_settings
        from django_outbox.checks import check_tracing
        with override_settings(OUTBOX_TRACING=True):
            print("CHECK", [e.id for e in check_tracing()])
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry") and sys.modules[m])
        print("LOADED", loaded)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "HEADERS {} None" in done.stdout, done.stdout
    assert "CHECK ['django_outbox.E022']" in done.stdout, done.stdout
    assert "LOADED []" in done.stdout, done.stdout


def test_with_the_api_and_no_sdk_tracing_is_a_no_op():
    done = run(
        """
        import django
        django.setup()
        from opentelemetry import trace
        from django_outbox import tracing
        assert tracing.AVAILABLE is True
        request_span = lambda: trace.get_tracer("app").start_as_current_span("POST /orders")
        """,
        ROUND_TRIP,
        """
        print("PROVIDER", type(trace.get_tracer_provider()).__name__)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "HEADERS {} None" in done.stdout, done.stdout
    assert "PROVIDER ProxyTracerProvider" in done.stdout, done.stdout
