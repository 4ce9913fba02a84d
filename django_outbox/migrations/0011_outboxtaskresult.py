"""The results table of the Django Tasks backend (``django_outbox.tasks_backend``):
one row per task, written by ``outbox_worker`` (docs/tasks.md). A new table: nothing
existing is rewritten."""

import django.core.serializers.json
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_outbox', '0010_lease_token_fixed_width'),
    ]

    operations = [
        migrations.CreateModel(
            name='OutboxTaskResult',
            fields=[
                ('id', models.CharField(max_length=64, primary_key=True, serialize=False, verbose_name='id')),
                ('task_path', models.CharField(max_length=255, verbose_name='task path')),
                ('backend_name', models.CharField(max_length=100, verbose_name='backend')),
                ('queue_name', models.CharField(max_length=100, verbose_name='queue')),
                ('priority', models.IntegerField(default=0, verbose_name='priority')),
                ('args_kwargs', models.JSONField(default=dict, encoder=django.core.serializers.json.DjangoJSONEncoder, verbose_name='arguments')),
                ('run_after', models.DateTimeField(blank=True, null=True, verbose_name='run after')),
                ('status', models.CharField(choices=[('READY', 'Ready'), ('RUNNING', 'Running'), ('FAILED', 'Failed'), ('SUCCESSFUL', 'Successful')], default='READY', max_length=10, verbose_name='status')),
                ('enqueued_at', models.DateTimeField(verbose_name='enqueued at')),
                ('started_at', models.DateTimeField(blank=True, null=True, verbose_name='started at')),
                ('finished_at', models.DateTimeField(blank=True, null=True, verbose_name='finished at')),
                ('last_attempted_at', models.DateTimeField(blank=True, null=True, verbose_name='last attempted at')),
                ('return_value', models.JSONField(blank=True, encoder=django.core.serializers.json.DjangoJSONEncoder, null=True, verbose_name='return value')),
                ('errors', models.JSONField(blank=True, default=list, verbose_name='errors')),
                ('worker_ids', models.JSONField(blank=True, default=list, verbose_name='worker ids')),
                ('max_retries', models.PositiveIntegerField(default=0, verbose_name='max retries')),
                ('message_id', models.CharField(blank=True, default='', max_length=64, verbose_name='message id')),
            ],
            options={
                'verbose_name': 'task result',
                'verbose_name_plural': 'task results',
                'ordering': ('-enqueued_at',),
                'indexes': [models.Index(fields=['status', 'queue_name'], name='django_outbox_task_status_idx')],
            },
        ),
    ]
