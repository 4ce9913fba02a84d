"""The demo's own rows: the receipts its ``send_receipt`` task "sends"."""

from django.db import models


class Receipt(models.Model):
    """One receipt per order; the unique number makes a second run of the task a no-op."""

    order_number = models.CharField(max_length=32, unique=True)
    sent_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"receipt for {self.order_number}"
