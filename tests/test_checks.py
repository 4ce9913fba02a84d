"""System checks fire where they should, with stable ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core import checks
from django.db import connection, connections

from django_outbox import checks as outbox_checks
from django_outbox.checks import (
    Codes,
    check_alerts,
    check_backend,
    check_cloudevents_source,
    check_inbox_retention,
    check_lease,
    check_message_format,
    check_ordered,
    check_ordered_dead_head,
    check_ordered_delete_on_confirm,
    check_ordered_isolation,
    check_outbox_aliases,
    check_positive_numbers,
    check_retention,
    check_retry_schedule,
    check_skip_locked,
    check_sqlite,
    check_tracing,
    check_unknown_settings,
)

ROOT = Path(__file__).resolve().parents[1]

SETTINGS_CHECKS = [
    check_retry_schedule,
    check_positive_numbers,
    check_lease,
    check_outbox_aliases,
    check_retention,
    check_inbox_retention,
    check_ordered,
    check_ordered_dead_head,
    check_ordered_delete_on_confirm,
    check_alerts,
    check_unknown_settings,
    check_message_format,
    check_cloudevents_source,
    check_tracing,
    check_outbox_aliases,
]


def ids(messages) -> list[str]:
    return [m.id for m in messages]


def test_defaults_of_the_test_settings_are_clean():
    for check in SETTINGS_CHECKS:
        assert check() == [], check.__name__
    assert check_backend() == []


def test_unknown_backend(settings):
    settings.OUTBOX_BACKEND = "nowhere.Backend"
    (error,) = check_backend()
    assert error.id == Codes.BACKEND
    assert "cannot be imported" in error.msg


def test_backend_not_a_backend(settings):
    settings.OUTBOX_BACKEND = "django_outbox.models.OutboxEvent"
    assert ids(check_backend()) == [Codes.BACKEND]


@pytest.mark.parametrize("schedule", [[], "1,5", [1, -5], [0], [1, "x"], None, [True]])
def test_malformed_retry_schedule(settings, schedule):
    settings.OUTBOX_RETRY_SCHEDULE = schedule
    assert ids(check_retry_schedule()) == [Codes.RETRY_SCHEDULE]


def test_numbers_must_be_positive(settings):
    settings.OUTBOX_BATCH_SIZE = 0
    settings.OUTBOX_POLL_INTERVAL = "1"
    errors = check_positive_numbers()
    assert ids(errors) == [Codes.NUMBERS, Codes.NUMBERS]
    assert {"OUTBOX_BATCH_SIZE", "OUTBOX_POLL_INTERVAL"} == {m.msg.split()[0] for m in errors}
    assert errors[0].hint == (
        "Set OUTBOX_BATCH_SIZE to a positive integer, or remove it: the relay then chooses "
        "per database."
    )
    settings.OUTBOX_BATCH_SIZE = None  # unset: chosen per database
    assert [m.msg.split()[0] for m in check_positive_numbers()] == ["OUTBOX_POLL_INTERVAL"]


def test_lease_must_outlast_confirm_timeout(settings):
    settings.OUTBOX_LEASE_SECONDS = 5
    settings.OUTBOX_CONFIRM_TIMEOUT = 10
    assert ids(check_lease()) == [Codes.LEASE]
    settings.OUTBOX_LEASE_SECONDS = 11
    assert check_lease() == []


def test_short_retention_warns(settings):
    settings.OUTBOX_RETENTION_DAYS = 1
    (warning,) = check_retention()
    assert warning.id == Codes.RETENTION
    assert warning.level == checks.WARNING


def test_ordered_type(settings):
    settings.OUTBOX_ORDERED = "ORDER_CREATED"
    assert ids(check_ordered()) == [Codes.ORDERED]
    settings.OUTBOX_ORDERED = ["ORDER_CREATED"]
    assert check_ordered() == []


def test_bad_alert_channel(settings):
    settings.OUTBOX_ALERTS = [{"BACKEND": "nowhere.Channel"}, {"OPTIONS": {}}]
    assert ids(check_alerts()) == [Codes.ALERTS, Codes.ALERTS]


def test_alerts_not_a_list(settings):
    settings.OUTBOX_ALERTS = {"BACKEND": "django_outbox.alerts.LoggingChannel"}
    (error,) = check_alerts()
    assert error.id == Codes.ALERTS
    assert "Set OUTBOX_ALERTS = [" in error.hint


def test_misspelt_setting_suggests_the_right_one(settings):
    settings.OUTBOX_BATCHSIZE = 10
    (warning,) = check_unknown_settings()
    assert warning.id == Codes.UNKNOWN_SETTING
    assert "OUTBOX_BATCHSIZE" in warning.msg
    assert warning.hint == "Rename OUTBOX_BATCHSIZE to OUTBOX_BATCH_SIZE."


def test_sqlite_warns_one_relay_only():
    found = ids(check_sqlite())
    # one warning per SQLite database that may hold the outbox (tests/settings.py has two)
    sqlite = [alias for alias in connections if connections[alias].vendor == "sqlite"]
    assert found == [Codes.SQLITE] * len(sqlite)


@pytest.mark.django_db
def test_skip_locked_check_passes_on_supported_servers():
    # Every server CI runs (PostgreSQL, MariaDB 10.11) supports SKIP LOCKED.
    assert check_skip_locked(databases=["default"]) == []


@pytest.mark.django_db
def test_skip_locked_check_fires_on_old_mysql(monkeypatch):
    if connection.vendor != "mysql":
        pytest.skip("MySQL/MariaDB only")
    monkeypatch.setattr(
        type(connection.features), "has_select_for_update_skip_locked", property(lambda s: False)
    )
    (error,) = check_skip_locked(databases=["default"])
    assert error.id == Codes.NO_SKIP_LOCKED
    assert "MariaDB 10.6+" in error.hint


def test_checks_are_registered():
    registry = checks.registry.registry
    registered = set(registry.get_checks(include_deployment_checks=True))
    ours = {
        value
        for name, value in vars(outbox_checks).items()
        if name.startswith("check_") and callable(value)
    }
    assert ours == {
        *SETTINGS_CHECKS,
        check_backend,
        check_sqlite,
        check_skip_locked,
        check_ordered_isolation,
    }
    assert ours <= registered


def test_a_bad_dead_head_policy_has_its_own_id(settings):
    settings.OUTBOX_ORDERED_DEAD_HEAD = "drop"
    (error,) = check_ordered_dead_head()
    assert error.id == Codes.ORDERED_DEAD_HEAD == "django_outbox.E014"
    assert "'drop'" in error.msg
    assert check_ordered() == []  # E009 is the other problem: OUTBOX_ORDERED's type
    settings.OUTBOX_ORDERED_DEAD_HEAD = "skip"
    assert check_ordered_dead_head() == []


def test_the_message_format_is_one_of_three(settings):
    for value in ("native", "cloudevents", "cloudevents-structured"):
        settings.OUTBOX_MESSAGE_FORMAT = value
        assert check_message_format() == []
    settings.OUTBOX_MESSAGE_FORMAT = "CloudEvents"
    (error,) = check_message_format()
    assert error.id == Codes.MESSAGE_FORMAT == "django_outbox.E018"
    assert "'CloudEvents'" in error.msg and "'cloudevents-structured'" in error.msg


@pytest.mark.parametrize("value", ["/orders", "https://orders.example.com/a?b=c", "urn:x:y", ""])
def test_a_cloudevents_source_is_a_uri_reference(settings, value):
    settings.OUTBOX_CLOUDEVENTS_SOURCE = value
    assert check_cloudevents_source() == []


@pytest.mark.parametrize("value", ["orders service", "/orders\n", 42, None])
def test_a_cloudevents_source_that_is_not_a_uri_reference(settings, value):
    settings.OUTBOX_CLOUDEVENTS_SOURCE = value
    (error,) = check_cloudevents_source()
    assert error.id == Codes.CLOUDEVENTS_SOURCE == "django_outbox.E019"
    assert repr(value) in error.msg


def test_ids_are_unique_and_documented():
    codes = {name: value for name, value in vars(Codes).items() if not name.startswith("_")}
    assert len(set(codes.values())) == len(codes)
    text = (ROOT / "docs" / "settings.md").read_text()
    assert [code for code in codes.values() if f"`{code}`" not in text] == []


def test_ordered_isolation(settings, monkeypatch):
    from django.conf import settings as django_settings

    settings.OUTBOX_ORDERED = True
    db = django_settings.DATABASES["default"]
    monkeypatch.setitem(db, "ENGINE", "django.db.backends.mysql")
    monkeypatch.setitem(db, "OPTIONS", {})
    assert Codes.ORDERED_ISOLATION not in ids(check_ordered_isolation())
    monkeypatch.setitem(db, "OPTIONS", {"isolation_level": "repeatable read"})
    assert Codes.ORDERED_ISOLATION in ids(check_ordered_isolation())
    settings.OUTBOX_ORDERED = False
    assert check_ordered_isolation() == []


PIKA = "django_outbox.backends.pika.PikaBackend"


@pytest.mark.django_db(databases="__all__")  # migrate --plan reads every database
def test_an_empty_broker_url_does_not_stand_in_the_way_of_migrate(settings):
    """Issue 28, item 6: E005 blocked migrate and makemigrations in a project whose broker
    was not configured yet. There it is W005; the commands that publish exit 2 on E005."""
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import SystemCheckError

    settings.OUTBOX_BACKEND, settings.OUTBOX_BROKER_URL = PIKA, ""
    out = StringIO()
    call_command("migrate", "--plan", skip_checks=False, stdout=out, stderr=out)
    call_command(
        "makemigrations", "--check", "--dry-run", skip_checks=False, stdout=out, stderr=out
    )
    for command, args in [
        ("publish_outbox", ["--once"]),
        ("compensate_outbox", []),
        ("outbox_check", []),
    ]:
        with pytest.raises(SystemCheckError) as info:
            call_command(command, *args, skip_checks=False, stdout=out, stderr=out)
        assert info.value.returncode == 2
        assert "(django_outbox.E005) OUTBOX_BROKER_URL is empty" in str(info.value)
        assert "ConsoleBackend" in str(info.value) and "LocmemBackend" in str(info.value)
