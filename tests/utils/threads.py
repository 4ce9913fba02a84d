"""Threads that do database work in a test."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import connections


def db_thread(target: Callable[..., Any], *args: Any, **kwargs: Any) -> threading.Thread:
    """A thread running ``target(*args, **kwargs)`` that closes the database connections it
    opened when it ends. Django keeps a connection per thread and nothing closes a
    finished thread's one but the garbage collector; one still open when the suite ends
    keeps the test database from being dropped ("being accessed by other users")."""

    def run() -> None:
        try:
            target(*args, **kwargs)
        finally:
            connections.close_all()

    return threading.Thread(target=run)
