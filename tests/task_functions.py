"""Django tasks the tests enqueue on the OutboxTaskBackend (tests/settings.py's TASKS)."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from pathlib import Path
from typing import Any

from django_outbox._compat.tasks import TaskContext

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef,import-not-found,unused-ignore]

from tests.testapp.models import Widget

#: Whether ``@task`` hands options of the backend's own to its task class (Django 6.1+):
#: ``@task(max_retries=N)``. Before, a task has the backend's OPTIONS["MAX_RETRIES"].
TASK_OPTIONS = any(
    p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(task).parameters.values()
)


@task()
def add(a: int, b: int) -> int:
    return a + b


@task()
def make_widget(code: str, name: str = "") -> str:
    """A task with an effect in the outbox's database: a Widget row."""
    Widget.objects.create(code=code, name=name)
    return code


@task(**({"max_retries": 1} if TASK_OPTIONS else {}))
def make_widget_then_fail(code: str) -> None:
    """Writes, then raises: the write must roll back with the failed attempt."""
    Widget.objects.create(code=code)
    raise ValueError(f"boom after writing {code}")


@task()
def fail_always(note: str) -> None:
    raise ValueError(f"always fails: {note}")


@task(takes_context=True)
def fail_first(context: TaskContext, code: str) -> int:
    """Fails its first attempt, succeeds its second."""
    if context.attempt < 2:
        raise RuntimeError("first attempt fails")
    Widget.objects.create(code=code)
    return context.attempt


@task()
async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task()
def slow_widget(code: str, marker: str, seconds: float) -> str:
    """Writes a Widget, announces it is running (``marker`` file), then sleeps: a worker
    killed meanwhile leaves neither the Widget nor a result (tests/faults)."""
    Widget.objects.create(code=code)
    Path(marker).write_text(str(os.getpid()))
    time.sleep(seconds)
    return code


def not_a_task(*args: Any) -> None:
    pass
