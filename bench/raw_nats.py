"""The NATS baseline: how fast plain nats-py publishes outbox-sized messages into a
JetStream stream and awaits their acks.

No database, no Django, no outbox code: ``JetStreamContext.publish_async()`` (nats-py's
asynchronous JetStream publish: a future per message, resolved by the stream's ack) with
``Nats-Msg-Id``, the outbox's headers and the same JSON body as an outbox event, to a
fresh file-storage stream, every future awaited. The rate is the best of the windows tried
(``--windows``: at most that many acks outstanding, nats-py's ``publish_async_max_pending``;
``0``: all of them at once, gathered at the end): nats-py's best, what the relay is held
against.

    python -m bench.raw_nats [--smoke] [--count 20000] [--windows 0,1000,4000] [--repeat 3]
        [--url nats://127.0.0.1:4222]

``relay_bench --transport nats`` and ``backend_bench --transport nats`` import
:func:`raw_nats_rate` and :func:`bench_stream` for their ratio.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from bench.common import (
    SAMPLE_EVENT_TYPE,
    SAMPLE_OCCURRED_AT,
    main_of_a_raw_client,
    sample_headers,
)
from bench.raw_pika import sample_body

DEFAULT_NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
DEFAULT_WINDOWS = (0, 1000, 4000)


def _run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@contextlib.contextmanager
def bench_stream(url: str = DEFAULT_NATS_URL, *, prefix: str = "BENCH") -> Iterator[str]:
    """A fresh stream named ``<prefix>_<random>`` taking ``<its name lower-cased>.>``;
    deleted afterwards. Yields its name (the subjects' prefix is ``name.lower()``)."""
    import nats
    from nats.js.api import StorageType, StreamConfig

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        client = await nats.connect(url)
        try:
            await client.jetstream().add_stream(
                StreamConfig(
                    name=name,
                    subjects=[f"{name.lower()}.>"],
                    duplicate_window=120,
                    storage=StorageType.FILE,
                )
            )
        finally:
            await client.close()

    async def delete() -> None:
        client = await nats.connect(url)
        try:
            await client.jetstream().delete_stream(name)
        finally:
            await client.close()

    _run(create())
    try:
        yield name
    finally:
        _run(delete())


def purge_stream(url: str, name: str) -> None:
    import nats

    async def purge() -> None:
        client = await nats.connect(url)
        try:
            await client.jetstream().purge_stream(name)
        finally:
            await client.close()

    _run(purge())


def raw_nats_rate(
    count: int, *, url: str = DEFAULT_NATS_URL, stream: str | None = None, window: int = 0
) -> float:
    """Events/s of ``publish_async()`` over ``count`` messages, every ack awaited, with at
    most ``window`` outstanding (0: no limit)."""
    if stream is None:
        with bench_stream(url, prefix="BENCH_RAW") as name:
            return raw_nats_rate(count, url=url, stream=name, window=window)
    import nats

    body = sample_body()
    subject = f"{stream.lower()}.{SAMPLE_EVENT_TYPE}"
    occurred = SAMPLE_OCCURRED_AT.isoformat()

    async def publish() -> float:
        client = await nats.connect(url)
        js = client.jetstream(publish_async_max_pending=window or count)
        try:
            started = time.perf_counter()
            futures = []
            for i in range(count):
                headers = {
                    "Nats-Msg-Id": uuid.uuid4().hex,
                    "Content-Type": "application/json",
                    "x-outbox-type": SAMPLE_EVENT_TYPE,
                    **{k: str(v) for k, v in sample_headers(i).items()},
                    "occurred_at": occurred,
                }
                futures.append(await js.publish_async(subject, body, headers=headers))
            acks = await asyncio.gather(*futures)
            elapsed = time.perf_counter() - started
        finally:
            await client.close()
        if len(acks) != count:
            raise RuntimeError(f"{len(acks)} of {count} acked")
        return count / elapsed

    return float(_run(publish()))


def best_raw_nats_rate(
    count: int, *, url: str = DEFAULT_NATS_URL, stream: str | None = None, windows: Any = None
) -> float:
    """The best :func:`raw_nats_rate` over ``windows``: nats-py's best."""
    return max(
        raw_nats_rate(count, url=url, stream=stream, window=w) for w in (windows or DEFAULT_WINDOWS)
    )


def main(argv: list[str] | None = None) -> None:
    main_of_a_raw_client(argv, __doc__, "raw nats-py", raw_nats_rate, window=DEFAULT_WINDOWS)


if __name__ == "__main__":
    main()
