"""The Redis Streams backend against the real server: what reaches the streams, what is
SENT, and what a lost connection, an error reply or an unbuildable row do."""

from __future__ import annotations

import json
import time

import pytest
import redis
from django.test import override_settings

from django_outbox.backends import get_backend_class
from django_outbox.backends.base import BrokerUnavailable, Reason
from django_outbox.backends.redis import RedisBackend
from django_outbox.checks import Codes, check_backend
from django_outbox.exceptions import ImproperlyConfiguredBackend
from django_outbox.transports import REDIS, Transport
from tests.utils.redis import primary_and_replica
from tests.utils.rows import wire_rows

pytestmark = pytest.mark.once


def backend(broker, **options) -> RedisBackend:
    return RedisBackend(**broker.backend_options(**options))


def test_outbox_backend_still_wins_over_a_redis_url():
    with override_settings(
        OUTBOX_BACKEND="django_outbox.backends.locmem.LocmemBackend",
        OUTBOX_BROKER_URL="redis://127.0.0.1:6379/0",
    ):
        assert get_backend_class().__name__ == "LocmemBackend"


def test_redis_and_amqp_urls_together_are_a_check_error():
    with override_settings(
        OUTBOX_BACKEND="",
        OUTBOX_BROKER_URL=["redis://127.0.0.1:6379/0", "amqp://guest:guest@127.0.0.1/%2F"],
    ):
        with pytest.raises(ImproperlyConfiguredBackend, match="several transports"):
            get_backend_class()
        assert [e.id for e in check_backend()] == [Codes.BACKEND]


def test_a_missing_redis_py_names_the_extra():
    transport = Transport(**{**REDIS.__dict__, "client": "no_such_module_for_redis"})
    with pytest.raises(ImportError, match=r"pip install 'django-transactional-outbox\[redis\]'"):
        transport.load(transport.backend)


def test_each_event_lands_once_in_its_stream_with_its_fields(redis_broker):
    rows = wire_rows(50) + wire_rows(2, event_type="ORDER_PAID", start=51)
    with backend(redis_broker) as b:
        results = b.publish(rows)
    assert all(r.ok for r in results), results
    entries = redis_broker.entries()
    assert [f[b"message_id"].decode() for _, f in entries] == [r.event_id for r in rows[:50]]
    assert redis_broker.count(redis_broker.stream("ORDER_PAID")) == 2
    _, first = entries[0]
    assert first[b"type"] == b"ORDER_CREATED"
    assert first[b"content_type"] == b"application/json"
    headers = json.loads(first[b"headers"])
    assert headers["aggregate_id"] == "A-1"
    assert headers["sequence"] == 1
    assert headers["trace_id"] == "t-1"
    assert json.loads(first[b"body"]) == {"order_id": 1, "total": "12.50", "note": "über"}


def test_the_streams_setting_maps_routing_keys_and_maxlen_bounds_them(redis_broker):
    target = redis_broker.stream("orders")
    with backend(redis_broker, streams={"ORDER_CREATED": target}, maxlen=10) as b:
        assert all(r.ok for r in b.publish(wire_rows(500)))
    # MAXLEN ~: trimmed in whole nodes, so about (never fewer than) 10 entries are kept.
    assert 10 <= redis_broker.count(target) < 500
    assert redis_broker.count() == 0


def test_an_error_reply_fails_that_row_with_its_reason(redis_broker):
    redis_broker.client.set(redis_broker.stream("ORDER_PAID"), "not a stream")
    rows = wire_rows(2) + wire_rows(1, event_type="ORDER_PAID", start=3) + wire_rows(1, start=4)
    with backend(redis_broker) as b:
        results = b.publish(rows)
        assert all(r.ok for r in b.publish(wire_rows(1, start=5)))  # still in step
    assert [r.ok for r in results] == [True, True, False, True]
    assert results[2].reason is Reason.NACKED
    assert "WRONGTYPE" in results[2].error
    assert redis_broker.count() == 4


def test_a_row_that_cannot_be_built_fails_alone(redis_broker):
    rows = wire_rows(3)
    rows[1].headers = {"bad": object()}
    with backend(redis_broker) as b:
        results = b.publish(rows)
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].reason is Reason.SERIALISATION
    assert redis_broker.count() == 2


