"""CeleryBackend against the real RabbitMQ: task and plain messages, confirms, returns,
nacks, channel errors, timeouts and lost connections; the relay keeps failed rows PENDING.

Each test uses its own Celery app (never set as current) whose default queue and
exchanges are uniquely named and deleted afterwards (tests.utils.amqp.Broker).
"""

from __future__ import annotations

import json
import pickle
import ssl
import threading
import uuid

import pytest
from celery import Celery

from django_outbox.backends import get_backend
from django_outbox.backends.base import BrokerUnavailable, Reason
from django_outbox.backends.celery import CLOSE_TIMEOUT, CeleryBackend
from django_outbox.checks import Codes
from django_outbox.message import decode_task_envelope, encode_task_envelope
from django_outbox.models import OutboxEvent, Status
from django_outbox.relay import Relay
from django_outbox.worker import BrokerNodes
from tests.utils.amqp import Broker
from tests.utils.proxy import TcpProxy
from tests.utils.rows import make_events, wire_rows

pytestmark = pytest.mark.amqp

TASK = "tests.celery.award"


def make_app(url: str, queue: str, **conf: object) -> Celery:
    """A Celery app of its own whose default queue is ``queue`` (see task_queue())."""
    app = Celery(f"test-{uuid.uuid4().hex[:6]}", broker=url, set_as_current=False)
    app.conf.update(task_default_queue=queue, **conf)
    return app


def task_queue(broker: Broker) -> str:
    """A queue the backend's app declares when sending, with a direct exchange of the same
    name (both deleted with the broker)."""
    name = f"test.outbox.celery.{uuid.uuid4().hex[:10]}"
    broker.delete_at_close(queues=[name], exchanges=[name])
    return name


def backend_for(broker: Broker, app: Celery | None = None, **options: object) -> CeleryBackend:
    """No tasks unless given (the testproject maps ORDER_CREATED to one)."""
    options.setdefault("confirm_timeout", 5)
    options.setdefault("connect_timeout", 5)
    options.setdefault("tasks", {})
    app = app or make_app(broker.url, task_queue(broker))
    return CeleryBackend(app=app, exchange=broker.exchange, **options)


@pytest.mark.once
def test_plain_messages_are_the_pika_wire_format(broker):
    queue = broker.declare_queue("ORDER_CREATED")
    rows = wire_rows(3)
    with backend_for(broker) as backend:
        results = backend.publish(rows)
    assert [r.ok for r in results] == [True] * 3
    messages = broker.get_all(queue, 3)
    assert [m[1].message_id for m in messages] == [r.event_id for r in rows]
    _method, props, body = messages[0]
    assert props.type == "ORDER_CREATED"
    assert props.content_type == "application/json"
    assert props.delivery_mode == 2
    assert props.timestamp == int(rows[0].occurred_at.timestamp())
    assert props.headers["aggregate_id"] == "A-1"
    assert props.headers["trace_id"] == "t-1"
    assert json.loads(body) == rows[0].payload


@pytest.mark.once
def test_task_messages_carry_the_envelope_and_the_event_id_as_task_id(broker):
    queue = task_queue(broker)
    rows = wire_rows(2)
    app = make_app(broker.url, queue)
    with backend_for(broker, app, tasks={"ORDER_CREATED": TASK}) as backend:
        results = backend.publish(rows)
    assert [r.ok for r in results] == [True, True]
    messages = broker.get_all(queue, 2)
    assert len(messages) == 2
    _method, props, body = messages[0]
    assert props.headers["task"] == TASK
    assert props.headers["id"] == rows[0].event_id
    assert props.delivery_mode == 2
    args, kwargs, _embed = json.loads(body)
    assert kwargs == {}
    event = decode_task_envelope(args[0])
    assert (event.event_id, event.event_type) == (rows[0].event_id, "ORDER_CREATED")
    assert event.payload == rows[0].payload
    assert event.aggregate_id == "A-1"
    assert event.occurred_at == rows[0].occurred_at
    assert event.headers == {"trace_id": "t-1"}


