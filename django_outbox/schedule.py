"""When an outbox row is due: the SQL of a scheduled row's due time (``emit(deliver_at=,
delay=)``), of "scheduled for later" and of "due since", which staleness and the oldest
PENDING age count from. Part of the data layer, beside :mod:`~django_outbox.querysets`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import models
from django.db.models.functions import Coalesce, Greatest

from .db import DbNow
from .states import Status


def as_timedelta(value: float | timedelta) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


def due_time(deliver_at: datetime | None = None, delay: timedelta | None = None) -> Any:
    """The SQL of when a new row becomes due, by the database clock at its INSERT: ``delay``
    after it, or ``deliver_at`` (at the earliest then: a time in the past is due now).

    An expression, not a value, so a block of events is still one INSERT and the worker's
    clock decides nothing. None when the row is due at once.
    """
    if delay is not None:
        return _DueTime(DbNow() + delay)
    if deliver_at is not None:
        return _DueTime(
            Greatest(
                models.Value(deliver_at, output_field=models.DateTimeField()),
                DbNow(),
                output_field=models.DateTimeField(),
            )
        )
    return None


class _DueTime(models.Expression):
    """:func:`due_time`'s expression, resolved and compiled once per connection however
    many columns of the INSERT use it (``next_retry_time`` and ``due_at``).

    Django resolves and compiles an expression given as a field's value once per row and
    column, and resolving date arithmetic is most of the cost of inserting a scheduled
    row: without this, a block of 1,000 scheduled events took four times as long to build
    its INSERT as one of unscheduled events. It refers to no column, so there is nothing
    to resolve against the INSERT's query.
    """

    output_field = models.DateTimeField()

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self._compiled: dict[str, tuple[str, Any]] = {}

    def resolve_expression(self, *args: Any, **kwargs: Any) -> _DueTime:
        return self

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, Any]:
        if connection.alias not in self._compiled:
            inner = self.inner.resolve_expression(compiler.query, allow_joins=False)
            self._compiled[connection.alias] = compiler.compile(inner)
        return self._compiled[connection.alias]


def scheduled_q(now: Any = None) -> models.Q:
    """PENDING and scheduled for later than ``now`` (default: the database clock).

    A row in retry backoff is not scheduled (its ``due_at`` has passed, only its
    ``next_retry_time`` is ahead): it is a delivery that failed, and counts as PENDING.
    """
    return models.Q(status=Status.PENDING, due_at__gt=DbNow() if now is None else now)


def due_q(now: Any) -> models.Q:
    """Of the PENDING rows, those :func:`scheduled_q` leaves out at ``now``: never
    scheduled nor requeued, or due since (written out, not negated, so that a count of
    them reads the ``due_at`` range itself)."""
    return models.Q(due_at__isnull=True) | models.Q(due_at__lte=now)


def due_since() -> Coalesce:
    """When a row became due: ``due_at`` (scheduled, or requeued), else ``created_at``.

    What staleness and the oldest PENDING age count from, so an event scheduled a week
    ahead is not a week-old incident, while a row failing since it became due still ages.
    """
    return Coalesce("due_at", "created_at")
