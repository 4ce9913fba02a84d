"""What django_outbox._compat assumes of pika's and Django's internals, checked against the
installed releases.

A failure here after an upgrade names the assumption that no longer holds and what to
re-check. Do not loosen the test: fix django_outbox/_compat/, or keep the pin in
pyproject.toml below the release.
"""

from __future__ import annotations

import inspect
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import celery
import django
import pika
import pytest
from celery import Celery, signals
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections, transaction
from kombu import Exchange, Queue
from kombu.common import Broadcast
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads
from pika.adapters.base_connection import BaseConnection
from pika.adapters.select_connection import IOLoop

from django_outbox import outbox
from django_outbox._compat import celery as compat_celery
from django_outbox._compat import django as compat_django
from django_outbox._compat import pika as compat_pika
from django_outbox._compat.django import (
    build_rows,
    clear_errors,
    delete_rows,
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


def celery_requires(ok: bool, what: str, recheck: str) -> None:
    _require(ok, "Celery", celery.__version__, compat_celery.PINNED, what, recheck)


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


# -- Celery ----------------------------------------------------------------------------------
TASK = "tests.compat.award"
ROUTER = "app.amqp.router.route() and send_task_message()'s destination (celery/app/amqp.py)"
MESSAGE = "as_task_v2() (celery/app/amqp.py) and task protocol v2 (docs/internals/protocol)"
SIGNALS = "the publish signals of send_task_message() (celery/app/amqp.py)"
ROUTED = Queue("compat.routed", Exchange("compat.routed", type="topic"), routing_key="points.#")


def _by_argument(name: str, args: list, kwargs: dict, options: dict, **kw: object) -> dict | None:
    """A router function: looks at the task's arguments."""
    return {"queue": ROUTED.name} if args[0]["routed"] else None


#: App settings whose routes the backend must follow as send_task() does.
ROUTES = {
    "the default queue": {},
    "transient by default": {"task_default_delivery_mode": "transient"},
    "a queue on a topic exchange": {
        "task_queues": [ROUTED],
        "task_routes": {TASK: {"queue": ROUTED.name, "routing_key": "points.award", "priority": 3}},
    },
    "a queue by name": {"task_queues": [ROUTED], "task_routes": {TASK: {"queue": ROUTED.name}}},
    "a pattern": {
        "task_queues": [ROUTED],
        "task_routes": {"tests.compat.*": {"queue": ROUTED.name}},
    },
    "an exchange without a queue": {
        "task_routes": {TASK: {"exchange": "compat.events", "routing_key": "points.award"}}
    },
    "an exchange without a routing key": {"task_routes": {TASK: {"exchange": "compat.events"}}},
    "an Exchange of a type": {
        "task_routes": {
            TASK: {"exchange": Exchange("compat.t", type="topic"), "routing_key": "a.b"}
        }
    },
    "an exchange type": {"task_routes": {TASK: {"exchange": "e", "exchange_type": "topic"}}},
    "a broadcast queue": {
        "task_queues": [Broadcast("compat.all")],
        "task_routes": {TASK: {"queue": "compat.all"}},
    },
    "a queue created when missing": {"task_routes": {TASK: {"queue": "compat.new"}}},
    "the app's serializer and compression": {
        "task_serializer": "pickle",
        "task_compression": "gzip",
    },
    "a route's serializer, compression, delivery mode": {
        "task_routes": {
            TASK: {"serializer": "pickle", "compression": "bzip2", "delivery_mode": "transient"}
        }
    },
    "a router function": {"task_queues": [ROUTED], "task_routes": [_by_argument]},
}


def _celery_app(**conf: object) -> Celery:
    app = Celery("compat", broker="amqp://", set_as_current=False)
    app.conf.update(task_default_queue="compat.default", **conf)
    return app


class _Producer:
    """What send_task() hands kombu's producer, recorded instead of published."""

    class connection:  # send_task() reads producer.connection
        @staticmethod
        @contextmanager
        def _reraise_as_library_errors() -> Iterator[None]:
            yield

    def __init__(self) -> None:
        self.published: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **options: Any) -> None:
        self.published.append((body, options))


