"""Settings of the relay children in tests/test_ordered_relays.py (real RabbitMQ).

The test passes the exchange and the lease through the environment; ``OUTBOX_ORDERED=1``
is read by the demo's settings, as from the shell.
"""

import faulthandler
import os
import signal
from typing import Any

from tests.settings import *  # noqa: F403

# A relay that goes quiet in a test shows where each of its threads is (Relays.dump_stacks).
faulthandler.register(signal.SIGUSR1, all_threads=True)

OUTBOX_BACKEND = "django_outbox.backends.pika.PikaBackend"
OUTBOX_EXCHANGE = os.environ.get("ORDERED_TEST_EXCHANGE", "outbox")
OUTBOX_ROUTING_KEY_FUNC = "tests.ordered_settings.routing_key"
# Short steps so failed first attempts come back quickly; enough of them that a confirm
# timeout on a loaded machine does not make a row DEAD (only the poison event goes DEAD).
OUTBOX_RETRY_SCHEDULE = [0.3, 0.3, 0.3, 1, 1, 1, 1, 1]
OUTBOX_LEASE_SECONDS = float(os.environ.get("ORDERED_TEST_LEASE", "60"))
OUTBOX_CONFIRM_TIMEOUT = min(10.0, OUTBOX_LEASE_SECONDS / 2)
OUTBOX_POLL_INTERVAL = 0.2
OUTBOX_DB_THREAD = os.environ.get("ORDERED_TEST_DB_THREAD", "1") == "1"

#: The only routing key the test's queue binds; anything else comes back unroutable.
ROUTABLE = "ok"


def routing_key(event: Any) -> str:
    """Unroutable on purpose: ``{"fail": "first"}`` on the first attempt, "always" always."""
    fail = event.payload.get("fail") if isinstance(event.payload, dict) else None
    if fail == "always" or (fail == "first" and event.retry_count == 0):
        return "nowhere"
    return ROUTABLE
