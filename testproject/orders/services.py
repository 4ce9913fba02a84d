"""The orders service: the business write and its event, in one transaction."""

from __future__ import annotations

import uuid
from decimal import Decimal

from django_outbox import outbox

from .models import Order

ORDER_CREATED = "ORDER_CREATED"


def create_order(*, user_id: int, amount: Decimal, number: str | None = None) -> Order:
    """Create an order and its ORDER_CREATED event; both commit or neither does."""
    with outbox.atomic() as box:
        order = Order.objects.create(
            number=number or uuid.uuid4().hex[:16], user_id=user_id, amount=amount
        )
        box.emit(
            ORDER_CREATED,
            aggregate=order,
            aggregate_type="ORDER",
            aggregate_id=order.number,
            payload={
                "order_id": order.pk,
                "number": order.number,
                "user_id": order.user_id,
                "amount": order.amount,
            },
        )
    return order
