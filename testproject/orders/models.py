from decimal import Decimal

from django.db import models


class Order(models.Model):
    """The business row of the orders service."""

    number = models.CharField(max_length=32, unique=True)
    user_id = models.PositiveIntegerField()
    amount = models.DecimalField(max_digits=12, decimal_places=2, default=Decimal("0"))
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.number
