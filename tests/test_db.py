"""Database helpers: which database holds the outbox, and the workers' connection hygiene."""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction

from django_outbox import outbox
from django_outbox.db import db_now, tidy_connections
from django_outbox.models import OutboxEvent, outbox_db

pytestmark = pytest.mark.django_db(transaction=True)


def test_db_now_is_the_database_clock():
    with transaction.atomic():
        outbox.emit("PING", payload={})
    event = OutboxEvent.objects.get()
    now = db_now()
    assert now.tzinfo is not None
    # created_at was set by the database itself (DbNow) just before
    assert timedelta(0) <= now - event.created_at < timedelta(seconds=30)


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


class _Router:
    """Sends the outbox's reads to ``read`` and its writes to ``write`` (None: no opinion)."""

    def __init__(self, *, read: str | None = None, write: str | None = None) -> None:
        self.read, self.write = read, write

    def db_for_read(self, model, **hints):
        return self.read if model._meta.app_label == "django_outbox" else None

    def db_for_write(self, model, **hints):
        return self.write if model._meta.app_label == "django_outbox" else None


def test_outbox_db_is_the_given_alias_else_the_routers_write_alias(settings):
    assert outbox_db() == "default"
    settings.DATABASE_ROUTERS = [_Router(read="replica", write="outbox")]
    assert outbox_db() == "outbox"
    assert outbox_db("other") == "other"


def test_the_figures_are_read_where_the_relay_writes_not_on_a_read_replica(settings):
    """A read router that sends outbox reads to a replica (here one that does not exist,
    so reading there fails) changes nothing: stats, gauges, admin, outbox_stats and purge
    all use the write alias, as the relay does."""
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    from django_outbox import stats
    from django_outbox.metrics import OutboxCollector
    from django_outbox.models import Status
    from django_outbox.purge import purge
    from tests.utils.rows import make_events

    make_events({"age": 60}, {"status": Status.DEAD, "age": 60})
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    settings.DATABASE_ROUTERS = [_Router(read="replica")]
    assert (stats.gauges().pending, stats.collect().dead) == (1, 1)
    scraped = {family.name: family.samples[0].value for family in OutboxCollector().collect()}
    assert scraped["django_outbox_database_up"] == 1
    assert scraped["django_outbox_pending_events"] == 1
    assert purge(dry_run=True, include_dead=True, force=True, older_than_days=0.0002).dead == 1
    out = io.StringIO()
    call_command("outbox_stats", "--json", stdout=out)
    assert json.loads(out.getvalue())["pending"] == 1
    response = client.get(reverse("admin:django_outbox_outboxevent_dashboard"))
    assert response.status_code == 200
