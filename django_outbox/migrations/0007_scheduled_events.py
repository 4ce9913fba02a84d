"""Scheduled events: ``due_at``, when a row became due (``emit(deliver_at=, delay=)``).

The column is nullable, with no default: adding it changes no existing row, so it is a
catalogue change on PostgreSQL, MariaDB 10.6 and MySQL 8.0.12+ (``ALGORITHM=INSTANT``: no
table rewrite, no backfill of a large outbox). NULL means "due from its creation"
(``created_at``), which is what every row written before this migration is.

On PostgreSQL the claim looks for due rows in two sets (see
``OutboxEventQuerySet._lease_returning``), each with its partial index, which replace
``django_outbox_claim_idx`` (0005): without them every claim would read every scheduled
event that is not due yet.

- ``django_outbox_claim_now_idx``: the unsent rows never scheduled nor requeued, by id (what
  ``django_outbox_claim_idx`` was, less the scheduled rows); every emit writes one entry,
  as it did in ``django_outbox_claim_idx``;
- ``django_outbox_scheduled_idx``: the unsent scheduled or requeued rows, by due time; only
  those rows have an entry.

Not declared in ``OutboxEvent.Meta.indexes``, for the reason 0005 gives (Django warns,
models.W037, on MySQL/MariaDB, which have no partial indexes: nothing changes there; SQLite
keeps 0005's index). ``IF NOT EXISTS``: on a large table, create them beforehand without
blocking writers, and this migration finds them done::

    CREATE INDEX CONCURRENTLY IF NOT EXISTS django_outbox_claim_now_idx
        ON django_outbox_outboxevent (id) WHERE status = 0 AND due_at IS NULL;
    CREATE INDEX CONCURRENTLY IF NOT EXISTS django_outbox_scheduled_idx
        ON django_outbox_outboxevent (next_retry_time) WHERE status = 0 AND due_at IS NOT NULL;

after the column, which is instant to add and which this migration then finds too::

    ALTER TABLE django_outbox_outboxevent
        ADD COLUMN IF NOT EXISTS due_at timestamp with time zone NULL;
"""

from django.db import migrations, models

OLD = "django_outbox_claim_idx"
NOW = "django_outbox_claim_now_idx"
SCHEDULED = "django_outbox_scheduled_idx"


def _table(apps, schema_editor):
    return schema_editor.quote_name(apps.get_model("django_outbox", "OutboxEvent")._meta.db_table)


def _indexes(apps, schema_editor):
    table = _table(apps, schema_editor)
    quote = schema_editor.quote_name
    status, due_at = quote("status"), quote("due_at")
    return [
        (NOW, f"{table} ({quote('id')}) WHERE {status} = 0 AND {due_at} IS NULL"),
        (
            SCHEDULED,
            f"{table} ({quote('next_retry_time')}) WHERE {status} = 0 AND {due_at} IS NOT NULL",
        ),
    ]


def _due_at():
    field = models.DateTimeField(null=True, blank=True)
    field.set_attributes_from_name("due_at")
    return field


def add_column(apps, schema_editor):
    model = apps.get_model("django_outbox", "OutboxEvent")
    if schema_editor.connection.vendor == "postgresql":
        # IF NOT EXISTS: the column may have been added by hand, before the indexes.
        schema_editor.execute(
            f"ALTER TABLE {_table(apps, schema_editor)} ADD COLUMN IF NOT EXISTS "
            f"{schema_editor.quote_name('due_at')} timestamp with time zone NULL"
        )
    else:
        schema_editor.add_field(model, _due_at())


def remove_column(apps, schema_editor):
    model = apps.get_model("django_outbox", "OutboxEvent")
    schema_editor.remove_field(model, _due_at())


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    for name, definition in _indexes(apps, schema_editor):
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {quote(name)} ON {definition}")
    schema_editor.execute(f"DROP INDEX IF EXISTS {quote(OLD)}")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    quote = schema_editor.quote_name
    schema_editor.execute(
        f"CREATE INDEX IF NOT EXISTS {quote(OLD)} ON {_table(apps, schema_editor)} "
        f"({quote('id')}) WHERE {quote('status')} = 0"
    )
    for name, _definition in _indexes(apps, schema_editor):
        schema_editor.execute(f"DROP INDEX IF EXISTS {quote(name)}")


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0006_replay_count"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="outboxevent",
                    name="due_at",
                    field=models.DateTimeField(
                        blank=True,
                        help_text=(
                            "When the row became due: set by emit(deliver_at=, delay=) and by "
                            "a requeue; empty when it was due from its creation. Staleness and "
                            "the oldest PENDING age count from here, so a scheduled event "
                            "waits without alarming anyone."
                        ),
                        null=True,
                        verbose_name="due at",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(add_column, remove_column),
                migrations.RunPython(create, drop),
            ],
        ),
    ]
