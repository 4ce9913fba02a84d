"""Small database helpers shared by the model, the emit helper, the relay, the figures and
the tasks: the database clock (:func:`db_now`), isolation, connections, run-once locks."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction
from django.db.models.functions import Now
from django.db.models.sql import Query
from django.utils import timezone as django_timezone

from ._compat.django import clear_errors, forget_connection, had_errors

if TYPE_CHECKING:
    from django.db.models import Model


class DbNow(Now):
    """``Now()`` that is UTC on MySQL/MariaDB too, and local time on SQLite under
    ``USE_TZ = False`` (the database clock in the terms Django reads datetimes in).

    Django stores naive UTC datetimes on MySQL when ``USE_TZ`` is on, but its ``Now()``
    renders ``CURRENT_TIMESTAMP`` in the *session* time zone; a server not running in UTC
    would then see every event as due hours early or late. ``UTC_TIMESTAMP`` does not
    depend on the session.
    """

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        template = "UTC_TIMESTAMP(6)" if settings.USE_TZ else "CURRENT_TIMESTAMP(6)"
        return self.as_sql(compiler, connection, template=template, **extra_context)

    def as_sqlite(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        # Under USE_TZ = False Django's datetimes are naive local times in TIME_ZONE (it
        # sets the process's TZ to it), but SQLite's 'now' is UTC: read the clock in the
        # same local time, as PostgreSQL's session time zone does there.
        local = "" if settings.USE_TZ else ", 'localtime'"
        # Six digits of fraction, as Django writes a datetime and its date arithmetic
        # returns one: SQLite compares them as text, and '.123' sorts before '.123000'
        # (a row due now + 0 s would wait for the next millisecond).
        template = f"(STRFTIME('%%%%Y-%%%%m-%%%%d %%%%H:%%%%M:%%%%f', 'now'{local}) || '000')"
        return self.as_sql(compiler, connection, template=template, **extra_context)


def db_now(using: str = DEFAULT_DB_ALIAS) -> datetime:
    """The database's current time (one round trip), as Django returns a datetime column:
    aware UTC under ``USE_TZ``, naive local time under ``USE_TZ = False``.

    Compiles :class:`DbNow` with the connection's own compiler, so it is the very
    expression the relay compares ``next_retry_time`` with.
    """
    connection = connections[using]
    query = Query(None)
    compiler = query.get_compiler(using=using)
    expression = DbNow().resolve_expression(query)
    sql, params = compiler.compile(expression)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {sql}", list(params))
        (value,) = cursor.fetchone()
    if isinstance(value, str):  # SQLite returns text
        value = datetime.fromisoformat(value)
    return django_datetime(value)


def django_datetime(value: datetime) -> datetime:
    """A datetime as Django hands one out: aware UTC under ``USE_TZ``, else naive local.

    Every figure subtracts the database clock from column values the ORM returned, so
    both must follow the same rule (mixing them is a TypeError under ``USE_TZ = False``).
    """
    if settings.USE_TZ:
        # MySQL/MariaDB (UTC_TIMESTAMP) and SQLite ('now') read the clock as naive UTC.
        if django_timezone.is_naive(value):
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)
    if django_timezone.is_aware(value):
        return django_timezone.make_naive(value, django_timezone.get_default_timezone())
    return value


@contextmanager
def read_committed_atomic(using: str) -> Iterator[None]:
    """``transaction.atomic(using)`` whose transaction runs at READ COMMITTED on
    MySQL/MariaDB, whatever the connection's own level (Django's default is READ COMMITTED,
    but ``isolation_level`` may say otherwise).

    For writes that must not hold InnoDB's gap locks: under REPEATABLE READ a statement
    that scans (a plan the optimizer may choose on a small table, or a range of ids) locks
    every row it reads and the gap after the last one, and an INSERT at the end of the
    table (an ``emit()``) waits until it commits. READ COMMITTED locks only the rows it
    changes. Inside a transaction already open, the level is that transaction's.
    """
    connection = connections[using]
    outermost = not connection.in_atomic_block
    with transaction.atomic(using=using):
        if outermost and connection.vendor == "mysql":
            with connection.cursor() as cursor:
                # No SESSION: the transaction that this block just began, and no other.
                cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        yield


def vendor(using: str) -> str:
    return connections[using].vendor


def tidy_connections() -> None:
    """Between relay passes: drop broken database connections, keep healthy ones.

    ``close_old_connections()`` also closes every connection past ``CONN_MAX_AGE``, and
    Django's default of 0 means every one, so a relay woken by each NOTIFY would reconnect
    on every pass (a new PostgreSQL backend each time: the largest part of its latency).
    A relay is a long-running worker, not a request: with ``CONN_MAX_AGE = 0`` it keeps
    its connection as long as it works; a positive ``CONN_MAX_AGE`` is still honoured.
    A connection that raised a database error is checked and closed if it is unusable,
    as Django does, so the next pass reconnects after an outage.
    """
    for conn in connections.all(initialized_only=True):
        if conn.in_atomic_block:
            _forget_stuck_transaction(conn)
            continue
        if conn.connection is None:
            continue
        if conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
            conn.close()  # left in a transaction by a failure: start clean
        elif had_errors(conn):
            if conn.is_usable():
                clear_errors(conn)
            else:
                # The driver may refuse to close a dead socket (MySQL error 2006); Django
                # forgets the connection either way, which is all that is needed here.
                with suppress(DatabaseError):
                    conn.close()
        elif conn.settings_dict.get("CONN_MAX_AGE"):
            conn.close_if_unusable_or_obsolete()


def _forget_stuck_transaction(conn: Any) -> None:
    """A connection "in a transaction" between passes, where none is open.

    ``atomic()`` leaves this behind when its own entry fails on a connection that died
    (it takes a connection whose autocommit is off for an outer transaction, then cannot
    make its savepoint), and Django then refuses every new connection on that thread:
    "Cannot open a new connection in an atomic block", for good. Only called between
    passes, outside any ``atomic()``: forget the state and the connection.
    """
    forget_connection(conn)


# -- run-once locks ----------------------------------------------------------------------------
# One lock per name per process on SQLite (which has no server-side locks and, per check
# W004, runs one relay process anyway).
_local_locks: dict[str, threading.Lock] = {}
_local_locks_guard = threading.Lock()


@contextmanager
def job_lock(name: str, using: str | None = None) -> Iterator[bool]:
    """Try to take a database-wide lock named ``name``; yield whether this job holds it.

    Never waits: a job that does not get the lock should skip. The lock is a session-level
    lock of the database server (``pg_try_advisory_lock`` on PostgreSQL, ``GET_LOCK`` on
    MySQL/MariaDB): it is held by the connection, not by a transaction, so the job may
    commit as often as it likes, and it disappears with the connection if the process dies,
    so there is no expiry to guess. On SQLite it is a lock of this process only.
    """
    using = using or DEFAULT_DB_ALIAS
    connection = connections[using]
    key = f"django_outbox.{name}.{connection.settings_dict.get('NAME')}"
    acquire: tuple[str, list[Any]]
    release: tuple[str, list[Any]]
    if connection.vendor == "postgresql":
        # Advisory locks live in a 64-bit key space shared by every user of the database.
        number = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
        acquire = ("SELECT pg_try_advisory_lock(%s)", [number])
        release = ("SELECT pg_advisory_unlock(%s)", [number])
    elif connection.vendor == "mysql":
        # GET_LOCK names are server-wide (hence the database name in them), at most 64 chars.
        lock_name = key if len(key) <= 64 else hashlib.sha256(key.encode()).hexdigest()
        acquire = ("SELECT GET_LOCK(%s, 0)", [lock_name])
        release = ("SELECT RELEASE_LOCK(%s)", [lock_name])
    else:
        with _local_locks_guard:
            lock = _local_locks.setdefault(key, threading.Lock())
        got = lock.acquire(blocking=False)
        try:
            yield got
        finally:
            if got:
                lock.release()
        return
    with connection.cursor() as cursor:
        cursor.execute(*acquire)
        row = cursor.fetchone()
    got = bool(row and row[0])
    try:
        yield got
    finally:
        if got:
            # The connection may be gone by now (then so is the lock).
            with suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute(*release)


def database_answers(using: str, *, attempts: int = 1) -> bool:
    """Whether the database ``using`` answers ``SELECT 1``: on its current connection, then
    (``attempts`` > 1) on a new one. A connection that fails is closed, so the next try
    opens a fresh one; the driver may refuse to close a dead socket, Django forgets it."""
    connection = connections[using]
    for _attempt in range(attempts):
        try:
            connection.ensure_connection()
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except DatabaseError:
            with suppress(DatabaseError):
                connection.close()
        else:
            return True
    return False


def missing_tables(using: str, models: Iterable[type[Model]]) -> list[type[Model]]:
    """The models among ``models`` whose table database ``using`` lacks (their app's
    migrations have not run there). Raises the driver's error when it does not answer."""
    connection = connections[using]
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
    return [model for model in models if model._meta.db_table not in tables]
