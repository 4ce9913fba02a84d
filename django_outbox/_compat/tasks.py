"""Django's Tasks API, from Django (6.0+: ``django.tasks``) or the backport on 5.2
(``django-tasks``, the ``tasks`` extra): one import for ``tasks_backend.py`` and
``tasks_worker.py``, so that there is one code path.

``django.tasks`` wins when both are installed. The backport's names are the ones Django took
over (``BaseTaskBackend``, ``Task``, ``TaskResult``, ``TaskError``, ``TaskContext``, the three
signals, ``TaskResultDoesNotExist``, ``normalize_json``) but for one: the backport's
``InvalidTaskError`` is Django's ``InvalidTask``, exported here under Django's name;
``tests/test_tasks_backend.py`` runs on both. Nothing here is private, but it is the one
place a rename in either would be absorbed.
"""

from __future__ import annotations

from typing import Any

try:
    from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import DEFAULT_TASK_PRIORITY, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    SOURCE = "django.tasks"
except ImportError:  # Django 5.2: the backport (the tasks extra)
    try:
        from django_tasks import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            TaskContext,
            TaskResult,
            TaskResultStatus,
            task_backends,
        )
        from django_tasks.backends.base import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            BaseTaskBackend,
        )
        from django_tasks.base import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            DEFAULT_TASK_PRIORITY,
            Task,
            TaskError,
        )
        from django_tasks.exceptions import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            InvalidTaskError as InvalidTask,
        )
        from django_tasks.exceptions import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            TaskResultDoesNotExist,
        )
        from django_tasks.signals import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            task_enqueued,
            task_finished,
            task_started,
        )
        from django_tasks.utils import (  # type: ignore[no-redef,import-not-found,unused-ignore]
            normalize_json,
        )
    except ImportError as exc:
        raise ImportError(
            "django_outbox.tasks_backend needs Django's Tasks API: Django 6.0+, or on Django "
            "5.2 the backport: pip install 'django-transactional-outbox[tasks]'."
        ) from exc
    SOURCE = "django_tasks"

__all__ = [
    "DEFAULT_TASK_PRIORITY",
    "SOURCE",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "normalize_json",
    "set_result_field",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]


def set_result_field(result: Any, name: str, value: Any) -> None:
    """Set a field of a frozen ``TaskResult`` (``_return_value`` included), as Django's own
    backends do with ``object.__setattr__``."""
    object.__setattr__(result, name, value)
