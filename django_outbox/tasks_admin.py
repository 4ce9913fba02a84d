"""The admin of Django task results (``OutboxTaskResult``, docs/tasks.md): the list, filters
by status, queue and task, and a requeue of FAILED tasks. Registered from ``admin.py``;
nothing here imports the tasks library until a requeue, so the admin works without it."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from .models import OutboxTaskResult, outbox_db


@admin.register(OutboxTaskResult)
class OutboxTaskResultAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "id",
        "task_path",
        "queue_name",
        "status",
        "attempts",
        "enqueued_at",
        "finished_at",
    )
    list_filter = ("status", "queue_name", "task_path")
    search_fields = ("=id", "task_path")
    date_hierarchy = "enqueued_at"
    actions = ("requeue",)
    readonly_fields = (
        "id",
        "task_path",
        "backend_name",
        "queue_name",
        "priority",
        "run_after",
        "status",
        "enqueued_at",
        "started_at",
        "last_attempted_at",
        "finished_at",
        "arguments",
        "result",
        "error_list",
        "worker_ids",
        "max_retries",
        "message_id",
    )
    exclude = ("args_kwargs", "return_value", "errors")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.display(description=_("attempts"))
    def attempts(self, obj: OutboxTaskResult) -> int:
        return len(obj.worker_ids)

    @admin.display(description=_("arguments"))
    def arguments(self, obj: OutboxTaskResult) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.args_kwargs, indent=2))

    @admin.display(description=_("return value"))
    def result(self, obj: OutboxTaskResult) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.return_value, indent=2))

    @admin.display(description=_("errors"))
    def error_list(self, obj: OutboxTaskResult) -> str:
        return format_html(
            "<pre>{}</pre>",
            "\n\n".join(f"{e['exception_class_path']}\n{e['traceback']}" for e in obj.errors),
        )

    @admin.action(
        description=_("Requeue selected failed tasks (one more attempt)"),
        permissions=["change"],
    )
    def requeue(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        from .tasks_backend import requeue_failed

        using = outbox_db()
        count = requeue_failed(queryset, using)
        skipped = queryset.count() - count
        self.message_user(
            request,
            ngettext("%(count)d failed task requeued.", "%(count)d failed tasks requeued.", count)
            % {"count": count},
            messages.SUCCESS,
        )
        if skipped:
            self.message_user(
                request,
                ngettext(
                    "%(count)d task was not FAILED and was left as it is.",
                    "%(count)d tasks were not FAILED and were left as they are.",
                    skipped,
                )
                % {"count": skipped},
                messages.WARNING,
            )
