"""Where the database work of a drain runs: claims and settles, each in its own lane."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

from django.db import connections

R = TypeVar("R")


def done(value: R) -> Future[R]:
    """A future that already holds ``value``."""
    future: Future[R] = Future()
    future.set_result(value)
    return future


class Lanes:
    """Runs the relay's database work now, on the calling thread (returns a done future).

    Two lanes: claims and settles. Within a lane, work runs in submission order.
    """

    def claim(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        return self._call(fn, *args)

    def settle(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        return self._call(fn, *args)

    def each_connection(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on every thread that has a database connection of its own."""

    @staticmethod
    def _call(fn: Callable[..., R], *args: Any) -> Future[R]:
        future: Future[R] = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def close(self) -> None:
        pass


INLINE = Lanes()


class ThreadLanes(Lanes):
    """Runs the relay's claims on one thread and its settles on another, each with its own
    database connection (Django's are per thread), closed with the lanes.

    Claims and settles are separate short transactions that need not wait for each other:
    on two connections the database runs them side by side.
    """

    def __init__(self, name: str) -> None:
        self._claims = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-claim")
        self._settles = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-settle")

    def claim(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        return self._claims.submit(fn, *args)

    def settle(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        return self._settles.submit(fn, *args)

    def each_connection(self, fn: Callable[[], Any]) -> None:
        for pool in (self._claims, self._settles):
            pool.submit(fn).result()

    def close(self) -> None:
        for pool in (self._claims, self._settles):
            with suppress(Exception):
                pool.submit(connections.close_all).result()
            pool.shutdown(wait=True)
