"""Broker backends. The relay talks to :class:`~django_outbox.backends.base.BaseBackend` only.

Like Django's email backends, a backend is chosen by dotted path (``OUTBOX_BACKEND``, else
the broker URL's transport's: :mod:`django_outbox.transports`) and built with
:func:`get_backend`; extra keyword arguments come from ``OUTBOX_BACKEND_OPTIONS``.
"""

from __future__ import annotations

from typing import Any

from django.utils.module_loading import import_string

from ..conf import outbox_settings
from ..exceptions import ImproperlyConfiguredBackend
from ..transports import UnknownTransport, backend_path
from .base import BaseBackend, contract_problem


def get_backend_class(path: str | None = None) -> type[BaseBackend]:
    """``path``, else ``OUTBOX_BACKEND``, else the backend of the broker URL's transport."""
    try:
        path = path or backend_path()
    except UnknownTransport as exc:
        raise ImproperlyConfiguredBackend(f"OUTBOX_BROKER_URL: {exc}.") from exc
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfiguredBackend(
            f"OUTBOX_BACKEND {path!r} cannot be imported ({exc}). Use one of "
            "django_outbox.backends.pika.PikaBackend, .locmem.LocmemBackend, "
            ".console.ConsoleBackend, or the dotted path of your own backend class."
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, BaseBackend)):
        raise ImproperlyConfiguredBackend(
            f"OUTBOX_BACKEND {path!r} is not a subclass of django_outbox.backends.base.BaseBackend."
        )
    problem = contract_problem(cls)
    if problem:
        raise ImproperlyConfiguredBackend(f"OUTBOX_BACKEND {path!r}: {problem}")
    return cls


def get_backend(path: str | None = None, **options: Any) -> BaseBackend:
    """Build the configured backend (not yet opened)."""
    merged = {**outbox_settings.BACKEND_OPTIONS, **options}
    return get_backend_class(path)(**merged)
