"""The wake-up ``emit()`` sends the relays on PostgreSQL: :func:`request_wake`, a NOTIFY
right after the commit, never inside the business transaction, and at most one per
:data:`NOTIFY_WINDOW` from a process.

The relays' side (LISTEN, and the promise the window makes them) is ``relay/wake.py``.
Here, below ``outbox.py`` and the relay both, so that a process that only emits loads
none of the relay.
"""

from __future__ import annotations

import logging
import math
import time

from django.db import connections

from .conf import outbox_settings

# The relay's logger, as before this module was split from relay/wake.py: what it logs is
# about the relays' wake-up, and log filters name it.
logger = logging.getLogger("django_outbox.relay")

#: A transaction of its own that commits asynchronously (``is_local``: the setting ends with
#: it): the NOTIFY carries no data to make durable.
NOTIFY_SQL = "SELECT set_config('synchronous_commit', 'off', true), pg_notify(%s, '')"

#: Seconds after a NOTIFY during which the commits of the same process send none: the
#: relays it woke look again this long after their pass (relay/wake.py's docstring). A busy
#: process pays one round trip per window instead of one per commit (bench.emit_bench);
#: what a skipped commit may wait for a relay is about this long.
NOTIFY_WINDOW = 0.01

# Database alias -> time.monotonic() when this process last sent a NOTIFY there. Shared by
# the process's threads: a NOTIFY from any of them wakes the relays for all.
_last_notify: dict[str, float] = {}


def request_wake(using: str) -> None:
    """Wake the relays of database ``using``: ``emit()``'s ``on_commit`` hook, run once per
    transaction that emitted, right after its commit, on the same connection.

    Why not ``NOTIFY`` inside the business transaction, as PostgreSQL intends: a
    transaction that issued NOTIFY takes a lock that every other notifying transaction
    waits for at commit, and holds it until its commit record is flushed to disk, so with
    a NOTIFY in every business transaction concurrent writers commit one at a time
    (docs/benchmarks.md, "What an event costs"). Sent after the commit, the NOTIFY is a
    transaction of its own that commits asynchronously, holding that lock for
    microseconds; it costs the request one round trip, and no thread nor connection
    beside the request's own.

    Sent at most once per :data:`NOTIFY_WINDOW` by a process: a commit less than that after
    the last NOTIFY sends none, and a relay finds it within about that long all the same.

    Never raises: the events are committed whatever happens here. A failed NOTIFY is
    logged and the relays find the events at their next poll (``OUTBOX_POLL_INTERVAL``).
    """
    sending = time.monotonic()
    if sending - _last_notify.get(using, -math.inf) < NOTIFY_WINDOW:
        return
    connection = connections[using]
    try:
        # The driver's cursor, not Django's: none of its wrapping (query logging, error
        # translation) is of use here, and this runs after every commit that emitted.
        cursor = connection.connection.cursor()
        try:
            cursor.execute(NOTIFY_SQL, [outbox_settings.NOTIFY_CHANNEL])
        finally:
            cursor.close()
        _last_notify[using] = sending
    except Exception:
        logger.warning(
            "The NOTIFY that wakes the relays failed on database %r; they will find the "
            "committed events at their next poll (OUTBOX_POLL_INTERVAL).",
            using,
            exc_info=True,
        )
