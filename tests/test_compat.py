"""What django_outbox._compat assumes of pika's and Django's internals, checked against the
installed releases.

A failure here after an upgrade names the assumption that no longer holds and what to
re-check. Do not loosen the test: fix django_outbox/_compat/, or keep the pin in
pyproject.toml below the release.
"""

from __future__ import annotations

import inspect
import socket
import threading
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import django
import pika
import pytest
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections, transaction
from pika.adapters.base_connection import BaseConnection
from pika.adapters.select_connection import IOLoop

from django_outbox import outbox
from django_outbox._compat import celery as compat_celery
from django_outbox._compat import django as compat_django
from django_outbox._compat import pika as compat_pika
from django_outbox._compat.django import (
    build_rows,
    clear_errors,
    forget_connection,
    had_errors,
    has_commit_hook,
    innermost_atomic,
    insert_rows,
)
from django_outbox._compat.pika import CoalescingConnection, HandTurnedLoop
from django_outbox.models import OutboxEvent
from django_outbox.querysets import CLAIM_FIELDS

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _require(ok: bool, library: str, version: str, pinned: str, what: str, recheck: str) -> None:
    if not ok:
        pytest.fail(
            f"{library} {version} no longer behaves as django_outbox/_compat/"
            f"{library.lower()}.py assumes: {what}. Those internals were checked for {pinned} "
            f"(pyproject.toml). Re-check {recheck} in this release and fix _compat/"
            f"{library.lower()}.py, or keep the pin below the release.",
            pytrace=False,
        )


def pika_requires(ok: bool, what: str, recheck: str) -> None:
    _require(ok, "pika", pika.__version__, compat_pika.PINNED, what, recheck)


def django_requires(ok: bool, what: str, recheck: str) -> None:
    _require(ok, "Django", django.__version__, compat_django.PINNED, what, recheck)


@pytest.mark.once
@pytest.mark.parametrize("pinned", [compat_pika.PINNED, compat_django.PINNED, compat_celery.PINNED])
def test_the_pins_the_messages_name_are_the_packaging_ones(pinned: str) -> None:
    assert f'"{pinned}"' in PYPROJECT.read_text(), f"{pinned} is not a dependency any more"


# -- pika ------------------------------------------------------------------------------------
LOOP = (
    "IOLoop's poll(), process_timeouts() and activate_poller() (pika/adapters/select_connection.py)"
)


@pytest.mark.once
@pytest.mark.parametrize(
    "name", ["activate_poller", "poll", "process_timeouts", "call_later", "remove_timeout"]
)
def test_pika_ioloop_has_what_the_hand_turned_loop_calls(name: str) -> None:
    pika_requires(callable(getattr(IOLoop, name, None)), f"IOLoop.{name}() is gone", LOOP)


@pytest.mark.once
def test_the_hand_turned_loop_serves_a_socket_registered_after_it_started() -> None:
    """The backend activates the poller once; the connection's socket comes later."""
    loop = HandTurnedLoop()
    left, right = socket.socketpair()
    seen: list[bytes] = []
    try:
        loop.ioloop.add_handler(
            left.fileno(), lambda fd, events: seen.append(left.recv(16)), IOLoop.READ
        )
        right.send(b"frame")
        served = loop.run_until(lambda: bool(seen), 2.0)
        loop.ioloop.remove_handler(left.fileno())
    finally:
        loop.close()
        left.close()
        right.close()
    pika_requires(
        served and seen == [b"frame"],
        "a socket added after activate_poller() is not polled by IOLoop.poll()",
        LOOP,
    )


@pytest.mark.once
def test_the_hand_turned_loop_waits_no_longer_than_asked() -> None:
    loop = HandTurnedLoop()
    try:
        started = time.monotonic()
        done = loop.run_until(lambda: False, 0.2)
        waited = time.monotonic() - started
        started = time.monotonic()
        loop.poll()
        polled = time.monotonic() - started
    finally:
        loop.close()
    pika_requires(
        not done and 0.15 <= waited < 2.0,
        f"run_until(0.2 s) returned after {waited:.2f} s: a timer due sooner no longer bounds "
        "IOLoop.poll()'s wait",
        LOOP,
    )
    pika_requires(polled < 0.5, f"poll() with a timer due now waited {polled:.2f} s", LOOP)


