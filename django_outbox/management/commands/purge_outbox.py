"""manage.py purge_outbox: delete old SENT outbox rows and old inbox rows in batches (a
daily CronJob).

Delete SENT outbox rows older than the retention (OUTBOX_RETENTION_DAYS, 7) in batches;
DEAD rows only with --include-dead. PENDING rows are never deleted. Inbox rows go after
OUTBOX_INBOX_RETENTION_DAYS (14), never sooner than SENT rows.

Exit codes: 0 done (also when nothing was old enough); 2 misconfigured (retention below 3
days without --force) or the database unreachable.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from ...conf import outbox_settings
from ...models import outbox_db
from ...purge import RetentionTooShort, purge
from ..errors import DatabaseCommand, database_work
from ..options import days, positive_int


class Command(DatabaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than-days",
            type=days,
            default=None,
            help="Retention in days (default OUTBOX_RETENTION_DAYS, 7; at least 3 without "
            "--force).",
        )
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="Rows per DELETE, each in its own transaction (default "
            "OUTBOX_PURGE_BATCH_SIZE, 1000).",
        )
        parser.add_argument(
            "--include-dead",
            action="store_true",
            default=None,
            help="Also delete DEAD rows past retention (default OUTBOX_PURGE_DEAD, off): "
            "they were never delivered.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would go; delete nothing."
        )
        parser.add_argument("--force", action="store_true", help="Allow a retention below 3 days.")
        self.add_database_argument(parser)

    def handle(
        self,
        *,
        older_than_days: float | None,
        batch_size: int | None,
        include_dead: bool | None,
        dry_run: bool,
        force: bool,
        database: str | None,
        **options: Any,
    ) -> None:
        try:
            with database_work(
                "purge_outbox",
                outbox_db(database),
                unfinished="nothing more was deleted, run it again later",
            ):
                result = purge(
                    older_than_days=older_than_days,
                    batch_size=batch_size,
                    include_dead=include_dead,
                    dry_run=dry_run,
                    force=force,
                    using=database,
                    on_batch=self._print_batch if options["verbosity"] >= 2 else None,
                )
        except RetentionTooShort as exc:
            raise CommandError(str(exc), returncode=2) from exc
        except ValueError as exc:
            raise CommandError(
                f"{exc} Check OUTBOX_RETENTION_DAYS, OUTBOX_PURGE_BATCH_SIZE and "
                f"OUTBOX_INBOX_RETENTION_DAYS (now {outbox_settings.RETENTION_DAYS!r}, "
                f"{outbox_settings.PURGE_BATCH_SIZE!r}, "
                f"{outbox_settings.INBOX_RETENTION_DAYS!r}).",
                returncode=2,
            ) from exc
        for warning in result.warnings:
            self.stderr.write(f"purge_outbox: {warning}", self.style.WARNING)
        self.stdout.write(result.summary())

    def _print_batch(self, kind: str, rows: int, seconds: float) -> None:
        self.stdout.write(f"purge_outbox: {rows} {kind} row(s) deleted in {seconds * 1000:.0f} ms")
