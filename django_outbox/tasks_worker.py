"""``manage.py outbox_worker``: Django tasks (``tasks_backend.py``) run by the consumer.

The worker is the consumer engine of ``consume_outbox``, not a second loop: a
:class:`~django_outbox.consumer.base.BaseConsumer` of the broker URL's transport reads each
task queue, the :class:`~django_outbox.consumer.dispatch.Dispatcher` decides every message,
and the one handler is :class:`TaskHandler`, an
:class:`~django_outbox.consumer.handlers.IdempotentHandler` whose de-duplication record is
the task's ``OutboxTaskResult`` row. One attempt of a task is three short transactions on
the outbox's database:

1. *start*: the row READY -> RUNNING, the attempt's worker id and time (``task_started``):
   at a task's first delivery one INSERT that commits alone, else under the row's lock; a
   delivery of a task that is finished, or stale (not the message the row waits for:
   ``message_id``), is a DUPLICATE and is acknowledged without running;
2. *run*: the task, then the row SUCCESSFUL with its return value, in ONE transaction: a
   task whose effects are in that database either committed them with its result, or did
   nothing (a crash: the message comes back and the task runs again);
3. *failed* (the task raised): the error on the row and, while retries are left, the next
   attempt as an outbox row due after the backoff (``OUTBOX_RETRY_SCHEDULE``): the message
   is acknowledged. Out of retries: FAILED (``task_finished``), and the message is
   dead-lettered with the error (:class:`TaskDispatcher`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterable, Sequence
from contextlib import nullcontext, suppress
from datetime import datetime
from typing import Any, ClassVar

from django.db import IntegrityError, connections, transaction
from django.db.models import Model
from django.utils import timezone

from . import outbox
from ._compat.django import insert_rows
from ._compat.tasks import (
    TaskContext,
    normalize_json,
    set_result_field,
    task_backends,
    task_finished,
    task_started,
)
from .conf import outbox_settings
from .consumer.base import BaseConsumer, BrokerUnreachable, ImproperlyConfiguredConsumer
from .consumer.dispatch import Action, ConsumeResult, Decision, Dispatcher
from .consumer.handlers import IdempotentHandler, Outcome, connection_lost
from .message import Delivery, ReceivedEvent
from .models import OutboxEvent, OutboxTaskResult
from .tasks_backend import BROKER_PRIORITIES, OutboxTaskBackend, task_event_type, task_headers

logger = logging.getLogger("django_outbox.tasks")

Status = OutboxTaskResult.TaskStatus
FINISHED = (Status.SUCCESSFUL, Status.FAILED)


class TaskGaveUp(Exception):
    """The task failed its last attempt: its row is FAILED, its message is dead-lettered."""


class _Stale(Exception):
    """Raised inside the run transaction: another worker finished the task meanwhile."""


def worker_id() -> str:
    """An id for this worker process's attempts (``TaskResult.worker_ids``)."""
    return uuid.uuid4().hex[:16]


