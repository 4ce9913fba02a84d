"""Celery integration: idempotent consumer tasks and the beat schedule of the periodic jobs.

A consumer service that is a Celery worker runs each outbox event as a task (sent by
:class:`~django_outbox.backends.celery.CeleryBackend`, one task name per event type)::

    from celery import shared_task
    from django_outbox.celery import IdempotentTask

    @shared_task(base=IdempotentTask, name="points.award_points", dedup_model=PointsLedger)
    def award_points(event: ReceivedEvent) -> None:
        PointsLedger.objects.create(source_event_id=event.event_id, ...)

:class:`IdempotentTask` gives the task what :class:`~django_outbox.consumer.IdempotentHandler`
gives a consume_outbox handler, through the same code: the function runs inside
``transaction.atomic()`` together with the record of the ``event_id`` (a unique
``source_event_id`` on ``dedup_model``'s row, or an InboxMessage row); a duplicate rolls
back and is a successful no-op; the message is acknowledged late, so a worker that dies
mid-task gets it redelivered.

The periodic jobs (publish, compensate, purge) are in :mod:`django_outbox.tasks`;
:func:`beat_schedule` schedules them. Only this module, ``django_outbox.tasks`` and
``django_outbox.backends.celery`` import Celery.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.schedules import crontab

from . import tracing
from .message import ReceivedEvent, UndecodableMessage, decode_task_envelope

if TYPE_CHECKING:
    from django.db import models

    from .consumer.handlers import IdempotentHandler, Outcome

# Importable before django.setup() (a project's celery.py imports beat_schedule from here):
# the consumer module, which defines a model, is imported when a task first runs.

__all__ = ["IdempotentTask", "beat_schedule"]

logger = logging.getLogger("django_outbox.celery")

COMPENSATE_TASK = "django_outbox.compensate"
PURGE_TASK = "django_outbox.purge"
PUBLISH_TASK = "django_outbox.publish"


class IdempotentTask(Task):
    """Base class of a Celery task that consumes one outbox event, exactly once in effect.

    The task is called with the event envelope the Celery backend sends (or a
    :class:`~django_outbox.message.ReceivedEvent`) and its function receives a
    ``ReceivedEvent``. Set ``dedup_model`` (and ``dedup_field``) for business-row
    de-duplication, as on an IdempotentHandler; without it an InboxMessage row named after
    the task records the event. A failure rolls everything back and is retried
    ``max_retries`` times with a growing pause (``default_retry_delay`` doubled per retry,
    at most ``retry_backoff_max`` seconds), then fails the task.
    """

    acks_late = True  # acknowledged after the transaction committed (or rolled back)
    reject_on_worker_lost = True  # a worker killed mid-task: the message comes back
    max_retries = 5
    default_retry_delay = 1
    retry_backoff_max = 60

    dedup_model: ClassVar[type[models.Model] | None] = None
    dedup_field: ClassVar[str] = "source_event_id"

    _handler_class: type[IdempotentHandler] | None = None

    def __call__(self, event: Any, *args: Any, **kwargs: Any) -> Any:
        from .consumer.handlers import Outcome

        delivery = self.request.delivery_info or {}
        try:
            received = decode_task_envelope(event, redelivered=bool(delivery.get("redelivered")))
        except UndecodableMessage as exc:
            if self.request.called_directly:
                raise
            # Not an event this task can ever run: no retry. Rejected without requeue, the
            # message goes to the queue's dead-letter exchange, as consume_outbox does with
            # it; failing the task instead would ack it (task_acks_on_failure_or_timeout).
            logger.error("task %s: rejected to the dead-letter exchange: %s", self.name, exc)
            raise Reject(str(exc), requeue=False) from exc
        handler: Any = self.handler_class()(self, args, kwargs)  # type: ignore[call-arg]
        where = tracing.Delivery(
            str(delivery.get("exchange") or ""),
            str(delivery.get("routing_key") or ""),
        )
        with tracing.processing(received, self.name, where) as span:
            outcome = self._process(handler, received, span)
            span.outcome(outcome.value)
        if outcome is Outcome.DUPLICATE:
            logger.info(
                "task %s: %s %s is a duplicate; nothing done",
                self.name,
                received.event_type,
                received.event_id,
            )
            return None
        return handler.returned

    def _process(
        self, handler: IdempotentHandler, received: ReceivedEvent, span: tracing.ProcessSpan
    ) -> Outcome:
        """``handler.process()``; a failure is retried with a growing pause, up to
        ``max_retries`` times, then raised. A database failing under the task (a lost
        connection, a missing table, a lock timeout) is not the message's fault: retried
        with the same pause until it answers, never counted toward ``max_retries``."""
        from .consumer.handlers import database_fault

        try:
            return handler.process(received)
        except (Retry, Ignore, Reject, UndecodableMessage):
            raise
        except Exception as exc:
            span.exception(exc)  # the handler's error, not the Retry raised for it
            retries = self.request.retries or 0
            if self.request.called_directly:
                raise
            countdown = min(self.default_retry_delay * 2**retries, self.retry_backoff_max)
            if database_fault(exc):
                logger.warning(
                    "task %s: the database failed on %s %s; rolled back, retrying in %ss "
                    "(not counted toward max_retries): %s",
                    self.name,
                    received.event_type,
                    received.event_id,
                    countdown,
                    exc,
                )
                # One more than this retry: Celery's limit never ends it.
                raise self.retry(exc=exc, countdown=countdown, max_retries=retries + 1) from exc
            if retries >= self.max_retries:
                raise
            logger.warning(
                "task %s failed on %s %s (attempt %d of %d); rolled back, retrying in %ss: %s",
                self.name,
                received.event_type,
                received.event_id,
                retries + 1,
                self.max_retries + 1,
                countdown,
                exc,
            )
            raise self.retry(exc=exc, countdown=countdown) from exc

    @classmethod
    def handler_class(cls) -> type[IdempotentHandler]:
        """The IdempotentHandler that runs this task's function (built once per task)."""
        handler = cls._handler_class
        if handler is None or getattr(handler, "task_class", None) is not cls:
            handler = cls._handler_class = type(
                f"{cls.__name__}Handler",
                (_task_handler_base(),),
                {
                    "task_class": cls,
                    "dedup_model": cls.dedup_model,
                    "dedup_field": cls.dedup_field,
                    "name": cls.name,
                },
            )
        return handler