def _send_task(app: Celery, args: list[Any]) -> tuple[Any, dict[str, Any]]:
    producer = _Producer()
    app.send_task(TASK, args=args, task_id="t-1", producer=producer)
    [published] = producer.published
    return published


@pytest.mark.once
@pytest.mark.parametrize("conf", ROUTES.values(), ids=ROUTES.keys())
def test_a_task_is_routed_where_send_task_sends_it(conf: dict[str, object]) -> None:
    app = _celery_app(**conf)
    args = [{"routed": True}]
    _body, sent = _send_task(app, args)
    exchange = getattr(sent["exchange"], "name", sent["exchange"])
    mode = sent["delivery_mode"]
    theirs = (
        exchange or "",
        sent["routing_key"] or "",
        {"transient": 1, "persistent": 2}.get(mode, mode),
        [queue.name for queue in sent["declare"] or []],
        sent["serializer"],
        sent["compression"],
        sent.get("priority"),
    )
    route = compat_celery.route(app, TASK, args)
    ours = (
        route.exchange,
        route.routing_key,
        route.delivery_mode,
        [route.queue.name] if route.queue is not None else [],
        route.serializer,
        route.compression,
        route.priority,
    )
    celery_requires(ours == theirs, f"send_task() publishes {theirs}, route() says {ours}", ROUTER)


@pytest.mark.once
def test_only_name_routes_are_map_routes() -> None:
    """A route kept per task name must not depend on the arguments."""
    by_name = [_celery_app(), _celery_app(**ROUTES["a pattern"])]
    by_function = _celery_app(**ROUTES["a router function"])
    celery_requires(
        all(compat_celery.routes_by_name(app) for app in by_name)
        and not compat_celery.routes_by_name(by_function),
        "task_routes of names and patterns are not all MapRoute, or a function is one",
        "celery/app/routes.py (prepare(), MapRoute)",
    )


@pytest.mark.once
@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_a_task_message_is_the_one_send_task_writes(serializer: str) -> None:
    """Protocol v2 as Celery writes it: the same body, the same values for the headers
    written (the others are the worker's defaults), the same content type."""
    app = _celery_app(task_serializer=serializer)
    args = [{"event_id": "t-1", "payload": {"total": "12.50"}}]
    route = compat_celery.route(app, TASK, args)
    message = compat_celery.task_message(
        TASK,
        "t-1",
        route,
        args=lambda: args,
        json_args=lambda: json.dumps(args).encode(),
        argsrepr="(<event>,)",
        origin=compat_celery.origin(),
    )
    headers, properties, body, _ = app.amqp.as_task_v2(
        "t-1", TASK, args=args, kwargs={}, argsrepr="(<event>,)", kwargsrepr="{}"
    )
    content_type, encoding, data = kombu_dumps(body, serializer=serializer)

    def decoded(raw: bytes | str) -> Any:
        return kombu_loads(raw, content_type, encoding, accept=[content_type])

    celery_requires(
        (message.content_type, message.content_encoding) == (content_type, encoding)
        and decoded(message.body) == decoded(data),
        "the body [args, kwargs, embed] differs from as_task_v2()'s, as kombu encodes it",
        MESSAGE,
    )
    written = {name: headers.get(name) for name in message.headers}
    celery_requires(
        written == message.headers and message.correlation_id == properties["correlation_id"],
        f"headers {message.headers} written, as_task_v2() writes {written}",
        MESSAGE,
    )
    left_out = {name: value for name, value in headers.items() if name not in message.headers}
    celery_requires(
        {"lang", "task", "id", "root_id", "parent_id", "group"} <= set(message.headers)
        and left_out.pop("ignore_result") is False
        and left_out
        == {
            "shadow": None,
            "eta": None,
            "expires": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        f"a header left to the worker's default is not the default send_task() writes: {left_out}",
        MESSAGE,
    )


@pytest.mark.once
def test_the_publish_signals_get_what_send_task_gives_them() -> None:
    """Instrumentation reads them: OpenTelemetry's Celery instrumentation finds the task id
    of after_task_publish in its headers."""
    app = _celery_app(**ROUTES["a queue on a topic exchange"])
    args = [{"routed": True}]
    received: list[tuple[str, dict[str, Any]]] = []

    def receiver(signal: Any, sender: str, **kwargs: Any) -> None:
        received.append((signal.name, kwargs))

    signals.before_task_publish.connect(receiver)
    signals.after_task_publish.connect(receiver)
    try:
        _send_task(app, args)
        theirs, received[:] = list(received), []
        compat_celery.task_message(
            TASK,
            "t-1",
            compat_celery.route(app, TASK, args),
            args=lambda: args,
            json_args=lambda: json.dumps(args).encode(),
            argsrepr="(<event>,)",
            origin=compat_celery.origin(),
        )
        ours = list(received)
    finally:
        signals.before_task_publish.disconnect(receiver)
        signals.after_task_publish.disconnect(receiver)

    def shape(sent: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, list[str], Any]]:
        return [
            (name, sorted(kwargs), (kwargs["exchange"], kwargs["routing_key"], kwargs["body"][0]))
            for name, kwargs in sent
        ]

    celery_requires(
        shape(ours) == shape(theirs),
        f"send_task() sends {shape(theirs)}, task_message() {shape(ours)}",
        SIGNALS,
    )
    celery_requires(
        all(kwargs["headers"]["id"] == "t-1" for _name, kwargs in ours),
        "a publish signal's headers do not name the task",
        SIGNALS,
    )


