"""Counting rows of a big outbox without reading them all: exact up to a bound, an estimate
above it.

``COUNT(*)`` reads every row it counts: with a million PENDING rows, each count the
dashboard, the gauges and the admin's event list made took 100-300 ms on PostgreSQL, and
the pages made several (``bench.reads_bench``, docs/benchmarks.md). :func:`count_rows`
counts at most :data:`EXACT_UP_TO` rows (``SELECT COUNT(*) FROM (... LIMIT n + 1)``, which
stops there); a figure that is over the bound is the database planner's estimate of the
same query (PostgreSQL's ``EXPLAIN``, from the table's statistics; MySQL/MariaDB's
``EXPLAIN`` row count, from index dives or the table's statistics), and says so
(:attr:`RowCount.estimated`): the pages show it as "about N". SQLite, for development, has
no estimate: it counts exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.utils.formats import number_format
from django.utils.translation import gettext

#: Counts up to this many rows are exact; above it, the planner's estimate. Reading 100,000
#: index entries takes a few tens of ms, and an alert on a backlog sits well below it.
EXACT_UP_TO = 100_000


@dataclass(frozen=True)
class RowCount:
    """A number of rows, and whether it is the planner's estimate (above the bound)."""

    value: int
    estimated: bool = False

    def __int__(self) -> int:
        return self.value

    def __str__(self) -> str:
        if not self.estimated:
            return str(self.value)
        return gettext("about %(count)s") % {"count": number_format(rounded(self.value))}


def rounded(value: int) -> int:
    """An estimate to two significant digits: 1,034,567 is about 1,000,000."""
    if value < 100:
        return value
    step = 10 ** (len(str(value)) - 2)
    return round(value / step) * step


def count_rows(queryset: QuerySet[Any], exact_up_to: int | None = None) -> RowCount:
    """How many rows ``queryset`` holds: exact up to ``exact_up_to``, else the database's
    estimate (at least ``exact_up_to + 1``: that many were counted). ``exact_up_to``:
    default :data:`EXACT_UP_TO`, read at each call."""
    if exact_up_to is None:
        exact_up_to = EXACT_UP_TO
    queryset = queryset.order_by()
    counted = queryset[: exact_up_to + 1].count()
    if counted <= exact_up_to:
        return RowCount(counted)
    estimate = planner_rows(queryset)
    if estimate is None:
        return RowCount(queryset.count())
    return RowCount(max(estimate, exact_up_to + 1), estimated=True)


def planner_rows(queryset: QuerySet[Any]) -> int | None:
    """The planner's estimate of the rows ``queryset`` returns; None where there is none
    (SQLite)."""
    connection = connections[queryset.db]
    # Compiled for the rows' own database: sql_with_params() compiles for the default one.
    sql, params = queryset.values("pk").query.get_compiler(using=queryset.db).as_sql()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
        if isinstance(plan, str):  # psycopg2 without its JSON adapter
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN {sql}", params)
            names = [column[0].lower() for column in cursor.description]
            row = dict(zip(names, cursor.fetchone(), strict=True))
        # One table: its row estimate, cut by the share MySQL expects the WHERE to keep
        # (MariaDB shows no "filtered" column in a plain EXPLAIN: its rows are the range's).
        rows = float(row.get("rows") or 0)
        return int(rows * float(row.get("filtered") or 100) / 100)
    return None


class About(int):
    """A count that is an estimate: an ``int`` for arithmetic, ``about N`` on a page."""

    def __str__(self) -> str:
        return str(RowCount(int(self), estimated=True))


class EstimatingPaginator(Paginator):
    """The admin's paginator for the outbox: :func:`count_rows`, not ``COUNT(*)``.

    Above the bound its ``count`` is an :class:`About`, which the admin's templates show
    as "about N outbox events" (and "Select all about N"); the pages past an estimate that
    was too high are empty."""

    @cached_property
    def count(self) -> int:  # type: ignore[override]
        if not isinstance(self.object_list, QuerySet):
            return len(self.object_list)
        counted = count_rows(self.object_list)
        return About(counted.value) if counted.estimated else counted.value
