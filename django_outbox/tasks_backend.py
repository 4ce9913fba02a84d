"""Django's Tasks API on the outbox: ``task.enqueue()`` writes an outbox row in the caller's
transaction; the relay publishes it like any event; ``manage.py outbox_worker`` runs it
(``tasks_worker.py``) and records its result in ``OutboxTaskResult``.

    TASKS = {
        "default": {
            "BACKEND": "django_outbox.tasks_backend.OutboxTaskBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"MAX_RETRIES": 3},
        }
    }

The module is not ``django_outbox.tasks``: that name is the Celery periodic jobs', where
Celery's autodiscovery looks for them. docs/tasks.md tells the guarantees.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from . import outbox
from ._compat.tasks import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    set_result_field,
    task_enqueued,
)
from .message import PRIORITY_HEADER
from .models import OutboxEvent, OutboxTaskResult, outbox_db

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "EVENT_TYPE_PREFIX",
    "OutboxTask",
    "OutboxTaskBackend",
    "broker_priority",
    "task_event_type",
    "task_headers",
]

#: A task's outbox event type (and default routing key) is this and its queue's name.
EVENT_TYPE_PREFIX = "django.tasks."
#: Retries of a task that raises, after its first run, unless OPTIONS or the task say.
DEFAULT_MAX_RETRIES = 3
#: The broker queue the worker reads for a task queue is this and the queue's name.
DEFAULT_BROKER_QUEUE_PREFIX = "django.tasks."
#: What OPTIONS may hold.
OPTIONS = frozenset({"MAX_RETRIES", "DATABASE", "BROKER_QUEUE_PREFIX"})
#: The longest queue name: an event type holds 128 characters.
MAX_QUEUE_NAME = 128 - len(EVENT_TYPE_PREFIX)
#: The AMQP priorities of a task queue (its ``x-max-priority``): Django's priorities,
#: -100..100, fall into 0..10 in steps of 20 (:func:`broker_priority`). RabbitMQ advises
#: few levels: each is a queue of its own inside the broker queue.
BROKER_PRIORITIES = 10
# Django's range (django.tasks.base's TASK_MIN_PRIORITY/TASK_MAX_PRIORITY; the backport's).
_MIN_PRIORITY, _MAX_PRIORITY = -100, 100


def broker_priority(priority: int) -> int:
    """The AMQP priority a task of Django priority ``priority`` is published with: 0 for
    -100, 5 for the default 0 (-10..9), 10 for 100; higher runs first."""
    step = (_MAX_PRIORITY - _MIN_PRIORITY) // BROKER_PRIORITIES
    return (priority - _MIN_PRIORITY + step // 2) // step


def task_headers(priority: int) -> dict[str, int]:
    """The outbox headers of a task's message (each attempt's): its broker priority."""
    return {PRIORITY_HEADER: broker_priority(priority)}


def task_event_type(queue_name: str) -> str:
    """The outbox event type (and routing key) of the tasks of ``queue_name``."""
    return f"{EVENT_TYPE_PREFIX}{queue_name}"


@dataclass(frozen=True, kw_only=True)
class OutboxTask(Task):  # type: ignore[misc,unused-ignore]
    """Django's ``Task`` with a retry limit of its own: ``@task(max_retries=5)`` (None: the
    backend's ``MAX_RETRIES``). ``task.using(...)`` keeps it."""

    max_retries: int | None = None


