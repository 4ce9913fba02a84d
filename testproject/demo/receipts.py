"""The demo's Django task: ``send_receipt``, enqueued with each order in its transaction
(``OutboxTaskBackend``, docs/tasks.md) and run by the task worker after the relay."""

from __future__ import annotations

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport, when the tasks extra is installed
    try:
        from django_tasks import task  # type: ignore[no-redef,import-not-found,unused-ignore]
    except ImportError:
        task = None  # type: ignore[assignment,unused-ignore]

from .models import Receipt


def send_receipt(order_number: str) -> bool:
    """ "Send" the receipt of an order: a Receipt row. Idempotent by the order's number (a
    redelivered task finds the row), and written in the worker's transaction with the
    task's result, so it commits once. True when this run wrote it."""
    _, created = Receipt.objects.get_or_create(order_number=order_number)
    return created


# The task, under the function's own name (a worker imports it by that path); None on
# Django 5.2 without the Tasks backport: the demo then has no receipts step, and says how
# to get it.
send_receipt = task(send_receipt) if task is not None else None  # type: ignore[assignment,unused-ignore]
