"""Django tasks on the outbox against django-tasks-db, on the same database in one run.

1. throughput to completion: ``--count`` no-op tasks enqueued one per transaction, then
   drained: this backend by ``publish_outbox`` + one ``outbox_worker`` process
   (``--processes`` worker processes forked from it, ``--concurrency`` threads in each),
   django-tasks-db by one ``db_worker --interval 0.1`` process; tasks/s from the start of
   the children (their start-up included) to the last result's ``finished_at``. The task
   queue is declared before the children start, as a deployed one is; the benchmark looks
   for the end only every 0.2 s and takes it from the rows, so its polling neither takes a
   core from what it measures nor adds its interval to the figure;
2. enqueue -> start latency at ``--rate`` tasks/s offered (``--latency-count`` tasks), with
   the children of (1) running: p50 and p95 of ``started_at - enqueued_at``;
3. enqueue cost: a transaction with a business row (an ``Order``) and an ``enqueue()``
   against one with an ``Order`` and an ``emit()``: median microseconds each, and the ratio.

django-tasks-db's half is skipped, with a message, when it is not installed::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test python -m bench.tasks_bench
        [--smoke] [--count 3000] [--rate 100] [--latency-count 500]
        [--processes 1] [--concurrency 1]

Numbers are only comparable on the same machine and load; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from bench.common import DEFAULT_URL, bench_exchange
from bench.relay_bench import MANAGE, ROOT, bench_database, setup_django

SMOKE = {"count": 200, "rate": 50, "latency_count": 50}


class Child:
    """A ``manage.py`` command in a child process, its output in a temporary file."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            [sys.executable, str(MANAGE), *args],
            env=env,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return text


def wait_until(
    done: Callable[[], bool], what: str, timeout: float = 600.0, every: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"tasks_bench: timed out waiting for {what}")
        time.sleep(every)


def results_model(backend: str) -> Any:
    if backend == "db":
        from django_tasks_db.models import DBTaskResult

        return DBTaskResult
    from django_outbox.models import OutboxTaskResult

    return OutboxTaskResult


def successful(backend: str) -> int:
    return int(results_model(backend).objects.filter(status="SUCCESSFUL").count())


def last_finished(backend: str) -> float:
    """When the last task finished (``finished_at``, the workers' clock: this machine's)."""
    from django.db.models import Max

    moment = results_model(backend).objects.aggregate(last=Max("finished_at"))["last"]
    return float(moment.timestamp())


def enqueue(task: Any, count: int) -> list[str]:
    """``count`` tasks, one per transaction; their ids."""
    from django.db import transaction

    ids = []
    for _ in range(count):
        with transaction.atomic():
            ids.append(task.enqueue().id)
    return ids


#: outbox_worker --concurrency and --processes (main()'s options).
CONCURRENCY = 1
PROCESSES = 1


def start_children(backend: str, env: dict[str, str], exchange: str, url: str) -> list[Child]:
    if backend == "db":
        return [
            Child(env, "db_worker", "--backend", "db", "--interval", "0.1", "--no-startup-delay")
        ]
    options = ("--concurrency", str(CONCURRENCY), "--processes", str(PROCESSES))
    return [Child(env, "outbox_worker", *options), Child(env, "publish_outbox")]


def declare_task_queue(exchange: str, url: str) -> None:
    """The worker's task queue, declared as the worker declares it (a deployed queue exists
    before the relay publishes; in a run, the relay's first events need one bound)."""
    from django_outbox.consumer.amqp import Consumer
    from django_outbox.tasks_worker import task_consumer

    consumer = task_consumer(
        "default", "default", consumer_class=Consumer, url=url, exchange=exchange
    )
    consumer.connect()
    consumer.close()


def throughput(
    backend: str, task: Any, count: int, env: dict[str, str], exchange: str, url: str
) -> tuple[float, list[Child]]:
    """Tasks/s to completion of ``count`` tasks enqueued first; the children, still running."""
    before = successful(backend)
    enqueue(task, count)
    if backend != "db":
        declare_task_queue(exchange, url)
    started = time.time()
    children = start_children(backend, env, exchange, url)
    wait_until(lambda: successful(backend) >= before + count, f"{backend}: {count} tasks")
    return count / (last_finished(backend) - started), children


