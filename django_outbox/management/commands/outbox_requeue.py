"""manage.py outbox_requeue: redrive dead letters, or replay sent events, in bulk.

Requeue outbox events in bulk: DEAD ones by default (a redrive), PENDING ones in retry
backoff, or SENT ones (a replay: published again with the same event_id and an
x-outbox-replay header). They become due now with retry_count 0, in batches.

Exit codes: 0 done (also when nothing matched, and for a dry run); 2 misconfigured (an
option that makes no sense, an unknown database alias) or the database unreachable.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from ...conf import outbox_settings
from ...models import outbox_db
from ...requeue import DEFAULT_BATCH_SIZE, NO_SENT_ROWS, STATUSES, Selection, requeue
from ..errors import DatabaseCommand, database_work
from ..options import moment, positive_int


class Command(DatabaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--status",
            choices=sorted(STATUSES),
            default="dead",
            help="Which events: dead (default), pending (in retry backoff: attempted and "
            "due later; the others are left alone and counted) or sent (a replay: only "
            "when named).",
        )
        parser.add_argument(
            "--event-type",
            action="append",
            dest="event_types",
            default=[],
            metavar="TYPE",
            help="Only this event type (repeat for several).",
        )
        parser.add_argument("--aggregate-type", default=None, help="Only this aggregate type.")
        parser.add_argument("--aggregate-id", default=None, help="Only this aggregate id.")
        parser.add_argument(
            "--error-contains",
            default=None,
            metavar="TEXT",
            help="Only events whose last_error contains TEXT (case-insensitive), e.g. "
            "'[unroutable]'.",
        )
        parser.add_argument(
            "--since",
            type=moment,
            default=None,
            help="Only events created at or after this: 2026-12-03T10:00Z, or a duration "
            "ago (6h, 2d) by the database clock.",
        )
        parser.add_argument(
            "--until",
            type=moment,
            default=None,
            help="Only events created before this (same forms as --since).",
        )
        parser.add_argument(
            "--limit", type=positive_int, default=None, help="At most this many, oldest first."
        )
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=DEFAULT_BATCH_SIZE,
            help=f"Events per UPDATE, each in its own transaction (default {DEFAULT_BATCH_SIZE}).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Print how many would be requeued and the first of them; change nothing.",
        )
        self.add_database_argument(parser)

    def handle(
        self,
        *,
        status: str,
        event_types: list[str],
        aggregate_type: str | None,
        aggregate_id: str | None,
        error_contains: str | None,
        since: datetime | timedelta | None,
        until: datetime | timedelta | None,
        limit: int | None,
        batch_size: int,
        dry_run: bool,
        database: str | None,
        **options: Any,
    ) -> None:
        if status == "sent" and outbox_settings.deletes_on_confirm:
            self.stderr.write(f"outbox_requeue: {NO_SENT_ROWS}", self.style.WARNING)
        selection = Selection(
            status=STATUSES[status],
            event_types=tuple(event_types),
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            error_contains=error_contains,
            since=since,
            until=until,
        )
        try:
            with database_work(
                "outbox_requeue",
                outbox_db(database),
                unfinished="batches already requeued stay so, run it again for the rest",
            ):
                result = requeue(
                    selection,
                    limit=limit,
                    batch_size=batch_size,
                    dry_run=dry_run,
                    using=database,
                )
        except ValueError as exc:
            raise CommandError(f"outbox_requeue: {exc}.", returncode=2) from exc
        self.stdout.write(result.summary())
        if result.sample:
            self.stdout.write(f"the first {len(result.sample)}, oldest first:")
            self.stdout.write("\n".join(result.sample_lines()))
