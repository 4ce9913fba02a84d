"""Ordered mode on the consumer side: the previous_sequence header and the handlers' check."""

from __future__ import annotations

import uuid

import pytest

from django_outbox.backends import locmem
from django_outbox.consumer import Dispatcher, ImproperlyConfiguredHandler, Outcome, get_handlers
from django_outbox.message import decode
from django_outbox.models import AggregateSequence, OutboxEvent, Status
from django_outbox.relay import Relay
from points.models import PointsLedger
from tests.utils.amqp import make_consumer
from tests.utils.rows import delivered, make_events, unsaved_event

pytestmark = pytest.mark.django_db(transaction=True)

PARK = "tests.consumer_handlers.OrderedParkHandler"
REJECT = "tests.consumer_handlers.OrderedRejectHandler"
LEDGER = "tests.consumer_handlers.OrderedLedgerHandler"
ADOPT = "tests.consumer_handlers.OrderedAdoptingHandler"


# -- the relay's side: the header ---------------------------------------------------------------
def add_rows(*aggregates: str, event_type: str = "ORDER_EVENT") -> list[OutboxEvent]:
    """Due PENDING rows of the ORDER aggregates named, in the given order."""
    return make_events(
        *(("ORDER", a) for a in aggregates), event_type=event_type, payload={}, due_age=1
    )


def headers_by_id() -> dict[int, dict]:
    return {m.headers["sequence"]: m.headers for m in locmem.outbox}


def test_relay_sends_previous_sequence_for_ordered_events(settings):
    settings.OUTBOX_ORDERED = ["ORDER_EVENT"]
    a1, b1, a2, a3 = add_rows("a", "b", "a", "a")
    (other,) = add_rows("a", event_type="NOTE")
    Relay(backend=locmem.LocmemBackend()).drain()
    sent = headers_by_id()
    assert sent[a1.pk]["previous_sequence"] == 0
    assert sent[b1.pk]["previous_sequence"] == 0
    assert sent[a2.pk]["previous_sequence"] == a1.pk
    assert sent[a3.pk]["previous_sequence"] == a2.pk
    # Unordered events carry no previous_sequence: consumers do not check them.
    assert "previous_sequence" not in sent[other.pk]


def test_previous_sequence_skips_a_skipped_dead_head(settings):
    settings.OUTBOX_ORDERED = True
    settings.OUTBOX_ORDERED_DEAD_HEAD = "skip"
    settings.OUTBOX_RETRY_SCHEDULE = [1]
    a1, a2, a3 = add_rows("a", "a", "a")
    relay = Relay(backend=locmem.LocmemBackend())
    relay.drain(max_events=1)  # a1 goes out
    OutboxEvent.objects.filter(pk=a2.pk).update(status=Status.DEAD)
    relay.drain()
    # a2 was never delivered: a3's predecessor, for consumers, is a1.
    assert headers_by_id()[a3.pk]["previous_sequence"] == a1.pk


def test_decode_reads_previous_sequence():
    event = unsaved_event(pk=20)
    event.previous_sequence = 10
    received = decode(delivered(event))
    assert (received.sequence, received.previous_sequence) == (20, 10)
    assert "previous_sequence" not in received.headers


# -- the handlers' check ----------------------------------------------------------------------
def ordered_event(sequence: int, previous: int | None, aggregate: str = "N1", event_id=None):
    event = unsaved_event("ORDER_EVENT", pk=sequence, event_id=event_id or uuid.uuid4().hex)
    event.aggregate_id = aggregate
    if previous is not None:
        event.previous_sequence = previous
    return decode(delivered(event))


def outcome(dispatcher: Dispatcher, event) -> Outcome:
    (result,) = dispatcher.process(event)
    return result.outcome


def processed_sequences() -> list[int]:
    return [
        int(n) for n in PointsLedger.objects.order_by("id").values_list("order_number", flat=True)
    ]


def test_park_holds_an_early_event_until_its_predecessor_is_processed():
    dispatcher = Dispatcher(handlers=[PARK])
    e1, e2, e3 = ordered_event(10, 0), ordered_event(20, 10), ordered_event(30, 20)
    assert outcome(dispatcher, e2) is Outcome.EARLY
    assert outcome(dispatcher, e3) is Outcome.EARLY
    assert processed_sequences() == []  # rolled back, inbox row included
    assert outcome(dispatcher, e1) is Outcome.PROCESSED
    assert outcome(dispatcher, e3) is Outcome.EARLY
    assert outcome(dispatcher, e2) is Outcome.PROCESSED
    assert outcome(dispatcher, e3) is Outcome.PROCESSED
    assert processed_sequences() == [10, 20, 30]
    assert outcome(dispatcher, e1) is Outcome.DUPLICATE
    # A different event older than the last processed one can no longer be applied in order.
    assert outcome(dispatcher, ordered_event(25, 20)) is Outcome.OUT_OF_ORDER
    state = AggregateSequence.objects.get()
    assert (state.handler, state.aggregate_id, state.last_sequence) == (
        "tests.ordered_park",
        "N1",
        30,
    )


