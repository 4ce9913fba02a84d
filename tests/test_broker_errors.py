"""What the broker refuses, said in words at the terminal, against the real RabbitMQ.

A broker URL that cannot work (an unresolvable host, a closed port, a missing vhost, a wrong
password): ``django_outbox._compat.pika.connection_failure`` reads the cause out of what
pika raises (``BlockingConnection``, the consumer's) or reports (``SelectConnection``, the
relay's); the one-pass commands exit 2 with it in words, and the long-running relay logs it
while it retries. An event no queue is bound for: the commands name the exchange and the
routing key, and say to start the consumer or bind a queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from io import StringIO
from urllib.parse import urlsplit, urlunsplit

import pika
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_outbox._compat.pika import HandTurnedLoop, connection_failure
from django_outbox.backends.pika import PikaBackend
from django_outbox.consumer import Consumer
from django_outbox.models import OutboxEvent, Status
from django_outbox.relay import Relay
from tests.utils.amqp import AWARD, serving
from tests.utils.proxy import closed_port
from tests.utils.rows import make_events
from tests.utils.waiting import wait_for

pytestmark = pytest.mark.amqp

PIKA = "django_outbox.backends.pika.PikaBackend"


def _with(url: str, *, user: str | None = None, password: str | None = None, **parts: str) -> str:
    """``url`` with its host, port, vhost or credentials replaced."""
    split = urlsplit(url)
    host = parts.get("host", split.hostname or "127.0.0.1")
    port = parts.get("port", str(split.port or 5672))
    user = split.username if user is None else user
    password = split.password if password is None else password
    path = parts.get("vhost", split.path)
    return urlunsplit((split.scheme, f"{user}:{password}@{host}:{port}", path, "", ""))


#: Each case: how to spoil the URL, and the words the cause must say.
CASES: dict[str, tuple[Callable[[str], str], str]] = {
    "unknown host": (
        lambda url: _with(url, host="no-such-host.invalid"),
        "name lookup failed for host 'no-such-host.invalid'",
    ),
    "closed port": (
        lambda url: _with(url, host="127.0.0.1", port=str(closed_port())),
        "connection refused by 127.0.0.1:",
    ),
    "missing vhost": (
        lambda url: _with(url, vhost="/no-such-vhost-h4"),
        "vhost 'no-such-vhost-h4' not found",
    ),
    "wrong password": (
        lambda url: _with(url, password="not-the-password"),
        "access refused for user ",
    ),
}


def _select_connection_error(url: str) -> BaseException:
    """What pika's SelectConnection (the relay's adapter) reports when it cannot open."""
    loop = HandTurnedLoop()
    errors: list[BaseException] = []
    params = pika.URLParameters(url)
    params.connection_attempts = 1
    connection = pika.SelectConnection(
        params,
        on_open_callback=lambda conn: errors.append(RuntimeError("it opened")),
        on_open_error_callback=lambda conn, error: errors.append(error),
        custom_ioloop=loop.ioloop,
    )
    try:
        assert loop.run_until(lambda: bool(errors), 20), "no answer within 20 s"
    finally:
        if connection.is_open:
            connection.close()
        loop.close()
    return errors[0]


def _blocking_connection_error(url: str) -> BaseException:
    """What pika's BlockingConnection (the consumer's adapter) raises."""
    try:
        pika.BlockingConnection(pika.URLParameters(url)).close()
    except Exception as exc:  # what pika raises is what is examined
        return exc
    raise AssertionError(f"connected to {url}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("adapter", [_select_connection_error, _blocking_connection_error])
def test_a_permanent_connection_error_is_named_in_words(amqp_url, case, adapter) -> None:
    spoil, words = CASES[case]
    url = spoil(amqp_url)
    failure = connection_failure(adapter(url), url)
    assert failure.permanent, failure
    assert failure.cause.startswith(words), failure
    assert failure.hint
    assert "not-the-password" not in str(failure)


def test_a_failure_names_what_pika_tried_from_its_parameters(amqp_url) -> None:
    url = CASES["missing vhost"][0](amqp_url)
    params = pika.URLParameters(url)
    assert connection_failure(_blocking_connection_error(url), params).cause == (
        "vhost 'no-such-vhost-h4' not found"
    )


def test_an_error_it_does_not_know_is_not_permanent_and_keeps_its_text() -> None:
    failure = connection_failure(pika.exceptions.StreamLostError("Transport indicated EOF"), "")
    assert not failure.permanent
    assert failure.cause == "StreamLostError: Transport indicated EOF"


# -- the commands --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", CASES)
def test_publish_outbox_once_exits_2_with_the_cause(amqp_url, case) -> None:
    spoil, words = CASES[case]
    (row,) = make_events({"event_type": "ORDER_CREATED"})
    started = time.monotonic()
    with (
        override_settings(OUTBOX_BACKEND=PIKA, OUTBOX_BROKER_URL=spoil(amqp_url)),
        pytest.raises(CommandError) as info,
    ):
        call_command("publish_outbox", "--once", stdout=StringIO(), verbosity=0)
    assert time.monotonic() - started < 30
    assert info.value.returncode == 2
    said = str(info.value)
    assert said.startswith("The broker is unreachable: cannot connect to RabbitMQ at ")
    assert words in said
    assert "not-the-password" not in said
    row.refresh_from_db()
    assert (row.status, row.retry_count) == (Status.PENDING, 0)  # not the event's fault


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", ["unknown host", "missing vhost"])
def test_compensate_outbox_exits_2_with_the_cause(amqp_url, case) -> None:
    spoil, words = CASES[case]
    make_events({"age": 3600})
    started = time.monotonic()
    with (
        override_settings(OUTBOX_BACKEND=PIKA, OUTBOX_BROKER_URL=spoil(amqp_url)),
        pytest.raises(CommandError) as info,
    ):
        call_command("compensate_outbox", stdout=StringIO(), verbosity=0)
    assert time.monotonic() - started < 30
    assert info.value.returncode == 2
    assert words in str(info.value)
    assert "the rows stay PENDING for the next run" in str(info.value)
    assert OutboxEvent.objects.get().retry_count == 0


@pytest.mark.django_db(transaction=True)
def test_the_long_running_relay_retries_and_logs_the_cause(amqp_url, caplog) -> None:
    spoil, words = CASES["missing vhost"]
    make_events({})
    caplog.set_level("WARNING", logger="django_outbox.relay")
    relay = Relay(backend=PikaBackend(broker_url=spoil(amqp_url)), db_thread=False)
    stop = threading.Event()
    runner = threading.Thread(target=relay.serve, kwargs={"stop": stop, "interval": 0.1})
    runner.start()
    try:
        assert wait_for(lambda: caplog.text.count(words) >= 2, timeout=20), caplog.text
    finally:
        stop.set()
        runner.join(10)
    lines = [r.getMessage() for r in caplog.records if words in r.getMessage()]
    assert all("broker unavailable" in line and "retrying in" in line for line in lines)
    assert OutboxEvent.objects.get().retry_count == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", CASES)
def test_consume_outbox_once_exits_2_with_the_cause(amqp_url, case) -> None:
    """Before: it reconnected for good, logging ``AMQPConnectionError: `` with no cause (an
    unknown host ended in a traceback: BlockingConnection raises the bare gaierror)."""
    spoil, words = CASES[case]
    started = time.monotonic()
    with (
        override_settings(OUTBOX_BROKER_URL=spoil(amqp_url)),
        pytest.raises(CommandError) as info,
    ):
        call_command("consume_outbox", "--once", "--handler", AWARD, stdout=StringIO(), verbosity=0)
    assert time.monotonic() - started < 30
    assert info.value.returncode == 2
    said = str(info.value)
    assert said.startswith("consume_outbox: cannot connect to RabbitMQ at ")
    assert words in said
    assert "not-the-password" not in said


@pytest.mark.django_db(transaction=True)
def test_the_long_running_consumer_retries_and_logs_the_cause(amqp_url, caplog) -> None:
    spoil, words = CASES["missing vhost"]
    caplog.set_level("WARNING", logger="django_outbox.consumer")
    consumer = Consumer(handlers=[AWARD], url=spoil(amqp_url), reconnect_max=0.2)
    with serving(consumer):
        assert wait_for(lambda: caplog.text.count(words) >= 2, timeout=20), caplog.text
    lines = [r.getMessage() for r in caplog.records if words in r.getMessage()]
    assert all(
        line.startswith("cannot connect to RabbitMQ at ") and "reconnecting in" in line
        for line in lines
    )


# -- unroutable ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command", ["publish_outbox", "compensate_outbox"])
def test_an_unroutable_event_says_which_route_and_what_to_do(broker, command, caplog) -> None:
    make_events({"event_type": "ORDER_CREATED"}, {"event_type": "ORDER_PAID"}, age=3600)
    args = ["--once"] if command == "publish_outbox" else ["--stale-after", "1s"]
    with (
        override_settings(
            OUTBOX_BACKEND=PIKA, OUTBOX_BROKER_URL=broker.url, OUTBOX_EXCHANGE=broker.exchange
        ),
        pytest.raises(CommandError) as info,
    ):
        call_command(command, *args, stdout=StringIO())
    broker.delete_at_close(exchanges=[broker.exchange])
    assert info.value.returncode == 1
    said = str(info.value)
    assert said.startswith("2 events failed:\n  1 unroutable: returned by RabbitMQ: 312 NO_ROUTE")
    for key in ("ORDER_CREATED", "ORDER_PAID"):
        assert (
            f"no queue bound to exchange {broker.exchange!r} for routing key {key!r}); start "
            "the consumer (consume_outbox declares and binds its queue) or bind a queue"
        ) in said
    assert "manage.py outbox_requeue --status pending" in said
    # The relay's log line (on stderr unless LOGGING routes it) says the same.
    assert "for routing key 'ORDER_PAID'); start the consumer" in caplog.text
