"""System checks. Ids are stable: tests and users' SILENCED_SYSTEM_CHECKS rely on them."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections, router

from .conf import OutboxSettings, outbox_settings
from .exceptions import ImproperlyConfiguredBackend


class Codes:
    BACKEND = "django_outbox.E001"
    RETRY_SCHEDULE = "django_outbox.E002"
    NO_SKIP_LOCKED = "django_outbox.E003"
    SQLITE = "django_outbox.W004"
    BROKER_URL = "django_outbox.E005"
    UNKNOWN_SETTING = "django_outbox.W006"
    NUMBERS = "django_outbox.E007"
    LEASE = "django_outbox.E008"
    ORDERED = "django_outbox.E009"
    ALERTS = "django_outbox.E010"
    RETENTION = "django_outbox.W011"
    ORDERED_ISOLATION = "django_outbox.W012"
    CELERY_APP = "django_outbox.E013"  # reported by backends.celery.CeleryBackend.check()


class Messages:
    RETRY_SCHEDULE = "OUTBOX_RETRY_SCHEDULE must be a non-empty list of positive seconds."
    NO_SKIP_LOCKED = (
        "Database {alias!r} ({server}) has no SELECT ... FOR UPDATE SKIP LOCKED; relays "
        "would block each other or claim the same rows."
    )
    SQLITE = (
        "Database {alias!r} is SQLite, which has no row locks: run a single publish_outbox "
        "and no compensate_outbox beside it."
    )
    UNKNOWN_SETTING = "Unknown setting {name}: django_outbox does not read it."
    NUMBERS = "{name} must be {rule}, got {value!r}."
    LEASE = (
        "OUTBOX_LEASE_SECONDS ({lease}) must be longer than OUTBOX_CONFIRM_TIMEOUT "
        "({timeout}), or another relay may take over rows whose confirms are still awaited."
    )
    ORDERED = "OUTBOX_ORDERED must be True, False or a list of event/aggregate types."
    ORDERED_DEAD_HEAD = "OUTBOX_ORDERED_DEAD_HEAD must be 'block' or 'skip', got {value!r}."
    ORDERED_ISOLATION = (
        "Database {alias!r} runs at isolation level {level!r}; ordered mode (OUTBOX_ORDERED) "
        "is built and tested for READ COMMITTED on MySQL/MariaDB (docs/ordered.md)."
    )
    ALERTS = "OUTBOX_ALERTS entry {index} is invalid: {problem}."
    RETENTION = (
        "OUTBOX_RETENTION_DAYS is {days}: sent rows are kept less than 3 days, too short to "
        "investigate an incident; purge_outbox refuses it without --force."
    )


class Hints:
    RETRY_SCHEDULE = "For example OUTBOX_RETRY_SCHEDULE = [1, 5, 30, 120, 900, 3600, 21600]."
    NO_SKIP_LOCKED = "Upgrade to PostgreSQL, MySQL 8.0.1+ or MariaDB 10.6+."
    SQLITE = (
        "Use PostgreSQL or MySQL/MariaDB in production; SQLite is fine for development and "
        "the demo. Silence with SILENCED_SYSTEM_CHECKS = ['django_outbox.W004']."
    )
    UNKNOWN_SETTING = "Did you mean {suggestion}? See docs/settings.md for every setting."
    UNKNOWN_SETTING_NONE = "See docs/settings.md for every setting."
    NUMBERS = "Fix {name} in your settings (docs/settings.md has the default)."
    LEASE = "Raise OUTBOX_LEASE_SECONDS (default 60) or lower OUTBOX_CONFIRM_TIMEOUT (10)."
    ORDERED = "For example OUTBOX_ORDERED = ['ORDER_CREATED', 'ORDER_PAID'] or True."
    ORDERED_DEAD_HEAD = (
        "Use 'block' (the default: later events wait until the dead one is requeued) or "
        "'skip' (they go ahead, and the dead-letter alert says so)."
    )
    ORDERED_ISOLATION = (
        "Remove 'isolation_level' from DATABASES[{alias!r}]['OPTIONS'] (Django's default is "
        "'read committed') or set it to 'read committed'."
    )
    ALERTS = (
        "Each entry is {'BACKEND': 'django_outbox.alerts.LoggingChannel', 'OPTIONS': {}}; "
        "see docs/operations.md."
    )
    RETENTION = "Set OUTBOX_RETENTION_DAYS to 3 or more (default 7)."


def _outbox_aliases(databases: Iterable[str] | None) -> list[str]:
    from .models import OutboxEvent

    aliases = list(databases) if databases is not None else list(connections)
    return [a for a in aliases if router.allow_migrate_model(a, OutboxEvent)]


@register()
def check_backend(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from .backends import get_backend_class

    try:
        backend_class = get_backend_class()
    except ImproperlyConfiguredBackend as exc:
        return [
            Error(
                str(exc),
                hint="Set OUTBOX_BACKEND to a valid dotted path.",
                id=Codes.BACKEND,
            )
        ]
    return list(backend_class.check(**kwargs))


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    schedule = outbox_settings.RETRY_SCHEDULE
    if (
        isinstance(schedule, (str, bytes))
        or not isinstance(schedule, (list, tuple))
        or not schedule
        or not all(_positive(v) for v in schedule)
    ):
        errors.append(
            Error(Messages.RETRY_SCHEDULE, hint=Hints.RETRY_SCHEDULE, id=Codes.RETRY_SCHEDULE)
        )

    numbers: list[tuple[str, Any, str, bool]] = [
        ("OUTBOX_BATCH_SIZE", outbox_settings.BATCH_SIZE, "a positive integer", True),
        (
            "OUTBOX_COMPENSATE_MAX_BATCH",
            outbox_settings.COMPENSATE_MAX_BATCH,
            "a positive integer",
            True,
        ),
        ("OUTBOX_PURGE_BATCH_SIZE", outbox_settings.PURGE_BATCH_SIZE, "a positive integer", True),
        ("OUTBOX_MAX_PAYLOAD_BYTES", outbox_settings.MAX_PAYLOAD_BYTES, "a positive integer", True),
        ("OUTBOX_CONSUMER_PREFETCH", outbox_settings.CONSUMER_PREFETCH, "a positive integer", True),
        ("OUTBOX_POLL_INTERVAL", outbox_settings.POLL_INTERVAL, "a positive number", False),
        ("OUTBOX_LEASE_SECONDS", outbox_settings.LEASE_SECONDS, "a positive number", False),
        ("OUTBOX_CONFIRM_TIMEOUT", outbox_settings.CONFIRM_TIMEOUT, "a positive number", False),
        (
            "OUTBOX_COMPENSATE_STALE_AFTER",
            outbox_settings.COMPENSATE_STALE_AFTER,
            "a positive number",
            False,
        ),
        (
            "OUTBOX_COMPENSATE_RETRY_DELAY",
            outbox_settings.COMPENSATE_RETRY_DELAY,
            "a positive number",
            False,
        ),
        ("OUTBOX_RETENTION_DAYS", outbox_settings.RETENTION_DAYS, "a positive number", False),
    ]
    for name, value, rule, integer in numbers:
        if not _positive(value) or (integer and not isinstance(value, int)):
            errors.append(
                Error(
                    Messages.NUMBERS.format(name=name, rule=rule, value=value),
                    hint=Hints.NUMBERS.format(name=name),
                    id=Codes.NUMBERS,
                )
            )
    lease, timeout = outbox_settings.LEASE_SECONDS, outbox_settings.CONFIRM_TIMEOUT
    if _positive(lease) and _positive(timeout) and lease <= timeout:
        errors.append(
            Error(
                Messages.LEASE.format(lease=lease, timeout=timeout),
                hint=Hints.LEASE,
                id=Codes.LEASE,
            )
        )
    days = outbox_settings.RETENTION_DAYS
    if _positive(days) and days < 3:
        errors.append(
            Warning(Messages.RETENTION.format(days=days), hint=Hints.RETENTION, id=Codes.RETENTION)
        )

    ordered = outbox_settings.ORDERED
    if not isinstance(ordered, bool) and not (
        isinstance(ordered, (list, tuple)) and all(isinstance(v, str) for v in ordered)
    ):
        errors.append(Error(Messages.ORDERED, hint=Hints.ORDERED, id=Codes.ORDERED))
    dead_head = outbox_settings.ORDERED_DEAD_HEAD
    if dead_head not in ("block", "skip"):
        errors.append(
            Error(
                Messages.ORDERED_DEAD_HEAD.format(value=dead_head),
                hint=Hints.ORDERED_DEAD_HEAD,
                id=Codes.ORDERED,
            )
        )

    errors.extend(_check_alerts())
    errors.extend(_check_unknown_settings())
    return errors


def _check_alerts() -> list[CheckMessage]:
    from django.core.exceptions import ImproperlyConfigured

    from .alerts import build_channel

    channels = outbox_settings.ALERTS
    if not isinstance(channels, (list, tuple)):
        return [
            Error(
                Messages.ALERTS.format(index="-", problem="not a list"),
                hint=Hints.ALERTS,
                id=Codes.ALERTS,
            )
        ]
    errors: list[CheckMessage] = []
    for index, entry in enumerate(channels):
        problem = ""
        if not isinstance(entry, dict) or "BACKEND" not in entry:
            problem = "it needs a 'BACKEND' key"
        elif not isinstance(entry.get("OPTIONS", {}), dict):
            problem = "'OPTIONS' must be a dict"
        else:
            # Building a channel validates its OPTIONS and never touches the network.
            try:
                build_channel(entry)
            except ImproperlyConfigured as exc:
                problem = str(exc).rstrip(".")
        if problem:
            errors.append(
                Error(
                    Messages.ALERTS.format(index=index, problem=problem),
                    hint=Hints.ALERTS,
                    id=Codes.ALERTS,
                )
            )
    return errors


def _check_unknown_settings() -> list[CheckMessage]:
    known = set(OutboxSettings.names())
    errors: list[CheckMessage] = []
    for name in dir(settings):
        if name.startswith("OUTBOX_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = (
                Hints.UNKNOWN_SETTING.format(suggestion=close[0])
                if close
                else Hints.UNKNOWN_SETTING_NONE
            )
            errors.append(
                Warning(
                    Messages.UNKNOWN_SETTING.format(name=name), hint=hint, id=Codes.UNKNOWN_SETTING
                )
            )
    return errors


@register()
def check_sqlite(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    return [
        Warning(Messages.SQLITE.format(alias=alias), hint=Hints.SQLITE, id=Codes.SQLITE)
        for alias in _outbox_aliases(None)
        if connections[alias].vendor == "sqlite"
    ]


@register(Tags.database)
def check_skip_locked(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Needs a connection, so it runs with ``migrate`` and ``check --database``."""
    errors: list[CheckMessage] = []
    for alias in _outbox_aliases(databases or ()):
        connection = connections[alias]
        if connection.vendor != "mysql":
            continue
        if not connection.features.has_select_for_update_skip_locked:
            mysql: Any = connection  # a django.db.backends.mysql DatabaseWrapper
            server = ("MariaDB " if mysql.mysql_is_mariadb else "MySQL ") + ".".join(
                str(p) for p in mysql.mysql_version
            )
            errors.append(
                Error(
                    Messages.NO_SKIP_LOCKED.format(alias=alias, server=server),
                    hint=Hints.NO_SKIP_LOCKED,
                    id=Codes.NO_SKIP_LOCKED,
                )
            )
    return errors


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@register()
def check_ordered_isolation(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Ordered mode's claim is reasoned about (and tested) statement by statement."""
    if not outbox_settings.ORDERED:
        return []
    errors: list[CheckMessage] = []
    for alias in _outbox_aliases(None):
        db: dict[str, Any] = settings.DATABASES.get(alias, {})
        if not str(db.get("ENGINE", "")).endswith("mysql"):
            continue
        # Django's MySQL backend defaults to read committed; None keeps the server's
        # default, which is REPEATABLE READ on MySQL and MariaDB.
        level = (db.get("OPTIONS") or {}).get("isolation_level", "read committed")
        if level != "read committed":
            errors.append(
                Warning(
                    Messages.ORDERED_ISOLATION.format(alias=alias, level=level),
                    hint=Hints.ORDERED_ISOLATION.format(alias=alias),
                    id=Codes.ORDERED_ISOLATION,
                )
            )
    return errors
