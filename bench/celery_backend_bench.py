"""CeleryBackend.publish() alone (no database, no relay), against PikaBackend and raw kombu.

Publishes the benchmark's sample event in batches through a CeleryBackend as plain
messages and as task messages, and prints events/s with the ratio to PikaBackend.publish
with the same batches (the baseline: pipelined confirms, which the Celery backend now
writes through too) and to raw kombu publishing one message at a time with
``confirm_publish`` (what any Celery producer with confirms costs: py-amqp waits for each
confirm before the next message, as the Celery backend used to publish).

    python -m bench.celery_backend_bench [--smoke] [--count 5000] [--batch-size 100]
        [--repeat 3]
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

from bench.backend_bench import backend_rate, make_rows
from bench.common import (
    SAMPLE_PAYLOAD,
    Stopwatch,
    bench_exchange,
    best_of,
    count_from,
    parser,
    publish_rate,
    report,
    setup_django,
)

TASK = "bench.outbox.award"


@contextlib.contextmanager
def task_queue(url: str) -> Iterator[str]:
    """A queue name for task messages; Celery declares it (and a direct exchange of the
    same name) on the first send. Both are deleted afterwards."""
    import pika

    name = f"bench.celery.{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        connection = pika.BlockingConnection(pika.URLParameters(url))
        try:
            channel = connection.channel()
            channel.queue_delete(name)
            channel.exchange_delete(name)
        finally:
            connection.close()


def celery_app(url: str, queue: str) -> Any:
    from celery import Celery

    app = Celery("bench", broker=url, set_as_current=False)
    app.conf.task_default_queue = queue
    return app


def celery_rate(count: int, *, url: str, batch_size: int, tasks: bool) -> float:
    """Events/s of CeleryBackend.publish() (task messages if ``tasks``, else plain)."""
    from django_outbox.backends.celery import CeleryBackend

    with bench_exchange(url, prefix="bench.celery") as exchange, task_queue(url) as queue:
        rows = make_rows(count)
        batches = [rows[i : i + batch_size] for i in range(0, count, batch_size)]
        backend = CeleryBackend(
            app=celery_app(url, queue),
            exchange=exchange,
            tasks={rows[0].event_type: TASK} if tasks else {},
        )
        return publish_rate(backend, batches)


def raw_kombu_rate(count: int, *, url: str) -> float:
    """Events/s of kombu publishing the sample payload with confirm_publish, one by one."""
    import json

    from kombu import Connection, Producer

    body = json.dumps(SAMPLE_PAYLOAD).encode()
    with (
        bench_exchange(url, prefix="bench.kombu") as exchange,
        Connection(url, transport_options={"confirm_publish": True}) as connection,
    ):
        producer = Producer(connection.channel(), auto_declare=False)
        with Stopwatch() as t:
            for i in range(count):
                producer.publish(
                    body,
                    exchange=exchange,
                    routing_key="ORDER_CREATED",
                    content_type="application/json",
                    content_encoding="utf-8",
                    delivery_mode=2,
                    mandatory=True,
                    message_id=str(i),
                )
    return count / t.seconds


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0], default_count=5000)
    p.add_argument("--batch-size", type=int, default=100, help="events per publish() call")
    args = p.parse_args(argv)
    setup_django()
    count, size = count_from(args), args.batch_size
    # PikaBackend and the Celery backend take turns within each repeat, in the opposite
    # order every other repeat (whichever ran first was measured faster), so a shared
    # machine's load moves the baseline and the ratio together; the best of each is kept.
    measure = {
        "pika": lambda: backend_rate(count, url=args.url, batch_size=size),
        "plain": lambda: celery_rate(count, url=args.url, batch_size=size, tasks=False),
        "tasks": lambda: celery_rate(count, url=args.url, batch_size=size, tasks=True),
    }
    runs: dict[str, list[float]] = {key: [] for key in measure}
    for repeat in range(max(1, args.repeat)):
        for key in list(measure)[:: -1 if repeat % 2 else 1]:
            runs[key].append(measure[key]())
    baseline = max(runs["pika"])
    report(f"PikaBackend, batches of {size} = baseline", baseline, count=count)
    kombu = best_of(args.repeat, lambda: raw_kombu_rate(count, url=args.url))
    report("raw kombu, confirm_publish", kombu, baseline=baseline, count=count)
    for name, key in (("plain messages", "plain"), ("task messages", "tasks")):
        rate = max(runs[key])
        report(f"CeleryBackend, {name}", rate, baseline=baseline, count=count)
        print(f"{'':<40}  ratio to raw kombu with confirms: {rate / kombu:5.2f}")


if __name__ == "__main__":
    main()