@pytest.mark.once
def test_a_task_message_is_what_send_task_would_publish():
    """The body as Celery writes it (app.amqp.as_task_v2), with the envelope's JSON written
    by the backend; the headers are _compat.celery's (tests/test_compat.py)."""
    app = Celery("fidelity", broker="amqp://", set_as_current=False)
    app.conf.task_default_queue = "fidelity"
    backend = CeleryBackend(app=app, tasks={"ORDER_CREATED": TASK})
    [event] = wire_rows(1)
    exchange, routing_key, body, props = backend._message(event)
    assert (exchange, routing_key) == ("", "fidelity")  # the default queue, direct
    argsrepr = f"(<ORDER_CREATED event {event.event_id}>,)"
    celery_headers, celery_props, celery_body, _ = app.amqp.as_task_v2(
        event.event_id, TASK, args=[encode_task_envelope(event)], kwargs={}, argsrepr=argsrepr
    )
    assert json.loads(body) == json.loads(json.dumps(celery_body))
    assert props.headers["argsrepr"] == celery_headers["argsrepr"]
    assert props.correlation_id == celery_props["correlation_id"] == event.event_id
    assert (props.content_type, props.content_encoding) == ("application/json", "utf-8")
    assert props.delivery_mode == 2 and props.message_id == event.event_id


@pytest.mark.once
def test_task_messages_follow_the_apps_routes_serializer_and_signals(broker):
    """A route to a queue of its own on a topic exchange (declared as send_task() would),
    the pickle serializer, priority, and a before_task_publish receiver adding a header."""
    from celery.signals import before_task_publish
    from kombu import Exchange, Queue

    name = f"test.outbox.celery.routed.{uuid.uuid4().hex[:8]}"
    broker.delete_at_close(queues=[name], exchanges=[name])
    routed = Queue(name, Exchange(name, type="topic"), routing_key="points.#")
    app = make_app(
        broker.url,
        task_queue(broker),
        task_queues=[routed],
        task_routes={TASK: {"queue": name, "routing_key": "points.award", "priority": 3}},
        task_serializer="pickle",
    )

    def add_header(headers: dict, **kwargs: object) -> None:
        headers["traceparent"] = "00-abc-def-01"

    before_task_publish.connect(add_header)
    try:
        with backend_for(broker, app, tasks={"ORDER_CREATED": TASK}) as backend:
            results = backend.publish(wire_rows(2))
    finally:
        before_task_publish.disconnect(add_header)
    assert [r.ok for r in results] == [True, True]
    messages = broker.get_all(name, 2)
    assert len(messages) == 2
    method, props, body = messages[0]
    assert (method.exchange, method.routing_key) == (name, "points.award")
    assert props.content_type == "application/x-python-serialize"
    assert props.priority == 3
    assert props.headers["traceparent"] == "00-abc-def-01"
    args, _kwargs, _embed = pickle.loads(body)
    assert args[0]["event_id"] == props.headers["id"]


@pytest.mark.once
def test_a_router_function_is_asked_for_every_message(broker):
    seen: list[str] = []

    def route(name: str, args: list, kwargs: dict, options: dict, **kw: object) -> dict:
        seen.append(args[0]["event_id"])
        return {"queue": queue}

    queue = task_queue(broker)
    app = make_app(broker.url, queue, task_routes=[route])
    rows = wire_rows(3)
    with backend_for(broker, app, tasks={"ORDER_CREATED": TASK}) as backend:
        assert all(r.ok for r in backend.publish(rows))
    assert seen == [r.event_id for r in rows]
    assert len(broker.get_all(queue, 3)) == 3


@pytest.mark.once
def test_a_task_routed_to_a_queue_the_app_does_not_know_fails_alone(broker):
    queue = task_queue(broker)
    app = make_app(
        broker.url,
        queue,
        task_create_missing_queues=False,
        task_routes={"tests.celery.nowhere": {"queue": "not-in-task-queues"}},
    )
    rows = [*wire_rows(1, event_type="NOWHERE"), *wire_rows(1, start=2)]
    tasks = {"NOWHERE": "tests.celery.nowhere", "ORDER_CREATED": TASK}
    with backend_for(broker, app, tasks=tasks) as backend:
        results = backend.publish(rows)
    assert results[0].reason is Reason.ERROR
    assert "cannot route task 'tests.celery.nowhere'" in results[0].error
    assert "not-in-task-queues" in results[0].error
    assert results[1].ok


