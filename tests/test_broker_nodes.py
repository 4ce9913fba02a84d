"""Several broker URLs: how the setting is read, which node is next, when the loop pauses."""

from __future__ import annotations

import threading

import pytest
from django.test import override_settings

from django_outbox.checks import check_backend
from django_outbox.conf import broker_urls
from django_outbox.masking import mask_url, mask_urls_in
from django_outbox.worker import Backoff, BrokerNodes, keep_running

pytestmark = pytest.mark.once

A = "amqp://app:s3cret@rabbit-1:5672/%2F"
B = "amqp://app:s3cret@rabbit-2:5672/%2F"
C = "amqp://app:s3cret@rabbit-3:5672/%2F"


@pytest.mark.parametrize(
    ("value", "urls"),
    [
        (A, [A]),
        (f"{A};{B}", [A, B]),  # kombu's failover form
        (f" {A} ; {B} ;", [A, B]),  # spaces and a trailing ";" are not entries
        (f"{A};;{B}", [A, B]),
        ([A, B, C], [A, B, C]),
        ((A, B), [A, B]),
        ([f"{A};{B}", C], [A, B, C]),
        ("", []),
        ([], []),
        # A ";" in a password is not followed by a scheme: it does not split the URL.
        ("amqp://app:pa;ss@rabbit-1/%2F", ["amqp://app:pa;ss@rabbit-1/%2F"]),
    ],
)
def test_broker_urls_accepts_one_url_a_list_or_kombus_form(value, urls):
    assert broker_urls(value) == urls


@pytest.mark.parametrize(
    ("value", "said"),
    [(None, "is of type NoneType"), (5, "is of type int"), ([A, 5], "lists a value of type int")],
)
def test_broker_urls_of_another_type_say_the_accepted_forms(value, said):
    with pytest.raises(TypeError) as info:
        broker_urls(value)
    assert said in str(info.value)
    assert "a list of AMQP URLs, or one string with ';' between URLs" in str(info.value)


def test_every_url_of_a_list_is_masked():
    assert (
        mask_url(f"{A};{B}") == "amqp://app:***@rabbit-1:5672/%2F;amqp://app:***@rabbit-2:5672/%2F"
    )
    assert "s3cret" not in mask_urls_in(f"connecting to {A}; {B} failed")
    assert mask_url("amqp://app:pa;ss@rabbit-1/%2F") == "amqp://app:***@rabbit-1/%2F"
    assert str(BrokerNodes([A, B])) == (
        "amqp://app:***@rabbit-1:5672/%2F; amqp://app:***@rabbit-2:5672/%2F"
    )


def test_nodes_are_tried_round_robin_and_a_round_ends_when_each_has_failed():
    nodes = BrokerNodes([A, B, C])
    nodes.start()
    assert nodes.current == A
    assert nodes.name() == "amqp://app:***@rabbit-1:5672/%2F (node 1 of 3)"
    assert nodes.failed() is True  # B is tried at once
    assert nodes.current == B
    assert nodes.failed() is True
    assert nodes.current == C
    assert nodes.failed() is False  # each failed once: pause before the next round
    assert nodes.current == A
    assert nodes.failed() is False  # said again (the relay asks after a failed open())
    assert nodes.current == A  # ... it changes nothing
    nodes.start()  # after the pause
    assert nodes.failed() is True
    assert nodes.current == B


def test_a_connection_that_worked_does_not_start_a_new_round():
    """Nodes failing in turn, each after working for a while, still get a pause once each
    has failed: a flapping cluster is not hammered without a pause."""
    nodes = BrokerNodes([A, B])
    nodes.start()
    assert nodes.failed() is True  # A lost; B connects and works
    nodes.start()
    assert nodes.failed() is False  # B lost too: pause
    nodes.start()
    assert nodes.current == A


def test_one_node_pauses_after_every_failure():
    nodes = BrokerNodes(A)
    assert nodes.name() == "amqp://app:***@rabbit-1:5672/%2F"
    assert nodes.failed() is False
    nodes.start()
    assert nodes.failed() is False
    assert nodes.current == A
    assert BrokerNodes("").failed() is False
    assert not BrokerNodes("")


def test_keep_running_tries_another_node_at_once_and_backs_off_after_a_round():
    """The loop asks fail_over() first: True retries at once without growing the backoff;
    False pauses with the backoff as for any failure."""
    nodes = BrokerNodes([A, B])
    stop = threading.Event()
    backoff = Backoff(initial=0.01, maximum=0.04)
    pauses: list[float] = []
    connected: list[str] = []

    def step() -> bool:
        nodes.start()
        connected.append(nodes.current)
        if len(connected) == 5:
            return True
        raise ConnectionError(f"lost {nodes.current}")

    def fail_over(exc: Exception) -> bool:
        assert isinstance(exc, ConnectionError)
        return nodes.failed()

    keep_running(
        stop,
        step,
        backoff=backoff,
        on_error=lambda exc, pause: pauses.append(pause),
        fail_over=fail_over,
    )
    assert connected == [A, B, A, B, A]
    assert pauses == [0.0, 0.01, 0.0, 0.02]


def test_keep_running_without_fail_over_pauses_on_every_failure():
    stop = threading.Event()
    pauses: list[float] = []
    calls = iter([False, False, True])

    def step() -> bool:
        if next(calls):
            return True
        raise ConnectionError

    keep_running(
        stop,
        step,
        backoff=Backoff(initial=0.01),
        on_error=lambda exc, pause: pauses.append(pause),
        fail_over=lambda exc: False,
    )
    assert pauses == [0.01, 0.02]


def test_a_broker_url_of_another_type_is_a_configuration_error_for_the_relay_and_consumer():
    from django.test import override_settings

    from django_outbox.backends.pika import PikaBackend
    from django_outbox.consumer import Consumer, ImproperlyConfiguredConsumer

    with pytest.raises(ImproperlyConfiguredConsumer, match="lists a value of type int"):
        Consumer(handlers=["points.handlers.AwardPointsHandler"], url=[A, 5])
    with (
        override_settings(OUTBOX_BROKER_URL={"url": A}),
        pytest.raises(TypeError, match="is of type dict"),  # publish_outbox: exit 2
    ):
        PikaBackend()


def test_the_broker_urls_scheme_picks_the_transport_and_one_broker_only():
    from django_outbox import transports
    from django_outbox.consumer.amqp import Consumer

    assert transports.transport_for(["amqps://u:p@a/%2F", "amqp://u:p@b/%2F"]) is transports.AMQP
    assert transports.transport_for([]) is transports.AMQP
    assert transports.consumer_class("amqp://guest:guest@127.0.0.1/%2F") is Consumer
    with pytest.raises(transports.UnknownTransport, match="no known scheme; use one of amqp://"):
        transports.transport_for(["kafka://u:secret@k1:9092"])
    with override_settings(OUTBOX_BROKER_URL="kafka://u:secret@k1:9092", OUTBOX_BACKEND=""):
        [error] = check_backend()
    assert error.id == "django_outbox.E001"
    assert "kafka://u:***@k1:9092 has no known scheme" in error.msg
    assert "secret" not in error.msg
    # OUTBOX_BACKEND, when set, still chooses the relay's backend.
    with override_settings(
        OUTBOX_BROKER_URL="kafka://k1", OUTBOX_BACKEND="django_outbox.backends.locmem.LocmemBackend"
    ):
        assert check_backend() == []
