"""How many times an event was replayed (``manage.py outbox_requeue --status sent``).

The relay sends it as the ``x-outbox-replay`` header. ``db_default``: the column keeps
``DEFAULT 0`` in the schema, so the previous release's ``emit()``, still running during a
rolling upgrade, inserts rows without naming it. A constant default adds the column
without rewriting the table on PostgreSQL 11+ and MySQL 8.0.12+/MariaDB 10.3+ (instant
``ADD COLUMN``); no CHECK constraint (an ``IntegerField``, not a positive one), which
PostgreSQL would validate by reading every row under the table's exclusive lock.

SQLite cannot add a NOT NULL column in place: Django rebuilds the table from the model
state, which does not hold the claim index of 0005 (raw SQL), so it is created again
(and again after the column is removed, when migrating back).
"""

from importlib import import_module

from django.db import migrations, models

# The module name starts with a digit: no import statement can name it.
claim_index = import_module("django_outbox.migrations.0005_claim_index")


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0005_claim_index"),
    ]

    operations = [
        # Run last when migrating back: removing the column rebuilds the table on SQLite too.
        migrations.RunPython(migrations.RunPython.noop, claim_index.create),
        migrations.AddField(
            model_name="outboxevent",
            name="replay_count",
            field=models.IntegerField(
                db_default=0,
                default=0,
                help_text=(
                    "How many times the event was replayed after it had been sent "
                    "(manage.py outbox_requeue --status sent); sent as the x-outbox-replay "
                    "header."
                ),
                verbose_name="replay count",
            ),
        ),
        # IF NOT EXISTS: nothing to do where the table was altered in place.
        migrations.RunPython(claim_index.create, migrations.RunPython.noop),
    ]