@pytest.mark.once
def test_unroutable_and_nacked_fail_per_event_and_the_rest_is_confirmed(broker):
    broker.declare_queue("ORDER_CREATED")
    full = broker.declare_queue(
        "FULL", arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    )
    assert full
    rows = [
        *wire_rows(1, event_type="NOBODY_LISTENS"),
        *wire_rows(1, event_type="FULL", start=2),
        *wire_rows(2, start=3),
    ]
    with backend_for(broker) as backend:
        results = backend.publish(rows)
    assert [r.reason for r in results] == [Reason.UNROUTABLE, Reason.NACKED, None, None]
    assert "NOBODY_LISTENS" in results[0].error
    assert [r.ok for r in results[2:]] == [True, True]


@pytest.mark.once
def test_a_task_routed_to_a_missing_exchange_fails_alone(broker):
    queue = task_queue(broker)
    missing = f"test.outbox.missing.{uuid.uuid4().hex[:8]}"
    app = make_app(
        broker.url,
        queue,
        task_routes={"tests.celery.lost": {"exchange": missing, "routing_key": "x"}},
    )
    rows = [*wire_rows(1, event_type="LOST"), *wire_rows(1, start=2)]
    tasks = {"LOST": "tests.celery.lost", "ORDER_CREATED": TASK}
    with backend_for(broker, app, tasks=tasks) as backend:
        results = backend.publish(rows)
        again = backend.publish(wire_rows(1, start=3))
    assert results[0].reason is Reason.ERROR
    assert "NOT_FOUND" in results[0].error or "404" in results[0].error
    assert results[1].ok
    assert again[0].ok
    assert len(broker.get_all(queue, 2)) == 2


@pytest.mark.once
def test_a_task_routed_to_an_exchange_without_queue_is_unroutable(broker):
    exchange = broker.declare_exchange(f"test.outbox.celery.x.{uuid.uuid4().hex[:8]}")
    app = make_app(
        broker.url,
        task_queue(broker),
        task_routes={TASK: {"exchange": exchange, "routing_key": "nobody"}},
    )
    with backend_for(broker, app, tasks={"ORDER_CREATED": TASK}) as backend:
        results = backend.publish(wire_rows(2))
    assert [r.reason for r in results] == [Reason.UNROUTABLE, Reason.UNROUTABLE]


@pytest.mark.once
def test_unreachable_broker_raises_broker_unavailable_with_a_masked_url(broker):
    proxy, url = TcpProxy.for_url(broker.url.replace("guest:guest", "guest:s3cret-pw"))
    proxy.refuse()
    try:
        backend = backend_for(broker, make_app(url, task_queue(broker)), connect_timeout=2)
        with pytest.raises(BrokerUnavailable) as info:
            backend.publish(wire_rows(1))
        assert "s3cret-pw" not in str(info.value)
    finally:
        proxy.close()


@pytest.mark.once
def test_a_connection_cut_under_a_batch_is_connection_lost_and_the_next_reconnects(broker):
    queue = broker.declare_queue("ORDER_CREATED")
    proxy, url = TcpProxy.for_url(broker.url)
    try:
        backend = backend_for(broker, make_app(url, task_queue(broker)))
        assert all(r.ok for r in backend.publish(wire_rows(2)))
        proxy.cut()  # while idle: noticed before the next batch is written
        assert all(r.ok for r in backend.publish(wire_rows(2, start=3)))
        proxy.pause()  # written, never confirmed
        backend.send(wire_rows(3, start=5))
        proxy.cut()
        results = backend.wait()
        assert {r.reason for r in results} == {Reason.CONNECTION_LOST}
        assert all(r.reason.is_connection_level for r in results)  # type: ignore[union-attr]
        proxy.resume()
        backend.close()  # what the relay does after an outage
        assert all(r.ok for r in backend.publish(wire_rows(2, start=8)))
        backend.close()
    finally:
        proxy.close()
    # The cut batch reached the broker or not: either way nothing confirmed is missing.
    assert len(broker.get_all(queue, 6)) >= 6


