"""IdempotentHandler and the dispatcher, in-process, on the test database."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from django_outbox.backends import locmem
from django_outbox.consumer import (
    Action,
    Consumer,
    ConsumeResult,
    Dispatcher,
    ImproperlyConfiguredConsumer,
    ImproperlyConfiguredHandler,
    Outcome,
    get_handlers,
    process_messages,
)
from django_outbox.message import Delivery, decode, encode_body, encode_headers
from django_outbox.models import InboxMessage
from django_outbox.testing import relay_now
from orders.services import create_order
from points.handlers import AwardPointsHandler
from points.models import PointsLedger
from tests.utils.rows import decided, delivered, unsaved_event

pytestmark = pytest.mark.django_db(transaction=True)


def received(event):
    return decode(delivered(event))


def test_business_row_style_same_event_twice_gives_one_row():
    dispatcher = Dispatcher(handlers=[AwardPointsHandler])
    event = received(unsaved_event())
    first = dispatcher.process(event)
    second = dispatcher.process(event)
    assert [r.outcome for r in first] == [Outcome.PROCESSED]
    assert [r.outcome for r in second] == [Outcome.DUPLICATE]
    row = PointsLedger.objects.get()
    assert (row.source_event_id, row.points, row.user_id) == (event.event_id, 12, 7)


def test_inbox_style_same_event_twice_gives_one_row():
    dispatcher = Dispatcher(handlers=["tests.consumer_handlers.InboxPointsHandler"])
    event = received(unsaved_event())
    assert dispatcher.process(event)[0].outcome is Outcome.PROCESSED
    assert dispatcher.process(event)[0].outcome is Outcome.DUPLICATE
    assert PointsLedger.objects.count() == 1
    inbox = InboxMessage.objects.get()
    assert (inbox.handler, inbox.source_event_id) == ("tests.inbox_points", event.event_id)


def test_other_integrity_error_is_a_failure_not_a_duplicate():
    dispatcher = Dispatcher(handlers=["tests.consumer_handlers.NegativePointsHandler"])
    [result] = dispatcher.process(received(unsaved_event()))
    assert result.outcome is Outcome.FAILED
    assert "IntegrityError" in result.error
    assert PointsLedger.objects.count() == 0


def test_handler_exception_rolls_back_its_writes():
    dispatcher = Dispatcher(handlers=["tests.consumer_handlers.FailingHandler"])
    [result] = dispatcher.process(received(unsaved_event()))
    assert result.outcome is Outcome.FAILED
    assert "boom" in result.error
    assert PointsLedger.objects.count() == 0


def test_unknown_type_and_undecodable():
    dispatcher = Dispatcher(handlers=[AwardPointsHandler])
    [unknown] = dispatcher.process(received(unsaved_event("ORDER_CANCELLED")))
    assert unknown.outcome is Outcome.UNKNOWN_TYPE
    [bad] = dispatcher.process_message(
        Delivery(b"not json", message_id="m1", message_type="ORDER_CREATED", headers={})
    )
    assert bad.outcome is Outcome.UNDECODABLE


def test_locmem_end_to_end_with_duplicates():
    """The demo's in-process path: outbox -> relay (locmem) -> handlers."""
    for i in range(5):
        create_order(user_id=i, amount=10 + i)
    relay_now()
    messages = list(locmem.outbox)
    assert len(messages) == 5
    outcomes = process_messages([*messages, *messages[:2]], dispatcher=Dispatcher())
    flat = [r.outcome for results in outcomes for r in results]
    assert flat.count(Outcome.PROCESSED) == 5
    assert flat.count(Outcome.DUPLICATE) == 2
    assert PointsLedger.objects.count() == 5


def test_handlers_are_discovered_and_paths_checked():
    assert AwardPointsHandler in get_handlers()
    with pytest.raises(ImproperlyConfiguredHandler, match="cannot be imported"):
        get_handlers(["nope.Handler"])
    with pytest.raises(ImproperlyConfiguredHandler, match="not a subclass"):
        get_handlers(["points.models.PointsLedger"])


def test_queue_name_and_arguments(settings):
    from django_outbox.consumer import default_queue_name, queue_arguments

    settings.OUTBOX_CONSUMER_QUEUE = ""
    assert default_queue_name([AwardPointsHandler]) == "points.outbox"
    settings.OUTBOX_CONSUMER_QUEUE = "svc.events"
    assert default_queue_name([AwardPointsHandler]) == "svc.events"
    quorum = queue_arguments("q", queue_type="quorum", max_retries=3)
    assert quorum == {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "q.dlq",
        "x-queue-type": "quorum",
        "x-delivery-limit": 3,
    }
    assert "x-queue-type" not in queue_arguments("q", queue_type="classic", max_retries=3)
    with pytest.raises(ImproperlyConfiguredConsumer, match="'quorum' or 'classic'"):
        queue_arguments("q", queue_type="stream", max_retries=3)
    classic = queue_arguments("q", queue_type="classic", max_retries=3, max_priority=10)
    assert classic["x-max-priority"] == 10
    with pytest.raises(ImproperlyConfiguredConsumer, match=r"priority queue .* is a classic"):
        queue_arguments("q", queue_type="quorum", max_retries=3, max_priority=10)