class OutboxTaskBackend(BaseTaskBackend):  # type: ignore[misc,unused-ignore]
    """A ``django.tasks`` backend whose queue is the transactional outbox.

    ``enqueue()`` writes one outbox row on the outbox's database, in the transaction open on
    it (rolled back: the task never runs; committed: it runs at least once), or in one of
    its own that commits at once outside a transaction. ``run_after`` is the row's scheduled
    time. ``get_result()`` reads ``OutboxTaskResult``, or the outbox row while no worker has
    taken the task yet.

    OPTIONS: ``MAX_RETRIES`` (default 3): retries of a task that raises, after the
    backoff of ``OUTBOX_RETRY_SCHEDULE``; ``DATABASE``: the alias of the outbox to write to
    (default the router's choice for the outbox); ``BROKER_QUEUE_PREFIX`` (default
    ``django.tasks.``): the worker reads task queue ``q`` from the broker queue
    ``<prefix>q``.
    """

    task_class = OutboxTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    # A broker priority: each attempt's message carries the task's priority as its AMQP
    # priority, and the worker's task queues are RabbitMQ priority queues, where the
    # backlog of due tasks waits (docs/tasks.md, "Priority").
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = sorted(set(self.options) - OPTIONS)
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS'] has unknown keys {unknown}; "
                f"OutboxTaskBackend takes {', '.join(sorted(OPTIONS))}."
            )
        self.max_retries = _retries(
            self.options.get("MAX_RETRIES", DEFAULT_MAX_RETRIES),
            f"TASKS[{alias!r}]['OPTIONS']['MAX_RETRIES']",
            ImproperlyConfigured,
        )
        self.database: str | None = self.options.get("DATABASE")
        self.broker_queue_prefix = str(
            self.options.get("BROKER_QUEUE_PREFIX", DEFAULT_BROKER_QUEUE_PREFIX)
        )
        for name in self.queues:
            if not isinstance(name, str) or not name or len(name) > MAX_QUEUE_NAME:
                raise ImproperlyConfigured(
                    f"TASKS[{alias!r}]['QUEUES'] has {name!r}: a queue name is a string of "
                    f"1 to {MAX_QUEUE_NAME} characters (it becomes the routing key "
                    f"{EVENT_TYPE_PREFIX}<queue>)."
                )

    def broker_queue(self, queue_name: str) -> str:
        """The broker queue ``outbox_worker`` reads the tasks of ``queue_name`` from."""
        return f"{self.broker_queue_prefix}{queue_name}"

    @property
    def using(self) -> str:
        """The alias of the outbox the tasks are written to and their results read from."""
        return outbox_db(self.database)

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)
        max_retries = getattr(task, "max_retries", None)
        if max_retries is not None:
            _retries(max_retries, f"{task.module_path}: max_retries", InvalidTask)

    def task_retries(self, task: Any) -> int:
        """The retries ``task`` gets: its own ``max_retries``, else the backend's."""
        own = getattr(task, "max_retries", None)
        return self.max_retries if own is None else int(own)

    def enqueue(self, task: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Write the task as an outbox row in the open transaction on the outbox's database
        (outside one: in a transaction of its own, committed at once) and return its
        ``TaskResult``, READY, whose id is the row's ``event_id``."""
        self.validate_task(task)
        result: Any = TaskResult(
            task=task,
            id=str(uuid.uuid4()),
            status=TaskResultStatus.READY,
            enqueued_at=None,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            # TaskResult normalises them to JSON types, raising TypeError (or ValueError)
            # for what JSON cannot carry, as Django's own backends do.
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        using = self.using
        # No savepoint: a failed INSERT marks the caller's transaction for rollback anyway
        # (emit()), and a savepoint is one more round trip on every enqueue.
        with transaction.atomic(using=using, savepoint=False):
            event = outbox.emit(
                task_event_type(task.queue_name),
                payload=task_payload(result, self.task_retries(task)),
                event_id=result.id,
                headers=task_headers(task.priority),
                deliver_at=task.run_after,
                using=using,
            )
        set_result_field(result, "enqueued_at", event.occurred_at)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> Any:
        """The task's result: its ``OutboxTaskResult`` row, else (no worker has taken it
        yet) READY from its outbox row. Raises ``TaskResultDoesNotExist``."""
        using = self.using
        row = OutboxTaskResult.objects.using(using).filter(pk=result_id).first()
        if row is not None:
            return self.result_from_row(row)
        event = (
            OutboxEvent.objects.using(using)
            .filter(event_id=result_id, event_type__startswith=EVENT_TYPE_PREFIX)
            .only("event_id", "payload", "occurred_at")
            .first()
        )
        if event is None:
            raise TaskResultDoesNotExist(result_id)
        return self.result_from_payload(event.payload, enqueued_at=event.occurred_at)

    # -- between a TaskResult, the outbox payload and the results row ---------------------------
    def load_task(self, payload: Mapping[str, Any]) -> Any:
        """The ``Task`` a payload (or a results row, as a payload) names, as enqueued."""
        path = payload["task"]
        try:
            task = import_string(path)
        except ImportError as exc:
            raise InvalidTask(f"Task {path!r} cannot be imported: {exc}") from exc
        if not isinstance(task, Task):
            raise InvalidTask(f"{path!r} is not a task (decorate it with @task).")
        run_after = payload.get("run_after")
        return task.using(
            queue_name=payload.get("queue", task.queue_name),
            priority=payload.get("priority", task.priority),
            run_after=_datetime(run_after) if run_after else None,
            backend=self.alias,
        )

    def result_from_payload(self, payload: Mapping[str, Any], *, enqueued_at: datetime) -> Any:
        return TaskResult(
            task=self.load_task(payload),
            id=payload["id"],
            status=TaskResultStatus.READY,
            enqueued_at=enqueued_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=payload.get("args", []),
            kwargs=payload.get("kwargs", {}),
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )

    def result_from_row(self, row: OutboxTaskResult) -> Any:
        result: Any = TaskResult(
            task=self.load_task(row_payload(row)),
            id=row.pk,
            status=TaskResultStatus(row.status),
            enqueued_at=row.enqueued_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            last_attempted_at=row.last_attempted_at,
            args=row.args_kwargs.get("args", []),
            kwargs=row.args_kwargs.get("kwargs", {}),
            backend=self.alias,
            errors=[TaskError(**error) for error in row.errors],
            worker_ids=list(row.worker_ids),
        )
        if row.status == OutboxTaskResult.TaskStatus.SUCCESSFUL:
            set_result_field(result, "_return_value", row.return_value)
        return result


def task_payload(result: Any, max_retries: int) -> dict[str, Any]:
    """What the outbox row of a task carries: all the worker needs to run it."""
    task = result.task
    return {
        "id": result.id,
        "task": task.module_path,
        "backend": result.backend,
        "queue": task.queue_name,
        "priority": task.priority,
        "run_after": task.run_after.isoformat() if task.run_after else None,
        "args": result.args,
        "kwargs": result.kwargs,
        "max_retries": max_retries,
    }


def row_payload(row: OutboxTaskResult) -> dict[str, Any]:
    """A results row as the payload of its task (a requeue emits it again)."""
    return {
        "id": row.pk,
        "task": row.task_path,
        "backend": row.backend_name,
        "queue": row.queue_name,
        "priority": row.priority,
        "run_after": row.run_after.isoformat() if row.run_after else None,
        "args": row.args_kwargs.get("args", []),
        "kwargs": row.args_kwargs.get("kwargs", {}),
        "max_retries": row.max_retries,
    }


def _datetime(value: str) -> datetime:
    moment = datetime.fromisoformat(value)
    if timezone.is_naive(moment) and timezone.is_aware(timezone.now()):
        moment = timezone.make_aware(moment)
    return moment


def _retries(value: Any, what: str, error: type[Exception]) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise error(f"{what} is {value!r}; use a whole number of retries, 0 or more.")
    return value


def requeue_failed(rows: Any, using: str) -> int:
    """Give each FAILED task of ``rows`` (a queryset of results) one more attempt: READY
    again, and a new outbox row for it in the same transaction. Returns how many."""
    status = OutboxTaskResult.TaskStatus
    count = 0
    with transaction.atomic(using=using):
        for row in rows.using(using).select_for_update().filter(status=status.FAILED):
            row.status = status.READY
            row.finished_at = None
            row.message_id = f"{row.pk}.{len(row.errors) + 1}"
            outbox.emit(
                task_event_type(row.queue_name),
                payload=row_payload(row),
                event_id=row.message_id,
                headers=task_headers(row.priority),
                using=using,
            )
            row.save(using=using)
            count += 1
    return count
