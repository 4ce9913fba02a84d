"""Test settings: the demo project's, on the database DATABASE_URL names.

DATABASE_URL selects SQLite (default, in memory), PostgreSQL or MariaDB; the test database
name may be set with TEST_DATABASE_NAME so that several runs can share a server.
"""

import os

os.environ.setdefault("DATABASE_URL", "sqlite://:memory:")

from config.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405

OUTBOX_BACKEND = "django_outbox.backends.locmem.LocmemBackend"
OUTBOX_BROKER_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")

if os.environ.get("TEST_DATABASE_NAME"):
    DATABASES["default"].setdefault("TEST", {})["NAME"] = os.environ["TEST_DATABASE_NAME"]  # noqa: F405

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
SILENCED_SYSTEM_CHECKS = []
LOGGING = {"version": 1, "disable_existing_loggers": False}