@pytest.mark.once
def test_the_hand_turned_loop_runs_timers_and_threadsafe_callbacks() -> None:
    """pika schedules its own work (the connection workflow) through both."""
    loop = HandTurnedLoop()
    fired: list[str] = []
    try:
        loop.ioloop.call_later(0.01, lambda: fired.append("timer"))
        thread = threading.Thread(
            target=loop.ioloop.add_callback_threadsafe, args=(lambda: fired.append("callback"),)
        )
        thread.start()
        thread.join()
        done = loop.run_until(lambda: len(fired) == 2, 2.0)
    finally:
        loop.close()
    pika_requires(
        done and sorted(fired) == ["callback", "timer"],
        f"process_timeouts() ran {fired} of a timer and a threadsafe callback",
        LOOP,
    )


EMIT = "Connection._output_marshaled_frames() and BaseConnection._adapter_emit_data()"


@pytest.mark.once
def test_pika_connection_still_emits_through_adapter_emit_data() -> None:
    method = getattr(BaseConnection, "_adapter_emit_data", None)
    pika_requires(
        callable(method) and list(inspect.signature(method).parameters) == ["self", "data"],
        "BaseConnection._adapter_emit_data(self, data) is gone or takes other arguments",
        EMIT,
    )


@pytest.mark.amqp
def test_the_coalescing_connection_gathers_every_frame_and_writes_them_in_one_piece(
    amqp_url: str,
) -> None:
    loop = HandTurnedLoop()
    state: dict[str, Any] = {"acked": 0}

    def opened(conn: Any) -> None:
        conn.channel(on_open_callback=channel_opened)

    def channel_opened(channel: Any) -> None:
        state["channel"] = channel
        channel.confirm_delivery(
            ack_nack_callback=confirmed,
            callback=lambda frame: channel.queue_declare("", exclusive=True, callback=declared),
        )

    def declared(frame: Any) -> None:
        state["queue"] = frame.method.queue

    def confirmed(frame: Any) -> None:
        state["acked"] = frame.method.delivery_tag  # multiple=True: all up to it

    conn = CoalescingConnection(
        pika.URLParameters(amqp_url),
        on_open_callback=opened,
        on_open_error_callback=lambda c, error: state.setdefault("error", error),
        custom_ioloop=loop.ioloop,
    )
    try:
        assert loop.run_until(lambda: "queue" in state or "error" in state, 10), "no channel"
        assert "queue" in state, state.get("error")
        before = conn.bytes_sent
        conn.coalesce()
        for n in range(3):
            state["channel"].basic_publish("", state["queue"], f"message {n}".encode())
        gathered = list(conn._gathered or [])
        written = conn.bytes_sent - before
        conn.flush()
        confirmed_all = loop.run_until(lambda: state["acked"] >= 3, 10)
    finally:
        conn.close()
        loop.run_until(lambda: conn.is_closed, 2)
        loop.close()
    pika_requires(
        len(gathered) == 9 and sum(map(len, gathered)) == written,
        f"3 messages gave {len(gathered)} frames through _adapter_emit_data() ({written} bytes "
        f"counted as sent, {sum(map(len, gathered))} gathered); expected 9 with every byte",
        EMIT,
    )
    pika_requires(confirmed_all, "RabbitMQ did not confirm frames written in one piece", EMIT)


