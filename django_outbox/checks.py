"""System checks, one small function per concern.

Ids are stable: tests and users' SILENCED_SYSTEM_CHECKS rely on them, and docs/settings.md
lists every one. A new problem gets a new id; an id is never reused for another problem.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections, router

from .conf import (
    BROKER_URL_EMPTY,
    BROKER_URL_EMPTY_HINT,
    PREFIX,
    OutboxSettings,
    broker_urls,
    outbox_settings,
)
from .exceptions import ImproperlyConfiguredBackend

if TYPE_CHECKING:
    from .transports import Transport


class Codes:
    BACKEND = "django_outbox.E001"
    RETRY_SCHEDULE = "django_outbox.E002"
    NO_SKIP_LOCKED = "django_outbox.E003"
    SQLITE = "django_outbox.W004"
    BROKER_URL = "django_outbox.E005"  # reported by backends.pika.PikaBackend.check()
    BROKER_URL_UNSET = "django_outbox.W005"  # E005's empty URL, where nothing is published
    UNKNOWN_SETTING = "django_outbox.W006"
    NUMBERS = "django_outbox.E007"
    LEASE = "django_outbox.E008"
    ORDERED = "django_outbox.E009"
    ALERTS = "django_outbox.E010"
    RETENTION = "django_outbox.W011"
    ORDERED_ISOLATION = "django_outbox.W012"
    # Reported by backends.celery.CeleryBackend.check():
    CELERY_NO_CONFIRMS = "django_outbox.E013"
    ORDERED_DEAD_HEAD = "django_outbox.E014"  # split from E009, which named two problems
    CELERY_APP = "django_outbox.E015"  # split from E013, which named two problems
    # Several broker nodes, reported by backends.pika.PikaBackend.check() (E005 each URL):
    BROKER_URL_FORM = "django_outbox.E016"
    BROKER_VHOSTS = "django_outbox.E017"
    MESSAGE_FORMAT = "django_outbox.E018"
    CLOUDEVENTS_SOURCE = "django_outbox.E019"
    TRACING_NO_API = "django_outbox.E022"
    # Inbox retention (purge_outbox):
    INBOX_RETENTION = "django_outbox.E024"
    INBOX_RETENTION_SHORT = "django_outbox.E025"
    # Reported by backends.pika.PikaBackend.check() for each URL:
    BROKER_URL_ENCODING = "django_outbox.E026"
    # NATS JetStream, reported by backends.nats.NatsBackend.check():
    NATS_DUPLICATE_WINDOW = "django_outbox.E030"
    # OUTBOX_RETENTION_DAYS = 0 (the relay deletes confirmed rows):
    ORDERED_DELETE_ON_CONFIRM = "django_outbox.E040"
    NATS_STREAM = "django_outbox.E031"
    # Redis Streams, reported by backends.redis.RedisBackend.check():
    REDIS_SETTING = "django_outbox.E032"
    # Several databases:
    ROUTED_UNMIGRATED = "django_outbox.W001"
    UNKNOWN_ALIAS = "django_outbox.W002"


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
    # Several broker nodes (E016 says conf.BROKER_URL_TYPE, the runtime error's words).
    BROKER_VHOSTS = (
        "The URLs of OUTBOX_BROKER_URL name different virtual hosts ({vhosts}): after a "
        "failover the relay would publish to another vhost, where no consumer reads."
    )
    BROKER_URL_ENCODING = (
        "{which} would connect to a host, port and vhost read from its password: the "
        "password holds a '/', '?' or '#' that is not percent-encoded, which ends the host "
        "part early for pika as for any URL parser (or the vhost or query holds an "
        "unencoded '@', which reads the same way)."
    )
    MESSAGE_FORMAT = "OUTBOX_MESSAGE_FORMAT must be one of {choices}, got {value!r}."
    CLOUDEVENTS_SOURCE = (
        "OUTBOX_CLOUDEVENTS_SOURCE must be a URI-reference (text without spaces or control "
        "characters), got {value!r}."
    )
    TRACING_NO_API = (
        "OUTBOX_TRACING is True but opentelemetry-api is not installed: no trace context is "
        "captured and no span is recorded."
    )
    INBOX_RETENTION = (
        "OUTBOX_INBOX_RETENTION_DAYS must be a positive number of days or None, got {value!r}."
    )
    INBOX_RETENTION_SHORT = (
        "OUTBOX_INBOX_RETENTION_DAYS ({inbox:g}) is shorter than OUTBOX_RETENTION_DAYS "
        "({sent:g}): an event can be replayed or requeued as long as its outbox row is kept, "
        "and its inbox row must still be there to catch the duplicate; purge_outbox keeps "
        "inbox rows {sent:g} days."
    )
    ROUTED_UNMIGRATED = (
        "The outbox is {why} database {alias!r}, but the database router does not allow "
        "django_outbox's migrations there: migrate never creates the outbox table on it."
    )
    UNKNOWN_ALIAS = "{where} names database {alias!r}, which is not in DATABASES."
    NATS_DUPLICATE_WINDOW = (
        "OUTBOX_NATS_DUPLICATE_WINDOW ({window:g} s) must be longer than "
        "OUTBOX_LEASE_SECONDS ({lease:g} s): a relay killed before it settled a batch leaves "
        "its rows to be published again once their lease runs out, and JetStream drops the "
        "second copy only while it remembers the first."
    )
    NATS_STREAM = "{name} is {value!r}: {problem}."
    ORDERED_DELETE_ON_CONFIRM = (
        "OUTBOX_RETENTION_DAYS is 0 (the relay deletes each row once the broker confirmed "
        "it) and OUTBOX_ORDERED is on: ordered mode sends each aggregate's head with the id "
        "of its last SENT event (previous_sequence), which no longer exists, so consumers "
        "checking the order could not tell a missing event from none."
    )
    REDIS_SETTING = "{name} is {value!r}: {problem}."


class Hints:
    """Each hint is one edit that makes the check pass."""

    BACKEND = (
        "Set OUTBOX_BACKEND to 'django_outbox.backends.pika.PikaBackend' (the default) or "
        "to the dotted path of your BaseBackend subclass."
    )
    RETRY_SCHEDULE = (
        "Set OUTBOX_RETRY_SCHEDULE = [1, 5, 30, 120, 900, 3600, 21600] (the default) or "
        "another list of positive seconds."
    )
    NO_SKIP_LOCKED = "Upgrade the database server to MySQL 8.0.1+ or MariaDB 10.6+."
    SQLITE = (
        "In production set DATABASES[{alias!r}] to PostgreSQL or MySQL/MariaDB; on a "
        "development machine add 'django_outbox.W004' to SILENCED_SYSTEM_CHECKS."
    )
    UNKNOWN_SETTING = "Rename {name} to {suggestion}."
    UNKNOWN_SETTING_NONE = "Remove {name}; docs/settings.md lists every setting."
    NUMBERS = "Set {name} to {rule} such as {default!r} (the default)."
    NUMBERS_UNSET = "Set {name} to {rule}, or remove it: the relay then chooses per database."
    LEASE = "Set OUTBOX_LEASE_SECONDS above {timeout}, e.g. OUTBOX_LEASE_SECONDS = {suggested:g}."
    ORDERED = "Set OUTBOX_ORDERED = True, or a list of types such as ['ORDER_CREATED']."
    ORDERED_DEAD_HEAD = (
        "Set OUTBOX_ORDERED_DEAD_HEAD = 'block' (the default: later events wait until the "
        "dead one is requeued) or 'skip' (they go ahead, and the dead-letter alert says so)."
    )
    ORDERED_ISOLATION = (
        "Remove 'isolation_level' from DATABASES[{alias!r}]['OPTIONS'] (Django's default is "
        "'read committed') or set it to 'read committed'."
    )
    ALERTS = (
        "Write entry {index} as {{'BACKEND': 'django_outbox.alerts.LoggingChannel', "
        "'OPTIONS': {{}}}} or as another channel of docs/operations.md."
    )
    ALERTS_NOT_A_LIST = (
        "Set OUTBOX_ALERTS = [{{'BACKEND': 'django_outbox.alerts.LoggingChannel'}}] (the "
        "default) or another list of channels of docs/operations.md."
    )
    RETENTION = "Set OUTBOX_RETENTION_DAYS to 3 or more (default 7)."
    BROKER_URL_FORM = (
        "Set OUTBOX_BROKER_URL to one AMQP URL, or for a cluster to a list such as "
        "['amqp://user:password@rabbit-1:5672/%2F', 'amqp://user:password@rabbit-2:5672/%2F']."
    )
    BROKER_VHOSTS = (
        "Give every URL the same vhost (the nodes of one cluster share them), e.g. /%2F on "
        "each for the vhost '/'."
    )
    BROKER_URL_ENCODING = (
        "Percent-encode the password: urllib.parse.quote(password, safe='') writes '/' as "
        "%2F, '?' as %3F, '#' as %23 and '@' as %40, e.g. 'amqp://user:' + "
        "quote(password, safe='') + '@rabbitmq:5672/%2F'."
    )
    MESSAGE_FORMAT = (
        "Set OUTBOX_MESSAGE_FORMAT = 'native' (the default), 'cloudevents' (CloudEvents "
        "binary content mode) or 'cloudevents-structured' (docs/writing-events.md)."
    )
    CLOUDEVENTS_SOURCE = (
        "Set OUTBOX_CLOUDEVENTS_SOURCE to a URI-reference naming the service, e.g. "
        "'/orders' or 'https://orders.example.com', or to '' for the default."
    )
    TRACING_NO_API = (
        "Install the otel extra: pip install 'django-transactional-outbox[otel]' (and "
        "configure the OpenTelemetry SDK), or remove OUTBOX_TRACING from the settings."
    )
    INBOX_RETENTION = (
        "Set OUTBOX_INBOX_RETENTION_DAYS = 14 (the default), another number of days, or None "
        "to keep the inbox for good."
    )
    INBOX_RETENTION_SHORT = (
        "Set OUTBOX_INBOX_RETENTION_DAYS to {sent:g} or more (default 14), at least the "
        "retention of the services whose events this one consumes."
    )
    ROUTED_UNMIGRATED = (
        "Make the router's allow_migrate() return True for app 'django_outbox' on {alias!r}, "
        "then run `manage.py migrate django_outbox --database {alias}`."
    )
    UNKNOWN_ALIAS = "Use one of {known}, or add {alias!r} to DATABASES."
    NATS_DUPLICATE_WINDOW = (
        "Set OUTBOX_NATS_DUPLICATE_WINDOW to at least twice the lease, e.g. "
        "OUTBOX_NATS_DUPLICATE_WINDOW = {window:g}."
    )
    ORDERED_DELETE_ON_CONFIRM = (
        "Keep SENT rows with ordered mode: set OUTBOX_RETENTION_DAYS to 3 or more (default "
        "7), or OUTBOX_ORDERED = False."
    )
    NATS_STREAM = (
        "Set OUTBOX_NATS_STREAM to a name without spaces, '.', '*', '>' or slashes (e.g. "
        "'OUTBOX'), OUTBOX_NATS_SUBJECTS to a list of subjects (e.g. ['outbox.>']) and "
        "OUTBOX_NATS_REPLICAS to 1, 3 or 5."
    )
    REDIS_SETTING = (
        "Set OUTBOX_REDIS_STREAMS to a dict of routing key to stream name, "
        "OUTBOX_REDIS_MAXLEN to None or a number of entries, "
        "and OUTBOX_REDIS_VISIBILITY_TIMEOUT to seconds (e.g. 60)."
    )


#: Settings that must be positive: name without the prefix, and whether whole numbers only.
POSITIVE_SETTINGS: tuple[tuple[str, bool], ...] = (
    ("BATCH_SIZE", True),
    ("COMPENSATE_MAX_BATCH", True),
    ("PURGE_BATCH_SIZE", True),
    ("MAX_PAYLOAD_BYTES", True),
    ("CONSUMER_PREFETCH", True),
    ("ORDERED_RUN", True),
    ("POLL_INTERVAL", False),
    ("LEASE_SECONDS", False),
    ("CONFIRM_TIMEOUT", False),
    ("COMPENSATE_STALE_AFTER", False),
    ("COMPENSATE_RETRY_DELAY", False),
)


#: Settings that may also be None: then chosen per database (OUTBOX_BATCH_SIZE).
UNSET_ALLOWED: frozenset[str] = frozenset({"BATCH_SIZE"})

#: Settings that must be a number >= 0 (0 turns the feature off), reported like the above.
#: OUTBOX_RETENTION_DAYS = 0: the relay deletes confirmed rows (no SENT rows are kept).
NON_NEGATIVE_SETTINGS: tuple[str, ...] = ("PURGE_PAUSE_RATIO", "RETENTION_DAYS")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def problem(
    key: str,
    level: Callable[..., CheckMessage] = Error,
    /,
    *,
    message: str | None = None,
    hint: str | None = None,
    **values: Any,
) -> CheckMessage:
    """The check message of ``Codes.<key>``: ``Messages.<key>`` and ``Hints.<key>`` (or
    the ``hint`` given, another of ``Hints``) filled in with ``values``; ``level`` is
    ``Error`` or ``Warning``. A ``message`` given (an exception's text) is taken as it is."""
    text = getattr(Messages, key).format(**values) if message is None else message
    advice = (getattr(Hints, key) if hint is None else hint).format(**values)
    return level(text, hint=advice, id=getattr(Codes, key))


def _outbox_aliases(databases: Iterable[str] | None) -> list[str]:
    from .models import OutboxEvent

    aliases = list(databases) if databases is not None else list(connections)
    return [a for a in aliases if router.allow_migrate_model(a, OutboxEvent)]


#: Set while the system checks of a command that publishes run (see :func:`publishing`).
_PUBLISHING: ContextVar[bool] = ContextVar("django_outbox_publishing", default=False)


@contextmanager
def publishing() -> Iterator[None]:
    """Around the system checks of a command that publishes (publish_outbox,
    compensate_outbox, outbox_check): what only publishing needs, a broker URL, is an error
    there and a warning for every other command, so that migrate, makemigrations or shell
    run in a project whose broker is not configured yet."""
    token = _PUBLISHING.set(True)
    try:
        yield
    finally:
        _PUBLISHING.reset(token)


def broker_url_missing() -> CheckMessage:
    """An empty ``OUTBOX_BROKER_URL``: E005 for a command that publishes, else W005."""
    if _PUBLISHING.get():
        return Error(BROKER_URL_EMPTY, hint=BROKER_URL_EMPTY_HINT, id=Codes.BROKER_URL)
    return Warning(BROKER_URL_EMPTY, hint=BROKER_URL_EMPTY_HINT, id=Codes.BROKER_URL_UNSET)


def relay_broker_urls() -> list[str] | CheckMessage:
    """The relay backend's broker URLs (``OUTBOX_BACKEND_OPTIONS["broker_url"]``, else
    ``OUTBOX_BROKER_URL``), or the check message that says why there are none: what every
    broker backend's ``check()`` starts from."""
    options = outbox_settings.BACKEND_OPTIONS or {}
    value = options.get("broker_url") or outbox_settings.BROKER_URL
    try:
        urls = broker_urls(value)
    except TypeError as exc:
        return Error(str(exc), hint=Hints.BROKER_URL_FORM, id=Codes.BROKER_URL_FORM)
    return urls or broker_url_missing()


def broker_url_problems(transport: Transport, hint: str) -> list[CheckMessage]:
    """What the check of a broker backend with plain URLs (NATS, Redis) starts with: the
    relay's broker URLs (:func:`relay_broker_urls`), each with its password encoded and a
    scheme of ``transport``'s. ``hint``: what such a URL looks like."""
    from .masking import mask_url, password_overruns
    from .transports import scheme_of

    urls = relay_broker_urls()
    if not isinstance(urls, list):
        return [urls]
    errors: list[CheckMessage] = []
    for url in urls:
        which = f"OUTBOX_BROKER_URL {mask_url(url)!r}"
        if password_overruns(url):
            errors.append(problem("BROKER_URL_ENCODING", which=which))
        elif scheme_of(url) not in transport.schemes:
            schemes = " or ".join(f"{s}://" for s in transport.schemes)
            errors.append(Error(f"{which} is not a {schemes} URL.", hint=hint, id=Codes.BROKER_URL))
    return errors


@register()
def check_backend(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from .backends import get_backend_class

    try:
        backend_class = get_backend_class()
    except ImproperlyConfiguredBackend as exc:
        return [problem("BACKEND", message=str(exc))]
    return list(backend_class.check(**kwargs))


@register()
def check_retry_schedule(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    schedule = outbox_settings.RETRY_SCHEDULE
    if isinstance(schedule, (list, tuple)) and schedule and all(map(_positive, schedule)):
        return []
    return [problem("RETRY_SCHEDULE")]


@register()
def check_positive_numbers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    for name, whole in POSITIVE_SETTINGS:
        value = getattr(outbox_settings, name)
        if value is None and name in UNSET_ALLOWED:
            continue
        if _positive(value) and (isinstance(value, int) or not whole):
            continue
        rule = "a positive integer" if whole else "a positive number"
        errors.append(_number_error(name, rule, value))
    for name in NON_NEGATIVE_SETTINGS:
        value = getattr(outbox_settings, name)
        if not (_positive(value) or (value == 0 and not isinstance(value, bool))):
            errors.append(_number_error(name, "a number >= 0", value))
    return errors


def _number_error(name: str, rule: str, value: Any) -> CheckMessage:
    default = OutboxSettings.defaults()[PREFIX + name].default
    hint = Hints.NUMBERS if default is not None else Hints.NUMBERS_UNSET
    return problem(
        "NUMBERS", hint=hint, name=PREFIX + name, rule=rule, value=value, default=default
    )


@register()
def check_lease(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    lease, timeout = outbox_settings.LEASE_SECONDS, outbox_settings.CONFIRM_TIMEOUT
    # A value that is not a positive number is check_positive_numbers' to report.
    if not (_positive(lease) and _positive(timeout)) or lease > timeout:
        return []
    return [problem("LEASE", lease=lease, timeout=timeout, suggested=6 * timeout)]


@register()
def check_retention(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    days = outbox_settings.RETENTION_DAYS
    if not _positive(days) or days >= 3:
        return []
    return [problem("RETENTION", Warning, days=days)]


@register()
def check_ordered_delete_on_confirm(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    ordered = outbox_settings.ORDERED
    if not outbox_settings.deletes_on_confirm or not ordered:
        return []
    return [problem("ORDERED_DELETE_ON_CONFIRM")]


@register()
def check_inbox_retention(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    inbox, sent = outbox_settings.INBOX_RETENTION_DAYS, outbox_settings.RETENTION_DAYS
    if inbox is None:
        return []
    if not _positive(inbox):
        return [problem("INBOX_RETENTION", value=inbox)]
    # A bad OUTBOX_RETENTION_DAYS is check_positive_numbers' to report; the default (14)
    # follows a longer outbox retention by itself: only a value the project chose is wrong.
    if not _positive(sent) or inbox >= sent or not outbox_settings.is_set("INBOX_RETENTION_DAYS"):
        return []
    return [problem("INBOX_RETENTION_SHORT", inbox=inbox, sent=sent)]


@register()
def check_ordered(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    ordered = outbox_settings.ORDERED
    if isinstance(ordered, bool) or (
        isinstance(ordered, (list, tuple)) and all(isinstance(v, str) for v in ordered)
    ):
        return []
    return [problem("ORDERED")]


@register()
def check_ordered_dead_head(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    dead_head = outbox_settings.ORDERED_DEAD_HEAD
    if dead_head in ("block", "skip"):
        return []
    return [problem("ORDERED_DEAD_HEAD", value=dead_head)]


@register()
def check_alerts(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from django.core.exceptions import ImproperlyConfigured

    from .alerts import build_channel

    channels = outbox_settings.ALERTS
    if not isinstance(channels, (list, tuple)):
        return [problem("ALERTS", hint=Hints.ALERTS_NOT_A_LIST, index="-", problem="not a list")]
    errors: list[CheckMessage] = []
    for index, entry in enumerate(channels):
        what = ""
        if not isinstance(entry, dict) or "BACKEND" not in entry:
            what = "it needs a 'BACKEND' key"
        elif not isinstance(entry.get("OPTIONS", {}), dict):
            what = "'OPTIONS' must be a dict"
        else:
            # Building a channel validates its OPTIONS and never touches the network.
            try:
                build_channel(entry)
            except ImproperlyConfigured as exc:
                what = str(exc).rstrip(".")
        if what:
            errors.append(problem("ALERTS", index=index, problem=what))
    return errors


@register()
def check_unknown_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    known = set(OutboxSettings.names())
    errors: list[CheckMessage] = []
    for name in dir(settings):
        if not name.startswith(PREFIX) or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            errors.append(problem("UNKNOWN_SETTING", Warning, name=name, suggestion=close[0]))
        else:
            hint = Hints.UNKNOWN_SETTING_NONE
            errors.append(problem("UNKNOWN_SETTING", Warning, hint=hint, name=name))
    return errors


@register()
def check_sqlite(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    return [
        problem("SQLITE", Warning, alias=alias)
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
            errors.append(problem("NO_SKIP_LOCKED", alias=alias, server=server))
    return errors


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
            errors.append(problem("ORDERED_ISOLATION", Warning, alias=alias, level=level))
    return errors


@register()
def check_message_format(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from .message import FORMATS

    value = outbox_settings.MESSAGE_FORMAT
    if value in FORMATS:
        return []
    return [problem("MESSAGE_FORMAT", choices=", ".join(map(repr, FORMATS)), value=value)]


@register()
def check_cloudevents_source(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    source = outbox_settings.CLOUDEVENTS_SOURCE
    if isinstance(source, str) and not any(c.isspace() or not c.isprintable() for c in source):
        return []
    return [problem("CLOUDEVENTS_SOURCE", value=source)]


@register()
def check_tracing(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Tracing asked for explicitly without the library that records it (the default,
    True, only means "when it is installed")."""
    from . import tracing

    if getattr(settings, PREFIX + "TRACING", None) is not True or tracing.AVAILABLE:
        return []
    return [problem("TRACING_NO_API")]


# -- several databases -------------------------------------------------------------------------


#: Who names an outbox database: (how W002 names it, how W001 says what goes there).
_ROUTER = ("The database router", "written to (the router's choice) on")
_SETTING = ("OUTBOX_DATABASES", "shown (OUTBOX_DATABASES) from")


def _outbox_targets() -> list[tuple[str, tuple[str, str]]]:
    """Every database the configuration sends the outbox to, and who names it."""
    from .models import OutboxEvent

    targets = [(router.db_for_write(OutboxEvent), _ROUTER)]
    configured = outbox_settings.DATABASES
    if isinstance(configured, (list, tuple)):
        targets += [(alias, _SETTING) for alias in configured]
    return targets


@register()
def check_outbox_aliases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W002: an alias the outbox is routed to or shown from that DATABASES lacks (a
    typo in a router or in OUTBOX_DATABASES); W001: one where migrate never creates
    the table. Reads configuration only, so it runs with every command."""
    from .models import OutboxEvent

    known = list(settings.DATABASES)
    messages: list[CheckMessage] = []
    seen: set[str] = set()
    for alias, (where, why) in _outbox_targets():
        if alias in seen:
            continue
        seen.add(alias)
        if alias not in known:
            names = ", ".join(map(repr, known))
            messages.append(
                problem("UNKNOWN_ALIAS", Warning, where=where, alias=alias, known=names)
            )
        elif not router.allow_migrate_model(alias, OutboxEvent):
            messages.append(problem("ROUTED_UNMIGRATED", Warning, why=why, alias=alias))
    return messages
