"""Every command exits 2 with one line when the database is unreachable (issue 19, item 8).

A real process each: the exit status and stderr are what a CronJob or a deployment gate
sees. The database URL points at the running engine on a port nothing listens on (SQLite:
a file in a directory that does not exist), with a password that must never be printed.
"""

from __future__ import annotations

import subprocess
import threading

import pytest
from django.core.management import CommandError
from django.db import OperationalError, connection, connections

from django_outbox.management.errors import database_errors
from tests.utils.subprocess import django_env, manage_command

# Each engine's driver says "unreachable" in its own words: every database pass runs these.
pytestmark = pytest.mark.engine

PASSWORD = "s3cret-pw"

COMMANDS = [
    ["publish_outbox", "--once"],
    ["publish_outbox"],  # long-running: a database down at start is exit 2, not a backoff
    ["compensate_outbox"],
    ["purge_outbox"],
    ["outbox_requeue", "--dry-run"],
    ["outbox_stats"],
    ["outbox_stats", "--json", "--database", "default"],
    ["outbox_check"],
    ["consume_outbox", "--once"],
    # --list needs no database, but Django's system checks may connect (MySQL/MariaDB, and
    # SQLite on Django 6.x): then it is exit 2 in one line too, never a traceback.
    ["consume_outbox", "--list"],
]


def down_url() -> str:
    if connection.vendor == "postgresql":
        return f"postgres://outbox:{PASSWORD}@127.0.0.1:1/outbox"
    if connection.vendor == "mysql":
        return f"mysql://outbox:{PASSWORD}@127.0.0.1:1/outbox"
    return "sqlite:////nonexistent-directory/outbox.sqlite3"


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_unreachable_database_exits_2_in_one_line(args):
    proc = subprocess.run(
        manage_command(*args),
        capture_output=True,
        text=True,
        env=django_env(DATABASE_URL=down_url()),
        timeout=60,
    )
    command = args[0]
    if args == ["consume_outbox", "--list"] and proc.returncode == 0:
        assert "points.award: ORDER_CREATED" in proc.stdout  # nothing connected: it listed
        return
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"CommandError: {command}: the database 'default' ("), lines[0]
    assert "is unreachable: " in lines[0]
    assert PASSWORD not in proc.stderr + proc.stdout
    if connection.vendor != "sqlite":
        assert ":***@127.0.0.1:1/outbox)" in lines[0]


def _in_thread_pointing_at_a_closed_port(work):
    """Run ``work`` on a thread whose own ``default`` connection points at a closed port.

    Connections are per thread: the test's own connection and settings are untouched.
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        wrapper = connections.create_connection("default")
        wrapper.settings_dict = {
            **wrapper.settings_dict,
            "HOST": "127.0.0.1",
            "PORT": "1",
            "PASSWORD": PASSWORD,
            "NAME": "/nonexistent-directory/outbox.sqlite3"
            if connection.vendor == "sqlite"
            else wrapper.settings_dict["NAME"],
        }
        connections["default"] = wrapper
        try:
            work()
            outcome.append(None)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    return outcome[0]


@pytest.mark.django_db
def test_a_connection_lost_mid_run_exits_2_when_the_database_stays_down():
    def work() -> None:
        with database_errors("publish_outbox", "default"):
            raise OperationalError("server closed the connection unexpectedly")

    error = _in_thread_pointing_at_a_closed_port(work)
    assert isinstance(error, CommandError), error
    assert error.returncode == 2
    assert str(error).startswith("publish_outbox: the database 'default' (")
    assert "is unreachable: " in str(error)
    assert PASSWORD not in str(error)
    assert "\n" not in str(error)


@pytest.mark.django_db
def test_an_operational_error_on_a_database_that_answers_is_not_unreachable():
    """A deadlock or a lock timeout is an OperationalError too; it stays what it is."""
    with (
        pytest.raises(OperationalError, match="deadlock"),
        database_errors("publish_outbox", "default"),
    ):
        raise OperationalError("deadlock detected")