def test_describe_names_types_bindings_and_dedup_style(settings):
    from tests.consumer_handlers import InboxPointsHandler

    settings.OUTBOX_ROUTING_KEYS = {"ORDER_CREATED": "orders.created"}
    assert InboxPointsHandler.describe() == (
        "tests.inbox_points: ORDER_CREATED (binds orders.created; dedup by inbox)"
    )
    assert AwardPointsHandler.describe().endswith(
        "(binds orders.created; dedup by points.PointsLedger.source_event_id)"
    )


def test_receive_decides_what_the_transport_does_and_gives_each_handlers_result():
    dispatcher = Dispatcher(
        handlers=[AwardPointsHandler, "tests.consumer_handlers.InboxPointsHandler"]
    )
    event = unsaved_event()
    decision = dispatcher.receive(delivered(event))
    assert (decision.action, decision.outcome) == (Action.ACKNOWLEDGE, Outcome.PROCESSED)
    assert [r.outcome for r in decision.results] == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert decision.message_format == "native"
    decision = dispatcher.receive(delivered(event, redelivered=True))
    assert (decision.action, decision.outcome) == (Action.ACKNOWLEDGE, Outcome.DUPLICATE)
    decision = dispatcher.receive(Delivery(b"not json", message_id="m1", message_type="T"))
    assert (decision.action, decision.outcome) == (Action.DEAD_LETTER, Outcome.UNDECODABLE)
    assert decision.reason.startswith("undecodable: message 'm1' body is not JSON")
    assert decision.message_format == ""


BOOM = "RuntimeError: boom after the write"


@pytest.mark.parametrize(
    ("number", "count_error", "action", "reason"),
    [
        (1, "", Action.RETRY, ""),
        (3, "", Action.RETRY, ""),
        (4, "", Action.DEAD_LETTER, f"failed 4 time(s): {BOOM}"),
        (1, "header x is 'a'", Action.DEAD_LETTER, f"failed: {BOOM}; header x is 'a'"),
    ],
)
def test_a_failure_is_retried_with_a_growing_pause_then_dead_lettered(
    number, count_error, action, reason
):
    dispatcher = Dispatcher(
        handlers=["tests.consumer_handlers.FailingHandler"], max_retries=3, retry_delay=0.5
    )
    decision = dispatcher.receive(
        delivered(unsaved_event(), number=number, count_error=count_error)
    )
    assert (decision.action, decision.outcome, decision.reason) == (action, Outcome.FAILED, reason)
    assert decision.delay == ({1: 0.5, 3: 2.0}.get(number, 0.0) if not count_error else 0.0)
    assert decision.error == BOOM
    assert PointsLedger.objects.count() == 0


def test_consume_result_as_dict_lists_every_outcome():
    result = ConsumeResult()
    for outcome in [Outcome.PROCESSED] * 4 + [Outcome.DUPLICATE] * 2:
        result.add(decided(outcome, "native" if outcome is Outcome.PROCESSED else "cloudevents"))
    result.add(decided(Outcome.FAILED, action=Action.DEAD_LETTER))  # undecodable: no format
    assert result.as_dict() == {
        "messages": 7,
        "outcomes": {
            "processed": 4,
            "duplicate": 2,
            "failed": 1,
            "unknown_type": 0,
            "undecodable": 0,
            "early": 0,
            "out_of_order": 0,
        },
        "dead_lettered": 1,
        "formats": {"native": 4, "cloudevents": 2, "cloudevents-structured": 0},
    }


def test_a_consumer_without_handlers_is_a_configuration_error(settings, monkeypatch):
    settings.OUTBOX_CONSUMER_HANDLERS = []
    # No apps' ones.
    monkeypatch.setattr("django_outbox.consumer.handlers.discover_handlers", lambda: [])
    with pytest.raises(ImproperlyConfiguredHandler, match="No handlers to run"):
        Consumer()
    with pytest.raises(CommandError, match="No handlers to run") as info:
        call_command("consume_outbox", stderr=StringIO())
    assert info.value.returncode == 2