def _task_handler_base() -> type[IdempotentHandler]:
    from .consumer.handlers import IdempotentHandler

    class TaskHandler(IdempotentHandler):
        """Runs a task's function as ``handle()``, inside the handler's transaction."""

        def __init__(
            self, task: IdempotentTask, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> None:
            self.task, self.args, self.kwargs = task, args, kwargs
            self.returned: Any = None

        def handle(self, event: ReceivedEvent) -> None:
            # Task.__call__ keeps Celery's request stack right when called directly.
            self.returned = Task.__call__(self.task, event, *self.args, **self.kwargs)

    return TaskHandler


def beat_schedule(
    *,
    compensate_every: float = 300.0,
    purge_at: crontab | None = None,
    publish_every: float | None = None,
    databases: list[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Celery beat entries for the periodic jobs, as the article schedules them.

    Compensation every 5 minutes, purge once a day (03:30 by default); publishing every
    ``publish_every`` seconds only if no ``publish_outbox`` worker runs. Each entry expires
    when the next one is due, so ticks that waited in a busy queue are dropped rather
    than run back to back; overlapping runs are also refused by the tasks' own lock.

    ``databases``: the aliases whose outbox to work on, one set of entries each (named
    ``outbox-compensate@ALIAS`` ...); None is the router's choice, as before.
    """
    if databases is not None:
        if not databases:
            raise ValueError("databases must name at least one alias, or be None")
        one = beat_schedule(
            compensate_every=compensate_every, purge_at=purge_at, publish_every=publish_every
        )
        return {
            f"{name}@{alias}": {**entry, "kwargs": {"database": alias}}
            for alias in databases
            for name, entry in one.items()
        }
    purge_schedule = purge_at if purge_at is not None else crontab(hour=3, minute=30)
    schedule: dict[str, dict[str, Any]] = {
        "outbox-compensate": {
            "task": COMPENSATE_TASK,
            "schedule": compensate_every,
            "options": {"expires": compensate_every},
        },
        "outbox-purge": {
            "task": PURGE_TASK,
            "schedule": purge_schedule,
            "options": {"expires": 3600.0},
        },
    }
    if publish_every:
        schedule["outbox-publish"] = {
            "task": PUBLISH_TASK,
            "schedule": publish_every,
            "options": {"expires": publish_every},
        }
    return schedule
