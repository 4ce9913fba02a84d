"""OUTBOX_MESSAGE_FORMAT: the CloudEvents formats on the wire, checked against the CloudEvents
Python SDK in both directions, and the consumer reading every format."""

from __future__ import annotations

import base64
import json
import logging
from datetime import datetime, timedelta, timezone

import pika
import pytest
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

from django_outbox import message
from django_outbox.backends.locmem import LocmemBackend
from django_outbox.backends.pika import PikaBackend
from django_outbox.consumer import REASON_HEADER, Outcome
from django_outbox.exceptions import ImproperlyConfiguredBackend
from django_outbox.formats import default_source, get_format, rfc3339
from django_outbox.message import Delivery, UndecodableMessage, decode
from points.models import PointsLedger
from tests.utils.amqp import make_consumer
from tests.utils.rows import OCCURRED, unsaved_event, wire_rows
from tests.utils.waiting import wait_for

SOURCE = "/orders-service"


def received(body: bytes, headers: dict, *, content_type: str, message_id="", type=""):
    return decode(
        Delivery(
            body,
            message_id=message_id or None,
            message_type=type or None,
            headers=headers,
            content_type=content_type,
        )
    )


def ordered_row():
    (row,) = wire_rows(1, start=7)
    row.previous_sequence = 3  # set by the claim on ordered rows
    row.retry_count = 1
    return row


# -- writing -------------------------------------------------------------------------------
def test_native_is_the_default_and_calls_the_encoders_it_always_called(settings):
    backend = LocmemBackend()
    assert backend.message_format.name == "native"
    assert backend.message_format.encode_body is message.encode_body
    assert backend.message_format.encode_headers is message.encode_headers
    assert backend.message_format.content_type == "application/json"


def test_an_unknown_format_stops_the_backend_with_the_fix(settings):
    settings.OUTBOX_MESSAGE_FORMAT = "cloud-events"
    with pytest.raises(ImproperlyConfiguredBackend, match="'cloudevents-structured'"):
        LocmemBackend()


def test_binary_mode_is_the_native_message_plus_prefixed_attributes():
    row = ordered_row()
    fmt = get_format("cloudevents", source=SOURCE)
    headers = fmt.encode_headers(row)
    assert fmt.content_type == "application/json"  # the datacontenttype
    assert fmt.encode_body(row) == message.encode_body(row)  # the data
    native = message.encode_headers(row)
    assert {k: v for k, v in headers.items() if not k.startswith("cloudEvents:")} == native
    assert {k: v for k, v in headers.items() if k.startswith("cloudEvents:")} == {
        "cloudEvents:specversion": "1.0",
        "cloudEvents:id": row.event_id,
        "cloudEvents:source": SOURCE,
        "cloudEvents:type": "ORDER_CREATED",
        "cloudEvents:subject": "orders.Order/A-7",
        "cloudEvents:time": "2026-05-17T08:30:15.123456+00:00",
    }


def test_structured_mode_is_the_event_format_object_with_the_native_headers():
    row = ordered_row()
    fmt = get_format("cloudevents-structured", source=SOURCE)
    assert fmt.content_type == "application/cloudevents+json"
    assert fmt.encode_headers(row) == message.encode_headers(row)
    assert json.loads(fmt.encode_body(row)) == {
        "specversion": "1.0",
        "id": row.event_id,
        "source": SOURCE,
        "type": "ORDER_CREATED",
        "subject": "orders.Order/A-7",
        "time": "2026-05-17T08:30:15.123456+00:00",
        "datacontenttype": "application/json",
        "data": {"order_id": 7, "total": "12.50", "note": "über"},
    }


def test_an_event_without_aggregate_has_no_subject():
    row = unsaved_event(aggregate_type="", aggregate_id="")
    headers = get_format("cloudevents", source=SOURCE).encode_headers(row)
    assert "cloudEvents:subject" not in headers


