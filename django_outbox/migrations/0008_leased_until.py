"""The lease moves to its own column, ``leased_until``, so that claiming a row changes no
indexed column.

Until 0007 the claim pushed ``next_retry_time`` forward as the lease. That column is in
``django_outbox_due_idx`` (and in the scheduled partial index), so on PostgreSQL every
claim was a non-HOT update: a new entry in each of the table's indexes for every row
claimed, and as much WAL again as the row's INSERT. ``leased_until``, ``lease_token`` and
``updated_at`` are in no index, so the claim is a HOT update (a new row version on the same
page, no index entry) wherever the page has room for it; the table's ``fillfactor`` (below)
leaves that room. On MySQL/MariaDB the claim no longer rewrites a secondary index either.

The column is nullable with no default: adding it is a catalogue change on PostgreSQL, and
``ALGORITHM=INSTANT`` on MariaDB 10.3+/MySQL 8.0.12+; SQLite adds it in place.

PostgreSQL: ``fillfactor = 80`` on the table (new pages are filled to 80% by inserts; the
rest is kept for later versions of their rows), measured with ``bench.relay_bench``
(docs/benchmarks.md). It applies to pages written from now on; existing pages are left as
they are until they are rewritten (``VACUUM FULL``, ``pg_repack``), which is not needed.

During a rolling upgrade a relay of the previous release still leases through
``next_retry_time``, which the new relays respect (a row is due only when both have
passed); it does not see the new relays' ``leased_until``, so it may publish a row that a
new relay is publishing: a duplicate, which consumers absorb, never a loss (settles stay
fenced on the lease token).
"""

from django.db import migrations, models

FILLFACTOR = 50


def _table(apps, schema_editor):
    return schema_editor.quote_name(apps.get_model("django_outbox", "OutboxEvent")._meta.db_table)


def set_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"ALTER TABLE {_table(apps, schema_editor)} SET (fillfactor = {FILLFACTOR})"
        )


def reset_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {_table(apps, schema_editor)} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0007_scheduled_events"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxevent",
            name="leased_until",
            field=models.DateTimeField(
                blank=True,
                help_text=(
                    "While a relay holds the row: the end of its lease. Another relay may "
                    "claim the row once it has passed."
                ),
                null=True,
                verbose_name="leased until",
            ),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="next_retry_time",
            field=models.DateTimeField(
                help_text=(
                    "When the row is next due: at once, when scheduled, or after a failed "
                    "attempt."
                ),
                verbose_name="next retry time",
            ),
        ),
        migrations.RunPython(set_fillfactor, reset_fillfactor),
    ]
