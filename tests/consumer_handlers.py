"""Handlers used by the consumer tests (passed with --handler / handlers=)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from django_outbox.consumer import IdempotentHandler
from points.handlers import AwardPointsHandler
from points.models import PointsLedger
from tests.testapp.models import NeverMigrated, Widget


class InboxPointsHandler(IdempotentHandler):
    """Inbox style: writes a ledger row but de-duplicates through the inbox table."""

    event_types = ["ORDER_CREATED"]
    name = "tests.inbox_points"

    def handle(self, event):
        PointsLedger.objects.create(
            source_event_id=f"inbox-{event.event_id}", user_id=1, order_number="x", points=1
        )


class FailingHandler(AwardPointsHandler):
    """Writes its ledger row, then raises: the row must be rolled back."""

    name = "tests.failing"

    def handle(self, event):
        super().handle(event)
        raise RuntimeError("boom after the write")


class NegativePointsHandler(IdempotentHandler):
    """Violates the ledger's check constraint: a real failure, not a duplicate."""

    event_types = ["ORDER_CREATED"]
    dedup_model = PointsLedger
    name = "tests.negative"

    def handle(self, event):
        PointsLedger.objects.create(
            source_event_id=event.event_id, user_id=1, order_number="x", points=-1
        )


class BlockingPointsHandler(AwardPointsHandler):
    """Writes the row, announces it in a file, then waits: the test kills the process."""

    name = "points.award"

    def handle(self, event):
        super().handle(event)
        marker = Path(os.environ["H3_BLOCK_FILE"])
        marker.write_text(event.event_id)
        while marker.exists():
            time.sleep(0.05)


class OrderedParkHandler(IdempotentHandler):
    """Inbox style with the order check: an early event is parked (retried later)."""

    event_types = ["ORDER_EVENT"]
    name = "tests.ordered_park"
    out_of_order = "park"

    def handle(self, event):
        PointsLedger.objects.create(
            source_event_id=event.event_id,
            user_id=1,
            order_number=str(event.sequence),
            points=1,
        )


class OrderedRejectHandler(OrderedParkHandler):
    name = "tests.ordered_reject"
    out_of_order = "reject"


class OrderedLedgerHandler(OrderedParkHandler):
    """Business-row style with the order check."""

    name = "tests.ordered_ledger"
    dedup_model = PointsLedger


class OrderedAdoptingHandler(OrderedParkHandler):
    name = "tests.ordered_adopt"
    adopt_running_aggregates = True


class GatedOrderedHandler(OrderedParkHandler):
    """Waits inside handle() (after the order check) until the test releases it."""

    name = "tests.ordered_gated"
    entered = threading.Event()
    release = threading.Event()

    def handle(self, event):
        super().handle(event)
        type(self).entered.set()
        assert type(self).release.wait(30)


class ConnectionBreakingHandler(AwardPointsHandler):
    """Closes its own database connection under Django every time: the database answers,
    but this handler loses its connection on every delivery (a poison, not an outage)."""

    name = "tests.connection_breaking"

    def handle(self, event):
        from django.db import connection

        super().handle(event)
        connection.connection.close()  # the driver's connection, behind Django's back
        PointsLedger.objects.count()  # fails: the connection is gone


class DeadlockHandler(AwardPointsHandler):
    """Raises an OperationalError (as a deadlock does) on a connection that still works."""

    name = "tests.deadlock"

    def handle(self, event):
        from django.db import OperationalError

        super().handle(event)
        raise OperationalError("deadlock detected")


class UnmigratedHandler(IdempotentHandler):
    """De-duplicates by a model whose table was never migrated."""

    event_types = ["ORDER_CREATED"]
    dedup_model = NeverMigrated
    name = "tests.unmigrated"

    def handle(self, event):
        NeverMigrated.objects.create(source_event_id=event.event_id)


class MissingTableHandler(IdempotentHandler):
    """Inbox style (its tables exist), but writes to a table that may not: the database's
    fault under the handler, never the message's."""

    event_types = ["ORDER_CREATED"]
    name = "tests.missing_table"

    def handle(self, event):
        NeverMigrated.objects.create(source_event_id=event.event_id)


class LockedRowHandler(AwardPointsHandler):
    """Writes its row, then asks for a row lock without waiting (NOWAIT): a lock held
    elsewhere makes the database refuse, as a lock timeout would."""

    name = "tests.locked_row"

    def handle(self, event):
        super().handle(event)
        list(Widget.objects.select_for_update(nowait=True).filter(code="locked"))
