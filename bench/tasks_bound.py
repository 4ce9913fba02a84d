"""The bound under bench/tasks_bench.py: how fast a minimal consumer, with no Django and no
outbox code, takes messages from RabbitMQ and writes each one's row to PostgreSQL.

``--count`` persistent messages are published to a durable queue first; then ``P``
processes (1, 2 and 3 by default) each consume it with pika (prefetch 50) and, for each
message, do one of two shapes on a psycopg connection of their own before ``basic.ack``:

* ``insert``: one INSERT in autocommit (one round trip, one flushed commit): the least a
  consumer that records each message can do;
* ``task``: what ``outbox_worker`` does for a task's first delivery, in plain SQL: the
  RUNNING row in one round trip with its commit not flushed, then BEGIN, the row's lock,
  the SUCCESSFUL UPDATE and COMMIT (flushed).

Messages/s from the fork to the last ack, start-up of Python and Django excluded (a worker's
is in tasks_bench's figure)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test python -m bench.tasks_bound
        [--count 3000] [--processes 1,2,3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

from bench.common import DEFAULT_URL, bench_exchange

PREFETCH = 50
SHAPES = ("insert", "task")


def publish(url: str, exchange: str, count: int) -> None:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        body = json.dumps({"task": "bench.bench_tasks.noop", "args": [], "kwargs": {}}).encode()
        for _ in range(count):
            properties = pika.BasicProperties(message_id=uuid.uuid4().hex, delivery_mode=2)
            channel.basic_publish(exchange, "task", body, properties)
    finally:
        connection.close()


def consume(url: str, queue: str, database: str, table: str, shape: str) -> float:
    """Consume ``queue`` until it stays empty for half a second; the time of the last ack."""
    import pika
    import psycopg

    db = psycopg.connect(database, autocommit=True, cursor_factory=psycopg.ClientCursor)
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=PREFETCH)
    last = 0.0
    insert = f"INSERT INTO {table} (id, status, finished_at) VALUES (%s, %s, now())"
    with db.cursor() as cursor:
        for method, properties, _body in channel.consume(queue, inactivity_timeout=0.5):
            if method is None:
                break
            key = properties.message_id
            if shape == "insert":
                cursor.execute(insert, (key, "SUCCESSFUL"))
            else:
                # Two statements in one query: a client-side binding cursor (as Django's).
                cursor.execute(f"SET LOCAL synchronous_commit TO OFF; {insert}", (key, "RUNNING"))
                with db.transaction():
                    cursor.execute(f"SELECT status FROM {table} WHERE id = %s FOR UPDATE", (key,))
                    cursor.execute(
                        f"UPDATE {table} SET status = 'SUCCESSFUL', finished_at = now() "
                        "WHERE id = %s",
                        (key,),
                    )
            channel.basic_ack(method.delivery_tag)
            last = time.time()
        channel.cancel()
    connection.close()
    db.close()
    return last


def rate(url: str, queue: str, database: str, shape: str, processes: int, count: int) -> float:
    """Messages/s of ``processes`` consumers draining ``count`` messages."""
    import psycopg

    table = f"bound_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database, autocommit=True) as db:
        db.execute(
            f"CREATE TABLE {table} (id varchar(64) PRIMARY KEY, status varchar(10), "
            "finished_at timestamptz)"
        )
    started = time.time()
    children = []
    for _ in range(processes):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            last = consume(url, queue, database, table, shape)
            os.write(write, repr(last).encode())
            os._exit(0)
        os.close(write)
        children.append((pid, read))
    lasts = []
    for pid, read in children:
        os.waitpid(pid, 0)
        with os.fdopen(read) as pipe:
            lasts.append(float(pipe.read() or 0))
    with psycopg.connect(database, autocommit=True) as db:
        (done,) = db.execute(f"SELECT count(*) FROM {table}").fetchone() or (0,)
    if done != count:
        raise SystemExit(f"tasks_bound: {done} rows written of {count}")
    return count / (max(lasts) - started)


@contextmanager
def fresh_database(url: str) -> Iterator[str]:
    """A new database on the PostgreSQL server of ``url``, dropped afterwards (no Django
    here: relay_bench's ``bench_database`` closes Django's connections)."""
    import psycopg

    name = f"outbox_bound_{uuid.uuid4().hex[:8]}"
    parts = urlsplit(url)
    admin = psycopg.connect(urlunsplit((*parts[:2], "/postgres", "", "")), autocommit=True)
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        yield urlunsplit((*parts[:2], f"/{name}", parts.query, ""))
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--processes", default="1,2,3")
    p.add_argument("--url", default=DEFAULT_URL)
    args = p.parse_args(argv)
    count = 200 if args.smoke else args.count
    database = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
    if not database.startswith("postgres"):
        print("tasks_bound: PostgreSQL only (DATABASE_URL); skipped", flush=True)
        return
    with bench_exchange(args.url, prefix="bench.bound") as exchange, fresh_database(database) as db:
        for processes in (int(n) for n in args.processes.split(",")):
            for shape in SHAPES:
                publish(args.url, exchange, count)
                value = rate(args.url, exchange, db, shape, processes, count)
                print(f"{shape:7} {processes} process(es): {value:8.0f} messages/s", flush=True)


if __name__ == "__main__":
    main()
