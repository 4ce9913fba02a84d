"""Exceptions raised by django_outbox. Each message says what to do about it."""

from __future__ import annotations

from .masking import mask_urls_in

#: An error's text is cut to this many characters where it is stored (an outbox row's
#: ``last_error``, a consumer's dead-letter header): a traceback-sized message must not
#: bloat every row or header that records it.
MAX_ERROR_LENGTH = 2000


def error_text(error: BaseException | str) -> str:
    """``error`` as it is recorded: ``"Type: message"`` for an exception, the password of
    any URL in it masked (what is recorded is shown to every admin user who may view the
    outbox), cut to :data:`MAX_ERROR_LENGTH` characters."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return mask_urls_in(text)[:MAX_ERROR_LENGTH]


class OutboxError(Exception):
    """Base class of every django_outbox error."""


class InvalidEvent(OutboxError, ValueError):
    """emit() was given something that cannot become an event; nothing was written."""


class PayloadTooLarge(InvalidEvent):
    """The serialised payload is larger than OUTBOX_MAX_PAYLOAD_BYTES."""


class NotInTransaction(OutboxError):
    """emit() was called in autocommit mode, outside any atomic block, or for an aggregate
    whose writes go to another database than the event's: either way the event would not
    commit with the business write."""


class DuplicateEventId(OutboxError):
    """An event with the same event_id exists already (or twice in one block)."""


class ImproperlyConfiguredBackend(OutboxError):
    """The configured backend or one of its options is wrong."""
