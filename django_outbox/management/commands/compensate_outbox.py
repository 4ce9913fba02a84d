"""manage.py compensate_outbox: one pass over stale PENDING rows, then exit (a CronJob).

Deliver PENDING outbox events the relay left behind (older than --stale-after), at most
--max-batch, then exit. Meant for a Kubernetes CronJob every 5 minutes.

Exit codes: 0 nothing failed; 1 some events failed or went DEAD; 2 misconfigured, or the
database or broker unreachable.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from ...relay import BrokerOutage, Relay, stale_source
from ...worker import configure_logging
from ..errors import DatabaseCommand, backend_errors, database_errors
from ..options import duration, positive_int

__all__ = ["Command", "stale_source"]


class Command(DatabaseCommand):
    publishes = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--stale-after",
            type=duration,
            default=None,
            help="Only rows created at least this long ago, e.g. 10m (default "
            "OUTBOX_COMPENSATE_STALE_AFTER, 600 s).",
        )
        parser.add_argument(
            "--max-batch",
            type=positive_int,
            default=None,
            help="At most this many rows per run (default OUTBOX_COMPENSATE_MAX_BATCH, 500).",
        )
        self.add_database_argument(parser)

    def handle(
        self,
        *,
        stale_after: float | None,
        max_batch: int | None,
        database: str | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        with backend_errors():
            relay = Relay.compensator(stale_after=stale_after, max_batch=max_batch, using=database)
        try:
            with database_errors("compensate_outbox", relay.using):
                result = relay.drain()
        except BrokerOutage as exc:
            raise CommandError(
                f"compensate_outbox: the broker is unreachable ({exc}); the rows stay PENDING "
                "for the next run.",
                returncode=2,
            ) from exc
        except DatabaseError as exc:
            raise CommandError(
                f"compensate_outbox: the database failed ({' '.join(str(exc).split())}); "
                "the rows stay PENDING for the next run.",
                returncode=2,
            ) from exc
        self.stdout.write(f"compensate_outbox: {result.summary()}")
        if result.failed or result.dead:
            raise CommandError(result.failure_report(), returncode=1)
