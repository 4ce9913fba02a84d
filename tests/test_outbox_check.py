"""manage.py outbox_check against the real RabbitMQ (and its management API): the broker
and the exchange, and for each known event type whether a queue receives it; exit 0/1/2."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_outbox.backends.bindings import matches
from django_outbox.models import Status
from tests.utils.amqp import Broker
from tests.utils.proxy import closed_port
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db

PIKA = "django_outbox.backends.pika.PikaBackend"


def check(**settings: object) -> tuple[int, str]:
    """Run outbox_check; its exit code and what it printed (stdout, then the error)."""
    out = StringIO()
    with override_settings(**settings):
        try:
            call_command("outbox_check", stdout=out)
        except CommandError as exc:
            return exc.returncode, out.getvalue() + f"CommandError: {exc}"
    return 0, out.getvalue()


def on(broker: Broker, management_url: str = "", **settings: object) -> dict[str, object]:
    """Settings for the pika backend on the test's exchange (deleted with the test's)."""
    broker.delete_at_close(exchanges=[broker.exchange])
    options = {"management_url": management_url} if management_url else {}
    return {
        "OUTBOX_BACKEND": PIKA,
        "OUTBOX_BROKER_URL": broker.url,
        "OUTBOX_EXCHANGE": broker.exchange,
        "OUTBOX_BACKEND_OPTIONS": options,
        **settings,
    }


@pytest.mark.amqp
def test_an_event_type_no_queue_receives_is_exit_1_and_named(broker, management_url):
    make_events(
        {"event_type": "ORDER_CREATED"},
        {"event_type": "ORDER_SHIPPED", "status": Status.SENT, "age": 30 * 86400},
    )
    code, said = check(**on(broker, OUTBOX_ROUTING_KEYS={"ORDER_PAID": "orders.paid"}))
    assert code == 1, said
    assert f"broker: exchange {broker.exchange!r} (topic, declared) at amqp://" in said
    assert "  ORDER_CREATED: NO QUEUE BOUND" in said
    assert "  ORDER_PAID (routing key orders.paid): NO QUEUE BOUND" in said
    assert "ORDER_SHIPPED" not in said  # sent a month ago: not a type to check
    assert "2 of 2 event types reach no queue (ORDER_CREATED, ORDER_PAID)" in said
    assert "start the consumer (consume_outbox declares and binds its queue)" in said


@pytest.mark.amqp
def test_every_event_type_reaching_a_queue_is_exit_0(broker, management_url):
    make_events({"event_type": "ORDER_CREATED", "status": Status.DEAD})
    created = broker.declare_queue("ORDER_CREATED")
    paid = broker.declare_queue("*.paid")  # a topic pattern
    # Through another exchange: bound to the outbox's, with a queue bound to it.
    relayed = broker.declare_exchange(f"{broker.exchange}.relayed")
    broker.channel.exchange_bind(relayed, broker.exchange, routing_key="#")
    shipped = broker.declare_queue(None)
    broker.channel.queue_bind(shipped, relayed, routing_key="orders.shipped")
    keys = {"ORDER_PAID": "orders.paid", "ORDER_SHIPPED": "orders.shipped"}
    code, said = check(**on(broker, OUTBOX_ROUTING_KEYS=keys))
    assert code == 0, said
    assert f"  ORDER_CREATED: queue {created!r}\n" in said
    assert f"  ORDER_PAID (routing key orders.paid): queue {paid!r}\n" in said
    assert f"  ORDER_SHIPPED (routing key orders.shipped): queue {shipped!r}\n" in said
    assert "outbox_check: every event type (3) reaches a queue" in said


@pytest.mark.amqp
def test_without_the_management_api_the_routes_are_not_checked_and_it_says_why(broker):
    make_events({"event_type": "ORDER_CREATED"})
    elsewhere = f"http://127.0.0.1:{closed_port()}/"
    code, said = check(**on(broker, elsewhere))
    assert code == 0, said
    assert f"routes not checked: the RabbitMQ management API at {elsewhere} did not answer" in said
    assert "rabbitmq-plugins enable rabbitmq_management" in said
    assert "  ORDER_CREATED\n" in said


@pytest.mark.amqp
def test_a_missing_vhost_is_exit_2_with_the_cause(broker):
    url = broker.url.rsplit("/", 1)[0] + "/no-such-vhost-h4"
    code, said = check(**{**on(broker), "OUTBOX_BROKER_URL": url})
    assert code == 2, said
    assert "the broker is unreachable: cannot connect to RabbitMQ at " in said
    assert "vhost 'no-such-vhost-h4' not found" in said


@pytest.mark.amqp
def test_a_passive_exchange_that_is_missing_is_exit_2(broker):
    code, said = check(**on(broker, OUTBOX_EXCHANGE_PASSIVE=True))
    assert code == 2, said
    assert f"exchange {broker.exchange!r} does not exist" in said


def test_a_backend_that_cannot_tell_says_so():
    make_events({"event_type": "ORDER_CREATED"})
    code, said = check(OUTBOX_BACKEND="django_outbox.backends.locmem.LocmemBackend")
    assert code == 0, said
    assert (
        "routes not checked: LocmemBackend cannot tell which routing keys reach a consumer" in said
    )
    assert "  ORDER_CREATED\n" in said


def test_no_event_type_known_yet():
    code, said = check(OUTBOX_BACKEND="django_outbox.backends.locmem.LocmemBackend")
    assert (code, said.splitlines()[-1]) == (
        0,
        "no event types known yet (none in OUTBOX_ROUTING_KEYS or the table)",
    )


@pytest.mark.once
@pytest.mark.parametrize(
    ("kind", "binding", "key", "reached"),
    [
        ("direct", "ORDER_CREATED", "ORDER_CREATED", True),
        ("direct", "ORDER_CREATED", "ORDER_PAID", False),
        ("topic", "orders.*", "orders.paid", True),
        ("topic", "orders.*", "orders.paid.eu", False),
        ("topic", "orders.#", "orders", True),
        ("topic", "#.eu", "orders.paid.eu", True),
        ("topic", "*.paid.#", "orders.paid", True),
        ("topic", "#", "anything.at.all", True),
        ("topic", "ORDER_CREATED", "ORDER_CREATED", True),
        ("topic", "ORDER_CREATED", "ORDER_CREATED.x", False),
        ("fanout", "", "whatever", True),
    ],
)
def test_a_binding_takes_a_routing_key_by_the_exchange_types_rules(kind, binding, key, reached):
    assert matches(kind, binding, key) is reached