@pytest.mark.once
def test_the_origin_is_the_one_as_task_v2_writes() -> None:
    headers = _celery_app().amqp.as_task_v2("t-1", TASK)[0]
    celery_requires(
        headers["origin"] == compat_celery.origin(),
        f"as_task_v2() names this process {headers['origin']!r}, "
        f"origin() {compat_celery.origin()!r}",
        "celery.utils.nodenames.anon_nodename()",
    )


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


@pytest.mark.engine
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


@pytest.mark.django_db(transaction=True)
def test_insert_rows_writes_a_primary_key_the_database_does_not_make_after_a_prefix() -> None:
    from django.test.utils import CaptureQueriesContext

    from django_outbox.models import OutboxTaskResult

    def result(pk: str) -> OutboxTaskResult:
        return OutboxTaskResult(
            pk=pk,
            task_path="tests.task_functions.add",
            backend_name="default",
            queue_name="default",
            args_kwargs={"args": [1, 2], "kwargs": {}},
            enqueued_at=datetime.now(timezone.utc),
        )

    rows = [result("written-1"), result("written-2")]
    prefix = "SELECT 1; " if connection.vendor == "postgresql" else ""
    with CaptureQueriesContext(connection) as queries:
        insert_rows(OutboxTaskResult, DEFAULT_DB_ALIAS, rows, prefix=prefix)
    (statement,) = [q["sql"] for q in queries.captured_queries]
    assert statement.startswith(prefix + "INSERT")
    assert sorted(OutboxTaskResult.objects.values_list("pk", "args_kwargs")) == [
        ("written-1", {"args": [1, 2], "kwargs": {}}),
        ("written-2", {"args": [1, 2], "kwargs": {}}),
    ]
    assert all(not row._state.adding for row in rows)


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


@pytest.mark.django_db
def test_delete_rows_is_one_delete_of_the_filter_whatever_receivers_listen() -> None:
    from django.db.models.signals import pre_delete
    from django.test.utils import CaptureQueriesContext

    kept, *gone = events = _events("delete", 3)
    insert_rows(OutboxEvent, DEFAULT_DB_ALIAS, events)

    def receiver(**kwargs: Any) -> None:  # any model's: delete() would select first
        pass

    pre_delete.connect(receiver)
    try:
        with CaptureQueriesContext(connection) as ctx:
            count = delete_rows(OutboxEvent.objects.filter(pk__in=[e.pk for e in gone]))
    finally:
        pre_delete.disconnect(receiver)
    sql = [q["sql"].lstrip().upper() for q in ctx.captured_queries]
    django_requires(
        count == 2 and len(sql) == 1 and sql[0].startswith("DELETE"),
        "QuerySet._raw_delete() is no longer one DELETE returning its row count",
        "QuerySet._raw_delete() (django/db/models/query.py), SQLDeleteCompiler",
    )
    assert list(OutboxEvent.objects.values_list("pk", flat=True)) == [kept.pk]