def test_a_row_whose_text_is_not_utf8_fails_alone(redis_broker):
    """A lone surrogate cannot be written: before the backend packed the commands itself,
    redis-py's packing raised for the whole batch."""
    rows = wire_rows(3)
    rows[1].event_id = "id-\udc80"
    with backend(redis_broker) as b:
        results = b.publish(rows)
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].reason is Reason.SERIALISATION
    assert redis_broker.count() == 2


def test_a_replica_is_passed_over_for_the_primary():
    with primary_and_replica() as (primary, replica):
        with RedisBackend(broker_url=[replica, primary], exchange="t") as b:
            assert all(r.ok for r in b.publish(wire_rows(5)))
            assert b.nodes.current == primary
        with pytest.raises(BrokerUnavailable, match="the node is a slave, which takes no"):
            RedisBackend(broker_url=replica, exchange="t").open()


def test_a_promoted_replica_takes_over_and_nothing_is_sent_without_an_answer():
    """A failover as Sentinel makes it: the replica is promoted, the old primary turns
    replica. The relay's next batch on the old primary is refused READONLY: released (not
    the events' fault), and the relay goes on through the promoted node."""
    with primary_and_replica() as (primary, replica):
        b = RedisBackend(broker_url=[primary, replica], exchange="t")
        first = wire_rows(50)
        assert all(r.ok for r in b.publish(first))
        promoted = redis.Redis.from_url(replica)
        deadline = time.monotonic() + 10
        while promoted.xlen("t.ORDER_CREATED") < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        promoted.replicaof("NO", "ONE")
        port = redis.Redis.from_url(replica).connection_pool.connection_kwargs["port"]
        redis.Redis.from_url(primary).replicaof("127.0.0.1", port)
        second = wire_rows(50, start=51)
        results = b.publish(second)
        assert {r.reason for r in results} == {Reason.CONNECTION_LOST}
        assert "ReadOnlyError" in results[0].error  # READONLY
        assert b.next_node() is True  # at once, to the promoted node
        b.close()
        assert all(r.ok for r in b.publish(second))
        b.close()
        stored = [f[b"message_id"].decode() for _, f in promoted.xrange("t.ORDER_CREATED")]
        assert stored == [r.event_id for r in first + second]


@override_settings(
    OUTBOX_BACKEND="",
    OUTBOX_BROKER_URL="redis://127.0.0.1:6379/0",
    OUTBOX_REDIS_STREAMS=["orders"],
    OUTBOX_REDIS_MAXLEN=0,
    OUTBOX_REDIS_VISIBILITY_TIMEOUT=-1,
)
def test_redis_settings_it_cannot_take_are_e032():
    errors = check_backend()
    assert [e.id for e in errors] == [Codes.REDIS_SETTING] * 3
    assert "OUTBOX_REDIS_MAXLEN is 0" in errors[1].msg


def test_check_routes_names_each_stream_and_its_groups(redis_broker):
    redis_broker.client.xgroup_create(redis_broker.stream(), "points", id="0", mkstream=True)
    check = backend(redis_broker).check_routes(["ORDER_CREATED", "ORDER_PAID"])
    assert check.target.startswith("Redis at redis://")
    routes = {route.routing_key: route.destinations for route in check.routes}
    assert routes == {
        "ORDER_CREATED": (f"stream {redis_broker.stream()!r} (read by group points)",),
        "ORDER_PAID": (
            f"stream {redis_broker.stream('ORDER_PAID')!r} (no consumer group yet: entries "
            "wait in the stream)",
        ),
    }


@pytest.mark.django_db
def test_outbox_check_on_redis_exits_0_and_names_the_streams(redis_broker):
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    with override_settings(
        OUTBOX_BACKEND="",
        OUTBOX_BROKER_URL=redis_broker.url,
        OUTBOX_EXCHANGE=redis_broker.prefix,
        OUTBOX_ROUTING_KEYS={"ORDER_CREATED": "ORDER_CREATED"},
    ):
        call_command("outbox_check", stdout=out)
    text = out.getvalue()
    assert "broker: Redis at redis://" in text
    assert f"ORDER_CREATED: stream {redis_broker.stream()!r}" in text