class TaskHandler(IdempotentHandler):
    """Runs the task a message carries, once per message the row waits for.

    A subclass per backend and task queue is made by :func:`task_handler`.
    """

    backend_alias: ClassVar[str] = "default"
    worker: ClassVar[str] = ""

    @classmethod
    def models(cls) -> list[type[Model]]:
        return [OutboxTaskResult, OutboxEvent]

    @property
    def backend(self) -> OutboxTaskBackend:
        backend = task_backends[self.backend_alias]
        if not isinstance(backend, OutboxTaskBackend):
            raise TypeError(
                f"TASKS[{self.backend_alias!r}] is {type(backend).__name__}, not "
                "django_outbox.tasks_backend.OutboxTaskBackend: outbox_worker runs only the "
                "tasks of an OutboxTaskBackend."
            )
        return backend

    def database(self) -> str:
        return self.backend.using

    def process(self, event: ReceivedEvent) -> Outcome:
        using = self.database()
        backend = self.backend
        payload = event.payload
        row = self._start(event, using)
        if row is None:
            return Outcome.DUPLICATE
        result = backend.result_from_row(row)
        task_started.send(type(backend), task_result=result)
        connection = connections[using]
        opened = connection.connection
        try:
            with transaction.atomic(using=using):
                # The lock keeps a concurrent delivery of this message from running the
                # task beside this one: it waits, then finds the row finished.
                status, message_id = (
                    OutboxTaskResult.objects.using(using)
                    .select_for_update()
                    .values_list("status", "message_id")
                    .get(pk=row.pk)
                )
                if status in FINISHED or message_id != event.event_id:
                    raise _Stale()
                task = result.task
                args, kwargs = payload.get("args", []), payload.get("kwargs", {})
                if task.takes_context:
                    value = task.call(TaskContext(task_result=result), *args, **kwargs)
                else:
                    value = task.call(*args, **kwargs)
                value = normalize_json(value)
                finished = timezone.now()
                OutboxTaskResult.objects.using(using).filter(pk=row.pk).update(
                    status=Status.SUCCESSFUL, return_value=value, finished_at=finished
                )
        except _Stale:
            return Outcome.DUPLICATE
        except Exception as exc:
            if connection_lost(exc, connection, opened):
                raise  # the consumer holds the message until the database answers
            self._record_failure(event, row.pk, exc, using)
            return Outcome.PROCESSED
        set_result_field(result, "status", Status.SUCCESSFUL)
        set_result_field(result, "finished_at", finished)
        set_result_field(result, "_return_value", value)
        task_finished.send(type(backend), task_result=result)
        return Outcome.PROCESSED

    def _start(self, event: ReceivedEvent, using: str) -> OutboxTaskResult | None:
        """The task's row, RUNNING for this attempt (created at its first); None when this
        delivery must not run it (finished, or not the message the row waits for)."""
        task_id = event.payload["id"]
        now = timezone.now()
        if event.event_id == task_id:
            row = self._first_start(event, using, now)
            if row is not None:
                return row
        manager = OutboxTaskResult.objects.using(using)
        with transaction.atomic(using=using):
            row = manager.select_for_update().filter(pk=task_id).first()
            if row is None:
                if event.event_id != task_id:
                    return None  # a retry of a task whose row was deleted: nothing to run
                row = self._new_row(event, now)
            elif row.status in FINISHED or row.message_id != event.event_id:
                logger.info(
                    "task %s: message %s is not the one its %s row waits for (%s); "
                    "acknowledged without running",
                    task_id,
                    event.event_id,
                    row.status,
                    row.message_id or "none",
                )
                return None
            row.status = Status.RUNNING
            row.started_at = row.started_at or now
            row.last_attempted_at = now
            row.worker_ids = [*row.worker_ids, self.worker]
            if row._state.adding:
                # A concurrent first delivery of the same task fails on the primary key
                # and is retried by the consumer: then it finds the row RUNNING.
                row.save(using=using, force_insert=True)
            else:
                row.save(using=using)
        return row

    def _new_row(self, event: ReceivedEvent, now: datetime) -> OutboxTaskResult:
        """The results row of a task's first attempt, not saved yet."""
        payload = event.payload
        return OutboxTaskResult(
            pk=payload["id"],
            task_path=payload["task"],
            backend_name=payload.get("backend", self.backend_alias),
            queue_name=payload.get("queue", ""),
            priority=payload.get("priority", 0),
            args_kwargs={"args": payload.get("args", []), "kwargs": payload.get("kwargs", {})},
            run_after=self._run_after(payload),
            enqueued_at=event.occurred_at or now,
            max_retries=payload.get("max_retries", 0),
            message_id=event.event_id,
        )

    def _first_start(
        self, event: ReceivedEvent, using: str, now: datetime
    ) -> OutboxTaskResult | None:
        """The first delivery of a task's first message: its row inserted RUNNING by one
        INSERT that commits alone (one round trip, where the locked read and write of
        :meth:`_start` take four). None: the row is there already (a redelivery, a
        concurrent delivery): :meth:`_start` decides under the row's lock."""
        row = self._new_row(event, now)
        row.status = Status.RUNNING
        row.started_at = row.last_attempted_at = now
        row.worker_ids = [self.worker]
        connection = connections[using]
        inside = connection.in_atomic_block
        # Not flushed to disk at once on PostgreSQL (:data:`LAZY_COMMIT`), outside a
        # caller's transaction (a test's), where a savepoint keeps a duplicate key from
        # breaking it. The worker has none: the INSERT commits on its own.
        prefix = LAZY_COMMIT if not inside and _lazy_insert(connection) else ""
        try:
            with transaction.atomic(using=using) if inside else nullcontext():
                insert_rows(OutboxTaskResult, using, [row], prefix=prefix)
        except IntegrityError:
            return None
        return row

    @staticmethod
    def _run_after(payload: dict[str, Any]) -> Any:
        value = payload.get("run_after")
        if not value:
            return None
        from .tasks_backend import _datetime

        return _datetime(value)

    def _record_failure(
        self, event: ReceivedEvent, task_id: str, exc: BaseException, using: str
    ) -> None:
        """Record the failed attempt; schedule the next one, or give up (FAILED)."""
        error = {
            "exception_class_path": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "traceback": "".join(traceback.format_exception(exc)),
        }
        with transaction.atomic(using=using):
            row = OutboxTaskResult.objects.using(using).select_for_update().get(pk=task_id)
            row.errors = [*row.errors, error]
            failures = len(row.errors)
            delay = retry_delay(failures, row.max_retries)
            if delay is None:
                row.status = Status.FAILED
                row.finished_at = timezone.now()
            else:
                row.status = Status.READY
                row.message_id = f"{task_id}.{failures + 1}"
                outbox.emit(
                    event.event_type,
                    payload=event.payload,
                    event_id=row.message_id,
                    headers=task_headers(row.priority),
                    delay=delay,
                    using=using,
                )
            row.save(using=using)
        if delay is not None:
            logger.warning(
                "task %s %s raised %s (attempt %d of %d); retrying in %.1fs",
                row.task_path,
                task_id,
                error["exception_class_path"],
                failures,
                row.max_retries + 1,
                delay,
            )
            return
        result = self.backend.result_from_row(row)
        task_finished.send(type(self.backend), task_result=result)
        raise TaskGaveUp(
            f"task {row.task_path} {task_id} failed {failures} time(s), the last with "
            f"{type(exc).__name__}: {exc}"
        ) from exc


