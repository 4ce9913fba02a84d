"""The points service's handler: points for every order, exactly once per event."""

from __future__ import annotations

from decimal import ROUND_DOWN, Decimal

from django_outbox.consumer import IdempotentHandler
from django_outbox.message import ReceivedEvent

from .models import PointsLedger

POINTS_PER_UNIT = 1  # one point per whole currency unit spent


class AwardPointsHandler(IdempotentHandler):
    """ORDER_CREATED -> one ledger row; a redelivery hits the unique source_event_id."""

    event_types = ["ORDER_CREATED"]
    dedup_model = PointsLedger
    name = "points.award"

    def handle(self, event: ReceivedEvent) -> None:
        payload = event.payload
        amount = Decimal(str(payload["amount"])).quantize(Decimal("1"), rounding=ROUND_DOWN)
        PointsLedger.objects.create(
            source_event_id=event.event_id,
            user_id=payload["user_id"],
            order_number=payload.get("number", event.aggregate_id),
            points=int(amount) * POINTS_PER_UNIT,
        )