def test_the_default_source_is_the_project_and_the_setting_overrides_it(settings):
    settings.OUTBOX_CLOUDEVENTS_SOURCE = ""  # the testproject sets one
    settings.SETTINGS_MODULE = "mysite.settings.production"
    assert default_source() == "/mysite"
    settings.OUTBOX_CLOUDEVENTS_SOURCE = "https://orders.example.com"
    assert default_source() == "https://orders.example.com"
    settings.OUTBOX_MESSAGE_FORMAT = "cloudevents"
    headers = LocmemBackend().message_format.encode_headers(unsaved_event())
    assert headers["cloudEvents:source"] == "https://orders.example.com"


def test_time_is_rfc3339_with_an_offset_also_for_naive_datetimes(settings):
    settings.TIME_ZONE = "Asia/Shanghai"
    assert rfc3339(datetime(2026, 5, 17, 16, 30)) == "2026-05-17T16:30:00+08:00"
    assert rfc3339(OCCURRED) == "2026-05-17T08:30:15.123456+00:00"


def test_emit_refuses_own_headers_that_read_as_attributes():
    assert message.is_reserved_header("cloudEvents:tenant")
    assert message.is_reserved_header("cloudEvents_id")
    assert not message.is_reserved_header("tenant")


# -- the SDK reads what the relay writes ---------------------------------------------------
@pytest.mark.parametrize(
    ("name", "read"),
    [("cloudevents", ce_amqp.from_binary), ("cloudevents-structured", ce_amqp.from_amqp)],
)
def test_the_sdk_reads_each_content_mode(name, read):
    """Binary mode (attributes in the application properties) and structured mode (the
    whole event in the body): the CloudEvents SDK's AMQP binding reads both."""
    row = ordered_row()
    fmt = get_format(name, source=SOURCE)
    amqp_message = ce_amqp.AMQPMessage(
        properties={"content-type": fmt.content_type},
        application_properties=fmt.encode_headers(row),
        application_data=fmt.encode_body(row),
    )
    event = read(amqp_message, JSONFormat(), CloudEvent)
    assert event.get_id() == row.event_id
    assert event.get_source() == SOURCE
    assert event.get_type() == "ORDER_CREATED"
    assert event.get_subject() == "orders.Order/A-7"
    assert event.get_time() == OCCURRED
    assert event.get_datacontenttype() == "application/json"
    assert event.get_specversion() == "1.0"
    assert event.get_data() == row.payload


# -- the consumer reads every format -------------------------------------------------------
@pytest.mark.parametrize("name", ["native", "cloudevents", "cloudevents-structured"])
def test_what_the_relay_writes_reads_back_the_same_in_every_format(name):
    row = ordered_row()
    fmt = get_format(name, source=SOURCE)
    event = received(
        fmt.encode_body(row),
        fmt.encode_headers(row),
        content_type=fmt.content_type,
        message_id=row.event_id,
        type=row.event_type,
    )
    assert event.format == name
    assert (event.event_id, event.event_type) == (row.event_id, "ORDER_CREATED")
    assert event.payload == {"order_id": 7, "total": "12.50", "note": "über"}
    assert (event.aggregate_type, event.aggregate_id) == ("orders.Order", "A-7")
    assert event.occurred_at == OCCURRED
    assert (event.attempt, event.sequence, event.previous_sequence) == (2, 7, 3)
    assert event.headers == {"trace_id": "t-7"}  # no attribute among the event's own
    if name == "native":
        assert event.cloudevent == {}
    else:
        assert event.cloudevent == {
            "specversion": "1.0",
            "id": row.event_id,
            "source": SOURCE,
            "type": "ORDER_CREATED",
            "subject": "orders.Order/A-7",
            "time": OCCURRED,
            **({"datacontenttype": "application/json"} if name != "cloudevents" else {}),
        }


def sdk_event(**attributes) -> CloudEvent:
    return CloudEvent(
        attributes={
            "id": "ce-1",
            "source": "https://spring.example.com/orders",
            "type": "com.example.order.created",
            "time": datetime(2026, 5, 17, 8, 30, 15, 123000, tzinfo=timezone.utc),
            "datacontenttype": "application/json",
            "tenant": "acme",
            **attributes,
        },
        data={"order_id": 1},
    )