# -- Django ----------------------------------------------------------------------------------
ROWS = "Model.from_db(), ModelState and the SQL compiler's get_converters()/apply_converters()"
CONNECTION = (
    "BaseDatabaseWrapper.__init__(), connect() and close() (django/db/backends/base/base.py)"
)
# What forget_connection() must leave as a new connection has it.
TRANSACTION_STATE = (
    "connection",
    "in_atomic_block",
    "savepoint_ids",
    "atomic_blocks",
    "needs_rollback",
    "closed_in_transaction",
    "commit_on_exit",
    "run_on_commit",
)


@pytest.mark.django_db
def test_built_rows_are_the_rows_django_loads() -> None:
    with outbox.atomic() as box:
        box.emit(
            "ORDER_CREATED",
            aggregate_type="orders.Order",
            aggregate_id="7",
            payload={"total": Decimal("12.50"), "at": datetime(2026, 5, 17, tzinfo=timezone.utc)},
            headers={"trace_id": "t-7"},
        )
    loaded = OutboxEvent.objects.only(*CLAIM_FIELDS).get()
    query = OutboxEvent.objects.filter(pk=loaded.pk).values_list(*CLAIM_FIELDS).query
    with connection.cursor() as cursor:
        cursor.execute(*query.get_compiler(using=DEFAULT_DB_ALIAS).as_sql())
        records = cursor.fetchall()
    [built] = build_rows(OutboxEvent, DEFAULT_DB_ALIAS, CLAIM_FIELDS, records)
    for name in CLAIM_FIELDS:
        value, expected = getattr(built, name), getattr(loaded, name)
        django_requires(
            value == expected and type(value) is type(expected),
            f"{name} is built as {value!r}, loaded as {expected!r}",
            ROWS,
        )
    django_requires(
        built.get_deferred_fields() == loaded.get_deferred_fields(),
        f"deferred fields {built.get_deferred_fields()} built, "
        f"{loaded.get_deferred_fields()} loaded",
        ROWS,
    )
    django_requires(
        (built._state.adding, built._state.db) == (False, DEFAULT_DB_ALIAS)
        and built == loaded
        and hash(built) == hash(loaded),
        "a built row's _state or identity differs from a loaded row's",
        ROWS,
    )
    django_requires(built.last_error == "", "a deferred field does not load on use", ROWS)
    built.last_error = "checked"
    built.save(update_fields=["last_error"])
    django_requires(
        OutboxEvent.objects.get(pk=built.pk).last_error == "checked",
        "a built row does not save as a loaded one",
        ROWS,
    )


def test_build_rows_of_no_records_needs_no_database() -> None:
    assert build_rows(OutboxEvent, DEFAULT_DB_ALIAS, CLAIM_FIELDS, []) == []


def test_a_forgotten_connection_is_in_the_state_a_new_one_starts_from() -> None:
    fresh = connections.create_connection(DEFAULT_DB_ALIAS)
    stuck = connections.create_connection(DEFAULT_DB_ALIAS)
    for name in TRANSACTION_STATE:
        django_requires(hasattr(fresh, name), f"a connection has no {name!r} any more", CONNECTION)
    # As atomic() leaves it when its savepoint fails on a connection that died.
    stuck.in_atomic_block = True
    stuck.atomic_blocks = [transaction.atomic()]
    stuck.savepoint_ids = ["s1"]
    stuck.needs_rollback = True
    stuck.closed_in_transaction = True
    stuck.commit_on_exit = False
    stuck.run_on_commit = [({"s1"}, print, False)]
    forget_connection(stuck)
    for name in TRANSACTION_STATE:
        left, new = getattr(stuck, name), getattr(fresh, name)
        django_requires(
            left == new,
            f"{name} is {left!r} after forget_connection(), {new!r} on a new connection",
            CONNECTION,
        )


def test_the_database_backend_can_drop_its_connection_without_a_word() -> None:
    """forget_connection() calls the backend's private _close() on a connection Django
    believes inside a transaction (where close() only flags it)."""
    django_requires(
        callable(getattr(type(connections[DEFAULT_DB_ALIAS]), "_close", None)),
        f"{type(connections[DEFAULT_DB_ALIAS]).__module__}.DatabaseWrapper has no _close()",
        CONNECTION,
    )


