"""Settings of the demo project: an orders service and a points service in one project.

Everything comes from the environment (django-environ), with embedded defaults that need
no services: SQLite in ``testproject/db.sqlite3`` and the in-memory broker.

- ``DATABASE_URL``: e.g. ``postgres://127.0.0.1/test`` or ``mysql://root@127.0.0.1/test``
- ``BROKER_URL``: e.g. ``amqp://guest:guest@127.0.0.1:5672/%2F``,
  ``nats://127.0.0.1:4222`` or ``redis://127.0.0.1:6379/0``; when set, the relay and the
  consumer use the broker its scheme names (RabbitMQ, NATS JetStream, Redis Streams),
  otherwise the in-memory (locmem) one. ``AMQP_URL`` is read when it is unset (its earlier
  name).
- ``OUTBOX_NATS_STREAM``: the JetStream stream (``manage.py demo`` sets its own).
- ``OUTBOX_REDIS_VISIBILITY_TIMEOUT``: seconds before a Redis consumer claims what a dead
  one left pending (``manage.py demo`` sets its own).
- ``TASKS_BROKER_QUEUE_PREFIX``: the ``BROKER_QUEUE_PREFIX`` of ``TASKS`` (default
  ``django.tasks.``): ``outbox_worker`` reads task queue ``q`` from the broker queue
  ``<prefix>q`` (``manage.py demo`` sets one of its run).
- ``OUTBOX_ORDERED=1``: ordered delivery per aggregate for every event type.
- ``OUTBOX_MESSAGE_FORMAT``: ``native`` (the default), ``cloudevents`` or
  ``cloudevents-structured``: how the relay publishes (the consumer reads all three);
  ``OUTBOX_CLOUDEVENTS_SOURCE``: the CloudEvents ``source`` (default ``/testproject``).
- ``OUTBOX_BACKEND``, ``OUTBOX_LEASE_SECONDS``, ``OUTBOX_CONFIRM_TIMEOUT``: what
  ``manage.py demo`` sets for the relay processes it starts.
- ``DEBUG=1``: Django's debug mode, off by default (an error page would show the broker
  and database URLs to whoever triggers it; ``runserver`` serves the admin's static files
  only with it on).
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, False),
    SECRET_KEY=(str, "demo-only-not-secret-" + "x" * 40),
    ALLOWED_HOSTS=(list, ["localhost", "127.0.0.1", "[::1]", "testserver"]),
    BROKER_URL=(str, ""),
    AMQP_URL=(str, ""),
    OUTBOX_NATS_STREAM=(str, "OUTBOX"),
    OUTBOX_REDIS_VISIBILITY_TIMEOUT=(float, 60.0),
    TASKS_BROKER_QUEUE_PREFIX=(str, "django.tasks."),
    OUTBOX_ORDERED=(bool, False),
    OUTBOX_MESSAGE_FORMAT=(str, "native"),
    OUTBOX_CLOUDEVENTS_SOURCE=(str, "/testproject"),
    OUTBOX_BACKEND=(str, ""),
    OUTBOX_LEASE_SECONDS=(float, 60.0),
    OUTBOX_CONFIRM_TIMEOUT=(float, 10.0),
)

DEBUG = env("DEBUG")
# Error pages and error e-mails hide the connection URLs too, not only *PASS*/*KEY* names.
DEFAULT_EXCEPTION_REPORTER_FILTER = "config.reporting.SecretSettingsFilter"
SECRET_KEY = env("SECRET_KEY")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_outbox",
    "orders",
    "points",
    "demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "config.wsgi.application"

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        charset="utf8mb4", isolation_level="read committed"
    )

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
USE_I18N = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "static"

# Django 6.1 configures e-mail with MAILERS and warns when a project sends mail without it
# (the dead-letter EmailChannel does); 5.2 and 6.0 ignore it and use the same SMTP default.
MAILERS = {"default": {"BACKEND": "django.core.mail.backends.smtp.EmailBackend"}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"django_outbox": {"handlers": ["console"], "level": "INFO", "propagate": False}},
}

# --- django_outbox -------------------------------------------------------------------------
BROKER_URL = env("BROKER_URL") or env("AMQP_URL")
# RabbitMQ's URL, for what only RabbitMQ serves (Celery's broker below).
AMQP_URL = BROKER_URL if BROKER_URL.lower().startswith("amqp") else ""
OUTBOX_BROKER_URL = BROKER_URL
# '': the backend of the broker URL's transport.
OUTBOX_BACKEND = env("OUTBOX_BACKEND") or (
    "" if BROKER_URL else "django_outbox.backends.locmem.LocmemBackend"
)
OUTBOX_NATS_STREAM = env("OUTBOX_NATS_STREAM")
OUTBOX_REDIS_VISIBILITY_TIMEOUT = env("OUTBOX_REDIS_VISIBILITY_TIMEOUT")
OUTBOX_ORDERED = env("OUTBOX_ORDERED")
OUTBOX_MESSAGE_FORMAT = env("OUTBOX_MESSAGE_FORMAT")
OUTBOX_CLOUDEVENTS_SOURCE = env("OUTBOX_CLOUDEVENTS_SOURCE")
# The demo's relay processes run with a lease of seconds, so that the rows of the relay it
# kills come back before the demo ends.
OUTBOX_LEASE_SECONDS = env("OUTBOX_LEASE_SECONDS")
OUTBOX_CONFIRM_TIMEOUT = env("OUTBOX_CONFIRM_TIMEOUT")
OUTBOX_CONSUMER_QUEUE = "points.outbox"
# With OUTBOX_BACKEND=django_outbox.backends.celery.CeleryBackend: ORDER_CREATED becomes
# the points service's task; any other event type goes to OUTBOX_EXCHANGE as a message.
OUTBOX_CELERY_APP = "config.celery.app"
OUTBOX_CELERY_TASKS = {"ORDER_CREATED": "points.award_points"}

# Django's Tasks API on the outbox (docs/tasks.md): the demo enqueues demo.receipts.send_receipt
# with each order, and runs it after the relay.
TASKS = {
    "default": {
        "BACKEND": "django_outbox.tasks_backend.OutboxTaskBackend",
        "QUEUES": ["default"],
        "OPTIONS": {"BROKER_QUEUE_PREFIX": env("TASKS_BROKER_QUEUE_PREFIX")},
    }
}

# --- Celery (config/celery.py) -----------------------------------------------------------
# OUTBOX_BACKEND=django_outbox.backends.celery.CeleryBackend relays through this app;
# CELERY_BROKER_URL (else AMQP_URL) is its broker, CELERY_TASK_DEFAULT_QUEUE its queue.
CELERY_BROKER_URL = (
    env.str("CELERY_BROKER_URL", default="") or AMQP_URL or "amqp://guest:guest@127.0.0.1:5672//"
)
# Publisher confirms for everything the app sends (task retries included); the outbox's
# Celery backend publishes on a confirm-mode connection of its own regardless.
CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
CELERY_TASK_DEFAULT_QUEUE = env.str("CELERY_TASK_DEFAULT_QUEUE", default="celery")
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TIMEZONE = TIME_ZONE

# The demo runs on one SQLite file by default: say so once, not on every command.
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    SILENCED_SYSTEM_CHECKS = ["django_outbox.W004"]