def test_reads_the_sdks_amqp_binary_mode_underscore_prefix_and_millisecond_time():
    sent = ce_amqp.to_binary(sdk_event(), JSONFormat())
    assert "cloudEvents_id" in sent.application_properties
    assert isinstance(sent.application_properties["cloudEvents_time"], int)
    event = received(
        sent.application_data,
        sent.application_properties,
        content_type=sent.properties["content-type"],
    )
    assert event.format == "cloudevents"
    assert (event.event_id, event.event_type) == ("ce-1", "com.example.order.created")
    assert event.payload == {"order_id": 1}
    assert event.occurred_at == datetime(2026, 5, 17, 8, 30, 15, 123000, tzinfo=timezone.utc)
    assert event.cloudevent["tenant"] == "acme"
    assert event.cloudevent["source"] == "https://spring.example.com/orders"
    assert event.headers == {}


def test_reads_the_sdks_rabbitmq_binding_ce_prefix():
    sent = ce_rabbitmq.to_binary(sdk_event(), JSONFormat())
    assert "ce-id" in sent.headers
    event = received(sent.body, sent.headers, content_type=sent.content_type)
    assert (event.format, event.event_id, event.payload) == ("cloudevents", "ce-1", {"order_id": 1})
    assert event.occurred_at == datetime(2026, 5, 17, 8, 30, 15, 123000, tzinfo=timezone.utc)


def test_reads_the_sdks_structured_mode():
    sent = ce_amqp.to_structured(sdk_event(), JSONFormat())
    event = received(sent.application_data, {}, content_type=sent.properties["content-type"])
    assert (event.format, event.event_id, event.payload) == (
        "cloudevents-structured",
        "ce-1",
        {"order_id": 1},
    )
    assert event.cloudevent["tenant"] == "acme"


def test_reads_structured_data_base64_holding_json():
    envelope = {
        "specversion": "1.0",
        "id": "b-1",
        "source": "/x",
        "type": "T",
        "data_base64": base64.b64encode(b'{"n": 1}').decode(),
    }
    event = received(json.dumps(envelope).encode(), {}, content_type="application/cloudevents+json")
    assert event.payload == {"n": 1}


def test_an_amqp_timestamp_time_is_read_as_such():
    headers = {
        "cloudEvents:specversion": "1.0",
        "cloudEvents:id": "t-1",
        "cloudEvents:source": "/x",
        "cloudEvents:type": "T",
        # pika reads an AMQP timestamp field as a naive UTC datetime.
        "cloudEvents:time": datetime(2026, 5, 17, 8, 30, 15),
    }
    event = received(b"{}", headers, content_type="application/json")
    assert event.occurred_at == datetime(2026, 5, 17, 8, 30, 15)


BINARY = {
    "cloudEvents:specversion": "1.0",
    "cloudEvents:id": "e-1",
    "cloudEvents:source": "/x",
    "cloudEvents:type": "T",
}


