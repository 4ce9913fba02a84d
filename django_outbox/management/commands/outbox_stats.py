"""manage.py outbox_stats: the outbox's health figures in the terminal, or as a gate.

Print the outbox's health figures (PENDING, DEAD, oldest PENDING age, SENT in the window)
and the status x retry_count triage table. With thresholds, exit 1 when one is crossed, so
it can gate a deployment or run as a check.

Exit codes: 0 all figures within the thresholds given (or none given), 1 a threshold was
crossed, 2 the database could not be read (the message says what to check).
"""

from __future__ import annotations

from json import dumps
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from ... import stats
from ...models import outbox_db
from ..errors import DatabaseCommand, database_errors
from ..options import duration, non_negative_int


class Command(DatabaseCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")
        parser.add_argument(
            "--since",
            type=duration,
            default=stats.DEFAULT_WINDOW,
            help="Window of the triage table, SENT count and trend, e.g. 30m or 2h (default 1h).",
        )
        parser.add_argument(
            "--max-pending",
            type=non_negative_int,
            default=None,
            help="Exit 1 if more than this many events are PENDING.",
        )
        parser.add_argument(
            "--max-oldest-age",
            type=duration,
            default=None,
            help="Exit 1 if the oldest PENDING event is older than this (seconds or 10m).",
        )
        parser.add_argument(
            "--max-dead",
            type=non_negative_int,
            default=None,
            help="Exit 1 if more than this many events are DEAD (0: any dead letter fails).",
        )
        parser.add_argument(
            "--max-blocked",
            type=non_negative_int,
            default=None,
            help="Ordered mode: exit 1 if more than this many aggregates are blocked by a "
            "DEAD head.",
        )
        self.add_database_argument(parser)

    def handle(
        self,
        *,
        json: bool,
        since: float,
        max_pending: int | None,
        max_oldest_age: float | None,
        max_dead: int | None,
        max_blocked: int | None,
        database: str | None,
        **options: Any,
    ) -> None:
        database = outbox_db(database)
        try:
            with database_errors("outbox_stats", database):
                snapshot = stats.collect(window=since, using=database)
        except CommandError:
            raise
        except DatabaseError as exc:
            raise CommandError(
                f"Cannot read the outbox table from database {database!r}: {exc}. Check that "
                "the database is reachable with these settings and that `manage.py migrate "
                "django_outbox` has run.",
                returncode=2,
            ) from exc
        except Exception as exc:  # e.g. ConnectionDoesNotExist for a wrong --database
            raise CommandError(
                f"Cannot read the outbox from database {database!r}: {exc}", returncode=2
            ) from exc

        thresholds = stats.Thresholds(
            max_pending=max_pending,
            max_oldest_age=max_oldest_age,
            max_dead=max_dead,
            max_blocked=max_blocked,
        )
        crossed = thresholds.crossed(snapshot)
        if json:
            data = {**snapshot.as_dict(), "thresholds_crossed": crossed}
            self.stdout.write(dumps(data, indent=2, sort_keys=True))
        else:
            self.stdout.write(snapshot.as_text(crossed))
        if crossed:
            raise CommandError("threshold crossed: " + "; ".join(crossed), returncode=1)
