"""The relay: claim -> send -> collect -> settle. One engine for publish_outbox and
compensate_outbox; see :mod:`django_outbox.relay.engine`."""

from .engine import BrokerOutage, PassResult, Relay, due_source, stale_source
from .wake import PostgresNotifyWaker, Waker, make_waker

__all__ = [
    "BrokerOutage",
    "PassResult",
    "PostgresNotifyWaker",
    "Relay",
    "Waker",
    "due_source",
    "make_waker",
    "stale_source",
]
