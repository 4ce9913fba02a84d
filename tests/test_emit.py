"""The atomic emit helper: events commit with the business write, or not at all."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_outbox import notify, outbox
from django_outbox.exceptions import (
    DuplicateEventId,
    InvalidEvent,
    NotInTransaction,
    PayloadTooLarge,
)
from django_outbox.message import is_reserved_header
from django_outbox.models import OutboxEvent, Status
from django_outbox.relay.wake import PostgresNotifyWaker
from orders.models import Order
from orders.services import create_order
from tests.testapp.models import Widget

#: The deepest JSON emit() accepts (objects and arrays, the outermost counted).
MAX_DEPTH = 31


def nested(levels: int, leaf: object = "leaf") -> object:
    """``levels`` arrays and objects inside each other, alternating, around ``leaf``."""
    value = leaf
    for level in range(levels):
        value = [value] if level % 2 else {"k": value}
    return value


pytestmark = pytest.mark.django_db(transaction=True)


class Boom(Exception):
    pass


def test_create_order_writes_one_order_and_one_pending_event():
    order = create_order(user_id=7, amount=Decimal("12.50"))
    assert Order.objects.count() == 1
    event = OutboxEvent.objects.get()
    assert event.status == Status.PENDING
    assert event.retry_count == 0
    assert event.event_type == "ORDER_CREATED"
    assert (event.aggregate_type, event.aggregate_id) == ("ORDER", order.number)
    assert event.payload == {
        "order_id": order.pk,
        "number": order.number,
        "user_id": 7,
        "amount": "12.50",
    }
    uuid.UUID(event.event_id)  # a generated UUID
    # The database clock made it due at once.
    assert OutboxEvent.objects.due().filter(pk=event.pk).exists()


def test_exception_after_emit_leaves_neither_row():
    with pytest.raises(Boom), outbox.atomic() as box:
        order = Order.objects.create(number="A1", user_id=1)
        box.emit("ORDER_CREATED", aggregate=order, payload={"id": order.pk})
        raise Boom
    assert not Order.objects.exists()
    assert not OutboxEvent.objects.exists()


def test_events_are_written_inside_the_block_before_commit():
    with outbox.atomic() as box:
        box.emit("A", payload={})
        assert not OutboxEvent.objects.exists()  # collected, not yet inserted
    assert OutboxEvent.objects.count() == 1


def test_nested_block_rolled_back_keeps_only_outer_events():
    with outbox.atomic() as outer:
        outer.emit("OUTER_1", payload={})
        with pytest.raises(Boom), outbox.atomic() as inner:
            inner.emit("INNER", payload={})
            raise Boom
        outer.emit("OUTER_2", payload={})
    assert sorted(OutboxEvent.objects.values_list("event_type", flat=True)) == [
        "OUTER_1",
        "OUTER_2",
    ]


def test_module_emit_in_rolled_back_savepoint_goes_with_it():
    with outbox.atomic():
        outbox.emit("KEPT", payload={})
        with pytest.raises(Boom), transaction.atomic():
            outbox.emit("ROLLED_BACK", payload={})
            raise Boom
    assert list(OutboxEvent.objects.values_list("event_type", flat=True)) == ["KEPT"]


def test_module_emit_inside_plain_atomic():
    with transaction.atomic():
        Widget.objects.create(code="w1")
        outbox.emit("WIDGET_CREATED", aggregate_type="WIDGET", aggregate_id="w1", payload={})
    assert OutboxEvent.objects.get().aggregate_id == "w1"


def test_outer_rollback_discards_inner_committed_savepoint():
    with pytest.raises(Boom), outbox.atomic():
        with outbox.atomic() as inner:
            inner.emit("INNER", payload={})
        raise Boom
    assert not OutboxEvent.objects.exists()


def test_several_events_in_one_block_are_one_insert():
    with CaptureQueriesContext(connection) as queries, outbox.atomic() as box:
        for i in range(5):
            box.emit("MANY", payload={"i": i})
    inserts = [q["sql"] for q in queries.captured_queries if "INSERT" in q["sql"].upper()]
    assert len(inserts) == 1
    assert "django_outbox_outboxevent" in inserts[0]
    assert OutboxEvent.objects.count() == 5


def test_module_emit_joins_the_block_insert():
    with CaptureQueriesContext(connection) as queries, outbox.atomic():
        outbox.emit("A", payload={})
        outbox.emit("B", payload={})
    inserts = [q for q in queries.captured_queries if q["sql"].upper().startswith("INSERT")]
    assert len(inserts) == 1


def test_no_broker_and_no_on_commit_hook():
    with outbox.atomic() as box:
        box.emit("A", payload={})
        assert connection.run_on_commit == []


def test_aggregate_from_model_instance_with_string_pk():
    with outbox.atomic() as box:
        widget = Widget.objects.create(code="w-42")
        box.emit("WIDGET_CREATED", aggregate=widget, payload={})
    event = OutboxEvent.objects.get()
    assert (event.aggregate_type, event.aggregate_id) == ("testapp.Widget", "w-42")


def test_explicit_fields_are_kept():
    when = dt.datetime(2024, 1, 2, 3, 4, 5, 600000, tzinfo=dt.timezone.utc)
    event_id = uuid.uuid4()
    with outbox.atomic() as box:
        box.emit(
            "X",
            payload={"when": when, "price": Decimal("1.10"), "ref": event_id},
            event_id=event_id,
            headers={"trace_id": "abc", "schema": 2},
            occurred_at=when,
        )
    event = OutboxEvent.objects.get()
    assert event.event_id == str(event_id)
    assert event.occurred_at == when
    assert event.headers == {"trace_id": "abc", "schema": 2}
    assert event.payload == {
        "when": "2024-01-02T03:04:05.600Z",
        "price": "1.10",
        "ref": str(event_id),
    }


@pytest.mark.parametrize("text", ["plain", "ü😀"])
def test_the_payload_and_headers_are_written_as_emit_checked_them(text):
    """The row holds the payload and headers as they were when emit() checked them, also
    where their text is not ASCII: a change to the dicts before the block writes its rows
    is not written (it was not checked: too large, not JSON, a reserved header)."""
    with outbox.atomic() as box:
        event = box.emit("X", payload={"text": text, "items": [1, 2]}, headers={"h": text})
        bare = box.emit("Y", payload={})
        event.payload["items"].append(object())
        event.payload["extra"] = "x" * 300_000
        event.headers["x-death"] = 1.5
        bare.headers["x-death"] = 1.5
    rows = OutboxEvent.objects.order_by("id")
    assert [(r.payload, r.headers) for r in rows] == [
        ({"text": text, "items": [1, 2]}, {"h": text}),
        ({}, {}),
    ]


def test_using_selects_the_alias():
    with outbox.atomic(using="default") as box:
        box.emit("X", payload={})
    assert OutboxEvent.objects.using("default").count() == 1


BAD_INPUT = [
    ({"event_type": "", "payload": {}}, InvalidEvent, "non-empty"),
    ({"event_type": "   ", "payload": {}}, InvalidEvent, "non-empty"),
    ({"event_type": "X", "payload": {"obj": object()}}, InvalidEvent, "not JSON-serialisable"),
    ({"event_type": "X", "payload": {"nan": float("nan")}}, InvalidEvent, "not JSON-serialisable"),
    ({"event_type": "X" * 129, "payload": {}}, InvalidEvent, "at most 128"),
    ({"event_type": "X", "payload": {}, "aggregate_id": "9" * 65}, InvalidEvent, "at most 64"),
    ({"event_type": "X", "payload": {}, "headers": {"attempt": 3}}, InvalidEvent, "may not use"),
    ({"event_type": "X", "payload": {}, "headers": ["a"]}, InvalidEvent, "mapping"),
    ({"event_type": "X", "payload": {}, "headers": {"v": 1.5}}, InvalidEvent, "float"),
    ({"event_type": "X", "payload": {}, "headers": {"t": {"n": [2**64]}}}, InvalidEvent, "64-bit"),
    ({"event_type": "X", "payload": {}, "headers": {"k" * 256: 1}}, InvalidEvent, "255 bytes"),
    ({"event_type": "X", "payload": {}, "aggregate": "ORDER"}, InvalidEvent, "model instance"),
    ({"event_type": "X", "payload": {}, "occurred_at": "yesterday"}, InvalidEvent, "datetime"),
    ({"event_type": "X", "payload": "x" * 300_000}, PayloadTooLarge, "OUTBOX_MAX_PAYLOAD_BYTES"),
    # AMQP short strings count bytes: the type and routing key, and the message_id.
    ({"event_type": "é" * 128, "payload": {}}, InvalidEvent, "256 bytes.*at most 255"),
    ({"event_type": "X", "payload": {}, "event_id": "😀" * 64}, InvalidEvent, "256 bytes"),
    ({"event_type": "X", "payload": {}, "headers": {"é" * 128: 1}}, InvalidEvent, "255 bytes"),
    # Lone surrogates are not Unicode: nothing can encode them as UTF-8.
    ({"event_type": "X", "payload": {"s": "\ud800"}}, InvalidEvent, "surrogate"),
    ({"event_type": "X", "payload": {"\udfff": 1}}, InvalidEvent, "surrogate"),
    ({"event_type": "X", "payload": {}, "headers": {"h": ["\ud800"]}}, InvalidEvent, "surrogate"),
    ({"event_type": "X\ud800", "payload": {}}, InvalidEvent, "event_type.*surrogate"),
    ({"event_type": "X", "payload": {}, "aggregate_id": "\udc00"}, InvalidEvent, "surrogate"),
    ({"event_type": "X", "payload": {}, "event_id": "e-\ud800"}, InvalidEvent, "surrogate"),
    # NUL: PostgreSQL's text and jsonb refuse it, so every database does.
    ({"event_type": "X", "payload": {"s": "a\x00b"}}, InvalidEvent, "NUL"),
    ({"event_type": "X", "payload": [{"a\x00": 1}]}, InvalidEvent, "NUL"),
    ({"event_type": "X", "payload": {"s": "\\\x00"}}, InvalidEvent, "NUL"),
    ({"event_type": "X", "payload": {}, "headers": {"h": "\x00"}}, InvalidEvent, "headers.*NUL"),
    ({"event_type": "X\x00", "payload": {}}, InvalidEvent, "event_type.*NUL"),
    ({"event_type": "X", "payload": {}, "aggregate_type": "\x00"}, InvalidEvent, "NUL"),
    ({"event_type": "X", "payload": {}, "event_id": "e\x00"}, InvalidEvent, "event_id.*NUL"),
    # Deeper than a MariaDB JSON column holds, and deeper than json.dumps can recurse.
    ({"event_type": "X", "payload": nested(MAX_DEPTH + 1)}, InvalidEvent, "levels"),
    ({"event_type": "X", "payload": nested(5_000)}, InvalidEvent, "levels"),
    ({"event_type": "X", "payload": nested(100_000)}, InvalidEvent, "levels"),
    (
        {"event_type": "X", "payload": {}, "headers": {"h": nested(MAX_DEPTH)}},
        InvalidEvent,
        "levels",
    ),
    # What the broker and the consumer count deliveries in.
    (
        {"event_type": "X", "payload": {}, "headers": {"x-delivery-count": 0}},
        InvalidEvent,
        "may not",
    ),
    (
        {"event_type": "X", "payload": {}, "headers": {"x-outbox-delivery": 1}},
        InvalidEvent,
        "may not",
    ),
    ({"event_type": "X", "payload": {}, "headers": {"x-outbox-mine": 1}}, InvalidEvent, "may not"),
    ({"event_type": "X", "payload": {}, "headers": {"x-death": []}}, InvalidEvent, "may not"),
    # The AMQP priority an event may ask for: 0..255.
    (
        {"event_type": "X", "payload": {}, "headers": {"x-outbox-priority": 256}},
        InvalidEvent,
        "0 to 255",
    ),
    (
        {"event_type": "X", "payload": {}, "headers": {"x-outbox-priority": "high"}},
        InvalidEvent,
        "0 to 255",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "text"), BAD_INPUT)
def test_bad_input_raises_and_rolls_back_the_business_write(kwargs, error, text):
    with pytest.raises(error, match=text), outbox.atomic() as box:
        Widget.objects.create(code="rolled-back")
        box.emit(kwargs.pop("event_type"), **kwargs)
    assert not Widget.objects.exists()
    assert not OutboxEvent.objects.exists()


def test_headers_amqp_carries_are_accepted():
    headers = {"tenant": "t1", "big": 2**63 - 1, "flag": True, "none": None, "n": {"l": [1, "a"]}}
    with outbox.atomic() as box:
        box.emit("X", payload={}, headers=headers)
    assert OutboxEvent.objects.get().headers == headers


def test_payload_limit_is_a_setting(settings):
    settings.OUTBOX_MAX_PAYLOAD_BYTES = 10
    with pytest.raises(PayloadTooLarge), outbox.atomic() as box:
        box.emit("X", payload={"long": "enough to pass ten bytes"})


def test_unsaved_aggregate_is_rejected():
    with pytest.raises(InvalidEvent, match="save it"), outbox.atomic() as box:
        box.emit("X", aggregate=Widget(code=None), payload={})


def test_emit_in_autocommit_says_to_wrap_the_block():
    with pytest.raises(NotInTransaction, match=r"outbox\.atomic\(\)"):
        outbox.emit("X", payload={})
    assert not OutboxEvent.objects.exists()


def test_box_emit_after_block_is_an_error():
    with outbox.atomic() as box:
        pass
    with pytest.raises(NotInTransaction):
        box.emit("X", payload={})


def test_duplicate_event_id_in_one_block():
    with pytest.raises(DuplicateEventId, match="twice"), outbox.atomic() as box:
        Widget.objects.create(code="w")
        box.emit("X", payload={}, event_id="same")
        box.emit("X", payload={}, event_id="same")
    assert not Widget.objects.exists()
    assert not OutboxEvent.objects.exists()


def test_duplicate_event_id_across_transactions_rolls_back_the_second():
    with outbox.atomic() as box:
        box.emit("X", payload={}, event_id="once")
    with pytest.raises(DuplicateEventId, match="exists already"), outbox.atomic() as box:
        Widget.objects.create(code="second")
        box.emit("X", payload={}, event_id="once")
    assert not Widget.objects.exists()
    assert OutboxEvent.objects.count() == 1


# -- the relays' wake-up (PostgreSQL) ------------------------------------------------------


@contextlib.contextmanager
def listening(db_vendor: str) -> Iterator[Callable[[float], bool]]:
    """LISTEN on the outbox channel as a relay does; yields ``received(timeout)``."""
    if db_vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL only")
    waker = PostgresNotifyWaker(threading.Event(), "default", "django_outbox")
    raw = waker._listen()
    # A commit of an earlier test, less than NOTIFY_WINDOW ago, must not silence this one's.
    notify._last_notify.clear()
    try:
        yield lambda timeout: waker._received(raw, timeout)
    finally:
        waker.close()


def test_a_commit_that_emitted_wakes_the_relays_after_it_and_issues_no_notify_in_it(db_vendor):
    with listening(db_vendor) as received:
        with CaptureQueriesContext(connection) as queries, transaction.atomic():
            outbox.emit("X", payload={})
            outbox.emit("X", payload={})
            # Nothing inside the transaction: NOTIFY there would serialise its commit
            # with every other notifying one.
            assert not received(0.1)
        assert not any("notify" in q["sql"].lower() for q in queries.captured_queries)
        assert received(5)
        assert not received(0.2)  # one wake-up for the transaction's two events


def test_a_rolled_back_transaction_wakes_no_one(db_vendor):
    with listening(db_vendor) as received:
        with contextlib.suppress(Boom), outbox.atomic() as box:
            box.emit("X", payload={})
            box.flush()
            raise Boom
        assert not received(0.3)
        with outbox.atomic() as box:  # a savepoint rolled back does not cancel the rest
            box.emit("X", payload={})
            with contextlib.suppress(Boom), transaction.atomic():
                outbox.emit("Y", payload={})
                raise Boom
        assert received(5)


def test_notify_off_wakes_no_one(db_vendor, settings):
    settings.OUTBOX_NOTIFY = False
    with listening(db_vendor) as received:
        with outbox.atomic() as box:
            box.emit("X", payload={})
        assert not received(0.3)


def test_every_commit_that_emitted_wakes_the_relays(db_vendor):
    with listening(db_vendor) as received:
        for _ in range(5):
            with outbox.atomic() as box:
                box.emit("X", payload={})
                box.emit("X", payload={})
            assert received(5)
            assert not received(0.1)  # one wake-up for the transaction's two events


def test_a_failed_wake_up_is_logged_and_loses_nothing(db_vendor, settings, caplog):
    with listening(db_vendor) as received:
        # pg_notify refuses a channel name this long: the NOTIFY fails after the commit.
        settings.OUTBOX_NOTIFY_CHANNEL = "x" * 100
        with outbox.atomic() as box:
            event = box.emit("X", payload={})
        assert "The NOTIFY that wakes the relays failed" in caplog.text
        assert OutboxEvent.objects.filter(event_id=event.event_id).exists()
        # The connection is fine for what follows, and the next commit wakes the relays.
        settings.OUTBOX_NOTIFY_CHANNEL = "django_outbox"
        with outbox.atomic() as box:
            box.emit("X", payload={})
        assert received(5)


# -- one INSERT for a block ----------------------------------------------------------------


def test_a_block_of_1000_events_is_one_insert_and_reads_back_as_emitted(db_vendor):
    table = OutboxEvent._meta.db_table
    with CaptureQueriesContext(connection) as queries, outbox.atomic() as box:
        events = [
            box.emit("X", payload={"n": i, "total": Decimal("1.10")}, aggregate_id=i)
            for i in range(1000)
        ]
    inserts = [
        q
        for q in queries.captured_queries
        if q["sql"].startswith(f"INSERT INTO {connection.ops.quote_name(table)}")
    ]
    if db_vendor == "sqlite":  # as many as its parameter limit needs, as bulk_create()
        assert 1 <= len(inserts) <= 20
    else:
        assert len(inserts) == 1
    rows = {row.event_id: row for row in OutboxEvent.objects.all()}
    assert len(rows) == 1000
    for i, event in enumerate(events):
        row = rows[event.event_id]
        assert (row.aggregate_id, row.payload) == (str(i), {"n": i, "total": "1.10"})
        assert row.status == Status.PENDING and row.retry_count == 0
        if connection.features.can_return_rows_from_bulk_insert:
            assert event.pk == row.pk
        assert not event._state.adding


# -- what emit() accepts at its limits, the relay sends ------------------------------------

#: 128 characters (the column) and 255 bytes in UTF-8 (an AMQP short string).
EDGE_TYPE = "é" * 127 + "A"
#: 64 characters (the column), 253 bytes.
EDGE_ID = "😀" * 63 + "a"


@pytest.mark.amqp
def test_what_emit_accepts_at_every_limit_the_relay_sends(broker):
    """Each limit at its edge: the row commits, reads back unchanged on this database and
    goes out through RabbitMQ with pika. One byte more is what pika itself refuses."""
    import pika

    from django_outbox.relay import Relay
    from tests.test_backend_pika import backend_for

    payload = {"deep": nested(MAX_DEPTH - 1), "escaped": "\\u0000 is text", "text": "ü😀"}
    headers = {"é" * 127 + "A": "name of 255 bytes", "deep": nested(MAX_DEPTH - 1)}
    with outbox.atomic() as box:
        box.emit(
            EDGE_TYPE,
            payload=payload,
            event_id=EDGE_ID,
            headers=headers,
            aggregate_type="é" * 64,
            aggregate_id="😀" * 64,
        )
    event = OutboxEvent.objects.get()
    assert (event.event_type, event.event_id) == (EDGE_TYPE, EDGE_ID)
    assert (event.payload, event.headers) == (payload, headers)

    queue = broker.bind_all("#")
    relay = Relay(backend=backend_for(broker), batch_size=10)
    try:
        relay.relay_batch()
    finally:
        relay.close()
    [(method, props, body)] = broker.get_all(queue, 1)
    assert OutboxEvent.objects.get().status == Status.SENT
    assert (method.routing_key, props.type, props.message_id) == (EDGE_TYPE, EDGE_TYPE, EDGE_ID)
    assert json.loads(body) == payload
    assert {k: props.headers[k] for k in headers} == headers
    assert (props.headers["aggregate_type"], props.headers["aggregate_id"]) == (
        "é" * 64,
        "😀" * 64,
    )
    with pytest.raises(pika.exceptions.ShortStringTooLong):
        pika.spec.BasicProperties(type=EDGE_TYPE + "A").encode()


# -- occurred_at follows USE_TZ --------------------------------------------------------------

NAIVE = dt.datetime(2024, 1, 2, 3, 4, 5, 600000)
AWARE = NAIVE.replace(tzinfo=dt.timezone.utc)


@pytest.mark.parametrize(
    ("use_tz", "when", "text"),
    [
        (True, NAIVE, "naive.*USE_TZ = True"),
        (False, AWARE, "aware.*USE_TZ = False"),
        # Year 10000 or 0 in UTC: an OverflowError on SQLite and MariaDB, a row PostgreSQL
        # stores and nobody can read back (issue 32, item 6).
        (
            True,
            dt.datetime(9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=5))),
            "outside years 1 to 9999 in UTC",
        ),
        (
            True,
            dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=14))),
            "outside years 1 to 9999 in UTC",
        ),
    ],
)
def test_occurred_at_that_does_not_match_use_tz_is_refused(settings, use_tz, when, text):
    settings.USE_TZ = use_tz
    with pytest.raises(InvalidEvent, match=text), outbox.atomic() as box:
        Widget.objects.create(code="rolled-back")
        box.emit("X", payload={}, occurred_at=when)
    assert not Widget.objects.exists()
    assert not OutboxEvent.objects.exists()


@pytest.mark.parametrize(("use_tz", "when"), [(True, AWARE), (False, NAIVE)])
def test_occurred_at_that_matches_use_tz_is_kept(settings, use_tz, when):
    settings.USE_TZ = use_tz
    with outbox.atomic() as box:
        box.emit("X", payload={}, occurred_at=when)
    assert OutboxEvent.objects.get().occurred_at == when


# -- idempotent emit: DuplicateEventId and the caller's transaction ------------------------


def _emit_paid() -> None:
    outbox.emit(
        "ORDER_PAID",
        aggregate_type="ORDER",
        aggregate_id="A-1",
        payload={},
        event_id="order-A-1-paid",
    )


def test_catching_duplicate_event_id_without_a_savepoint_drops_the_business_write(db_vendor):
    """The trap docs/writing-events.md warns about: the failed INSERT spoils the caller's
    transaction, the block exits without an error, and the business write is gone."""
    with transaction.atomic():
        _emit_paid()
    with transaction.atomic():
        Widget.objects.create(code="paid-twice")
        with contextlib.suppress(DuplicateEventId):
            _emit_paid()
    assert not Widget.objects.exists()
    assert OutboxEvent.objects.count() == 1


@pytest.mark.parametrize("savepoint", ["transaction.atomic", "outbox.atomic"])
def test_a_savepoint_around_the_emit_keeps_the_business_write(savepoint):
    """The pattern docs/writing-events.md shows: only the savepoint rolls back."""
    with transaction.atomic():
        _emit_paid()
    with transaction.atomic():
        Widget.objects.create(code="paid-twice")
        try:
            if savepoint == "transaction.atomic":
                with transaction.atomic():
                    _emit_paid()
            else:
                with outbox.atomic():
                    _emit_paid()
        except DuplicateEventId:
            announced_already = True
    assert announced_already
    assert Widget.objects.filter(code="paid-twice").exists()
    assert OutboxEvent.objects.count() == 1


def test_the_consumers_delivery_count_header_is_reserved():
    from django_outbox.consumer import DELIVERY_HEADER

    assert is_reserved_header(DELIVERY_HEADER)
    assert not is_reserved_header("x-request-id")
    assert not is_reserved_header("x-outbox-priority")  # the one an event sets itself


@pytest.mark.parametrize("name", ["cloudEvents:tenant", "cloudEvents_id"])
def test_a_header_that_would_read_as_a_cloudevents_attribute_is_refused(name):
    refused = pytest.raises(InvalidEvent, match="would read as CloudEvents attributes")
    with refused, outbox.atomic() as box:
        box.emit("X", payload={}, headers={name: "acme"})
    assert not OutboxEvent.objects.exists()


def test_text_that_only_looks_like_an_escaped_nul_is_kept():
    payload = {"backslash-u": "\\u0000", "two backslashes then it": "\\\\u0000"}
    with outbox.atomic() as box:
        box.emit("X", payload=payload, headers={"h": "\\u0000"})
    event = OutboxEvent.objects.get()
    assert (event.payload, event.headers) == (payload, {"h": "\\u0000"})