#: Sent with the INSERT of a task's RUNNING row, in one query, on PostgreSQL. Half of a
#: task's cost was that commit's fsync, and the BEGIN, ``SET LOCAL`` and COMMIT around the
#: INSERT were three more round trips: as one query the two statements run in one implicit
#: transaction (``SET LOCAL`` holds inside it) that commits when the INSERT succeeds and
#: rolls back whole when it fails. RUNNING is visible as soon as it commits, and losing it
#: in a crash of PostgreSQL loses nothing: the message is acknowledged only after the
#: result's commit, a synchronous one that flushes this too.
LAZY_COMMIT = "SET LOCAL synchronous_commit TO OFF; "


def _lazy_insert(connection: Any) -> bool:
    """Whether a RUNNING row can be inserted with :data:`LAZY_COMMIT`: PostgreSQL with
    client-side parameter binding (Django's default; server-side binding refuses two
    statements in one query)."""
    return bool(
        connection.vendor == "postgresql"
        and connection.settings_dict["OPTIONS"].get("server_side_binding") is not True
    )


def retry_delay(failures: int, max_retries: int) -> float | None:
    """The pause before the next attempt of a task that has failed ``failures`` times, from
    ``OUTBOX_RETRY_SCHEDULE`` (its last step once past it); None: out of retries."""
    if failures > max_retries:
        return None
    schedule = tuple(outbox_settings.RETRY_SCHEDULE) or (0.0,)
    return float(schedule[min(failures, len(schedule)) - 1])


def task_handler(backend_alias: str, queue_names: Sequence[str]) -> type[TaskHandler]:
    """The handler class of the tasks of ``queue_names`` on backend ``backend_alias``."""
    return type(
        "TaskHandler",
        (TaskHandler,),
        {
            "event_types": tuple(task_event_type(q) for q in queue_names),
            "backend_alias": backend_alias,
            "worker": worker_id(),
            "name": f"django_outbox.tasks:{backend_alias}",
            "__module__": __name__,
        },
    )


class TaskDispatcher(Dispatcher):
    """The consumer's dispatcher, with one difference: a task's retries are outbox rows the
    handler schedules, so a FAILED message (a task out of retries, or one that cannot run:
    its function is gone) is dead-lettered at once instead of redelivered."""

    def receive(self, delivery: Delivery, *, hold_lost_connection: bool = True) -> Decision:
        decision = super().receive(delivery, hold_lost_connection=hold_lost_connection)
        if decision.action is Action.RETRY:
            return Decision(
                Action.DEAD_LETTER,
                decision.outcome,
                decision.results,
                reason=decision.error,
                error=decision.error,
            )
        return decision