@pytest.mark.once
def test_several_broker_urls_fail_over_as_the_pika_backend_does(broker):
    """What docs/celery.md says: the app's URLs (``;`` between them, or a list) are the
    nodes; the backend connects to the first that answers from the current one on, and
    next_node() moves on after a lost connection, as PikaBackend does with
    OUTBOX_BROKER_URL."""
    queue = broker.declare_queue("ORDER_CREATED")
    node_a, url_a = TcpProxy.for_url(broker.url)
    node_b, url_b = TcpProxy.for_url(broker.url)
    try:
        node_a.refuse()
        backend = backend_for(broker, make_app(f"{url_a};{url_b}", task_queue(broker)))
        assert all(r.ok for r in backend.publish(wire_rows(2)))  # through B
        node_a.allow()
        node_b.pause()
        backend.send(wire_rows(1, start=2))
        node_b.refuse()
        node_b.cut()
        assert {r.reason for r in backend.wait()} == {Reason.CONNECTION_LOST}
        # A was refused and B lost since the relay last paused: pause before the next round.
        assert backend.next_node() is False
        backend.close()  # what the relay does after an outage
        assert all(r.ok for r in backend.publish(wire_rows(2, start=3)))  # through A
        backend.close()
    finally:
        node_a.close()
        node_b.close()
    assert len(broker.get_all(queue, 4)) >= 4


@pytest.mark.once
def test_the_nodes_are_the_apps_broker_urls_read_as_kombu_reads_them():
    app = Celery("nodes", broker="pyamqp://u:p%40w@rabbit-1//;amqp://rabbit-2:5673/vh")
    app.conf.broker_login_method = "PLAIN"
    backend = CeleryBackend(app=app)
    with pytest.raises(BrokerUnavailable) as info:  # no such hosts
        backend.open()
    assert "the Celery app's broker_url" in str(info.value)
    assert "p@w" not in str(info.value) and "p%40w" not in str(info.value)
    assert backend.nodes.urls == ["pyamqp://u:p%40w@rabbit-1//", "amqp://rabbit-2:5673/vh"]
    backend.nodes._index = 0
    first = backend._node_parameters()
    assert (first.host, first.port, first.virtual_host) == ("rabbit-1", 5672, "/")
    assert (first.credentials.username, first.credentials.password) == ("u", "p@w")
    assert first.ssl_options is None
    backend.nodes._index = 1
    second = backend._node_parameters()
    assert (second.host, second.port, second.virtual_host) == ("rabbit-2", 5673, "vh")
    assert (second.credentials.username, second.credentials.password) == ("guest", "guest")
    with pytest.raises(TypeError, match="takes no broker_url"):
        CeleryBackend(app=app, broker_url="amqp://elsewhere/")


@pytest.mark.once
def test_broker_use_ssl_becomes_a_verifying_tls_context():
    app = Celery("tls", broker="amqp://u:p@rabbit:5671//", set_as_current=False)
    app.conf.broker_use_ssl = True
    params = CeleryBackend(app=app)
    params.nodes = BrokerNodes(["amqp://u:p@rabbit:5671//"])
    options = params._node_parameters().ssl_options
    assert options is not None and options.server_hostname == "rabbit"
    assert options.context.verify_mode == ssl.CERT_REQUIRED and options.context.check_hostname
    app.conf.broker_use_ssl = {"cert_reqs": ssl.CERT_NONE, "server_hostname": "rabbit.internal"}
    options = params._node_parameters().ssl_options
    assert options is not None and options.server_hostname == "rabbit.internal"
    assert options.context.verify_mode == ssl.CERT_NONE


@pytest.mark.once
def test_no_confirm_is_a_timeout_and_a_late_one_is_not_taken_for_the_next(broker):
    broker.declare_queue("ORDER_CREATED")
    proxy, url = TcpProxy.for_url(broker.url)
    try:
        backend = backend_for(broker, make_app(url, task_queue(broker)), confirm_timeout=1)
        assert all(r.ok for r in backend.publish(wire_rows(1)))
        proxy.pause()
        results = backend.publish(wire_rows(3, start=2))
        proxy.resume()
        assert [r.reason for r in results] == [Reason.TIMEOUT] * 3
        # The late confirms of the timed-out messages match no batch in flight: delivery
        # tags, not "the message being waited for", decide.
        assert all(r.ok for r in backend.publish(wire_rows(2, start=5)))
        backend.close()
    finally:
        proxy.close()


