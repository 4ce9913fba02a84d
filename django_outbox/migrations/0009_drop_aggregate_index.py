"""Drop ``django_outbox_aggregate_idx`` (``aggregate_type, aggregate_id, id``).

``django_outbox_agg_head_idx`` (``aggregate_type, aggregate_id, status, id``, migration
0003) has the same leading columns and serves every lookup the older index served: triage
by business key (an aggregate's few events, sorted by id), and ordered mode's
per-aggregate lookups, which filter on status too. Every event paid for both at its
INSERT, and on PostgreSQL again at its settle (a change of ``status`` is not a HOT update,
so it adds an entry to every index): per event one index entry less on MySQL/MariaDB and
two on PostgreSQL (bench.emit_bench, bench.relay_bench; docs/benchmarks.md).

Dropping an index is quick; on PostgreSQL ``DROP INDEX`` waits for the transactions that
use the table to end and blocks new ones meanwhile, as any DDL does: run ``migrate`` when
no long transaction holds the table (docs/installation.md, "Upgrading").
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0008_leased_until"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="outboxevent",
            name="django_outbox_aggregate_idx",
        ),
    ]