def test_reject_dead_letters_an_early_event():
    dispatcher = Dispatcher(handlers=[REJECT])
    assert outcome(dispatcher, ordered_event(20, 10)) is Outcome.OUT_OF_ORDER
    assert outcome(dispatcher, ordered_event(10, 0)) is Outcome.PROCESSED


def test_aggregates_are_independent_and_unordered_events_are_not_checked():
    dispatcher = Dispatcher(handlers=[PARK])
    assert outcome(dispatcher, ordered_event(10, 0, "N1")) is Outcome.PROCESSED
    assert outcome(dispatcher, ordered_event(11, 0, "N2")) is Outcome.PROCESSED
    assert outcome(dispatcher, ordered_event(5, None, "N1")) is Outcome.PROCESSED


def test_business_row_style_tells_a_duplicate_from_a_late_event():
    dispatcher = Dispatcher(handlers=[LEDGER])
    e1 = ordered_event(10, 0)
    assert outcome(dispatcher, e1) is Outcome.PROCESSED
    assert outcome(dispatcher, e1) is Outcome.DUPLICATE
    assert outcome(dispatcher, ordered_event(9, 0)) is Outcome.OUT_OF_ORDER


def test_adopting_handler_takes_up_a_running_aggregate():
    assert outcome(Dispatcher(handlers=[PARK]), ordered_event(50, 40)) is Outcome.EARLY
    dispatcher = Dispatcher(handlers=[ADOPT])
    assert outcome(dispatcher, ordered_event(50, 40)) is Outcome.PROCESSED
    assert outcome(dispatcher, ordered_event(70, 60)) is Outcome.EARLY
    assert outcome(dispatcher, ordered_event(60, 50)) is Outcome.PROCESSED


@pytest.mark.once
def test_bad_out_of_order_value_is_a_configuration_error():
    from tests.consumer_handlers import OrderedParkHandler

    class Wrong(OrderedParkHandler):
        out_of_order = "drop"

    with pytest.raises(ImproperlyConfiguredHandler, match="out_of_order"):
        get_handlers([Wrong])


# -- over RabbitMQ -------------------------------------------------------------------------------
def publish_ordered(broker, sequence: int, previous: int) -> str:
    event = unsaved_event("ORDER_EVENT", pk=sequence)
    event.aggregate_id = "N1"
    event.previous_sequence = previous
    broker.publish(event)
    return event.event_id


def test_consumer_parks_an_early_message_and_processes_it_after_its_predecessor(broker):
    consumer = make_consumer(broker, [PARK], queue_type="classic")
    publish_ordered(broker, 20, 10)
    publish_ordered(broker, 10, 0)
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.EARLY] == 1
    assert result.counts[Outcome.PROCESSED] == 2
    assert processed_sequences() == [10, 20]
    assert broker.count(broker.dlq) == 0


def test_consumer_dead_letters_a_rejected_early_message(broker):
    consumer = make_consumer(broker, [REJECT], queue_type="classic")
    early = publish_ordered(broker, 20, 10)
    publish_ordered(broker, 10, 0)
    result = consumer.serve(until_idle=True)
    assert result.counts[Outcome.OUT_OF_ORDER] == 1
    assert result.dead_lettered == 1
    assert processed_sequences() == [10]
    got = broker.get(broker.dlq)
    assert got is not None and got[1].message_id == early


def test_two_consumers_take_successive_events_of_an_aggregate_one_after_the_other(db_vendor):
    """The aggregate's row is locked by the first until it commits; the second then sees it.

    Without the lock the second would read the old last sequence and park its event.
    """
    import threading
    import time

    from django.db import connection

    from tests.consumer_handlers import GatedOrderedHandler as Gated

    if db_vendor == "sqlite":
        pytest.skip("concurrent transactions need PostgreSQL or MariaDB")
    Gated.release.set()
    assert outcome(Dispatcher(handlers=[Gated]), ordered_event(10, 0)) is Outcome.PROCESSED
    Gated.release.clear()
    Gated.entered.clear()
    results: dict[str, Outcome] = {}

    def consume(name: str, event) -> None:
        try:
            results[name] = outcome(Dispatcher(handlers=[Gated]), event)
        finally:
            connection.close()

    first = threading.Thread(target=consume, args=("first", ordered_event(20, 10)))
    second = threading.Thread(target=consume, args=("second", ordered_event(30, 20)))
    try:
        first.start()
        assert Gated.entered.wait(30)
        second.start()
        time.sleep(1.0)
        assert "second" not in results  # waiting for the first one's row lock
    finally:
        Gated.release.set()
        first.join(30)
        second.join(30)
    assert results == {"first": Outcome.PROCESSED, "second": Outcome.PROCESSED}
    assert processed_sequences() == [10, 20, 30]
