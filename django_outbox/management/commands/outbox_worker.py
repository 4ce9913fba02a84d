"""manage.py outbox_worker: run the Django tasks enqueued on the outbox (docs/tasks.md).

Run the Django tasks of an OutboxTaskBackend: read each task queue from the broker and run
its tasks, recording each result with the task's own writes. Runs until SIGTERM/SIGINT
(the task in hand is finished; a second signal exits 1).

The consumer engine of ``consume_outbox`` with the task handler
(``django_outbox.tasks_worker``): one broker queue per task queue, ``--concurrency``
consumers (threads) on each, in each of ``--processes`` worker processes.

Exit codes: 0 stopped by a signal, or ``--once`` done; 1 a second signal, or a worker
process of ``--processes`` died (the others are stopped); 2 misconfigured
(TASKS, a queue not in QUEUES, the broker URL, a task queue that exists with other
arguments), the outbox's database unreachable or unmigrated at start, or (``--once``) no
broker node could be connected to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from ...consumer import ImproperlyConfiguredConsumer
from ...worker import configure_logging
from ..options import positive_int
from ..serving import ConsumerCommand
from .consume_outbox import transport_consumer

if TYPE_CHECKING:
    from django.db.models import Model


class Command(ConsumerCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--backend",
            default="default",
            help="The alias in TASKS of the OutboxTaskBackend (default 'default').",
        )
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            default=None,
            metavar="NAME",
            help="Run the tasks of this queue (repeatable; default every queue in QUEUES).",
        )
        parser.add_argument(
            "--concurrency",
            type=positive_int,
            default=1,
            help="Tasks run at once per queue in each process, each on a thread with its "
            "own broker and database connections (default 1).",
        )
        parser.add_argument(
            "--processes",
            type=positive_int,
            default=1,
            help="Worker processes, forked from this one, each running --concurrency tasks "
            "per queue: the tasks' Python code on more than one core (default 1: this "
            "process runs them).",
        )
        self.add_broker_arguments(
            parser,
            prefetch="Messages each consumer holds unacknowledged (default "
            "OUTBOX_CONSUMER_PREFETCH).",
            once="Exit as soon as every queue has been empty for a second.",
            queue_type="classic (default: a priority queue, where a task's priority is "
            "honoured) or quorum (replicated; no priorities on RabbitMQ 3.x).",
        )

    def databases_needed(self, options: dict[str, Any]) -> list[str]:
        backend = _backend(options.get("backend") or "default")
        return [backend.using] if backend is not None else []

    def tables_needed(self, options: dict[str, Any]) -> dict[str, dict[type[Model], str]]:
        from ...models import OutboxTaskResult

        backend = _backend(options.get("backend") or "default")
        if backend is None:
            return {}
        return {backend.using: {OutboxTaskResult: "outbox_worker"}}

    def handle(
        self,
        *,
        backend: str,
        queues: list[str] | None,
        concurrency: int,
        processes: int,
        exchange: str | None,
        prefetch: int | None,
        queue_type: str | None,
        once: bool,
        json: bool,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        from ...tasks_worker import Worker, WorkerProcessDied

        try:
            worker = Worker(
                backend_alias=backend,
                queue_names=queues,
                concurrency=concurrency,
                processes=processes,
                consumer_class=transport_consumer(),
                exchange=exchange,
                prefetch=prefetch,
                queue_type=queue_type,
            )
        except (
            ImproperlyConfigured,
            ImproperlyConfiguredConsumer,
            ImportError,
            TypeError,
            ValueError,
        ) as exc:
            raise CommandError(f"outbox_worker: {exc}", returncode=2) from exc
        if verbosity >= 1:
            self.stderr.write(
                f"outbox_worker: queue(s) {', '.join(worker.queue_names)} of TASKS[{backend!r}], "
                f"{concurrency} at once each"
                f"{f' in each of {processes} processes' if processes > 1 else ''}, on "
                f"{worker.consumers[0].nodes}"
            )
        try:
            self.serve(lambda stop: worker.serve(stop=stop, once=once), json=json)
        except WorkerProcessDied as exc:
            raise CommandError(f"outbox_worker: {exc}", returncode=1) from exc


def _backend(alias: str) -> Any:
    """The OutboxTaskBackend of ``alias``; None when it is not one (handle() says so)."""
    try:
        from ..._compat.tasks import task_backends
        from ...tasks_backend import OutboxTaskBackend

        backend = task_backends[alias]
    except Exception:
        return None
    return backend if isinstance(backend, OutboxTaskBackend) else None
