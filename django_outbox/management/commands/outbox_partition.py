"""manage.py outbox_partition: a PostgreSQL outbox partitioned by time (opt-in).

``--convert`` turns the table into one partitioned by ``created_at`` (a partition per
``--span``, a day by default); without it, the partitions of the next spans are created
and every partition is listed. ``purge_outbox`` then drops whole partitions past the
retention that hold SENT rows only (docs/operations.md, "A partitioned outbox").

Exit codes: 0 done; 2 misconfigured (not PostgreSQL, not partitioned without --convert,
converted already) or the database unreachable.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from ...models import outbox_db
from ...partitions import (
    DEFAULT_AHEAD,
    PartitionError,
    convert,
    ensure_partitions,
    is_partitioned,
    partitions,
)
from ..errors import DatabaseCommand, database_work
from ..options import duration, positive_int

MOMENT = "%Y-%m-%d %H:%M:%S"


class Command(DatabaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--convert",
            action="store_true",
            help="Turn the (unpartitioned) outbox table into a partitioned one and copy its "
            "rows, in one transaction; the old table is kept as <table>_unpartitioned.",
        )
        parser.add_argument(
            "--span",
            type=duration,
            default=86400.0,
            help="With --convert: the time each partition covers (default 1d).",
        )
        parser.add_argument(
            "--history",
            type=duration,
            default=7 * 86400.0,
            help="With --convert: partitions from this long ago (default 7d, the "
            "retention); older rows go to the DEFAULT partition.",
        )
        parser.add_argument(
            "--ahead",
            type=positive_int,
            default=DEFAULT_AHEAD,
            help=f"Partitions kept ready past now (default {DEFAULT_AHEAD}).",
        )
        self.add_database_argument(parser)

    def handle(
        self,
        *,
        convert: bool,
        span: float,
        history: float,
        ahead: int,
        database: str | None,
        **options: Any,
    ) -> None:
        using = outbox_db(database)
        try:
            with database_work(
                "outbox_partition", using, unfinished="nothing was changed, run it again"
            ):
                if convert:
                    done = self._convert(using, span, history, ahead)
                    self.stdout.write(done)
                    return
                if not is_partitioned(using):
                    raise PartitionError(
                        "The outbox table is not partitioned: run outbox_partition --convert "
                        "first (docs/operations.md, 'A partitioned outbox')."
                    )
                created = ensure_partitions(using, ahead=ahead)
                for partition in partitions(using):
                    bounds = "DEFAULT"
                    if partition.start is not None:
                        bounds = f"{partition.start:{MOMENT}} .. {partition.end:{MOMENT}} UTC"
                    self.stdout.write(f"{partition.name}  {bounds}")
                self.stdout.write(f"outbox_partition: created {len(created)} partition(s) ahead")
        except PartitionError as exc:
            raise CommandError(f"outbox_partition: {exc}", returncode=2) from exc

    def _convert(self, using: str, span: float, history: float, ahead: int) -> str:
        result = convert(
            using,
            span=timedelta(seconds=span),
            history=timedelta(seconds=history),
            ahead=ahead,
        )
        return (
            f"outbox_partition: converted, {result.rows} row(s) copied into "
            f"{len(result.partitions)} partition(s) and a DEFAULT one in {result.seconds:.1f} s; "
            f"the old table is kept as {result.kept_table}: drop it (DROP TABLE "
            f"{result.kept_table}) once you have checked the new one"
        )
