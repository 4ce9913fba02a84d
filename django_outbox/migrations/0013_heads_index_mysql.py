"""Ordered heads without reading the backlog on MySQL/MariaDB (an index; nothing elsewhere).

Migration 0012 gave PostgreSQL partial indexes; MySQL/MariaDB have none, so a claim that
looked for heads grouped every unsent ordered row by aggregate, and walked a hot aggregate's
whole queue by id for the unordered rows behind it: 48 ms -> 569 ms a claim behind one hot
aggregate, 10,000 rows queued against 200,000 (docs/benchmarks.md). This index,
``(status, aggregate_id, aggregate_type, id)``:

- lists, for each status, each aggregate's rows by id: the optimizer's loose index scan
  reads one entry per aggregate with PENDING (or DEAD) rows, whatever each has queued, and
  never the SENT rows, which are a range of their own (``ordering._heads_loose_scan``);
- lists the PENDING rows without an aggregate (``status = 0 AND aggregate_id = ''``): the
  claim's unordered rows, without a walk past the ordered backlog.

An index on virtual columns NULL outside those rows (the nearest to a partial index) was
measured first: MariaDB 10.11 makes no loose index scan on generated columns. Each event
has one index entry more (measured with ``bench.emit_bench --part cost``,
docs/benchmarks.md). Not declared in ``OutboxEvent.Meta.indexes``, so that PostgreSQL and
SQLite, which do not need it, do not pay for it. Created only when it is not there: on a
large table, create it beforehand (MariaDB and MySQL build it online, writers go on)::

    CREATE INDEX django_outbox_heads_idx ON django_outbox_outboxevent
        (status, aggregate_id, aggregate_type, id) ALGORITHM=INPLACE LOCK=NONE;
"""

from django.db import migrations

NAME = "django_outbox_heads_idx"
COLUMNS = ("status", "aggregate_id", "aggregate_type", "id")


def _exists(schema_editor, table):
    with schema_editor.connection.cursor() as cursor:
        constraints = schema_editor.connection.introspection.get_constraints(cursor, table)
    return NAME in constraints


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "mysql":
        return
    table = apps.get_model("django_outbox", "OutboxEvent")._meta.db_table
    if _exists(schema_editor, table):
        return
    quote = schema_editor.quote_name
    columns = ", ".join(quote(column) for column in COLUMNS)
    schema_editor.execute(f"CREATE INDEX {quote(NAME)} ON {quote(table)} ({columns})")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "mysql":
        return
    table = apps.get_model("django_outbox", "OutboxEvent")._meta.db_table
    if _exists(schema_editor, table):
        quote = schema_editor.quote_name
        schema_editor.execute(f"DROP INDEX {quote(NAME)} ON {quote(table)}")


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0012_heads_index"),
    ]

    # Not in a transaction: MySQL/MariaDB commit DDL at once, and Django refuses DDL inside
    # an atomic block on databases that cannot roll it back.
    operations = [migrations.RunPython(create, drop, atomic=False)]
