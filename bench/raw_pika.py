"""The baseline: how fast plain pika publishes outbox-sized messages with pipelined confirms.

No database, no Django, no outbox code: a SelectConnection publisher (confirm mode,
``mandatory=True``, persistent, a message_id and the outbox headers on every message, the
same JSON body size as an outbox event) to a durable queue. It keeps up to ``window``
messages in flight and counts them done when acked, exactly what a relay could at best do.
``batch_size`` makes it publish in batches and wait for each batch's confirms instead, as a
relay pass does. ``coalesce`` writes the frames of each refill to the socket in one piece,
as ``PikaBackend`` does, instead of pika's one ``send()`` per frame: not how pika is
usually used, so not the baseline, but what a publisher tuned the same way achieves.

    python -m bench.raw_pika [--smoke] [--count 20000] [--batch-size 100] [--coalesce]
        [--repeat 3]

``relay_bench`` and ``backend_bench`` import :func:`raw_pika_rate` for their ratio.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pika
from pika import spec
from pika.adapters.select_connection import SelectConnection

from bench.common import (
    DEFAULT_URL,
    SAMPLE_EVENT_TYPE,
    SAMPLE_OCCURRED_AT,
    SAMPLE_PAYLOAD,
    bench_exchange,
    best_of,
    count_from,
    parser,
    report,
    sample_headers,
)
from django_outbox.masking import mask_url

DEFAULT_WINDOW = 1000


def sample_body() -> bytes:
    """The payload as the outbox serialises it (compact separators, UTF-8)."""
    return json.dumps(SAMPLE_PAYLOAD, ensure_ascii=False, separators=(",", ":")).encode()


class _Publisher:
    def __init__(
        self,
        url: str,
        exchange: str,
        count: int,
        window: int,
        batch_size: int | None,
        coalesce: bool = False,
    ) -> None:
        self.exchange = exchange
        self.coalesce = coalesce
        self.count = count
        self.window = window
        self.batch_size = batch_size
        self.body = sample_body()
        self.timestamp = int(SAMPLE_OCCURRED_AT.timestamp())
        self.published = 0
        self.confirmed = 0
        self.failed = 0
        self.started = 0.0
        self.finished = 0.0
        self.error: Any = None
        self.channel: Any = None
        self.connection = SelectConnection(
            pika.URLParameters(url),
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_error,
            on_close_callback=self._on_closed,
        )

    def run(self) -> float:
        self.connection.ioloop.start()
        if self.error is not None:
            raise RuntimeError(f"raw pika benchmark failed: {self.error}")
        if self.failed:
            raise RuntimeError(f"{self.failed} messages were nacked")
        return self.count / (self.finished - self.started)

    def _on_error(self, connection: Any, error: Any) -> None:
        self.error = error
        connection.ioloop.stop()

    def _on_closed(self, connection: Any, error: Any) -> None:
        if not self.finished:
            self.error = error
        connection.ioloop.stop()

    def _on_open(self, connection: Any) -> None:
        connection.channel(on_open_callback=self._on_channel)

    def _on_channel(self, channel: Any) -> None:
        self.channel = channel
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_ok)

    def _on_confirm_ok(self, frame: Any) -> None:
        self.started = time.perf_counter()
        self._fill()

    def _fill(self) -> None:
        """Publish until the window (or the current batch) is full."""
        if self.batch_size:
            if self.published != self.confirmed:
                return  # wait for the whole batch, like a relay pass
            limit = min(self.count, self.published + self.batch_size)
        else:
            limit = min(self.count, self.confirmed + self.window)
        if not self.coalesce:
            self._publish_up_to(limit)
            return
        # Gather what pika would write frame by frame: an instance attribute shadows the
        # method until it is deleted again.
        frames: list[bytes] = []
        self.connection._adapter_emit_data = frames.append
        try:
            self._publish_up_to(limit)
        finally:
            del self.connection._adapter_emit_data
            if frames:
                self.connection._adapter_emit_data(b"".join(frames))

    def _publish_up_to(self, limit: int) -> None:
        publish = self.channel.basic_publish
        while self.published < limit:
            self.published += 1
            # A real publisher gives every message its id and headers: build them each time.
            properties = spec.BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                message_id=uuid.uuid4().hex,
                type=SAMPLE_EVENT_TYPE,
                timestamp=self.timestamp,
                headers=sample_headers(self.published),
            )
            publish(self.exchange, SAMPLE_EVENT_TYPE, self.body, properties, mandatory=True)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        settled = tag - self.confirmed if method.multiple else 1
        if isinstance(method, spec.Basic.Nack):
            self.failed += settled
        self.confirmed += settled
        if self.confirmed >= self.count:
            self.finished = time.perf_counter()
            self.connection.close()
            return
        self._fill()


def raw_pika_rate(
    count: int,
    *,
    url: str = DEFAULT_URL,
    exchange: str | None = None,
    window: int = DEFAULT_WINDOW,
    batch_size: int | None = None,
    coalesce: bool = False,
) -> float:
    """Events/s of plain pika publishing ``count`` messages with pipelined confirms.

    ``exchange`` must route to a durable queue; by default a temporary one is made (and
    deleted). ``window``: messages in flight at most (streaming); ``batch_size``: publish in
    batches and wait for each batch's confirms instead; ``coalesce``: one socket write per
    refill instead of one per frame.
    """
    if exchange is None:
        with bench_exchange(url, prefix="bench.raw") as name:
            return _Publisher(url, name, count, window, batch_size, coalesce).run()
    return _Publisher(url, exchange, count, window, batch_size, coalesce).run()


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="messages in flight")
    p.add_argument("--batch-size", type=int, default=None, help="wait per batch instead")
    p.add_argument("--coalesce", action="store_true", help="one socket write per refill")
    args = p.parse_args(argv)
    count = count_from(args)
    print(f"body {len(sample_body())} bytes, {count} messages, {mask_url(args.url)}")
    rate = best_of(
        args.repeat,
        lambda: raw_pika_rate(
            count,
            url=args.url,
            window=args.window,
            batch_size=args.batch_size,
            coalesce=args.coalesce,
        ),
    )
    mode = f"batches of {args.batch_size}" if args.batch_size else f"window {args.window}"
    mode += ", coalesced writes" if args.coalesce else ""
    report(f"raw pika ({mode})", rate, count=count)


if __name__ == "__main__":
    main()
