"""A consumer never dead-letters a message for its own infrastructure's fault (issue 28).

A handler's table missing at start stops ``consume_outbox`` before it takes a message; a
database failing under a handler (a table not there, a lock refused) holds the message
without counting a delivery, and the consumer goes on once the database is right. In every
case the dead-letter queue stays empty. Real RabbitMQ, the test database.
"""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from django_outbox.consumer import Outcome
from points.models import PointsLedger
from tests.testapp.models import NeverMigrated, Widget
from tests.utils.amqp import make_consumer, serving
from tests.utils.rows import unsaved_event
from tests.utils.waiting import wait_for

pytestmark = [pytest.mark.amqp, pytest.mark.django_db(transaction=True)]


def held(caplog, state: str) -> int:
    return sum(
        f"{state} (" in r.getMessage() and "holding message" in r.getMessage()
        for r in caplog.records
    )


def test_consume_outbox_exits_2_naming_the_missing_table_before_taking_a_message(broker, settings):
    make_consumer(broker).close()  # the queue and its bindings
    broker.publish(unsaved_event())
    settings.OUTBOX_BROKER_URL = broker.url
    with pytest.raises(CommandError) as refused:
        call_command(
            "consume_outbox",
            *("--once", "--queue", broker.queue, "--exchange", broker.exchange),
            *("--handler", "tests.consumer_handlers.UnmigratedHandler"),
            stdout=StringIO(),
            stderr=StringIO(),
        )
    assert refused.value.returncode == 2
    text = str(refused.value)
    assert "testapp_never_migrated (testapp.NeverMigrated, for handler tests.unmigrated)" in text
    assert "`manage.py migrate testapp --database default`" in text
    assert wait_for(lambda: broker.count(broker.queue) == 1)  # not taken
    assert broker.count(broker.dlq) == 0


def test_a_table_missing_under_a_handler_holds_the_message_until_it_is_migrated(broker, caplog):
    """Before: ``relation ... does not exist`` was a failure like any other, retried and
    dead-lettered (the first-hour user's DLQ went 2 -> 5)."""
    caplog.set_level("INFO", logger="django_outbox")
    consumer = make_consumer(
        broker, handlers=["tests.consumer_handlers.MissingTableHandler"], max_retries=0
    )
    event = unsaved_event()
    broker.publish(event)
    try:
        with serving(consumer) as results:
            # max_retries 0: one counted failure would have dead-lettered it.
            assert wait_for(lambda: held(caplog, "failed") >= 2, timeout=30)
            assert broker.count(broker.dlq) == 0
            with connection.schema_editor() as editor:  # `migrate`, while it waits
                editor.create_model(NeverMigrated)
            assert wait_for(lambda: NeverMigrated.objects.count() == 1, timeout=30)
        [result] = results
    finally:
        with connection.schema_editor() as editor:
            editor.delete_model(NeverMigrated)
    assert result.counts[Outcome.PROCESSED] == 1
    assert result.counts[Outcome.FAILED] == result.dead_lettered == 0
    assert "failed (delivery" not in caplog.text  # no delivery was counted
    assert broker.count(broker.dlq) == 0
    assert broker.count(broker.queue) == 0


def test_a_lock_the_database_refuses_holds_the_message_then_it_is_processed(
    broker, caplog, db_vendor
):
    if db_vendor == "sqlite":
        pytest.skip("SQLite has no row locks (SELECT ... FOR UPDATE NOWAIT)")
    caplog.set_level("INFO", logger="django_outbox")
    Widget.objects.create(code="locked")
    consumer = make_consumer(
        broker, handlers=["tests.consumer_handlers.LockedRowHandler"], max_retries=0
    )
    event = unsaved_event()
    broker.publish(event)
    with serving(consumer) as results:
        with transaction.atomic():
            Widget.objects.select_for_update().get(code="locked")
            assert wait_for(lambda: held(caplog, "failed") >= 2, timeout=30)
            assert PointsLedger.objects.count() == 0  # each attempt rolled back
        assert wait_for(lambda: PointsLedger.objects.count() == 1, timeout=30)
    [result] = results
    assert result.counts[Outcome.PROCESSED] == 1
    assert result.dead_lettered == 0
    assert PointsLedger.objects.get().source_event_id == event.event_id
    assert broker.count(broker.dlq) == 0