def latency(backend: str, task: Any, count: int, rate: float) -> tuple[float, float]:
    """p50 and p95 ms from enqueue to start, ``count`` tasks offered at ``rate``/s."""
    from django.db import transaction

    ids = []
    started = time.perf_counter()
    for i in range(count):
        pause = started + i / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        with transaction.atomic():
            ids.append(task.enqueue().id)
    if backend == "db":
        from django_tasks_db.models import DBTaskResult as Model
    else:
        from django_outbox.models import OutboxTaskResult as Model  # type: ignore[assignment]
    rows = Model.objects.filter(pk__in=ids)
    wait_until(lambda: rows.filter(status="SUCCESSFUL").count() == count, "latency tasks")
    delays = sorted(
        (row.started_at - row.enqueued_at).total_seconds() * 1000
        for row in rows.only("started_at", "enqueued_at")
    )
    return statistics.median(delays), delays[int(len(delays) * 0.95) - 1]


def enqueue_cost(task: Any, count: int) -> tuple[float, float]:
    """Median microseconds of a transaction with an Order and an emit(), and of one with an
    Order and an enqueue()."""
    from django.db import transaction

    from django_outbox import outbox
    from orders.models import Order

    def order() -> Order:
        return Order.objects.create(number=uuid.uuid4().hex[:16], user_id=1, amount=Decimal(1))

    def with_emit() -> None:
        with transaction.atomic():
            outbox.emit("ORDER_CREATED", payload={"order_id": order().pk})

    def with_enqueue() -> None:
        with transaction.atomic():
            order()
            task.enqueue()

    times: dict[str, list[float]] = {"emit": [], "enqueue": []}
    for _ in range(count):  # interleaved: both see the same table sizes and caches
        for name, run in (("emit", with_emit), ("enqueue", with_enqueue)):
            begun = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - begun) * 1e6)
    return statistics.median(times["emit"]), statistics.median(times["enqueue"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script runs")
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--latency-count", type=int, default=500)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument(
        "--concurrency", type=int, default=1, help="outbox_worker --concurrency (threads)"
    )
    p.add_argument("--processes", type=int, default=1, help="outbox_worker --processes")
    args = p.parse_args(argv)
    global CONCURRENCY, PROCESSES
    CONCURRENCY, PROCESSES = args.concurrency, args.processes
    if args.smoke:
        args.count, args.rate, args.latency_count = (
            SMOKE["count"],
            SMOKE["rate"],
            SMOKE["latency_count"],
        )
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    database = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    if database.startswith("sqlite"):
        raise SystemExit("tasks_bench needs PostgreSQL or MariaDB (DATABASE_URL)")
    with bench_exchange(args.url, prefix="bench.tasks") as exchange, bench_database(database) as db:
        env = setup_django(db, exchange, args.url)
        from django.test.utils import override_settings

        prefix = f"{exchange}.tasks."
        tasks_setting = {
            "default": {
                "BACKEND": "django_outbox.tasks_backend.OutboxTaskBackend",
                "OPTIONS": {"BROKER_QUEUE_PREFIX": prefix},
            }
        }
        have_db = importlib.util.find_spec("django_tasks_db") is not None
        if have_db:
            tasks_setting["db"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}
        with override_settings(TASKS=tasks_setting):
            from django.db import connection

            from bench.bench_tasks import noop

            print(
                f"database: {connection.vendor}; {args.count} no-op tasks; outbox_worker "
                f"--processes {PROCESSES} --concurrency {CONCURRENCY}",
                flush=True,
            )
            runs = [("outbox", "default", noop)]
            if have_db:
                runs.append(("django-tasks-db", "db", noop.using(backend="db")))
            else:
                print(
                    "django-tasks-db is not installed: its half is skipped "
                    "(pip install django-tasks-db)",
                    flush=True,
                )
            rates: dict[str, float] = {}
            try:
                for label, backend, task in runs:
                    rate, children = throughput(backend, task, args.count, env, exchange, args.url)
                    rates[label] = rate
                    try:
                        p50, p95 = latency(backend, task, args.latency_count, args.rate)
                    finally:
                        for child in children:
                            child.stop()
                    print(
                        f"{label:16} {rate:8.0f} tasks/s to completion; enqueue->start at "
                        f"{args.rate:.0f}/s: p50 {p50:.1f} ms, p95 {p95:.1f} ms",
                        flush=True,
                    )
                if len(rates) == 2:
                    ratio = rates["outbox"] / rates["django-tasks-db"]
                    print(f"throughput: outbox {ratio:.1f}x django-tasks-db", flush=True)
                emit_us, enqueue_us = enqueue_cost(noop, max(50, args.count // 3))
                print(
                    f"enqueue cost: Order + emit() {emit_us:.0f} us, Order + enqueue() "
                    f"{enqueue_us:.0f} us: {enqueue_us / emit_us:.2f}x",
                    flush=True,
                )
            finally:
                _delete_queues(args.url, [f"{prefix}default", f"{prefix}default.dlq"])


def _delete_queues(url: str, queues: list[str]) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for queue in queues:
            channel.queue_delete(queue)
    finally:
        connection.close()


if __name__ == "__main__":
    main()
