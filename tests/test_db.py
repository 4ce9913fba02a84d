"""Connection hygiene of the long-running workers (relay, consumer) between passes."""

from __future__ import annotations

import time

import pytest
from django.db import DatabaseError, connection, transaction

from django_outbox.db import tidy_connections

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_healthy_connection_is_kept_with_the_default_conn_max_age():
    """Django's close_old_connections() would close it (CONN_MAX_AGE 0): a reconnect per
    NOTIFY wake-up of the relay, per message of the consumer."""
    assert not connection.settings_dict.get("CONN_MAX_AGE")
    connection.ensure_connection()
    raw = connection.connection
    tidy_connections()
    assert connection.connection is raw


def test_a_connection_that_failed_and_is_unusable_is_closed():
    if connection.vendor == "sqlite":
        pytest.skip("closing the raw connection would drop the in-memory test database")
    connection.ensure_connection()
    connection.connection.close()  # as a server restart or pg_terminate_backend would
    connection.errors_occurred = True
    tidy_connections()
    assert connection.connection is None
    with connection.cursor() as cursor:  # the next pass reconnects
        cursor.execute("SELECT 1")


def test_a_connection_stuck_in_a_dead_transaction_is_forgotten():
    """The state a relay thread was left in on MariaDB when its session was killed: Django
    believed a transaction open where none was, and refused every new connection."""
    if connection.vendor == "sqlite":
        pytest.skip("closing the raw connection would drop the in-memory test database")
    connection.ensure_connection()
    connection.set_autocommit(False)  # as an atomic() whose exit could not restore it
    connection.connection.close()  # the session is gone
    with pytest.raises(DatabaseError), transaction.atomic():
        pass  # taken for an inner block: its savepoint fails in __enter__
    assert connection.in_atomic_block  # and nothing will ever leave that block
    tidy_connections()
    assert not connection.in_atomic_block
    with transaction.atomic(), connection.cursor() as cursor:  # the next pass works
        cursor.execute("SELECT 1")


def test_a_connection_that_failed_but_works_is_kept():
    connection.ensure_connection()
    raw = connection.connection
    connection.errors_occurred = True
    tidy_connections()
    assert connection.connection is raw and not connection.errors_occurred


def test_a_positive_conn_max_age_is_honoured(monkeypatch):
    if connection.vendor == "sqlite":
        pytest.skip("Django never closes an in-memory SQLite connection")
    connection.ensure_connection()
    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 60)
    monkeypatch.setattr(connection, "close_at", time.monotonic() - 1)
    tidy_connections()
    assert connection.connection is None
