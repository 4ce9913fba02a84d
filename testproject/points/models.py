"""The points service (consumer side): one ledger row per rewarded event."""

import django
from django.db import models

from django_outbox.consumer import SourceEventModel

# CheckConstraint(check=) became condition= in Django 5.1.
_CHECK_KWARG = "condition" if django.VERSION >= (5, 1) else "check"


class PointsLedger(SourceEventModel):
    """Points awarded to a user; ``source_event_id`` (unique) is the event that caused it."""

    user_id = models.PositiveIntegerField()
    order_number = models.CharField(max_length=32)
    points = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            # Another constraint on the same row: its violation is a real failure, not a
            # duplicate (the tests rely on it).
            models.CheckConstraint(
                **{_CHECK_KWARG: models.Q(points__gte=0)}, name="points_ledger_points_gte_0"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.points} points for user {self.user_id} ({self.source_event_id})"
