"""The states of an outbox row: the one definition every module imports.

A module of its own, importing nothing of the app, so that the models, the querysets that
write the row's lifecycle and the ordered-mode policy can all use it without importing each
other.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class Status(models.IntegerChoices):
    """Row states; the numbers match the SQL people type during incidents."""

    PENDING = 0, _("pending")
    SENT = 1, _("sent")
    DEAD = 2, _("dead")
