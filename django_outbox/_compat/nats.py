"""nats-py, which is asyncio only, under the relay's and the consumer's synchronous loops;
and the nats-py internals the NATS relay backend relies on (pinned in pyproject.toml).

* :class:`LoopThread`: one asyncio event loop on a thread of its own, for as long as a
  backend or a consumer lives. nats-py's connection, its reader and its flusher tasks run
  there; the caller's thread hands it coroutines (:meth:`LoopThread.run`, which waits for
  the result) or plain callables (:meth:`LoopThread.call_soon`, which does not). The
  caller never blocks the loop and the loop never blocks the caller: publishes are written
  and acks read while the relay claims and settles on its own threads.
* :func:`write_frames`: a batch of ``HPUB`` frames, built by the caller, handed to the
  connection's pending buffer in one piece and flushed, through the private
  ``Client._send_command()`` and ``Client._flush_pending()`` that ``Client.publish()``
  itself ends with. ``publish()`` costs a coroutine, a subject check and a header dict
  walked per message; a batch of frames built in one loop costs half of the relay's time
  per message (docs/benchmarks.md, "NATS JetStream").
* :func:`take_replies`: the messages of one subscription (the relay's acks) handed to a
  plain function straight from nats-py's protocol parser, through the private
  ``Client._process_msg()`` and ``Subscription._id``: nats-py would build a ``Msg``, queue
  it and wake a task to call a coroutine for each ack, about half of what a publish costs
  the relay.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

#: The nats-py releases these internals are known to behave as assumed (tests/test_compat_nats.py).
PINNED = "nats-py>=2.15,<3"

_T = TypeVar("_T")


class LoopThread:
    """An asyncio event loop running on a daemon thread of its own (named ``name``)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # Whatever is left (nats-py's reader after a close) is cancelled and awaited,
            # so that the loop closes without "Task was destroyed but it is pending".
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_loop(self) -> bool:
        """Whether the caller runs on the loop's own thread."""
        return threading.current_thread() is self._thread

    def run(self, coroutine: Coroutine[Any, Any, _T], timeout: float | None) -> _T:
        """Run ``coroutine`` on the loop and wait for its result, at most ``timeout``
        seconds: then it is cancelled and ``TimeoutError`` raised."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout:g} s") from None

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Start ``coroutine`` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        """Call ``callback(*args)`` on the loop, without waiting for it."""
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop (what still runs on it is cancelled) and wait for its thread."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if not self.in_loop():
            self._thread.join(timeout)


async def write_frames(client: Any, frames: bytes) -> None:
    """Queue ``frames`` (whole protocol commands) on ``client``'s connection and flush
    them: what ``Client.publish()`` does after it has built one ``PUB``/``HPUB``."""
    await client._send_command(frames)
    await client._flush_pending()


def take_replies(
    client: Any, subscription: Any, handler: Callable[[bytes, bytes, bytes | None], None]
) -> None:
    """Call ``handler(subject, data, headers)`` (bytes as they came: ``headers`` is the raw
    ``NATS/1.0`` block, None without one) for each message of ``subscription``, on the
    loop's thread, instead of its callback. Other subscriptions are left as they are."""
    sid = subscription._id
    original = client._process_msg

    async def process_msg(
        s: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        if s == sid:
            handler(subject, data, headers)
            return
        await original(s, subject, reply, data, headers)

    client._process_msg = process_msg
