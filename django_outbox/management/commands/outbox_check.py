"""manage.py outbox_check: can the outbox work as configured? Before the first event, in a
deployment gate, when events come back unroutable.

Connects to the outbox's database and to the broker, declares (or verifies) the exchange,
and says for each event type it knows, those of ``OUTBOX_ROUTING_KEYS`` and those in the
table, whether a queue receives its routing key.

Exit codes: 0 all is well; 1 reachable, but an event type has no queue bound (its events
come back unroutable); 2 the database or the broker is unreachable or misconfigured.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from ...backends import get_backend
from ...backends.base import BaseBackend, BrokerUnavailable, Reason
from ...db import DbNow
from ...models import OutboxEvent, Status, outbox_db
from ..errors import DatabaseCommand, backend_errors, database_errors, describe

#: Event types in the table are read from the rows not yet sent and those created this
#: recently (the (status, created_at) index serves both): a type last sent a year ago is
#: not one to check.
RECENT = timedelta(days=7)


class Command(DatabaseCommand):
    publishes = True

    def add_arguments(self, parser: CommandParser) -> None:
        self.add_database_argument(parser)

    def handle(self, *, database: str | None, **options: Any) -> None:
        using = outbox_db(database)
        self.stdout.write(f"database {describe(using)}: reachable, outbox table present")
        with backend_errors():
            backend = get_backend()
        with database_errors("outbox_check", using):
            keys = routing_keys(backend, using)
        try:
            check = backend.check_routes(sorted(set(keys.values())))
        except BrokerUnavailable as exc:
            raise CommandError(
                f"outbox_check: the broker is unreachable: {exc}", returncode=2
            ) from exc
        self.stdout.write(f"broker: {check.target}")
        if not keys:
            self.stdout.write("no event types known yet (none in OUTBOX_ROUTING_KEYS or the table)")
            return
        if check.routes is None:
            self.stdout.write(f"routes not checked: {check.unknown}")
            for event_type, key in keys.items():
                self.stdout.write(f"  {_name(event_type, key)}")
            return
        routes = {route.routing_key: route for route in check.routes}
        unbound = []
        for event_type, key in keys.items():
            destinations = routes[key].destinations
            if destinations:
                self.stdout.write(f"  {_name(event_type, key)}: {', '.join(destinations)}")
            else:
                unbound.append(event_type)
                self.stdout.write(f"  {_name(event_type, key)}: NO QUEUE BOUND")
        if unbound:
            raise CommandError(
                f"outbox_check: {len(unbound)} of {len(keys)} event types reach no queue "
                f"({', '.join(unbound)}): their events come back from the broker unroutable; "
                f"{Reason.UNROUTABLE.fix}",
                returncode=1,
            )
        self.stdout.write(f"outbox_check: every event type ({len(keys)}) reaches a queue")


def routing_keys(backend: BaseBackend, using: str) -> dict[str, str]:
    """Each known event type and the routing key the backend publishes it with: the types
    named in the routing keys setting and those of the rows not yet sent or recent."""
    rows = OutboxEvent.objects.using(using).order_by()
    in_table = {
        event_type
        for selection in (
            rows.filter(status__in=[Status.PENDING, Status.DEAD]),
            rows.filter(created_at__gte=DbNow() - RECENT),
        )
        for event_type in selection.values_list("event_type", flat=True).distinct()
    }
    keys = {}
    by_function = backend._routing_key_func is not None
    for event_type in sorted(set(backend.routing_keys) | in_table):
        event = OutboxEvent(event_type=event_type)
        if by_function:
            # A routing key function may read more of the event than its type: ask it with
            # the newest row of the type.
            event = rows.filter(event_type=event_type).order_by("-id").first() or event
        keys[event_type] = backend.routing_key(event)
    return keys


def _name(event_type: str, key: str) -> str:
    return event_type if key == event_type else f"{event_type} (routing key {key})"
