"""manage.py demo: the outbox story end to end, with a reconciliation at the end.

Exit codes: 0 the reconciliation adds up; 1 it does not (something was lost or counted
twice); 2 the demo could not run (a child process failed, a service is unreachable).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.management.options import non_negative_int, positive_int

from ...scenario import Demo, DemoError


class Command(BaseCommand):
    help = (
        "Create orders through the outbox, run the relay and the points consumer, kill the "
        "relay once and deliver some events twice on purpose, run the send_receipt task "
        "each order enqueued, then reconcile orders, outbox rows, points and receipts. "
        "Embedded (SQLite file, in-process broker) by default; PostgreSQL/MySQL and "
        "RabbitMQ, Redis or NATS when DATABASE_URL / BROKER_URL are set."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--orders", type=positive_int, default=100, help="Orders to create (default 100)."
        )
        parser.add_argument(
            "--duplicates",
            type=non_negative_int,
            default=5,
            help="Messages a consumer commits and then fails to acknowledge, so that the "
            "broker delivers them twice (default 5).",
        )
        parser.add_argument(
            "--seed", type=int, default=1, help="Seed of the orders' users and amounts."
        )
        parser.add_argument(
            "--inject-loss",
            type=non_negative_int,
            default=0,
            metavar="N",
            help="Fault injection: acknowledge N messages without handling them, as a "
            "consumer that acks before it commits would; the reconciliation then reports "
            "them lost and the demo exits 1.",
        )

    def handle(
        self,
        *,
        orders: int,
        duplicates: int,
        seed: int,
        inject_loss: int,
        verbosity: int,
        **options: Any,
    ) -> None:
        if verbosity < 2:
            # The story says what happened; the library's INFO lines would drown it.
            logging.getLogger("django_outbox").setLevel(logging.WARNING)
        with tempfile.TemporaryDirectory(prefix="outbox-demo-") as workdir:
            demo = Demo(
                orders=orders,
                duplicates=duplicates,
                inject_loss=inject_loss,
                seed=seed,
                verbosity=verbosity,
                amqp_url=getattr(settings, "BROKER_URL", ""),
                workdir=Path(workdir),
                write=self.stdout.write,
            )
            try:
                problems = demo.run()
            except DemoError as exc:
                raise CommandError(str(exc), returncode=2) from exc
        if problems:
            raise CommandError("the reconciliation does not add up", returncode=1)
