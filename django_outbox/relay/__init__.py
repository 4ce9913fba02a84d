"""The relay: claim -> send -> collect -> settle. One engine for publish_outbox and
compensate_outbox.

- :mod:`.engine`: :class:`Relay`, the steps of a batch, ``drain()`` (one pass), ``serve()``
- :mod:`.pipeline`: a drain with batches in flight while others are claimed and settled
- :mod:`.batch`: a batch and its stages, :class:`PassResult`, :class:`BrokerOutage`
- :mod:`.runs`: ordered mode on the relay, a batch's runs sent one confirm after another
- :mod:`.lanes`: where a drain's database work runs (this thread, or a claims thread and
  a settles thread)
- :mod:`.wake`: waiting between passes (polling, or LISTEN/NOTIFY on PostgreSQL)
"""

from .batch import Batch, BrokerOutage, PassResult, Stage
from .engine import Relay, due_source, stale_source
from .wake import PostgresNotifyWaker, Waker, make_waker

__all__ = [
    "Batch",
    "BrokerOutage",
    "PassResult",
    "PostgresNotifyWaker",
    "Relay",
    "Stage",
    "Waker",
    "due_source",
    "make_waker",
    "stale_source",
]
