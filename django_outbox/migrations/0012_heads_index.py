"""Ordered heads without reading the backlog (PostgreSQL; partial indexes only).

Finding each aggregate's head was one pass over every unsent ordered row, grouped by
aggregate: about 1 s per claim that looked for heads with a million rows queued. Two partial
indexes let the claim read no more than one index entry per aggregate
(``ordering.heads``, a loose index scan: a recursive query that jumps from one aggregate to
the next):

- ``django_outbox_heads_idx``: the unsent rows (PENDING or DEAD) that have an aggregate,
  by aggregate then id: the first entry of each aggregate is where its head is;
- ``django_outbox_unordered_idx``: the PENDING rows without an aggregate that are due from
  their creation, by id: the claim's unordered rows, without walking past the ordered
  backlog in front of them.

Each new row has an entry in one of the two (one index entry more per event than before,
measured with ``bench.emit_bench --part cost``, docs/benchmarks.md); a SENT row in neither.
MySQL/MariaDB have no partial indexes and SQLite is for development: nothing changes
there. Not declared in ``OutboxEvent.Meta.indexes`` for the reason 0005 gives. ``IF NOT
EXISTS``: on a large table, create them beforehand without blocking writers, and this
migration finds them done::

    CREATE INDEX CONCURRENTLY IF NOT EXISTS django_outbox_heads_idx
        ON django_outbox_outboxevent (aggregate_type, aggregate_id, id)
        WHERE status IN (0, 2) AND aggregate_id <> '';
    CREATE INDEX CONCURRENTLY IF NOT EXISTS django_outbox_unordered_idx
        ON django_outbox_outboxevent (id)
        WHERE status = 0 AND due_at IS NULL AND aggregate_id = '';
"""

from django.db import migrations

HEADS = "django_outbox_heads_idx"
UNORDERED = "django_outbox_unordered_idx"


def _indexes(apps, schema_editor):
    table = schema_editor.quote_name(
        apps.get_model("django_outbox", "OutboxEvent")._meta.db_table
    )
    quote = schema_editor.quote_name
    status, aggregate_id = quote("status"), quote("aggregate_id")
    return [
        (
            HEADS,
            f"{table} ({quote('aggregate_type')}, {aggregate_id}, {quote('id')}) "
            f"WHERE {status} IN (0, 2) AND {aggregate_id} <> ''",
        ),
        (
            UNORDERED,
            f"{table} ({quote('id')}) WHERE {status} = 0 AND {quote('due_at')} IS NULL "
            f"AND {aggregate_id} = ''",
        ),
    ]


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, definition in _indexes(apps, schema_editor):
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {schema_editor.quote_name(name)} ON {definition}"
        )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, _definition in _indexes(apps, schema_editor):
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(name)}")


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0011_outboxtaskresult"),
    ]

    operations = [migrations.RunPython(create, drop)]
