"""The demo's Celery app: ``celery -A config worker`` / ``celery -A config beat``.

The broker is RabbitMQ (CELERY_BROKER_URL, else AMQP_URL); settings come from Django's
``CELERY_*`` entries. With ``OUTBOX_BACKEND=django_outbox.backends.celery.CeleryBackend``
the relay publishes ORDER_CREATED as the ``points.award_points`` task (OUTBOX_CELERY_TASKS)
through this app; the beat schedule runs the outbox's periodic jobs.
"""

import os

from celery import Celery

from django_outbox.celery import beat_schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("config")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds points/tasks.py and django_outbox/tasks.py (publish, compensate, purge).
app.autodiscover_tasks()
# The article's schedule: compensate every 5 minutes, purge daily. No publish entry: the
# demo runs `manage.py publish_outbox` (set publish_every=2 to relay from beat instead).
app.conf.beat_schedule = beat_schedule()
