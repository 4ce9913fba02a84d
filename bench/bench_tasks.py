"""The no-op Django task bench/tasks_bench.py enqueues (a module of its own: a task must be
importable by its path, and this one is imported only once Django is set up)."""

from __future__ import annotations

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef,import-not-found,unused-ignore]


@task()
def noop() -> None:
    """Does nothing: what is measured is the queue's own cost."""
