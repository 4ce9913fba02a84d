"""The claim's index: unsent rows by id (PostgreSQL and SQLite; partial indexes only).

The relay claims the oldest due rows (``status = 0 ... ORDER BY id LIMIT n``). Without this
index PostgreSQL walks the primary key past every SENT row of a draining backlog on each
claim (its statistics still say "all PENDING"), so a claim gets slower the further a backlog
has drained. MySQL/MariaDB have no partial indexes; this migration does nothing there (their
claim reads the primary key, measured flat in bench/relay_bench.py).

Not declared in ``OutboxEvent.Meta.indexes``: Django warns (models.W037) on every command
against MySQL/MariaDB about a conditional index. ``IF NOT EXISTS``: on a large table, create
it beforehand without blocking writers, and this migration finds it done::

    CREATE INDEX CONCURRENTLY IF NOT EXISTS django_outbox_claim_idx
        ON django_outbox_outboxevent (id) WHERE status = 0;
"""

from django.db import migrations

NAME = "django_outbox_claim_idx"


def create(apps, schema_editor):
    connection = schema_editor.connection
    if not connection.features.supports_partial_indexes:
        return
    table = apps.get_model("django_outbox", "OutboxEvent")._meta.db_table
    quote = schema_editor.quote_name
    schema_editor.execute(
        f"CREATE INDEX IF NOT EXISTS {quote(NAME)} ON {quote(table)} ({quote('id')}) "
        f"WHERE {quote('status')} = 0"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.features.supports_partial_indexes:
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(NAME)}")


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0004_aggregatesequence"),
    ]

    operations = [migrations.RunPython(create, drop)]