@pytest.mark.django_db
def test_a_database_error_flags_its_connection_until_cleared() -> None:
    """tidy_connections() checks a connection that raised, and only that one."""
    connection.ensure_connection()
    clear_errors(connection)
    flagged_before = had_errors(connection)
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT no_such_column FROM no_such_table")
    flagged = had_errors(connection)
    clear_errors(connection)
    django_requires(
        (flagged_before, flagged, had_errors(connection)) == (False, True, False),
        "errors_occurred is no longer set by a database error, or no longer cleared",
        "DatabaseErrorWrapper.__exit__() (django/db/utils.py) and close_if_unusable_or_obsolete()",
    )


@pytest.mark.django_db
def test_innermost_atomic_is_the_block_entered_last() -> None:
    outer, inner = transaction.atomic(), transaction.atomic()
    with outer:
        with inner:
            innermost = innermost_atomic(connection)
        after = innermost_atomic(connection)
    django_requires(
        innermost is inner and after is outer,
        "connection.atomic_blocks is not the stack of Atomic blocks entered",
        "transaction.Atomic.__enter__()/__exit__() (django/db/transaction.py)",
    )
    assert innermost_atomic(connections.create_connection(DEFAULT_DB_ALIAS)) is None


def _events(prefix: str, count: int) -> list[OutboxEvent]:
    return [
        outbox.build_event(
            outbox.EventArgs(
                "X",
                payload={"n": i, "at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)},
                aggregate_type="T",
                aggregate_id=i,
                event_id=f"{prefix}-{i}",
                headers={"h": "v"},
                occurred_at=datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc),
                delay=5 if i % 2 else None,
            )
        )
        for i in range(count)
    ]


@pytest.mark.django_db
def test_insert_rows_writes_the_rows_bulk_create_writes() -> None:
    ours, theirs = _events("ours", 3), _events("theirs", 3)
    insert_rows(OutboxEvent, DEFAULT_DB_ALIAS, ours)
    OutboxEvent.objects.bulk_create(theirs)
    # Times of the INSERT (or the database clock's), which differ between the two.
    skip = {
        "id",
        "event_id",
        "next_retry_time",
        "leased_until",
        "due_at",
        "created_at",
        "updated_at",
    }
    fields = [f.attname for f in OutboxEvent._meta.concrete_fields if f.attname not in skip]

    def read(prefix: str) -> list[tuple[Any, ...]]:
        rows = OutboxEvent.objects.filter(event_id__startswith=prefix).order_by("id")
        return [
            (
                *(getattr(r, name) for name in fields),
                r.due_at is None,
                r.due_at == r.next_retry_time,
            )
            for r in rows
        ]

    django_requires(
        read("ours") == read("theirs"),
        "insert_rows() writes other values than bulk_create()",
        "SQLInsertCompiler.as_sql() (django/db/models/sql/compiler.py), Field.pre_save()",
    )
    for event in ours:
        assert not event._state.adding and event._state.db == DEFAULT_DB_ALIAS
        if connection.features.can_return_rows_from_bulk_insert:
            assert OutboxEvent.objects.get(pk=event.pk).event_id == event.event_id


@pytest.mark.django_db
def test_has_commit_hook_sees_the_hooks_of_open_savepoints_only() -> None:
    def hook() -> None:
        pass

    with transaction.atomic():
        assert not has_commit_hook(connection, hook)
        try:
            with transaction.atomic():
                transaction.on_commit(hook)
                inside = has_commit_hook(connection, hook)
                raise RuntimeError
        except RuntimeError:
            pass
        after_rollback = has_commit_hook(connection, hook)
    django_requires(
        inside and not after_rollback,
        "connection.run_on_commit is not the list of (savepoint ids, function, robust)",
        "BaseDatabaseWrapper.on_commit()/savepoint_rollback() (django/db/backends/base/base.py)",
    )
