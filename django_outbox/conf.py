"""Typed, lazy settings for django_outbox.

Every setting is a flat ``OUTBOX_<NAME>`` entry in the project's settings module. Values
are read from ``django.conf.settings`` when first used, never at import time, and again
after ``override_settings`` (pytest-django's ``settings`` fixture too) or a
``setting_changed`` signal; nothing here needs Django to be configured at import. A plain
assignment to ``django.conf.settings`` at run time is not seen, as by Django's own caches.
``docs/settings.md`` documents each one; a test keeps the two in step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from .masking import split_urls

PREFIX = "OUTBOX_"

T = TypeVar("T")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting: its default and a one-line description.

    Mutable defaults (lists, dicts) are copied on every read so that callers can never
    change the default for everybody else.
    """

    default: T
    doc: str
    name: str = ""

    def __set_name__(self, owner: type, name: str) -> None:
        object.__setattr__(self, "name", name)

    @property
    def setting_name(self) -> str:
        return PREFIX + self.name

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, instance: object, owner: type) -> T: ...

    def __get__(self, instance: object | None, owner: type) -> Setting[T] | T:
        if instance is None:
            return self
        from django.conf import settings as django_settings

        # Each setting is looked up once per settings object: one the project leaves out
        # costs Django's two exceptions per read, and emit() reads two on every call.
        # override_settings (pytest-django's fixture too) puts another object in place;
        # setting_changed clears the values read (reset_caches()).
        lazy: Any = django_settings
        source = lazy._wrapped
        if source is not _read.source:
            _read.values.clear()
            _read.source = source
        value = _read.values.get(self.name, _UNREAD)
        if value is _UNREAD:
            value = getattr(django_settings, self.setting_name, _MISSING)
            if source is lazy._wrapped:  # (else it was read before the setup)
                _read.values[self.name] = value
        if value is _MISSING:
            default = self.default
            if isinstance(default, (list, dict, set)):
                return copy.deepcopy(default)  # type: ignore[no-any-return]
            return default
        return value  # type: ignore[no-any-return]


class _Read:
    """The values read from one settings object: the project's, or _MISSING."""

    def __init__(self) -> None:
        self.source: object = None
        self.values: dict[str, Any] = {}


_read = _Read()


_MISSING: Any = object()
_UNREAD: Any = object()

DEFAULT_RETRY_SCHEDULE: tuple[float, ...] = (1, 5, 30, 120, 900, 3600, 21600)

#: What every part that needs RabbitMQ says when OUTBOX_BROKER_URL is empty: check E005
#: shows the two as its message and hint, the relay's backend and the consumer as one.
BROKER_URL_EMPTY = "OUTBOX_BROKER_URL is empty: there is no RabbitMQ to connect to."
BROKER_URL_EMPTY_HINT = (
    "Set OUTBOX_BROKER_URL to the AMQP URL of RabbitMQ, e.g. "
    "'amqp://user:password@rabbitmq:5672/%2F' (for instance from an environment variable). "
    "Without RabbitMQ (development, tests), let the relay print each event with "
    "OUTBOX_BACKEND = 'django_outbox.backends.console.ConsoleBackend', or keep them in "
    "memory with 'django_outbox.backends.locmem.LocmemBackend'."
)


def broker_urls(value: object) -> list[str]:
    """The broker URLs of ``OUTBOX_BROKER_URL`` (or a ``broker_url`` option), in order.

    One URL; a list or tuple of URLs; or one string with ``;`` between URLs, as Celery and
    kombu write failover URLs (split where the next URL begins, so a ``;`` in a password
    stays in it). Blank entries (a trailing ``;``) are left out; ``[]`` for an empty
    setting. Anything else raises ``TypeError`` saying the accepted forms (system
    check E016 reports the same before a worker starts).
    """
    if isinstance(value, str):
        parts = [value]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
        wrong = next((v for v in parts if not isinstance(v, str)), None)
        if wrong is not None:
            kind = type(wrong).__name__
            raise TypeError(BROKER_URL_TYPE.format(what=f"lists a value of type {kind}"))
    else:
        raise TypeError(BROKER_URL_TYPE.format(what=f"is of type {type(value).__name__}"))
    return [url for part in parts for url in split_urls(part)]


