"""manage.py outbox_stats: the outbox's health figures in the terminal, or as a gate.

Exit codes: 0 all figures within the thresholds given (or none given), 1 a threshold was
crossed, 2 the database could not be read (the message says what to check).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from ... import ordering, stats
from ...models import outbox_db
from ..options import duration, non_negative_int


class Command(BaseCommand):
    help = (
        "Print the outbox's health figures (PENDING, DEAD, oldest PENDING age, SENT in the "
        "window) and the status x retry_count triage table. With thresholds, exit 1 when "
        "one is crossed, so it can gate a deployment or run as a check."
    )

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
        parser.add_argument(
            "--database",
            default=None,
            help="Database alias to read the outbox from (default: the one the relay writes "
            "to, the database router's choice).",
        )

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
            snapshot = stats.collect(window=since, using=database)
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

        crossed = []
        if max_pending is not None and snapshot.pending > max_pending:
            crossed.append(
                f"{snapshot.pending} PENDING events, more than --max-pending {max_pending}"
            )
        if max_oldest_age is not None and snapshot.oldest_pending_age > max_oldest_age:
            crossed.append(
                f"oldest PENDING event is {snapshot.oldest_pending_age:.0f}s old, older than "
                f"--max-oldest-age {max_oldest_age:g}s"
            )
        if max_dead is not None and snapshot.dead > max_dead:
            crossed.append(f"{snapshot.dead} DEAD events, more than --max-dead {max_dead}")
        if max_blocked is not None and snapshot.blocked_aggregates > max_blocked:
            crossed.append(
                f"{snapshot.blocked_aggregates} aggregates blocked by a DEAD head, more than "
                f"--max-blocked {max_blocked}"
            )

        if json:
            self._print_json(snapshot, crossed)
        else:
            self._print_text(snapshot, crossed)
        if crossed:
            raise CommandError("threshold crossed: " + "; ".join(crossed), returncode=1)

    def _print_json(self, snapshot: stats.OutboxStats, crossed: list[str]) -> None:
        data = snapshot.as_dict()
        data["thresholds_crossed"] = crossed
        self.stdout.write(json.dumps(data, indent=2, sort_keys=True))

    def _print_text(self, snapshot: stats.OutboxStats, crossed: list[str]) -> None:
        window = stats.format_age(snapshot.window)
        age = stats.format_age(snapshot.oldest_pending_age) if snapshot.pending else "-"
        figures = [
            ("PENDING", snapshot.pending),
            ("oldest PENDING age", age),
            ("DEAD", snapshot.dead),
            (f"SENT (last {window})", snapshot.sent_in_window),
            (f"created (last {window})", snapshot.created_in_window),
            *sorted(snapshot.extra.items()),
        ]
        if ordering.is_enabled():
            figures.append(("blocked aggregates", snapshot.blocked_aggregates))
        pad = max(len(label) for label, _ in figures)
        lines = [f"{label:<{pad}}  {value}" for label, value in figures]
        lines.append("")
        retries, table = snapshot.triage_matrix()
        lines.append(f"status x retry_count, rows created in the last {window}:")
        if retries:
            width = max(6, *(len(str(n)) for _, counts in table for n in counts))
            header = "status   " + " ".join(f"{r:>{width}}" for r in retries)
            lines.append(header)
            for label, counts in table:
                lines.append(f"{label:<8} " + " ".join(f"{n:>{width}}" for n in counts))
        else:
            lines.append("  (no rows)")
        if snapshot.top_dead_types:
            lines.append("")
            lines.append("top event types among dead letters:")
            lines += [f"  {n:>6}  {event_type}" for event_type, n in snapshot.top_dead_types]
        if snapshot.blocked:
            lines.append("")
            lines.append(
                "aggregates blocked by a DEAD head (fix the cause, then requeue the head):"
            )
            lines += [
                f"  {b.aggregate_type}:{b.aggregate_id}  head id={b.id} {b.event_type} "
                f"event_id={b.event_id}  {b.waiting} waiting  {' '.join(b.last_error.split())[:80]}"
                for b in snapshot.blocked
            ]
        for message in crossed:
            lines.append("")
            lines.append(f"THRESHOLD CROSSED: {message}")
        self.stdout.write("\n".join(lines))
