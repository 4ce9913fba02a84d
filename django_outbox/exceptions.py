"""Exceptions raised by django_outbox. Each message says what to do about it."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every django_outbox error."""


class InvalidEvent(OutboxError, ValueError):
    """emit() was given something that cannot become an event; nothing was written."""


class PayloadTooLarge(InvalidEvent):
    """The serialised payload is larger than OUTBOX_MAX_PAYLOAD_BYTES."""


class NotInTransaction(OutboxError):
    """emit() was called in autocommit mode, outside any atomic block."""


class DuplicateEventId(OutboxError):
    """An event with the same event_id exists already (or twice in one block)."""


class ImproperlyConfiguredBackend(OutboxError):
    """The configured backend or one of its options is wrong."""