@pytest.mark.parametrize(
    ("headers", "body", "content_type", "reason"),
    [
        (
            {k: v for k, v in BINARY.items() if k != "cloudEvents:source"},
            b"{}",
            "application/json",
            "CloudEvent 'e-1': the required attribute source (header cloudEvents:source) is "
            "missing",
        ),
        (
            {**BINARY, "cloudEvents:type": ""},
            b"{}",
            "application/json",
            "the required attribute type (header cloudEvents:type) is '', not text",
        ),
        (
            {**BINARY, "cloudEvents:specversion": "0.3"},
            b"{}",
            "application/json",
            "CloudEvent 'e-1' has specversion '0.3'; the consumer reads CloudEvents 1.0",
        ),
        (
            BINARY,
            b"<order/>",
            "application/xml",
            "CloudEvent 'e-1' has datacontenttype 'application/xml'; the consumer reads "
            "application/json data only",
        ),
        (BINARY, b"not json", "application/json", "CloudEvent 'e-1': the body is not JSON"),
        (
            {**BINARY, "cloudEvents:time": "yesterday"},
            b"{}",
            "application/json",
            "CloudEvent 'e-1': time is 'yesterday', not an RFC 3339 timestamp",
        ),
        (
            {**BINARY, "cloudEvents:id": "x" * 65},
            b"{}",
            "application/json",
            "CloudEvents id is 65 characters long, more than 64",
        ),
        (
            {},
            b"[1]",
            "application/cloudevents+json",
            "a application/cloudevents+json body is a list, not a JSON object",
        ),
        (
            {},
            json.dumps({"specversion": "1.0", "id": "s-1", "type": "T"}).encode(),
            "application/cloudevents+json",
            "CloudEvent 's-1': the required attribute source is missing",
        ),
        (
            {},
            b"\x00",
            "application/cloudevents+avro",
            "is a CloudEvent in the event format 'application/cloudevents+avro'; the consumer "
            "reads application/cloudevents+json only",
        ),
        (
            {"tenant": "acme"},
            b"{}",
            "application/json",
            "the message is not an outbox event: it has no message_id (the event_id) and is "
            "no CloudEvent either",
        ),
    ],
)
def test_a_message_in_neither_format_is_undecodable_with_the_reason(
    headers, body, content_type, reason
):
    with pytest.raises(UndecodableMessage) as info:
        received(body, headers, content_type=content_type)
    assert reason in str(info.value)


STRUCTURED = {"specversion": "1.0", "id": "s-1", "source": "/x", "type": "T"}


@pytest.mark.parametrize(
    ("headers", "envelope", "reason"),
    [
        (
            {},
            {**STRUCTURED, "data": {"n": 1}, "data_base64": "eyJuIjogMn0="},
            "CloudEvent 's-1' has both data and data_base64; the JSON event format allows "
            "one of them",
        ),
        (
            {},
            {**STRUCTURED, "time": 1779006615000},
            "CloudEvent 's-1': time is 1779006615000, a JSON number; the JSON event format "
            "writes it as an RFC 3339 string",
        ),
        (
            {},
            {**STRUCTURED, "time": {"seconds": 1}},
            "time is {'seconds': 1}, a JSON object",
        ),
        (
            {"cloudEvents:id": "s-2"},
            STRUCTURED,
            "CloudEvent 's-1': id is 's-1' in the body and 's-2' in header cloudEvents:id; a "
            "message carries one event",
        ),
    ],
    ids=["data-and-data_base64", "time-number", "time-object", "header-id-differs"],
)
def test_what_the_json_event_format_forbids_is_undecodable(headers, envelope, reason):
    """Accepted before (issue 32, item 7): the payload taken from data, the number read as
    milliseconds, the body's id de-duplicated on."""
    body = json.dumps(envelope).encode()
    with pytest.raises(UndecodableMessage) as info:
        received(body, headers, content_type="application/cloudevents+json")
    assert reason in str(info.value)


@pytest.mark.parametrize("other", ["cloudEvents_id", "ce-id"])
def test_binary_mode_ids_that_differ_between_prefixes_are_undecodable(other):
    headers = {**BINARY, other: "e-2"}
    with pytest.raises(UndecodableMessage) as info:
        received(b"{}", headers, content_type="application/json")
    assert str(info.value) == (
        f"CloudEvent 'e-1': id is 'e-1' in header cloudEvents:id and 'e-2' in header {other}; "
        "a message carries one event"
    )


def test_the_same_attributes_under_two_prefixes_are_read_once():
    """A bridge that adds the other binding's headers with the same values: one event. The
    time may be written two ways (text, an AMQP timestamp) for the same moment."""
    headers = {
        **BINARY,
        "cloudEvents:time": "2026-05-17T08:30:15+00:00",
        "cloudEvents_id": b"e-1",
        "ce-id": "e-1",
        "ce-type": "T",
        "ce-time": datetime(2026, 5, 17, 8, 30, 15),
        "ce-tenant": "only-here",
    }
    event = received(b"{}", headers, content_type="application/json")
    assert (event.event_id, event.event_type) == ("e-1", "T")
    assert "tenant" not in event.cloudevent
    structured = {**STRUCTURED, "data": None, "data_base64": "eyJuIjogMX0="}
    event = received(
        json.dumps(structured).encode(),
        {"cloudEvents:id": "s-1"},
        content_type="application/cloudevents+json",
    )
    assert event.payload == {"n": 1}