@pytest.mark.once
def test_a_task_queue_whose_declaration_gets_no_answer_is_a_timeout_once(broker):
    """The rest of the batch is not sent: a broker that stopped answering costs one
    confirm_timeout, not one per event."""
    proxy, url = TcpProxy.for_url(broker.url)
    try:
        backend = backend_for(
            broker,
            make_app(url, task_queue(broker)),
            confirm_timeout=1,
            connect_timeout=1,
            tasks={"ORDER_CREATED": TASK},
        )
        backend.open()
        proxy.pause()  # the task's queue is declared before its first message
        results: list = []
        publishing = threading.Thread(
            target=lambda: results.extend(backend.publish(wire_rows(3))), daemon=True
        )
        publishing.start()
        publishing.join(20)
        assert not publishing.is_alive()
        assert results[0].reason in (Reason.TIMEOUT, Reason.CONNECTION_LOST)
        assert "declar" in results[0].error
        assert [r.reason for r in results[1:]] == [Reason.CONNECTION_LOST] * 2
        backend.close()
    finally:
        proxy.resume()
        proxy.close()


@pytest.mark.once
def test_close_does_not_hang_on_a_broker_that_stopped_answering(broker):
    broker.declare_queue("ORDER_CREATED")
    proxy, url = TcpProxy.for_url(broker.url)
    try:
        backend = backend_for(broker, make_app(url, task_queue(broker)))
        assert all(r.ok for r in backend.publish(wire_rows(1)))
        proxy.pause()
        closing = threading.Thread(target=backend.close, daemon=True)
        closing.start()
        closing.join(CLOSE_TIMEOUT + 10)
        assert not closing.is_alive()
    finally:
        proxy.resume()
        proxy.close()


@pytest.mark.once
def test_checks_reject_a_broker_without_confirms_and_a_bad_app_path(settings):
    settings.OUTBOX_BACKEND = "django_outbox.backends.celery.CeleryBackend"
    settings.OUTBOX_CELERY_APP = "tests.test_backend_celery.REDIS_APP"
    errors = CeleryBackend.check()
    assert [e.id for e in errors] == [Codes.CELERY_NO_CONFIRMS] == ["django_outbox.E013"]
    assert "'redis' transport" in errors[0].msg
    settings.OUTBOX_CELERY_APP = "tests.nowhere.app"
    errors = CeleryBackend.check()
    assert [e.id for e in errors] == [Codes.CELERY_APP] == ["django_outbox.E015"]
    assert "cannot be loaded" in errors[0].msg
    settings.OUTBOX_CELERY_APP = "tests.test_backend_celery.AMQP_APP"
    assert CeleryBackend.check() == []
    settings.OUTBOX_CELERY_APP = "tests.test_backend_celery.FAILOVER_APP"
    assert CeleryBackend.check() == []
    with pytest.raises(BrokerUnavailable, match="no publisher confirms"):
        CeleryBackend(app=REDIS_APP).open()


REDIS_APP = Celery("redis-app", broker="redis://127.0.0.1:6379/0", set_as_current=False)
AMQP_APP = Celery("amqp-app", broker="amqp://guest@127.0.0.1//", set_as_current=False)
FAILOVER_APP = Celery(
    "failover-app", broker="pyamqp://rabbit-1//;pyamqp://rabbit-2//", set_as_current=False
)


@pytest.mark.django_db
def test_relay_keeps_nacked_and_unroutable_rows_pending_with_one_more_attempt(broker, settings):
    broker.declare_queue("ORDER_CREATED")
    broker.declare_queue("FULL", arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    queue = task_queue(broker)
    settings.OUTBOX_BACKEND = "django_outbox.backends.celery.CeleryBackend"
    settings.OUTBOX_BACKEND_OPTIONS = {
        "app": make_app(broker.url, queue),
        "exchange": broker.exchange,
        "tasks": {"TASKED": TASK},
        "confirm_timeout": 5,
    }
    make_events(
        {"event_type": "NOBODY_LISTENS"},
        {"event_type": "FULL"},
        {"event_type": "ORDER_CREATED"},
        {"event_type": "TASKED"},
    )
    relay = Relay(backend=get_backend())
    try:
        result = relay.drain()
    finally:
        relay.close()
    assert (result.sent, result.failed) == (2, 2)
    by_type = {row.event_type: row for row in OutboxEvent.objects.all()}
    for event_type, reason in (("NOBODY_LISTENS", "unroutable"), ("FULL", "nacked")):
        row = by_type[event_type]
        assert row.status == Status.PENDING
        assert row.retry_count == 1
        assert row.last_error.startswith(f"[{reason}]")
    assert by_type["ORDER_CREATED"].status == Status.SENT
    assert by_type["TASKED"].status == Status.SENT
