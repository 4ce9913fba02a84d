"""PikaBackend against the real RabbitMQ: confirms, returns, nacks, timeouts, lost connections.

Every test declares its own uniquely named exchange and queues and deletes them afterwards;
outages are made with tests.utils.proxy.TcpProxy, never by touching the shared broker.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import pika
import pytest
from django.core import checks
from django.test import override_settings

from django_outbox.backends import get_backend
from django_outbox.backends.base import BrokerUnavailable, Reason
from django_outbox.backends.pika import FLUSH_EVERY, PikaBackend, mask_url
from django_outbox.checks import Codes, publishing
from django_outbox.models import OutboxEvent
from tests.utils.amqp import Broker
from tests.utils.proxy import TcpProxy, closed_port
from tests.utils.rows import OCCURRED, wire_rows

pytestmark = pytest.mark.amqp


def backend_for(broker: Broker, url: str | None = None, **options: object) -> PikaBackend:
    return PikaBackend(broker_url=url or broker.url, exchange=broker.exchange, **options)


@contextlib.contextmanager
def through_proxy(
    broker: Broker, proxied: tuple[TcpProxy, str], confirm_timeout: float = 10
) -> Iterator[tuple[TcpProxy, str, PikaBackend]]:
    """An open backend whose connection goes through the proxy, and a queue bound to all."""
    proxy, url = proxied
    queue = broker.declare_queue("#")
    backend = backend_for(broker, url, confirm_timeout=confirm_timeout)
    try:
        backend.open()
        yield proxy, queue, backend
    finally:
        backend.close()


def test_messages_arrive_with_properties_body_and_headers(broker: Broker) -> None:
    queue = broker.declare_queue("ORDER_CREATED")
    rows = wire_rows(3)
    with backend_for(broker) as backend:
        results = backend.publish(rows)
    assert [r.ok for r in results] == [True, True, True]
    messages = broker.get_all(queue, 3)
    assert len(messages) == 3
    for row, (method, props, body) in zip(rows, messages, strict=True):
        assert method.exchange == broker.exchange
        assert method.routing_key == "ORDER_CREATED"
        assert props.message_id == row.event_id
        assert props.type == "ORDER_CREATED"
        assert props.content_type == "application/json"
        assert props.delivery_mode == 2
        assert props.timestamp == int(OCCURRED.timestamp())
        assert props.headers == {
            "trace_id": f"t-{row.pk}",
            "aggregate_type": "orders.Order",
            "aggregate_id": f"A-{row.pk}",
            "occurred_at": "2026-05-17T08:30:15.123456+00:00",
            "attempt": 1,
            "sequence": row.pk,
        }
        assert body == f'{{"order_id":{row.pk},"total":"12.50","note":"über"}}'.encode()


def test_declares_a_durable_exchange_and_uses_routing_keys(broker: Broker) -> None:
    rows = wire_rows(1)
    backend = backend_for(broker, routing_keys={"ORDER_CREATED": "orders.created"})
    backend.open()  # declares the exchange: the queue can be bound to it now
    try:
        queue = broker.declare_queue(None)  # bound by hand: the broker must not declare it
        broker.channel.queue_bind(queue, broker.exchange, routing_key="orders.created")
        assert backend.publish(rows)[0].ok
    finally:
        backend.close()
    [(method, _, _)] = broker.get_all(queue, 1)
    assert method.routing_key == "orders.created"
    # Declaring it again as durable topic succeeds only if that is what the backend made.
    broker.channel.exchange_declare(broker.exchange, exchange_type="topic", durable=True)


def test_unroutable_is_a_failure_even_though_the_broker_acks_it(broker: Broker) -> None:
    queue = broker.declare_queue("ORDER_CREATED")  # ORDER_PAID has no binding
    rows = wire_rows(2) + wire_rows(2, event_type="ORDER_PAID", start=10) + wire_rows(1, start=20)
    with backend_for(broker) as backend:
        results = backend.publish(rows)
    assert [r.ok for r in results] == [True, True, False, False, True]
    assert {results[2].reason, results[3].reason} == {Reason.UNROUTABLE}
    assert "312 NO_ROUTE" in results[2].error
    assert len(broker.get_all(queue, 3)) == 3


def test_a_batch_reaches_the_socket_in_a_few_writes(broker: Broker, monkeypatch) -> None:
    """pika writes each frame on its own, three per message; the backend hands the
    transport one write per flush point instead (a system call each)."""
    queue = broker.declare_queue("#")
    rows = wire_rows(200)
    backend = backend_for(broker)
    backend.open()
    try:
        transport = backend._connection._transport
        write = transport.write
        sizes: list[int] = []

        def counting(data: bytes) -> None:
            sizes.append(len(data))
            write(data)

        monkeypatch.setattr(transport, "write", counting)
        results = backend.publish(rows)
    finally:
        backend.close()
    assert [r.ok for r in results] == [True] * 200
    assert len(broker.get_all(queue, 200)) == 200
    assert len(sizes) <= 200 // FLUSH_EVERY + 2  # + the channel close at the end
    assert sum(sizes) > 200 * 100  # the messages themselves went through these writes


def test_batches_in_flight_together_are_collected_in_order(broker: Broker) -> None:
    """The relay writes batch 2 before it waits for batch 1: confirms (``multiple``
    included) and returns are matched to the right batch."""
    queue = broker.declare_queue("ORDER_CREATED")  # ORDER_PAID has no binding
    first = wire_rows(300)
    second = wire_rows(2, start=1000) + wire_rows(1, event_type="ORDER_PAID", start=2000)
    third = wire_rows(50, start=3000)
    with backend_for(broker) as backend:
        backend.send(first)
        backend.send(second)
        got_first = backend.wait()
        backend.send(third)
        got_second, got_third = backend.wait(), backend.wait()
        assert backend.wait() == []
    assert [r.ok for r in got_first] == [True] * 300
    assert [r.ok for r in got_second] == [True, True, False]
    assert got_second[2].reason is Reason.UNROUTABLE
    assert [r.ok for r in got_third] == [True] * 50
    assert len(broker.get_all(queue, 352)) == 352


def test_connection_lost_under_two_batches_fails_both_and_the_next_send_reconnects(
    broker: Broker, proxied
) -> None:
    with through_proxy(broker, proxied) as (proxy, queue, backend):
        proxy.pause()  # written, never confirmed
        backend.send(wire_rows(20))
        backend.send(wire_rows(20, start=100))
        proxy.cut()
        results = backend.wait() + backend.wait()
        assert {r.reason for r in results} == {Reason.CONNECTION_LOST}
        proxy.resume()
        backend.send(wire_rows(3, start=500))
        assert [r.ok for r in backend.wait()] == [True] * 3
    assert len(broker.get_all(queue, 3, timeout=2)) >= 3


def test_nack_from_a_full_reject_publish_queue(broker: Broker) -> None:
    broker.declare_queue("#", arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    with backend_for(broker) as backend:
        results = backend.publish(wire_rows(3))
    assert [r.reason for r in results] == [Reason.NACKED] * 3
    assert all(not r.ok for r in results)


def test_serialisation_failure_only_fails_that_row(broker: Broker) -> None:
    queue = broker.declare_queue("#")
    rows = wire_rows(3)
    rows[1].payload = {"bad": object()}
    with backend_for(broker) as backend:
        results = backend.publish(rows)
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].reason is Reason.SERIALISATION
    assert len(broker.get_all(queue, 2)) == 2


def test_headers_amqp_cannot_encode_fail_only_that_row(broker: Broker) -> None:
    """JSON accepts a float or a 2**64 header, a routing map a 300-byte key; AMQP does
    not, and pika raises while building the frame. That is the message's fault, not the
    connection's: the row fails as SERIALISATION, the rest of the batch goes out and the
    delivery tags stay in step."""
    queue = broker.declare_queue("#")
    rows = wire_rows(6)
    rows[1].headers = {"schema_version": 1.5}
    rows[3].headers = {"big": 2**64}
    rows[4].event_type = "LONG"  # routed to a key longer than AMQP's 255 bytes
    with backend_for(broker, routing_keys={"LONG": "k" * 300}) as backend:
        results = backend.publish(rows)
        assert [r.ok for r in results] == [True, False, True, False, False, True]
        assert {results[i].reason for i in (1, 3, 4)} == {Reason.SERIALISATION}
        assert "type float" in results[1].error
        more = backend.publish(wire_rows(3, start=10))
    assert [r.ok for r in more] == [True, True, True]
    assert len(broker.get_all(queue, 6)) == 6


def test_timeout_when_the_broker_stops_answering(broker: Broker, proxied) -> None:
    proxy, url = proxied
    queue = broker.declare_queue("#")
    backend = backend_for(broker, url, confirm_timeout=0.5)
    try:
        backend.open()
        proxy.pause()  # the broker gets the messages, its confirms never come back
        results = backend.publish(wire_rows(5))
        assert [r.reason for r in results] == [Reason.TIMEOUT] * 5
        assert "OUTBOX_CONFIRM_TIMEOUT" in results[0].error
        proxy.resume()
        # The late confirms of the first batch must not settle the second one.
        later = backend.publish(wire_rows(3, start=100))
        assert [r.ok for r in later] == [True, True, True]
    finally:
        backend.close()
    assert len(broker.get_all(queue, 8)) == 8  # timed out does not mean not delivered


def test_a_batch_sent_after_the_loss_is_lost_too_until_every_batch_is_collected(
    broker: Broker, proxied
) -> None:
    """The connection goes away after two batches were confirmed and before they are
    collected. A batch sent then fails as connection lost, and so does one sent after the
    first was collected: nothing is written to a dead channel (it once raised an
    AssertionError, counted as an attempt against the rows), and once every batch is
    collected the next send connects again."""
    with through_proxy(broker, proxied) as (proxy, queue, backend):
        backend.send(wire_rows(20))
        backend.send(wire_rows(20, start=100))
        backend._poll()  # one turn of the I/O loop writes them out, before any confirm is back
        time.sleep(0.3)  # both confirmed: the confirms wait, unread, in the socket
        proxy.refuse()
        proxy.cut()
        first = backend.wait()  # reads the confirms, then the loss
        backend.send(wire_rows(5, start=200))
        second = backend.wait()
        backend.send(wire_rows(5, start=300))
        third, fourth = backend.wait(), backend.wait()
        assert [r.ok for r in first + second] == [True] * 40
        assert {r.reason for r in third + fourth} == {Reason.CONNECTION_LOST}
        proxy.allow()
        backend.send(wire_rows(3, start=500))
        assert [r.ok for r in backend.wait()] == [True] * 3
    assert len(broker.get_all(queue, 43, timeout=2)) >= 43


def test_connection_cut_mid_batch_keeps_the_confirmed_and_reconnects(
    broker: Broker, proxied
) -> None:
    with through_proxy(broker, proxied) as (proxy, queue, backend):
        # Only about the first ten messages reach the broker; the rest wait in the proxy.
        proxy.hold_upstream_after(10 * 400)
        seen = proxy.downstream_bytes

        def cut_once_confirms_came_back() -> None:
            deadline = time.monotonic() + 10
            while proxy.downstream_bytes == seen and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # let the confirms of what got through arrive
            proxy.refuse()
            proxy.cut()

        cutter = threading.Thread(target=cut_once_confirms_came_back)
        cutter.start()
        results = backend.publish(wire_rows(200))
        cutter.join()
        oks = [r.ok for r in results]
        confirmed = oks.index(False)
        assert confirmed >= 1
        assert all(oks[:confirmed]) and not any(oks[confirmed:])
        assert {r.reason for r in results[confirmed:]} == {Reason.CONNECTION_LOST}
        assert Reason.CONNECTION_LOST.is_connection_level

        # While the broker cannot be reached, publish fails fast and sends nothing.
        proxy.resume()
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="cannot connect to RabbitMQ"):
            backend.publish(wire_rows(1, start=500))
        assert time.monotonic() - started < 5

        proxy.allow()
        again = backend.publish(wire_rows(4, start=1000))
        assert [r.ok for r in again] == [True] * 4
    delivered = len(broker.get_all(queue, confirmed + 4, timeout=2))
    assert delivered >= confirmed + 4


def test_unreachable_broker_raises_quickly_with_a_masked_url(amqp_url: str) -> None:
    url = f"amqp://app:s3cret@127.0.0.1:{closed_port()}/%2F"
    backend = PikaBackend(broker_url=url, exchange="never.declared", connect_timeout=3)
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as info:
        backend.publish(wire_rows(2))
    assert time.monotonic() - started < 3
    assert "s3cret" not in str(info.value)
    assert "amqp://app:***@127.0.0.1" in str(info.value)
    with pytest.raises(BrokerUnavailable):
        backend.open()
    backend.close()
    backend.close()  # safe twice


def test_passive_declare_of_a_missing_exchange_says_how_to_fix(broker: Broker) -> None:
    backend = backend_for(broker, exchange_passive=True)
    with pytest.raises(BrokerUnavailable, match="OUTBOX_EXCHANGE_PASSIVE = False"):
        backend.open()
    backend.close()
    broker.declare_exchange()
    queue = broker.declare_queue("#")
    with backend_for(broker, exchange_passive=True) as backend:
        assert backend.publish(wire_rows(1))[0].ok
    assert len(broker.get_all(queue, 1)) == 1


def test_channel_error_is_connection_lost_and_the_next_publish_reopens(broker: Broker) -> None:
    queue = broker.declare_queue("#")
    with backend_for(broker) as backend:
        assert backend.publish(wire_rows(1))[0].ok
        broker.channel.exchange_delete(broker.exchange)  # publishing now closes the channel
        results = backend.publish(wire_rows(2, start=10))
        assert [r.reason for r in results] == [Reason.CONNECTION_LOST] * 2
        broker.channel.queue_bind(queue, broker.declare_exchange(), routing_key="#")
        assert backend.publish(wire_rows(2, start=20))[0].ok


def test_reconnects_after_the_broker_closed_an_idle_connection(broker: Broker, proxied) -> None:
    proxy, url = proxied
    queue = broker.declare_queue("#")
    with backend_for(broker, url) as backend:
        assert backend.publish(wire_rows(1))[0].ok
        proxy.cut()  # while idle: noticed before the next batch is written
        assert [r.ok for r in backend.publish(wire_rows(3, start=10))] == [True] * 3
    assert len(broker.get_all(queue, 4)) == 4


def test_empty_batch_needs_no_broker() -> None:
    assert PikaBackend(broker_url="amqp://127.0.0.1:1/").publish([]) == []


def test_options_and_settings(amqp_url: str) -> None:
    with override_settings(
        OUTBOX_BROKER_URL="amqp://u:p@h:5672/v",
        OUTBOX_EXCHANGE="events",
        OUTBOX_EXCHANGE_TYPE="direct",
        OUTBOX_EXCHANGE_PASSIVE=True,
        OUTBOX_CONFIRM_TIMEOUT=3,
        OUTBOX_CONNECT_TIMEOUT=4,
        OUTBOX_BACKEND="django_outbox.backends.pika.PikaBackend",
        OUTBOX_BACKEND_OPTIONS={"confirm_timeout": 7},
    ):
        backend = get_backend()
    assert isinstance(backend, PikaBackend)
    assert (backend.broker_url, backend.exchange, backend.exchange_type) == (
        "amqp://u:p@h:5672/v",
        "events",
        "direct",
    )
    assert backend.exchange_passive is True
    assert (backend.confirm_timeout, backend.connect_timeout) == (7.0, 4.0)
    assert "p@" not in repr(backend)
    with pytest.raises(TypeError, match="unknown options"):
        PikaBackend(broker_url=amqp_url, heartbeat=5)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://guest:hunter2@rabbit:5672/", "not an amqp"),
        ("redis://127.0.0.1:6379/0", "not an amqp"),
    ],
)
def test_check_reports_a_bad_broker_url(url: str, problem: str) -> None:
    with override_settings(OUTBOX_BROKER_URL=url, OUTBOX_BACKEND_OPTIONS={}):
        [error] = PikaBackend.check()
    assert error.id == Codes.BROKER_URL == "django_outbox.E005"
    assert problem in error.msg
    assert "hunter2" not in error.msg
    assert "amqp://user:password@rabbitmq:5672/%2F" in error.hint


def test_an_empty_broker_url_is_an_error_only_for_the_commands_that_publish() -> None:
    """Issue 28, item 6: migrate, makemigrations or shell need no broker (W005); the
    commands that publish run their checks in publishing() and get E005."""
    with override_settings(OUTBOX_BROKER_URL="", OUTBOX_BACKEND_OPTIONS={}):
        [warning] = PikaBackend.check()
        with publishing():
            [error] = PikaBackend.check()
    assert (warning.level, warning.id) == (checks.WARNING, "django_outbox.W005")
    assert (error.level, error.id) == (checks.ERROR, "django_outbox.E005")
    assert warning.msg == error.msg and warning.hint == error.hint
    assert "django_outbox.backends.console.ConsoleBackend" in error.hint
    assert "django_outbox.backends.locmem.LocmemBackend" in error.hint


def test_an_empty_broker_url_gets_the_same_message_from_the_check_relay_and_consumer() -> None:
    from django_outbox.consumer import Consumer, ImproperlyConfiguredConsumer

    with override_settings(OUTBOX_BROKER_URL="", OUTBOX_BACKEND_OPTIONS={}):
        [error] = PikaBackend.check()
        with pytest.raises(BrokerUnavailable) as relay:
            PikaBackend().open()
        with pytest.raises(ImproperlyConfiguredConsumer) as consumer:
            Consumer(handlers=[])
    said = f"{error.msg} {error.hint}"
    assert "OUTBOX_BROKER_URL is empty" in said
    assert str(relay.value) == str(consumer.value) == said


@pytest.mark.parametrize(
    "url", ["amqp://guest:guest@127.0.0.1:5672/%2F", "amqps://u:p@rabbit.example:5671/prod"]
)
def test_check_accepts_amqp_urls(url: str) -> None:
    with override_settings(OUTBOX_BROKER_URL=url, OUTBOX_BACKEND_OPTIONS={}):
        assert PikaBackend.check() == []


def test_check_prefers_the_backend_option() -> None:
    with override_settings(
        OUTBOX_BROKER_URL="", OUTBOX_BACKEND_OPTIONS={"broker_url": "amqp://rabbit/"}
    ):
        assert PikaBackend.check() == []


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/%2F", "amqp://guest:***@127.0.0.1:5672/%2F"),
        (
            "amqps://app:p%40ss@rabbit:5671/prod?heartbeat=30",
            "amqps://app:***@rabbit:5671/prod?heartbeat=30",
        ),
        ("amqp://rabbit/", "amqp://rabbit/"),
        ("amqp://user@rabbit/", "amqp://user@rabbit/"),
        ("postgres://u:pw@db/app", "postgres://u:***@db/app"),
        ("amqp://u:pw@rabbit:notaport/", "amqp://u:***@rabbit:notaport/"),
        ("", ""),
        # A password with an unescaped "/", "?" or "#": the host part ends inside it, and
        # pika tries a host (and port, vhost) read from the password, shown masked.
        ("amqp://u:2024/pw@h:5672/v", "amqp://u:***@***"),
        ("amqp://u:p?w#x@h/v", "amqp://u:***@***"),
        ("amqp://adv2_u:Se;Cr@t/x:y%z@127.0.0.1:5672/adv2", "amqp://adv2_u:***@***"),
        # An unescaped "@" in the password is read as every URL parser reads it.
        ("amqp://u:p@ss@h:5672/v", "amqp://u:***@h:5672/v"),
        ("u:pw@host:5672", "u:***@host:5672"),  # no scheme
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


@pytest.mark.django_db(transaction=True)
def test_relay_marks_rows_sent_only_when_confirmed(broker: Broker) -> None:
    from django_outbox import outbox
    from django_outbox.models import Status
    from django_outbox.relay import Relay

    queue = broker.declare_queue("ORDER_CREATED")  # ORDER_PAID is unroutable
    with outbox.atomic() as box:
        for n in range(3):
            box.emit(
                "ORDER_CREATED", aggregate_type="orders.Order", aggregate_id=n, payload={"n": n}
            )
        box.emit("ORDER_PAID", aggregate_type="orders.Order", aggregate_id=9, payload={"n": 9})
    relay = Relay(backend=backend_for(broker), batch_size=10)
    try:
        result = relay.relay_batch()
    finally:
        relay.close()
    assert result.found == 4
    statuses = dict(OutboxEvent.objects.values_list("event_type", "status").distinct())
    assert statuses == {"ORDER_CREATED": Status.SENT, "ORDER_PAID": Status.PENDING}
    paid = OutboxEvent.objects.get(event_type="ORDER_PAID")
    assert paid.retry_count == 1 and "[unroutable]" in paid.last_error
    assert len(broker.get_all(queue, 3)) == 3


# -- several broker nodes ------------------------------------------------------------------
def _node(broker: Broker) -> tuple[TcpProxy, str]:
    """A loopback proxy in front of the broker, standing for one node of a cluster."""
    proxy, url = TcpProxy.for_url(broker.url)
    return proxy, url


def test_connects_to_the_first_node_that_answers_and_names_it(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"amqp://app:s3cret@127.0.0.1:{closed_port()}/%2F"
    queue = broker.declare_queue("#")
    caplog.set_level("INFO", logger="django_outbox")
    # kombu's form: one string, ";" between the URLs.
    with backend_for(broker, f"{dead};{broker.url}") as backend:
        assert [r.ok for r in backend.publish(wire_rows(2))] == [True, True]
        assert backend.masked_url == mask_url(broker.url)
    assert len(broker.get_all(queue, 2)) == 2
    text = caplog.text
    assert "s3cret" not in text
    assert "cannot connect to RabbitMQ at amqp://app:***@127.0.0.1:" in text
    assert f"trying the next node, {mask_url(broker.url)} (node 2 of 2)" in text
    assert f"connected to {mask_url(broker.url)} (node 2 of 2)" in text


def test_no_node_answering_names_each_and_pauses(broker: Broker) -> None:
    urls = [f"amqp://app:s3cret@127.0.0.1:{closed_port()}/%2F" for _ in range(2)]
    backend = backend_for(broker, urls, connect_timeout=3)
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as info:
        backend.open()
    assert time.monotonic() - started < 3
    said = str(info.value)
    assert "cannot connect to any RabbitMQ node of OUTBOX_BROKER_URL" in said
    assert said.count("amqp://app:***@127.0.0.1:") == 2
    assert "s3cret" not in said
    # Every node failed in this round: the relay pauses instead of trying again at once.
    assert backend.next_node() is False
    backend.close()


def test_a_lost_node_is_left_for_the_next_once_its_batch_is_settled(broker: Broker) -> None:
    """Node A is cut with a batch in flight: its rows are CONNECTION_LOST (released by the
    relay); next_node() moves on at once and the next batch goes through node B.
    When B is lost too, every node has failed: next_node() says to pause, and the round
    after the pause starts again at A."""
    queue = broker.declare_queue("#")
    node_a, url_a = _node(broker)
    node_b, url_b = _node(broker)
    backend = backend_for(broker, [url_a, url_b])
    try:
        backend.open()
        assert backend.masked_url == mask_url(url_a)
        node_a.pause()  # A's confirms are held back: the batch is in flight when A dies
        backend.send(wire_rows(30))
        node_a.refuse()
        node_a.cut()
        results = backend.wait()
        assert {r.reason for r in results} == {Reason.CONNECTION_LOST}
        assert backend.next_node() is True
        backend.close()
        before = node_b.downstream_bytes
        again = backend.publish(wire_rows(4, start=1000))
        assert [r.ok for r in again] == [True] * 4
        assert backend.masked_url == mask_url(url_b)
        assert node_b.downstream_bytes > before
        node_a.resume()
        node_a.allow()
        node_b.refuse()
        node_b.cut()
        # B is gone too, and A has failed in this round already: no node is left to try.
        with pytest.raises(BrokerUnavailable, match=r"127\.0\.0\.1:\d+/%2F \(node 2 of 2\)"):
            backend.publish(wire_rows(1, start=2000))
        assert backend.next_node() is False  # pause first
        backend.close()
        assert [r.ok for r in backend.publish(wire_rows(2, start=3000))] == [True, True]
        assert backend.masked_url == mask_url(url_a)
    finally:
        backend.close()
        node_a.close()
        node_b.close()
    # The 30 may have reached the queue before A died (they would be published again).
    assert len(broker.get_all(queue, 36, timeout=3)) >= 6


def test_check_validates_every_url() -> None:
    good = "amqp://u:p@rabbit-1:5672/%2F"
    with override_settings(
        OUTBOX_BROKER_URL=[good, "http://u:hunter2@rabbit-2/", "amqp://u:p@rabbit-3:5672/%2F"],
        OUTBOX_BACKEND_OPTIONS={},
    ):
        [error] = PikaBackend.check()
    assert error.id == Codes.BROKER_URL
    assert "entry 2 of 3, 'http://u:***@rabbit-2/', is not an amqp" in error.msg
    for value in (f"{good};amqp://u:p@rabbit-2:5672/%2F", [good, "amqp://u:p@rabbit-2/"]):
        with override_settings(OUTBOX_BROKER_URL=value, OUTBOX_BACKEND_OPTIONS={}):
            assert PikaBackend.check() == []  # amqp://host/ is the vhost "/" as well


@pytest.mark.parametrize("value", [5, None, ["amqp://rabbit-1/", 5]])
def test_check_reports_a_broker_url_of_another_type(value: object) -> None:
    with override_settings(OUTBOX_BROKER_URL=value, OUTBOX_BACKEND_OPTIONS={}):
        [error] = PikaBackend.check()
    assert error.id == Codes.BROKER_URL_FORM == "django_outbox.E016"
    assert "a list of AMQP URLs" in error.msg
    assert "amqp://user:password@rabbit-1:5672/%2F" in error.hint


UNENCODED = "amqp://adv2_u:Se;Cr@t/x:y%z@127.0.0.1:5672/adv2"  # password Se;Cr@t/x:y%z


@pytest.mark.parametrize(
    "url",
    [UNENCODED, "amqp://u:2024/pw@rabbit:5672/%2F", "amqp://u:p?w#x@rabbit/%2F"],
)
def test_check_reports_a_password_that_is_not_percent_encoded(url: str) -> None:
    """pika connects to host 't', vhost 'x:y%z@127.0.0.1:5672' for the first URL (the check
    passed before, and the logs named 127.0.0.1); E026 says to percent-encode, and no check
    message holds a piece of the password."""
    with override_settings(OUTBOX_BROKER_URL=url, OUTBOX_BACKEND_OPTIONS={}):
        [error] = PikaBackend.check()
    assert error.id == Codes.BROKER_URL_ENCODING == "django_outbox.E026"
    assert "read from its password" in error.msg
    assert "quote(password, safe='')" in error.hint
    password = url.split("://")[1].split(":", 1)[1].rpartition("@")[0]
    assert_no_piece_of(password, f"{error.msg} {error.hint}")


def test_an_unencoded_password_leaks_into_no_message_of_a_list_of_urls() -> None:
    """With two URLs, E017 printed ('x:y%z@127.0.0.1:5672', 'adv2'): the vhost pika read."""
    good = "amqp://adv2_u:pw@127.0.0.1:5672/adv2"
    with override_settings(OUTBOX_BROKER_URL=[UNENCODED, good], OUTBOX_BACKEND_OPTIONS={}):
        errors = PikaBackend.check()
    assert [e.id for e in errors] == [Codes.BROKER_URL_ENCODING]
    assert "entry 1 of 2, 'amqp://adv2_u:***@***'," in errors[0].msg
    assert_no_piece_of("Se;Cr@t/x:y%z", " ".join(f"{e.msg} {e.hint}" for e in errors))


def test_a_percent_encoded_password_passes_and_is_what_pika_reads() -> None:
    encoded = "amqp://adv2_u:" + quote("Se;Cr@t/x:y%z", safe="") + "@127.0.0.1:5672/adv2"
    with override_settings(OUTBOX_BROKER_URL=encoded, OUTBOX_BACKEND_OPTIONS={}):
        assert PikaBackend.check() == []
    params = pika.URLParameters(encoded)
    assert (params.host, params.port, params.virtual_host) == ("127.0.0.1", 5672, "adv2")
    assert params.credentials.password == "Se;Cr@t/x:y%z"
    assert mask_url(encoded) == "amqp://adv2_u:***@127.0.0.1:5672/adv2"


def assert_no_piece_of(password: str, text: str) -> None:
    """No run of three characters of ``password`` in ``text``."""
    pieces = {password[i : i + 3] for i in range(len(password) - 2)}
    assert [p for p in pieces if p in text] == [], text


def test_check_reports_urls_that_name_different_vhosts() -> None:
    with override_settings(
        OUTBOX_BROKER_URL="amqp://u:p@rabbit-1/%2F;amqp://u:p@rabbit-2/orders",
        OUTBOX_BACKEND_OPTIONS={},
    ):
        [error] = PikaBackend.check()
    assert error.id == Codes.BROKER_VHOSTS == "django_outbox.E017"
    assert "'/', 'orders'" in error.msg
    assert "same vhost" in error.hint