def test_a_time_in_milliseconds_out_of_range_is_undecodable():
    headers = {**BINARY, "cloudEvents:time": 10**20}
    with pytest.raises(UndecodableMessage, match="not an RFC 3339 timestamp"):
        received(b"{}", headers, content_type="application/json")


def test_an_offset_time_keeps_its_offset():
    headers = {**BINARY, "cloudEvents:time": "2026-05-17T16:30:15+08:00"}
    event = received(b"{}", headers, content_type="application/json")
    assert event.occurred_at == OCCURRED.replace(microsecond=0)
    assert event.occurred_at.utcoffset() == timedelta(hours=8)


# -- over RabbitMQ -------------------------------------------------------------------------
@pytest.mark.amqp
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["cloudevents", "cloudevents-structured"])
def test_relayed_over_rabbitmq_the_sdk_and_the_consumer_read_it(broker, settings, name):
    """The pika backend publishes in the format; what RabbitMQ delivers keeps the native
    properties, the SDK reads it as a CloudEvent and consume_outbox handles it."""
    settings.OUTBOX_MESSAGE_FORMAT = name
    settings.OUTBOX_CLOUDEVENTS_SOURCE = SOURCE
    consumer = make_consumer(broker)
    rows = [unsaved_event(pk=1), unsaved_event(pk=2)]
    probe = broker.declare_queue("ORDER_CREATED")
    with PikaBackend(broker_url=broker.url, exchange=broker.exchange) as backend:
        assert [r.ok for r in backend.publish(rows)] == [True, True]

    _method, props, body = broker.get_all(probe, 1)[0]
    assert (props.message_id, props.type, props.delivery_mode) == (
        rows[0].event_id,
        "ORDER_CREATED",
        2,
    )
    assert props.timestamp == int(rows[0].occurred_at.timestamp())
    assert props.headers["aggregate_id"] == "N1"
    sdk_message = ce_amqp.AMQPMessage(
        properties={"content-type": props.content_type},
        application_properties=props.headers,
        application_data=body,
    )
    event = ce_amqp.from_amqp(sdk_message, JSONFormat(), CloudEvent)
    assert (event.get_id(), event.get_source(), event.get_subject()) == (
        rows[0].event_id,
        SOURCE,
        "ORDER/N1",
    )
    assert event.get_data() == json.loads(message.encode_body(rows[0]))

    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 2
    assert result.as_dict()["formats"] == {
        "native": 0,
        "cloudevents": 0,
        "cloudevents-structured": 0,
        name: 2,
    }
    assert set(PointsLedger.objects.values_list("source_event_id", flat=True)) == {
        r.event_id for r in rows
    }


@pytest.mark.amqp
@pytest.mark.django_db(transaction=True)
def test_a_producer_switching_format_needs_no_flag_day_and_a_bad_cloudevent_is_dead_lettered(
    broker, settings, caplog
):
    consumer = make_consumer(broker)
    native, binary, structured, bad = (unsaved_event(pk=pk) for pk in (1, 2, 3, 4))
    broker.publish(native)
    for row, name in [(binary, "cloudevents"), (structured, "cloudevents-structured")]:
        fmt = get_format(name, source=SOURCE)
        props = pika.BasicProperties(
            content_type=fmt.content_type,
            delivery_mode=2,
            message_id=row.event_id,
            type=row.event_type,
            headers=fmt.encode_headers(row),
        )
        broker.publish_raw(fmt.encode_body(row), props, "ORDER_CREATED")
    headers = get_format("cloudevents", source=SOURCE).encode_headers(bad)
    headers["cloudEvents:specversion"] = "0.3"
    broker.publish_raw(
        message.encode_body(bad),
        pika.BasicProperties(content_type="application/json", headers=headers),
        "ORDER_CREATED",
    )
    with caplog.at_level(logging.INFO, logger="django_outbox.consumer"):
        result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.PROCESSED] == 3
    assert result.counts[Outcome.UNDECODABLE] == 1
    assert result.as_dict()["formats"] == {
        "native": 1,
        "cloudevents": 1,
        "cloudevents-structured": 1,
    }
    logged = caplog.text
    for name in ("native", "cloudevents", "cloudevents-structured"):
        assert f"reading {name} messages" in logged
    assert wait_for(lambda: broker.count(broker.dlq) == 1)
    props, _body = broker.drain(broker.dlq)[0]
    assert props.headers[REASON_HEADER] == (
        f"undecodable: CloudEvent '{bad.event_id}' has specversion '0.3'; the consumer reads "
        "CloudEvents 1.0"
    )