#: What a broker URL setting of the wrong type gets (broker_urls(), check E016).
BROKER_URL_TYPE = (
    "OUTBOX_BROKER_URL {what}: it must be an AMQP URL, a list of AMQP URLs, or one "
    "string with ';' between URLs (e.g. 'amqp://u:p@rabbit-1/%2F;amqp://u:p@rabbit-2/%2F')."
)


class OutboxSettings:
    """The settings of django_outbox, with their defaults (``OUTBOX_`` + attribute name)."""

    # --- the relay and its backend -------------------------------------------------------
    BACKEND: Setting[str] = Setting(
        "",
        "Dotted path of the broker backend class the relay publishes through; '' picks it by "
        "OUTBOX_BROKER_URL's scheme (amqp://, amqps://: django_outbox.backends.pika.PikaBackend).",
    )
    BACKEND_OPTIONS: Setting[dict[str, Any]] = Setting(
        {}, "Extra keyword arguments passed to the backend class."
    )
    BROKER_URL: Setting[str | list[str]] = Setting(
        "",
        "AMQP URL of RabbitMQ, e.g. amqp://user:password@rabbitmq:5672/%2F; for a cluster, a "
        "list of URLs or one string with ';' between them (failover, round robin).",
    )
    EXCHANGE: Setting[str] = Setting("outbox", "Name of the exchange events are published to.")
    EXCHANGE_TYPE: Setting[str] = Setting(
        "topic", "Type of the exchange declared on connect (topic, direct, fanout, headers)."
    )
    EXCHANGE_PASSIVE: Setting[bool] = Setting(
        False, "Only check that the exchange exists (it is managed elsewhere); never declare it."
    )
    ROUTING_KEYS: Setting[dict[str, str]] = Setting(
        {}, "Map of event_type to routing key; event types not in it use the event_type."
    )
    ROUTING_KEY_FUNC: Setting[str] = Setting(
        "",
        "Dotted path of a callable(event) -> routing key; overrides ROUTING_KEYS when set.",
    )
    CONFIRM_TIMEOUT: Setting[float] = Setting(
        10.0, "Seconds to wait for the broker's publisher confirms of a batch before failing it."
    )
    CONNECT_TIMEOUT: Setting[float] = Setting(
        10.0,
        "Seconds to wait for the broker connection (also the blocked-connection timeout).",
    )
    BATCH_SIZE: Setting[int | None] = Setting(
        None,
        "Events claimed and published per relay batch; None: the fastest measured for the "
        "database (1000 on PostgreSQL and MySQL/MariaDB, 500 on SQLite).",
    )
    DB_THREAD: Setting[bool] = Setting(
        True,
        "The relay claims and settles batches on two more threads (a connection each) while "
        "it publishes (not on SQLite, nor inside a transaction); False: all on one thread.",
    )
    POLL_INTERVAL: Setting[float] = Setting(
        1.0, "Seconds the relay sleeps when nothing is due (a NOTIFY wakes it sooner)."
    )
    LEASE_SECONDS: Setting[float] = Setting(
        60.0,
        "How long a claimed row is held by one relay before another may take it over.",
    )
    RETRY_SCHEDULE: Setting[tuple[float, ...]] = Setting(
        DEFAULT_RETRY_SCHEDULE,
        "Seconds to wait after the 1st, 2nd, ... failed attempt; past the last step, DEAD.",
    )
    BROKER_BACKOFF_MAX: Setting[float] = Setting(
        30.0, "Longest pause of the whole relay while the broker is unreachable (seconds)."
    )
    NOTIFY: Setting[bool] = Setting(
        True,
        "On PostgreSQL, a commit that emitted sends NOTIFY (right after it, as a "
        "transaction of its own) so an idle relay wakes at once.",
    )
    NOTIFY_CHANNEL: Setting[str] = Setting(
        "django_outbox", "PostgreSQL LISTEN/NOTIFY channel name."
    )
    HEARTBEAT_FILE: Setting[str] = Setting(
        "", "File the relay touches every loop, for a liveness probe ('' = none)."
    )
    MAX_PAYLOAD_BYTES: Setting[int] = Setting(
        256 * 1024, "Largest serialised payload emit() accepts, in bytes."
    )
    ORDERED: Setting[bool | list[str]] = Setting(
        False,
        "Ordered delivery per aggregate: True for every event, or a list of event/aggregate types.",
    )
    ORDERED_DEAD_HEAD: Setting[str] = Setting(
        "block",
        "Ordered mode: a DEAD event's successors 'block' until it is requeued, or 'skip' it.",
    )
    ORDERED_RUN: Setting[int] = Setting(
        100,
        "Ordered mode: most events of one aggregate a relay claims at once and publishes one "
        "after another, each after the previous one's confirm (1 = its head only).",
    )

    # --- the message format (django_outbox.formats) --------------------------------------
    MESSAGE_FORMAT: Setting[str] = Setting(
        "native",
        "Wire format of published events: 'native', 'cloudevents' (CloudEvents 1.0, binary "
        "content mode) or 'cloudevents-structured' (application/cloudevents+json).",
    )
    CLOUDEVENTS_SOURCE: Setting[str] = Setting(
        "",
        "CloudEvents 'source' of every event, a URI-reference ('' = '/' and the top package "
        "of the settings module, e.g. '/mysite').",
    )

    # --- Celery (django_outbox.backends.celery.CeleryBackend) ---------------------------
    CELERY_APP: Setting[str] = Setting(
        "",
        "Dotted path of the project's Celery app, e.g. 'config.celery.app' ('' = current app).",
    )
    CELERY_TASKS: Setting[dict[str, str]] = Setting(
        {},
        "Map of event_type to Celery task name; other types go to OUTBOX_EXCHANGE as messages.",
    )

    # --- NATS JetStream (nats:// and tls:// broker URLs; docs/transports.md) -------------
    NATS_STREAM: Setting[str] = Setting(
        "OUTBOX",
        "JetStream stream the relay publishes into and consumers read: declared at start when "
        "missing, verified (never changed) when it exists.",
    )
    NATS_SUBJECTS: Setting[list[str]] = Setting(
        [],
        "Subjects of the stream when the relay declares it ([] = '<OUTBOX_EXCHANGE>.>'); an "
        "event is published to '<OUTBOX_EXCHANGE>.<routing key>'.",
    )
    NATS_REPLICAS: Setting[int] = Setting(
        1, "Replicas of the stream when the relay declares it (3 on a cluster of three nodes)."
    )
    NATS_DUPLICATE_WINDOW: Setting[float] = Setting(
        120.0,
        "Seconds JetStream remembers an event_id (Nats-Msg-Id) to drop a republished event; "
        "longer than OUTBOX_LEASE_SECONDS.",
    )

    # --- Redis Streams (redis:// and rediss:// broker URLs; docs/transports.md) ----------
    REDIS_STREAMS: Setting[dict[str, str]] = Setting(
        {},
        "Map of routing key (the event_type unless OUTBOX_ROUTING_KEYS says otherwise) to "
        "Redis stream; other keys go to '<OUTBOX_EXCHANGE>.<routing key>'.",
    )
    REDIS_MAXLEN: Setting[int | None] = Setting(
        None,
        "Approximate bound of each stream (XADD MAXLEN ~): older entries are trimmed, read "
        "or not. None keeps every entry.",
    )
    REDIS_VISIBILITY_TIMEOUT: Setting[float] = Setting(
        60.0,
        "Seconds an entry delivered to a consumer stays pending before another consumer of "
        "the group claims it (XAUTOCLAIM): a consumer that died leaves its entries for this long.",
    )

    # --- compensation, dead letters, purge -----------------------------------------------
    COMPENSATE_STALE_AFTER: Setting[float] = Setting(
        600.0, "compensate_outbox takes only PENDING rows created at least this long ago (s)."
    )
    COMPENSATE_MAX_BATCH: Setting[int] = Setting(
        500, "At most this many rows per compensate_outbox run."
    )
    COMPENSATE_MAX_ATTEMPTS: Setting[int] = Setting(
        10, "compensate_outbox makes a row DEAD once it has failed more than this many times."
    )
    COMPENSATE_RETRY_DELAY: Setting[float] = Setting(
        60.0, "After a failed compensation attempt the row is due again in this many seconds."
    )
    ALERTS: Setting[list[dict[str, Any]]] = Setting(
        [{"BACKEND": "django_outbox.alerts.LoggingChannel"}],
        "Dead-letter alert channels: a list of {'BACKEND': dotted path, 'OPTIONS': {...}}.",
    )
    RETENTION_DAYS: Setting[float] = Setting(
        7.0,
        "purge_outbox deletes SENT rows older than this many days (at least 3); 0: the "
        "relay deletes each row once the broker confirmed it, and keeps no SENT rows.",
    )
    PURGE_BATCH_SIZE: Setting[int] = Setting(1000, "Rows deleted per purge statement.")
    PURGE_PAUSE_RATIO: Setting[float] = Setting(
        1.0,
        "purge_outbox sleeps this many times as long as each batch took before the next "
        "(1: half the time, for the application's writers; 0: no pause).",
    )
    PURGE_DEAD: Setting[bool] = Setting(
        False, "Let purge_outbox delete DEAD rows past retention too (they are undelivered)."
    )

    # --- inbox retention (purge_outbox) ---------------------------------------------------
    INBOX_RETENTION_DAYS: Setting[float | None] = Setting(
        14.0,
        "purge_outbox deletes inbox rows processed longer ago than this many days, never "
        "sooner than SENT rows (OUTBOX_RETENTION_DAYS); None keeps them.",
    )

    # --- monitoring -----------------------------------------------------------------------
    ALERT_PENDING_AGE: Setting[float] = Setting(
        300.0, "Admin banner when the oldest PENDING event is older than this (seconds)."
    )

    # --- several databases ---------------------------------------------------------------
    DATABASES: Setting[list[str] | None] = Setting(
        None,
        "Aliases whose outbox the admin dashboard and the gauges show; None: the router's "
        "write alias and every other alias that holds the outbox table.",
    )

    # --- consumers -----------------------------------------------------------------------
    CONSUMER_HANDLERS: Setting[list[str]] = Setting(
        [], "Dotted paths of IdempotentHandler subclasses consume_outbox runs."
    )
    CONSUMER_QUEUE: Setting[str] = Setting(
        "", "Queue consume_outbox declares and reads ('' = <service>.outbox from the app name)."
    )
    CONSUMER_PREFETCH: Setting[int] = Setting(50, "Unacknowledged messages a consumer holds.")
    CONSUMER_MAX_RETRIES: Setting[int] = Setting(
        5, "Deliveries of a failing message before it goes to the dead-letter queue."
    )
    CONSUMER_QUEUE_TYPE: Setting[str] = Setting(
        "quorum", "Queue type declared by consume_outbox: 'quorum' or 'classic'."
    )

    # --- tracing (docs/tracing.md) ---------------------------------------------------------
    TRACING: Setting[bool] = Setting(
        True,
        "With opentelemetry-api installed: emit() stores the active trace context with the "
        "event, the relay and consumers record spans. False: neither.",
    )
    TRACING_CREATE_SPANS: Setting[bool] = Setting(
        True,
        "emit() records a 'create' span and stores its context; False: it stores the "
        "active span's context itself.",
    )

    @classmethod
    def names(cls) -> list[str]:
        """All setting names, with the ``OUTBOX_`` prefix."""
        return [v.setting_name for v in vars(cls).values() if isinstance(v, Setting)]

    @classmethod
    def defaults(cls) -> dict[str, Setting[Any]]:
        return {v.setting_name: v for v in vars(cls).values() if isinstance(v, Setting)}

    @staticmethod
    def is_set(name: str) -> bool:
        """Whether the project's settings give ``OUTBOX_<name>`` (else the default is used)."""
        from django.conf import settings as django_settings

        return hasattr(django_settings, PREFIX + name)

    @property
    def deletes_on_confirm(self) -> bool:
        """``OUTBOX_RETENTION_DAYS = 0``: the relay's settle deletes the rows the broker
        confirmed instead of keeping them as SENT (docs/operations.md, "Keeping no SENT
        rows")."""
        days = self.RETENTION_DAYS
        return not isinstance(days, bool) and days == 0


outbox_settings = OutboxSettings()


def reset_caches(**kwargs: Any) -> None:
    """Clear everything derived from settings (connected to ``setting_changed``)."""
    _read.values.clear()
    for hook in _reset_hooks:
        hook()


_reset_hooks: list[Callable[[], None]] = []


def on_settings_reset(func: Callable[[], None]) -> Callable[[], None]:
    """Register a cache-clearing function run whenever an ``OUTBOX_*`` setting changes."""
    _reset_hooks.append(func)
    return func
