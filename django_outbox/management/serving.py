"""What consume_outbox and outbox_worker share: the broker options of a consumer engine
and the run until a signal, with exit 2 when no broker node can be reached or a queue is
declared otherwise than the broker has it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from json import dumps
from typing import Any, Protocol

from django.core.management.base import CommandError, CommandParser

from ..consumer import BrokerUnreachable, ImproperlyConfiguredConsumer
from ..worker import stop_on_signals
from .errors import DatabaseCommand
from .options import positive_int
from .options import queue_type as queue_kind


class Totals(Protocol):
    def as_dict(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


class ConsumerCommand(DatabaseCommand):
    """A command that runs consumers over broker queues until SIGTERM/SIGINT (``--once``:
    until the queues are empty) and then prints its totals."""

    def add_broker_arguments(
        self,
        parser: CommandParser,
        *,
        prefetch: str,
        once: str,
        queue_type: str = "quorum or classic (default OUTBOX_CONSUMER_QUEUE_TYPE).",
    ) -> None:
        """``--exchange``, ``--prefetch``, ``--queue-type``, ``--once`` and ``--json``;
        ``prefetch``, ``once`` and ``queue_type`` are their help texts (a queue or every
        queue; the task queues' own default type)."""
        parser.add_argument(
            "--exchange", default=None, help="Exchange to bind to (default OUTBOX_EXCHANGE)."
        )
        parser.add_argument("--prefetch", type=positive_int, default=None, help=prefetch)
        parser.add_argument("--queue-type", type=queue_kind, default=None, help=queue_type)
        parser.add_argument("--once", action="store_true", help=once)
        parser.add_argument(
            "--json",
            action="store_true",
            help="At the end, print the totals as one JSON object instead of the summary line.",
        )

    def serve(self, serve: Callable[[threading.Event], Totals], *, json: bool) -> None:
        """Run ``serve(stop)`` with ``stop`` set by the first signal, then print the totals."""
        stop = threading.Event()
        with stop_on_signals(stop, lambda msg: self.stderr.write(msg)):
            try:
                result = serve(stop)
            except (BrokerUnreachable, ImproperlyConfiguredConsumer) as exc:
                raise CommandError(f"{self.command_name}: {exc}", returncode=2) from exc
        if json:
            self.stdout.write(dumps(result.as_dict(), sort_keys=True))
        else:
            self.stdout.write(f"{self.command_name} stopped: {result.summary()}")
