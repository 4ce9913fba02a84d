"""The NATS JetStream backend against the real server: what reaches the stream, what is
SENT, and what a lost connection, a missing stream or an unbuildable row do."""

from __future__ import annotations

import json

import pytest
from django.core.checks import Error
from django.test import override_settings

from django_outbox.backends.base import BrokerUnavailable, Reason
from django_outbox.backends.nats import NatsBackend
from django_outbox.checks import Codes, check_backend
from django_outbox.transports import NATS, Transport
from tests.utils.rows import wire_rows

pytestmark = pytest.mark.once


def backend(broker, **options) -> NatsBackend:
    return NatsBackend(**broker.backend_options(**options))


def test_a_missing_nats_py_names_the_extra(monkeypatch):
    transport = Transport(**{**NATS.__dict__, "client": "no_such_module_for_nats"})
    with pytest.raises(ImportError, match=r"pip install 'django-transactional-outbox\[nats\]'"):
        transport.load(transport.consumer)


def test_each_event_lands_once_in_the_stream_with_its_id_type_and_headers(nats_broker):
    rows = wire_rows(50)
    with backend(nats_broker) as b:
        results = b.publish(rows)
    assert all(r.ok for r in results), results
    messages = nats_broker.messages()
    assert [m.headers["Nats-Msg-Id"] for m in messages] == [r.event_id for r in rows]
    first = messages[0]
    assert first.subject == f"{nats_broker.prefix}.ORDER_CREATED"
    assert first.headers["x-outbox-type"] == "ORDER_CREATED"
    assert first.headers["Content-Type"] == "application/json"
    assert first.headers["aggregate_id"] == "A-1"
    assert first.headers["sequence"] == "1"
    assert first.headers["trace_id"] == "t-1"
    assert json.loads(first.data) == {"order_id": 1, "total": "12.50", "note": "über"}


def test_the_stream_is_declared_with_the_settings(nats_broker):
    with backend(nats_broker, duplicate_window=300, replicas=1) as b:
        b.publish(wire_rows(1))
    info = nats_broker.run(nats_broker.js.stream_info(nats_broker.stream))
    assert info.config.duplicate_window == 300
    assert info.config.subjects == [f"{nats_broker.prefix}.>"]
    assert info.config.num_replicas == 1


def test_a_republished_event_is_acked_and_stored_once(nats_broker):
    """What makes a relay killed between the ack and the settle harmless."""
    rows = wire_rows(20)
    with backend(nats_broker) as b:
        assert all(r.ok for r in b.publish(rows))
    with backend(nats_broker) as b:
        assert all(r.ok for r in b.publish(rows))
    assert nats_broker.count() == 20


def test_a_subject_no_stream_takes_fails_that_row_unroutable(nats_broker):
    nats_broker.declare_stream(subjects=[f"{nats_broker.prefix}.ORDER_CREATED"])
    rows = wire_rows(2) + wire_rows(1, event_type="ORDER_PAID", start=3)
    with backend(nats_broker) as b:
        results = b.publish(rows)
    assert [r.ok for r in results] == [True, True, False]
    assert results[2].reason is Reason.UNROUTABLE
    assert f"{nats_broker.prefix}.ORDER_PAID" in results[2].error


def test_a_row_nats_cannot_carry_fails_alone(nats_broker):
    rows = wire_rows(3)
    rows[1].headers = {"bad name": "x"}
    with backend(nats_broker) as b:
        results = b.publish(rows)
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].reason is Reason.SERIALISATION
    assert "'bad name'" in results[1].error
    assert nats_broker.count() == 2


def test_a_stream_with_a_shorter_window_is_refused_not_changed(nats_broker):
    nats_broker.declare_stream(duplicate_window=10)
    b = backend(nats_broker, duplicate_window=120)
    with pytest.raises(BrokerUnavailable, match="duplicate window of 10 s"):
        b.open()
    b.close()
    info = nats_broker.run(nats_broker.js.stream_info(nats_broker.stream))
    assert info.config.duplicate_window == 10


@override_settings(
    OUTBOX_BACKEND="",
    OUTBOX_BROKER_URL="nats://127.0.0.1:4222",
    OUTBOX_LEASE_SECONDS=60,
    OUTBOX_NATS_DUPLICATE_WINDOW=60,
)
def test_a_duplicate_window_not_longer_than_the_lease_is_e030():
    errors = check_backend()
    assert [e.id for e in errors] == [Codes.NATS_DUPLICATE_WINDOW]
    assert "OUTBOX_NATS_DUPLICATE_WINDOW = 120" in errors[0].hint


@override_settings(
    OUTBOX_BACKEND="",
    OUTBOX_BROKER_URL="nats://127.0.0.1:4222",
    OUTBOX_NATS_STREAM="out.box",
    OUTBOX_NATS_REPLICAS=2.5,
)
def test_stream_settings_nats_cannot_take_are_e031():
    errors = check_backend()
    assert {e.id for e in errors} == {Codes.NATS_STREAM}
    assert len(errors) == 2
    assert all(isinstance(e, Error) for e in errors)


def test_check_routes_says_which_subjects_the_stream_takes_and_who_reads_them(nats_broker):
    from nats.js.api import ConsumerConfig

    nats_broker.declare_stream(subjects=[f"{nats_broker.prefix}.ORDER_CREATED"])
    config = ConsumerConfig(
        durable_name="points", filter_subject=f"{nats_broker.prefix}.ORDER_CREATED"
    )
    nats_broker.run(nats_broker.js.add_consumer(nats_broker.stream, config))
    check = backend(nats_broker).check_routes(["ORDER_CREATED", "ORDER_PAID"])
    assert check.target.startswith(f"stream {nats_broker.stream!r} at nats://")
    routes = {route.routing_key: route.destinations for route in check.routes}
    assert routes == {
        "ORDER_CREATED": (f"stream {nats_broker.stream!r} (read by points)",),
        "ORDER_PAID": (),
    }


@pytest.mark.django_db
def test_outbox_check_on_nats_exits_1_for_a_type_no_stream_takes(nats_broker):
    from io import StringIO

    from django.core.management import CommandError, call_command

    nats_broker.declare_stream(subjects=[f"{nats_broker.prefix}.ORDER_CREATED"])
    out = StringIO()
    with (
        override_settings(
            OUTBOX_BACKEND="",
            OUTBOX_BROKER_URL=nats_broker.url,
            OUTBOX_NATS_STREAM=nats_broker.stream,
            OUTBOX_EXCHANGE=nats_broker.prefix,
            OUTBOX_ROUTING_KEYS={"ORDER_CREATED": "ORDER_CREATED", "ORDER_PAID": "ORDER_PAID"},
        ),
        pytest.raises(CommandError) as info,
    ):
        call_command("outbox_check", stdout=out)
    assert info.value.returncode == 1
    text = out.getvalue()
    assert f"broker: stream {nats_broker.stream!r}" in text
    assert f"ORDER_CREATED: stream {nats_broker.stream!r}" in text
    assert "ORDER_PAID: NO QUEUE BOUND" in text