@pytest.mark.amqp
def test_the_celery_backends_plain_messages_follow_the_format(broker, settings):
    from tests.test_backend_celery import backend_for

    settings.OUTBOX_MESSAGE_FORMAT = "cloudevents"
    queue = broker.declare_queue("ORDER_CREATED")
    rows = wire_rows(1)
    with backend_for(broker) as backend:
        assert [r.ok for r in backend.publish(rows)] == [True]
    _method, props, body = broker.get_all(queue, 1)[0]
    event = received(
        body, props.headers, content_type=props.content_type, message_id=props.message_id
    )
    assert (event.format, event.event_id, event.payload) == (
        "cloudevents",
        rows[0].event_id,
        rows[0].payload,
    )


# -- text headers and the NATS binding ---------------------------------------------------------
@pytest.mark.once
def test_the_nats_binding_writes_ce_headers_with_datacontenttype():
    from django_outbox.formats import NATS_BINDING

    event = wire_rows(1)[0]
    headers = get_format("cloudevents", source="/orders", binding=NATS_BINDING).encode_headers(
        event
    )
    assert headers["ce-id"] == event.event_id
    assert headers["ce-source"] == "/orders"
    assert headers["ce-datacontenttype"] == "application/json"
    assert not any(name.startswith("cloudEvents:") for name in headers)
    # The AMQP binding is unchanged: the content type is AMQP's own property.
    amqp = get_format("cloudevents", source="/orders").encode_headers(event)
    assert "cloudEvents:datacontenttype" not in amqp


@pytest.mark.once
@pytest.mark.parametrize(
    ("value", "written"),
    [
        ("plain", "plain"),
        ("Euro € 😀", "Euro%20%E2%82%AC%20%F0%9F%98%80"),  # the binding's own example
        ("100%", "100%25"),
        ("two\r\nlines", "two%0D%0Alines"),
        ('"quoted"', "%22quoted%22"),
    ],
)
def test_a_text_header_value_is_percent_encoded_as_the_nats_binding_says(value, written):
    assert message.escape_header_value(value) == written
    assert message.unescape_header_value(written) == value


@pytest.mark.once
def test_text_headers_keep_each_value_s_type():
    headers = {"attempt": 2, "sequence": 41, "tenant": 5, "flags": [1, "a"], "ok": True}
    headers["note"] = "ä b"
    pairs = message.encode_text_headers(headers)
    assert all(isinstance(value, str) for _, value in pairs)
    assert dict(pairs)["x-outbox-json"] == "tenant,flags,ok"
    decoded = message.decode_text_headers(dict(pairs))
    # attempt and sequence stay digits: decode() reads them as integers on every transport.
    assert decoded == {**headers, "attempt": "2", "sequence": "41"}
    event = decode(Delivery(b"{}", message_id="e", message_type="T", headers=decoded))
    assert (event.attempt, event.sequence, event.headers["tenant"]) == (2, 41, 5)


@pytest.mark.once
def test_a_value_that_is_not_valid_percent_encoding_is_read_as_it_is():
    assert message.unescape_header_value("50%off") == "50%off"
    assert message.unescape_header_value("%C0%A0") == "%C0%A0"  # overlong UTF-8: refused
    assert message.unescape_header_value('"a\\"b"') == 'a"b'
