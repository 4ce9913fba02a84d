"""The Redis baseline: how fast plain redis-py adds outbox-sized entries to a stream with
pipelined ``XADD``s.

No database, no Django, no outbox code: redis-py's ``Pipeline`` (``transaction=False``)
of ``XADD``s with the fields the relay writes (``message_id``, ``type``, ``content_type``,
``headers`` as JSON, ``body``: the same JSON body as an outbox event) to a fresh stream,
every answer read. The rate is the best of the pipeline depths tried (``--depths``: that
many ``XADD``s per ``execute()``; ``0``: all of them in one): redis-py's best, what the
relay is held against.

    python -m bench.raw_redis [--smoke] [--count 20000] [--depths 0,200,1000] [--repeat 3]
        [--url redis://127.0.0.1:6379/0]

``relay_bench --transport redis`` imports :func:`best_raw_redis_rate` and
:func:`bench_streams` for its ratio.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from bench.common import (
    SAMPLE_EVENT_TYPE,
    main_of_a_raw_client,
    sample_headers,
)
from bench.raw_pika import sample_body

DEFAULT_REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
DEFAULT_DEPTHS = (0, 200, 1000)


@contextlib.contextmanager
def bench_streams(url: str = DEFAULT_REDIS_URL, *, prefix: str = "bench") -> Iterator[str]:
    """A fresh streams' prefix ``<prefix>-<random>``: events go to ``<it>.<routing key>``;
    every stream under it is deleted afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    try:
        yield name
    finally:
        purge_streams(url, name)


def purge_streams(url: str, name: str) -> None:
    """Delete every stream under prefix ``name``."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(f"{name}.*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def raw_redis_rate(
    count: int, *, url: str = DEFAULT_REDIS_URL, prefix: str | None = None, depth: int = 0
) -> float:
    """Events/s of pipelined ``XADD``s over ``count`` entries, ``depth`` per ``execute()``
    (0: all in one), every answer read."""
    if prefix is None:
        with bench_streams(url, prefix="bench-raw") as name:
            return raw_redis_rate(count, url=url, prefix=name, depth=depth)
    import redis

    body = sample_body()
    stream = f"{prefix}.{SAMPLE_EVENT_TYPE}"
    depth = depth or count
    client = redis.Redis.from_url(url)
    try:
        client.ping()
        started = time.perf_counter()
        answered = 0
        for first in range(0, count, depth):
            pipe = client.pipeline(transaction=False)
            for i in range(first, min(first + depth, count)):
                fields: Any = {
                    "message_id": uuid.uuid4().hex,
                    "type": SAMPLE_EVENT_TYPE,
                    "content_type": "application/json",
                    "headers": json.dumps(sample_headers(i), separators=(",", ":")),
                    "body": body,
                }
                pipe.xadd(stream, fields)
            answered += len(pipe.execute())
        elapsed = time.perf_counter() - started
    finally:
        client.close()
    if answered != count:
        raise RuntimeError(f"{answered} of {count} answered")
    return count / elapsed


def best_raw_redis_rate(
    count: int, *, url: str = DEFAULT_REDIS_URL, prefix: str | None = None, depths: Any = None
) -> float:
    """The best :func:`raw_redis_rate` over ``depths``: redis-py's best."""
    return max(
        raw_redis_rate(count, url=url, prefix=prefix, depth=d) for d in (depths or DEFAULT_DEPTHS)
    )


def main(argv: list[str] | None = None) -> None:
    main_of_a_raw_client(argv, __doc__, "raw redis-py", raw_redis_rate, depth=DEFAULT_DEPTHS)


if __name__ == "__main__":
    main()