# Each is a message some publisher could send; each must be UNDECODABLE, with a reason that
# names what is wrong, and never raise out of the dispatcher (issue 19: these crashed it).
MALFORMED = {
    "attempt not a number": ({"attempt": "abc"}, b"{}", "attempt"),
    "attempt zero": ({"attempt": 0}, b"{}", "attempt"),
    "sequence not a number": ({"sequence": "x"}, b"{}", "sequence"),
    "sequence a list": ({"sequence": [1, 2]}, b"{}", "sequence"),
    "sequence a bool": ({"sequence": True}, b"{}", "sequence"),
    "sequence past 64 bits": ({"sequence": 2**63}, b"{}", "sequence"),
    "previous_sequence not a number": ({"previous_sequence": "zz"}, b"{}", "previous_sequence"),
    "previous_sequence negative": ({"previous_sequence": -1}, b"{}", "previous_sequence"),
    "occurred_at not a date": ({"occurred_at": "2024-13-45T00:00:00"}, b"{}", "occurred_at"),
    "occurred_at garbage": ({"occurred_at": "yesterday"}, b"{}", "occurred_at"),
    "occurred_at a number": ({"occurred_at": 12}, b"{}", "occurred_at"),
    "aggregate_id a table": ({"aggregate_id": {"a": 1}}, b"{}", "aggregate_id"),
    "aggregate_id not UTF-8": ({"aggregate_id": b"\xff\xfe"}, b"{}", "aggregate_id"),
    "aggregate_type too long": ({"aggregate_type": "A" * 65}, b"{}", "aggregate_type"),
    "body nested 100,000 deep": ({}, b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
    "body not UTF-8": ({}, b'{"a": "\xff"}', "not JSON"),
    # json.loads(bytes) would read these as UTF-16 / UTF-32: the number 2 and {}.
    "body in UTF-16": ({}, b"\x002", "not JSON"),
    "body in UTF-32": ({}, "{}".encode("utf-32-le"), "not JSON"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_message_is_undecodable_with_its_reason(case):
    headers, body, named = MALFORMED[case]
    good = encode_headers(unsaved_event())
    dispatcher = Dispatcher(handlers=[AwardPointsHandler])
    [result] = dispatcher.process_message(
        Delivery(body, message_id="m1", message_type="ORDER_CREATED", headers={**good, **headers})
    )
    assert result.outcome is Outcome.UNDECODABLE
    assert named in result.error
    assert PointsLedger.objects.count() == 0


def test_properties_that_are_not_an_outbox_event_are_undecodable():
    body, headers = encode_body(unsaved_event()), encode_headers(unsaved_event())
    dispatcher = Dispatcher(handlers=[AwardPointsHandler])
    for props, named in [
        ({"message_id": b"\xff\x00", "message_type": "ORDER_CREATED"}, "message_id"),
        ({"message_id": "m" * 65, "message_type": "ORDER_CREATED"}, "message_id"),
        ({"message_id": "m1", "message_type": "T" * 129}, "type"),
        ({"message_id": "m1", "message_type": "ORDER_CREATED", "content_type": "text/xml"}, "xml"),
    ]:
        [result] = dispatcher.process_message(Delivery(body, headers=headers, **props))
        assert result.outcome is Outcome.UNDECODABLE, props
        assert named in result.error


def test_well_formed_variants_still_decode():
    """What other publishers send and the outbox accepts: digit strings, an AMQP timestamp,
    a JSON content type with parameters, no optional headers at all."""
    event = decode(
        Delivery(
            b'{"a": 1}',
            message_id="m1",
            message_type="ORDER_CREATED",
            headers={"attempt": "2", "sequence": b"7", "occurred_at": timezone.now()},
            content_type="application/json; charset=utf-8",
        )
    )
    assert (event.attempt, event.sequence, event.previous_sequence) == (2, 7, None)
    bare = decode(Delivery(b"null", message_id="m2", message_type="T", headers=None))
    assert (bare.attempt, bare.occurred_at, bare.aggregate_id, bare.payload) == (1, None, "", None)


def test_length_limits_are_the_columns():
    from django_outbox import message
    from django_outbox.models import AggregateSequence, InboxMessage

    assert InboxMessage._meta.get_field("source_event_id").max_length == message.MAX_EVENT_ID_LENGTH
    assert InboxMessage._meta.get_field("event_type").max_length == message.MAX_EVENT_TYPE_LENGTH
    for name in ("aggregate_type", "aggregate_id"):
        assert AggregateSequence._meta.get_field(name).max_length == message.MAX_AGGREGATE_LENGTH


def test_an_operational_error_on_a_working_connection_is_a_handler_failure():
    """Not an outage (the consumer would hold the message): a deadlock or lock timeout."""
    dispatcher = Dispatcher(handlers=["tests.consumer_handlers.DeadlockHandler"])
    [result] = dispatcher.process(received(unsaved_event()))
    assert result.outcome is Outcome.FAILED
    assert (result.lost_database, result.error) == ("", "OperationalError: deadlock detected")
    assert PointsLedger.objects.count() == 0
