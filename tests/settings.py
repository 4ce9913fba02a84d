"""Test settings: the demo project's, on the database DATABASE_URL names.

DATABASE_URL selects SQLite (default, in memory), PostgreSQL or MariaDB; the test database
name may be set with TEST_DATABASE_NAME so that several runs can share a server.

A second alias, ``other``, is the outbox of a project with several databases (tests marked
with ``databases={"default", "other"}`` use it; the rest of the suite never touches it): by
default the same server as ``default`` with ``_other`` appended to the database's names, so
a child process given the test database's DATABASE_URL finds the test's ``other`` too;
``OTHER_DATABASE_URL`` puts it elsewhere (PostgreSQL and MariaDB side by side).
"""

import copy
import os

os.environ.setdefault("DATABASE_URL", "sqlite://:memory:")

from config.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405

OUTBOX_BACKEND = "django_outbox.backends.locmem.LocmemBackend"
OUTBOX_BROKER_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")

if os.environ.get("TEST_DATABASE_NAME"):
    DATABASES["default"].setdefault("TEST", {})["NAME"] = os.environ["TEST_DATABASE_NAME"]  # noqa: F405


def _other_database(url: str) -> dict:
    if url:
        other = env.db_url_config(url)  # noqa: F405
    else:
        other = copy.deepcopy(DATABASES["default"])  # noqa: F405
        other.pop("TEST", None)
        name = str(other.get("NAME") or "")
        if ":memory:" not in name and "mode=memory" not in name:
            other["NAME"] = f"{name}_other"
    if other["ENGINE"] == "django.db.backends.mysql":
        other.setdefault("OPTIONS", {}).update(charset="utf8mb4", isolation_level="read committed")
    # Named explicitly, so tests.utils.subprocess can tell whether it was created.
    if os.environ.get("TEST_DATABASE_NAME"):
        other["TEST"] = {"NAME": os.environ["TEST_DATABASE_NAME"] + "_other"}
    elif other["ENGINE"] != "django.db.backends.sqlite3":
        other["TEST"] = {"NAME": f"test_{other['NAME']}"}
    return other


# "none": a child process of a test that did not create "other" (its system checks would
# connect to every alias, and on MariaDB fail on a database that does not exist).
if os.environ.get("OTHER_DATABASE_URL") != "none":
    DATABASES["other"] = _other_database(os.environ.get("OTHER_DATABASE_URL", ""))  # noqa: F405

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
SILENCED_SYSTEM_CHECKS = []
LOGGING = {"version": 1, "disable_existing_loggers": False}

# Django's Tasks API on the outbox (tests/test_tasks_backend.py): the tasks in tests/tasks_app.
TASKS = {
    "default": {
        "BACKEND": "django_outbox.tasks_backend.OutboxTaskBackend",
        "QUEUES": ["default", "other"],
        "OPTIONS": {
            "MAX_RETRIES": 2,
            # A child process of a test reads the test's own broker queues.
            "BROKER_QUEUE_PREFIX": os.environ.get("TASKS_BROKER_QUEUE_PREFIX", "django.tasks."),
        },
    }
}
