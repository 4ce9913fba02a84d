"""Scheduled events: ``due_at``, when a row became due (``emit(deliver_at=, delay=)``).

Nullable, with no default and no index: adding it changes no existing row, so it is a
catalogue change on PostgreSQL, MySQL 8 and MariaDB 10.6 (no table rewrite, no backfill of a
large outbox). NULL means "due from its creation" (``created_at``), which is what every row
written before this migration is. The relay keeps its ``(status, next_retry_time)`` index:
a scheduled row's ``next_retry_time`` is its due time, so the claim needs nothing new.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0005_claim_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxevent",
            name="due_at",
            field=models.DateTimeField(
                blank=True,
                help_text=(
                    "When the row became due: set by emit(deliver_at=, delay=) and by a "
                    "requeue; empty when it was due from its creation. Staleness and the "
                    "oldest PENDING age count from here, so a scheduled event waits without "
                    "alarming anyone."
                ),
                null=True,
                verbose_name="due at",
            ),
        ),
    ]
