"""manage.py publish_outbox: the long-running relay (several replicas are safe).

Relay committed outbox events to the broker, marking them SENT only after the broker
confirmed them. Runs until SIGTERM/SIGINT; --once drains what is due and exits.

Exit codes: 0 stopped by a signal (``--once``: nothing failed); 1 a second signal
(``--once``: some events failed); 2 misconfigured, the database unreachable at start
(``--once``: at any point), or with ``--once`` the broker unreachable.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser

from ...backends import get_backend
from ...relay import BrokerOutage, Relay
from ...worker import configure_logging, stop_on_signals
from ..errors import DatabaseCommand, backend_errors, database_errors
from ..options import duration, port, positive_int

logger = logging.getLogger("django_outbox.relay")


class Command(DatabaseCommand):
    publishes = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="Drain what is due now, then exit.")
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="Events per batch (default OUTBOX_BATCH_SIZE; unset: 1000 on PostgreSQL "
            "and MySQL/MariaDB, 500 on SQLite).",
        )
        parser.add_argument(
            "--interval",
            type=duration,
            default=None,
            help="Sleep when nothing is due, e.g. 1s or 500ms (default OUTBOX_POLL_INTERVAL).",
        )
        parser.add_argument(
            "--max-events",
            type=positive_int,
            default=None,
            help="Exit after handling this many events (tests, one-off catch-up).",
        )
        parser.add_argument(
            "--heartbeat-file",
            default=None,
            help="Touch this file every loop, for a liveness probe (OUTBOX_HEARTBEAT_FILE).",
        )
        parser.add_argument(
            "--metrics-port",
            type=port,
            default=None,
            help="Serve Prometheus metrics on this port (0 or unset: do not serve).",
        )
        self.add_database_argument(parser)

    def handle(
        self,
        *,
        once: bool,
        batch_size: int | None,
        interval: float | None,
        max_events: int | None,
        heartbeat_file: str | None,
        metrics_port: int | None,
        database: str | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        if settings.DEBUG:
            logger.warning(
                "DEBUG is on: Django records every query the relay makes, which costs it a "
                "good part of its throughput (see docs/benchmarks.md). Run the relay with "
                "DEBUG = False in production."
            )
        with backend_errors():
            relay = Relay(
                backend=get_backend(),
                batch_size=batch_size,
                heartbeat_file=heartbeat_file,
                using=database,
            )
        if metrics_port:
            from ...metrics import start_metrics_server

            start_metrics_server(metrics_port, using=relay.using)

        if once:
            try:
                with database_errors("publish_outbox", relay.using):
                    result = relay.drain(max_events=max_events)
            except BrokerOutage as exc:
                raise CommandError(f"The broker is unreachable: {exc}", returncode=2) from exc
            self.stdout.write(f"publish_outbox: {result.summary()}")
            if result.failed:
                raise CommandError(result.failure_report(), returncode=1)
            return

        stop = threading.Event()
        with stop_on_signals(stop, lambda msg: self.stderr.write(msg)):
            result = relay.serve(stop=stop, interval=interval, max_events=max_events)
        self.stdout.write(f"publish_outbox stopped: {result.summary()}")
