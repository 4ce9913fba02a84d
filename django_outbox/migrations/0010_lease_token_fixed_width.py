"""The lease token becomes ``CHAR(32)`` on MySQL/MariaDB; nothing changes elsewhere.

InnoDB updates a record in place only when it keeps its length; a record that grows is
deleted and inserted again, and the outbox's pages are full (rows are inserted in key
order), so a claim that lengthened ``lease_token`` ('' -> 32 characters) and filled
``leased_until`` (NULL -> a time) split pages: 5.3 kB of redo log per row claimed. With the
token ``CHAR(32)`` ('' and a token take the same room) and ``leased_until`` written at the
INSERT (``OutboxEventQuerySet.new_pending``), the claim rewrites the row in place: 0.2 kB.
See ``models.LeaseTokenField`` and docs/benchmarks.md.

On MySQL/MariaDB ``ALTER TABLE ... MODIFY`` copies the table, and writes to it wait until
the copy is done: on an outbox of millions of rows, purge the SENT ones first
(``purge_outbox``) or run ``migrate`` in a quiet hour (docs/installation.md, "Upgrading").
PostgreSQL and SQLite keep ``varchar``: no statement is run there.
"""

from django.db import migrations

import django_outbox.models


def _modify(column_type):
    def run(apps, schema_editor):
        # MySQL/MariaDB only. Elsewhere the column stays varchar, and an AlterField would
        # not be a no-op everywhere: SQLite rebuilds the table for it, which would drop the
        # partial indexes that migrations 0005 and 0007 created outside the model state.
        if schema_editor.connection.vendor != "mysql":
            return
        model = apps.get_model("django_outbox", "OutboxEvent")
        quote = schema_editor.quote_name
        schema_editor.execute(
            f"ALTER TABLE {quote(model._meta.db_table)} "
            f"MODIFY {quote('lease_token')} {column_type} NOT NULL"
        )

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0009_drop_aggregate_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="outboxevent",
                    name="lease_token",
                    field=django_outbox.models.LeaseTokenField(
                        blank=True,
                        default="",
                        help_text=(
                            "Identifies the relay claim holding the row; settles are fenced on it."
                        ),
                        max_length=32,
                        verbose_name="lease token",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(_modify("char(32)"), _modify("varchar(32)")),
            ],
        ),
    ]