def task_consumer(
    backend_alias: str,
    queue_name: str,
    *,
    consumer_class: type[BaseConsumer[Any]],
    **options: Any,
) -> BaseConsumer[Any]:
    """A consumer of the broker URL's transport that runs the tasks of ``queue_name``.

    On RabbitMQ the queue is a classic priority queue unless ``queue_type`` says quorum
    (RabbitMQ 3.x quorum queues have no priorities): the due tasks wait there, so that is
    where a higher priority passes the others."""
    handler = task_handler(backend_alias, [queue_name])
    options.setdefault("queue", handler().backend.broker_queue(queue_name))
    if getattr(consumer_class, "transport", None) == "amqp":
        options["queue_type"] = options.get("queue_type") or "classic"
        if options["queue_type"] == "classic":
            options.setdefault("max_priority", BROKER_PRIORITIES)
    consumer = consumer_class(handlers=[handler], **options)
    consumer.dispatcher = TaskDispatcher(
        handlers=[handler],
        max_retries=consumer.dispatcher.max_retries,
        retry_delay=0,
    )
    return consumer


class Worker:
    """``outbox_worker``: ``concurrency`` consumers per task queue, each on a thread of its
    own (its own broker connection and database connection), in each of ``processes``
    worker processes, until ``stop`` is set.

    With ``processes`` above 1 this process forks them and only watches: a signal it gets
    is passed on to each (the first: finish the task in hand; the second: exit at once);
    one that dies (``kill -9``, out of memory) stops the others and :meth:`serve` raises
    :class:`WorkerProcessDied`: what it held comes back from the broker. A process whose
    parent is gone (killed with ``-9`` itself) finishes its task in hand and exits.
    """

    def __init__(
        self,
        *,
        backend_alias: str = "default",
        queue_names: Iterable[str] | None = None,
        concurrency: int = 1,
        processes: int = 1,
        consumer_class: type[BaseConsumer[Any]],
        **options: Any,
    ) -> None:
        backend = task_backends[backend_alias]
        if not isinstance(backend, OutboxTaskBackend):
            raise TypeError(
                f"TASKS[{backend_alias!r}] is {type(backend).__name__}; outbox_worker runs the "
                "tasks of a django_outbox.tasks_backend.OutboxTaskBackend."
            )
        names = list(queue_names or sorted(backend.queues))
        unknown = sorted(set(names) - set(backend.queues))
        if unknown:
            raise ValueError(
                f"queue(s) {unknown} are not in TASKS[{backend_alias!r}]['QUEUES'] "
                f"({sorted(backend.queues)})"
            )
        if processes > 1 and not hasattr(os, "fork"):
            raise ValueError("--processes above 1 needs os.fork(), which this system lacks.")
        self.queue_names = names
        self.processes = processes
        self.consumers = [
            task_consumer(backend_alias, name, consumer_class=consumer_class, **options)
            for name in names
            for _ in range(concurrency)
        ]

    def serve(self, *, stop: threading.Event, once: bool = False) -> ConsumeResult:
        """Run every consumer until ``stop`` (``once``: until each queue stayed empty)."""
        if self.processes > 1:
            return self._serve_processes(stop, once)
        return self._serve_threads(stop, once)

    def _serve_threads(self, stop: threading.Event, once: bool) -> ConsumeResult:
        totals: list[ConsumeResult] = []
        errors: list[BaseException] = []

        def run(consumer: BaseConsumer[Any]) -> None:
            try:
                totals.append(consumer.serve(stop=stop, until_idle=once))
            except BaseException as exc:  # shown by the command, after the others stopped
                errors.append(exc)
                stop.set()

        def run_in_thread(consumer: BaseConsumer[Any]) -> None:
            try:
                run(consumer)
            finally:
                connections.close_all()  # this thread's own

        if len(self.consumers) == 1:
            run(self.consumers[0])
        else:
            threads = [
                threading.Thread(
                    target=run_in_thread, args=(c,), name=f"outbox_worker-{i}", daemon=True
                )
                for i, c in enumerate(self.consumers)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
        if errors:
            raise errors[0]
        return _total(totals)

    # -- worker processes ------------------------------------------------------------------------
    def _serve_processes(self, stop: threading.Event, once: bool) -> ConsumeResult:
        # A database connection must not be shared by two processes: each opens its own.
        connections.close_all()
        parent = os.getpid()
        children: dict[int, int] = {}  # pid -> the read end of its pipe
        for _ in range(self.processes):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover (the child's coverage is not collected)
                os.close(read)
                for other in children.values():
                    os.close(other)
                os._exit(self._child(stop, once, parent, write))
            os.close(write)
            children[pid] = read
        results: list[ConsumeResult] = []
        failures: list[BaseException] = []
        signalled = False
        try:
            while children:
                if stop.is_set() and not signalled:
                    signalled = True
                    _signal(children, signal.SIGTERM)
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    time.sleep(0.1)
                    continue
                if pid not in children:
                    continue
                read = children.pop(pid)
                with os.fdopen(read, "rb") as pipe:
                    report = pipe.read()
                outcome = _child_outcome(pid, status, report)
                if isinstance(outcome, ConsumeResult):
                    results.append(outcome)
                    continue
                failures.append(outcome)
                if not stop.is_set():
                    stop.set()
        except BaseException:
            # A second signal (SystemExit): each process is told, and exits at once too.
            _signal(children, signal.SIGTERM)
            raise
        if failures:
            raise failures[0]
        return _total(results)

    def _child(self, stop: threading.Event, once: bool, parent: int, write: int) -> int:
        """The body of one worker process: its exit code. Its totals, or its error, go to
        the parent through the pipe ``write``."""
        # Its own process group: a Ctrl-C in a terminal reaches the parent only, which
        # passes it on once (a second one would make this process exit at once).
        os.setpgid(0, 0)
        for consumer in self.consumers:  # an attempt's worker id names its process
            for cls in consumer.dispatcher.handler_classes:
                if issubclass(cls, TaskHandler):
                    cls.worker = worker_id()
        watcher = threading.Thread(
            target=_watch_parent, args=(parent, stop), name="outbox_worker-parent", daemon=True
        )
        watcher.start()
        code = 0
        try:
            report: dict[str, Any] = {"result": self._serve_threads(stop, once).as_dict()}
        except SystemExit as exc:  # a second signal
            code = exc.code if isinstance(exc.code, int) else 1
            report = {"exit": code}
        except BaseException as exc:
            logger.exception("worker process %d failed", os.getpid())
            code = 1
            report = {"error": str(exc), "kind": type(exc).__name__}
        finally:
            connections.close_all()
        with os.fdopen(write, "w") as pipe:
            json.dump(report, pipe)
        sys.stdout.flush()
        sys.stderr.flush()
        return code


class WorkerProcessDied(Exception):
    """A worker process of ``outbox_worker --processes`` ended without finishing its run
    (killed, or out of memory): the others were stopped."""


def _signal(children: dict[int, int], signum: int) -> None:
    for pid in children:
        with suppress(ProcessLookupError):
            os.kill(pid, signum)


def _watch_parent(parent: int, stop: threading.Event) -> None:
    """Stop this worker process once its parent is gone (``kill -9``: no signal is passed
    on): it finishes its task in hand, as after SIGTERM, instead of running on alone."""
    while not stop.wait(1.0):
        if os.getppid() != parent:
            logger.warning("outbox_worker's parent process is gone: stopping")
            stop.set()


def _child_outcome(pid: int, status: int, report: bytes) -> ConsumeResult | BaseException:
    """A finished worker process's totals, or the error to raise for it."""
    try:
        data = json.loads(report) if report else {}
    except ValueError:
        data = {}
    if "result" in data:
        return _result_from(data["result"])
    if "error" in data:
        kinds: dict[str, type[Exception]] = {
            "BrokerUnreachable": BrokerUnreachable,
            "ImproperlyConfiguredConsumer": ImproperlyConfiguredConsumer,
        }
        return kinds.get(data["kind"], WorkerProcessDied)(data["error"])
    if "exit" in data:
        return SystemExit(data["exit"])
    if os.WIFSIGNALED(status):
        how = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        how = f"exited with {os.waitstatus_to_exitcode(status)}"
    return WorkerProcessDied(
        f"worker process {pid} {how}; the other processes were stopped (its unfinished "
        "tasks come back from the broker)"
    )


def _result_from(data: dict[str, Any]) -> ConsumeResult:
    """A :class:`ConsumeResult` from its :meth:`~ConsumeResult.as_dict` form."""
    result = ConsumeResult(messages=data["messages"], dead_lettered=data["dead_lettered"])
    for name, count in data["outcomes"].items():
        result.counts[Outcome(name)] += count
    result.formats.update(data["formats"])
    return result


def _total(results: Iterable[ConsumeResult]) -> ConsumeResult:
    total = ConsumeResult()
    for result in results:
        total.messages += result.messages
        total.dead_lettered += result.dead_lettered
        for outcome, count in result.counts.items():
            total.counts[outcome] += count
        for name, count in result.formats.items():
            total.formats[name] = total.formats.get(name, 0) + count
    return total
