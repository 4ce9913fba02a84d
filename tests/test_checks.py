"""System checks fire where they should, with stable ids."""

from __future__ import annotations

import pytest
from django.core import checks
from django.db import connection

from django_outbox.checks import (
    Codes,
    check_backend,
    check_settings,
    check_skip_locked,
    check_sqlite,
)


def ids(messages) -> list[str]:
    return [m.id for m in messages]


def test_defaults_of_the_test_settings_are_clean():
    assert check_settings() == []
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
    assert Codes.RETRY_SCHEDULE in ids(check_settings())


def test_numbers_must_be_positive(settings):
    settings.OUTBOX_BATCH_SIZE = 0
    settings.OUTBOX_POLL_INTERVAL = "1"
    errors = [m for m in check_settings() if m.id == Codes.NUMBERS]
    assert {"OUTBOX_BATCH_SIZE", "OUTBOX_POLL_INTERVAL"} == {m.msg.split()[0] for m in errors}


def test_lease_must_outlast_confirm_timeout(settings):
    settings.OUTBOX_LEASE_SECONDS = 5
    settings.OUTBOX_CONFIRM_TIMEOUT = 10
    assert Codes.LEASE in ids(check_settings())


def test_short_retention_warns(settings):
    settings.OUTBOX_RETENTION_DAYS = 1
    (warning,) = [m for m in check_settings() if m.id == Codes.RETENTION]
    assert warning.level == checks.WARNING


def test_ordered_type(settings):
    settings.OUTBOX_ORDERED = "ORDER_CREATED"
    assert Codes.ORDERED in ids(check_settings())
    settings.OUTBOX_ORDERED = ["ORDER_CREATED"]
    assert Codes.ORDERED not in ids(check_settings())


def test_bad_alert_channel(settings):
    settings.OUTBOX_ALERTS = [{"BACKEND": "nowhere.Channel"}, {"OPTIONS": {}}]
    assert ids(check_settings()).count(Codes.ALERTS) == 2


def test_misspelt_setting_suggests_the_right_one(settings):
    settings.OUTBOX_BATCHSIZE = 10
    (warning,) = [m for m in check_settings() if m.id == Codes.UNKNOWN_SETTING]
    assert "OUTBOX_BATCHSIZE" in warning.msg
    assert "OUTBOX_BATCH_SIZE" in warning.hint


def test_sqlite_warns_one_relay_only():
    found = ids(check_sqlite())
    if connection.vendor == "sqlite":
        assert found == [Codes.SQLITE]
    else:
        assert found == []


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
    registered = {c.__name__ for c in registry.get_checks(include_deployment_checks=True)}
    assert {"check_backend", "check_settings", "check_sqlite", "check_skip_locked"} <= registered


def test_ordered_checks(settings, monkeypatch):
    from django.conf import settings as django_settings

    from django_outbox.checks import check_ordered_isolation

    settings.OUTBOX_ORDERED_DEAD_HEAD = "drop"
    assert Codes.ORDERED in ids(check_settings())
    settings.OUTBOX_ORDERED_DEAD_HEAD = "skip"
    assert Codes.ORDERED not in ids(check_settings())
    settings.OUTBOX_ORDERED = True
    db = django_settings.DATABASES["default"]
    monkeypatch.setitem(db, "ENGINE", "django.db.backends.mysql")
    monkeypatch.setitem(db, "OPTIONS", {})
    assert Codes.ORDERED_ISOLATION not in ids(check_ordered_isolation())
    monkeypatch.setitem(db, "OPTIONS", {"isolation_level": "repeatable read"})
    assert Codes.ORDERED_ISOLATION in ids(check_ordered_isolation())
    settings.OUTBOX_ORDERED = False
    assert check_ordered_isolation() == []
