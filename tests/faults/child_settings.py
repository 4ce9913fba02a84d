"""Settings of the relay and compensator processes the fault-injection tests start.

The test settings on the test's database, plus the real RabbitMQ backend and short timings.
``FAULTS_OUTBOX`` (JSON) sets any ``OUTBOX_*`` setting: the broker URL (often a TcpProxy's),
the test's own exchange, the lease, the retry schedule, routing keys.
"""

import json
import os

from tests.settings import *  # noqa: F403

OUTBOX_BACKEND = "django_outbox.backends.pika.PikaBackend"
OUTBOX_LEASE_SECONDS = 3.0
OUTBOX_POLL_INTERVAL = 0.2
OUTBOX_CONNECT_TIMEOUT = 3.0
OUTBOX_CONFIRM_TIMEOUT = 2.0
OUTBOX_BROKER_BACKOFF_MAX = 1.0

for _name, _value in json.loads(os.environ.get("FAULTS_OUTBOX", "{}")).items():
    if not _name.startswith("OUTBOX_"):
        raise ValueError(f"FAULTS_OUTBOX may only set OUTBOX_* settings, not {_name}")
    globals()[_name] = _value

# The tests read what happened from the children's stderr (relay warnings, dead-letter
# alerts), so log the outbox at INFO with the logger name.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_outbox": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        "pika": {"handlers": ["stderr"], "level": "ERROR", "propagate": False},
    },
}
