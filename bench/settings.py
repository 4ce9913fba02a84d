"""Settings of the relay benchmark (its own process and the publish_outbox child it starts).

The demo project's settings, with the RabbitMQ backend on the benchmark's throwaway exchange
(``BENCH_EXCHANGE``) and the database ``DATABASE_URL`` names (the benchmark's own one).
"""

import os

from config.settings import *  # noqa: F403

# As deployed: with DEBUG on, Django records every query (SQL and parameters formatted),
# which is not what a production relay spends its time on.
DEBUG = False
OUTBOX_BACKEND = "django_outbox.backends.pika.PikaBackend"
OUTBOX_BROKER_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
OUTBOX_EXCHANGE = os.environ.get("BENCH_EXCHANGE", "outbox")
# relay_bench --transport nats: the benchmark's throwaway stream, its subjects' prefix its
# name lower-cased (bench.raw_nats.bench_stream).
if os.environ.get("BENCH_TRANSPORT") == "nats":
    OUTBOX_BACKEND = ""
    OUTBOX_BROKER_URL = os.environ["BENCH_BROKER_URL"]
    OUTBOX_NATS_STREAM = os.environ["BENCH_NATS_STREAM"]
    OUTBOX_EXCHANGE = OUTBOX_NATS_STREAM.lower()
# relay_bench --transport redis: the benchmark's throwaway streams' prefix (BENCH_EXCHANGE).
if os.environ.get("BENCH_TRANSPORT") == "redis":
    OUTBOX_BACKEND = ""
    OUTBOX_BROKER_URL = os.environ["BENCH_BROKER_URL"]
# BENCH_NULL_BROKER=1 (with any relay_bench --transport): the relay child publishes to the
# in-memory backend, which confirms at once: the relay's and the database's own ceiling on
# this machine, against the same run's raw client baseline.
if os.environ.get("BENCH_NULL_BROKER"):
    OUTBOX_BACKEND = "django_outbox.backends.locmem.LocmemBackend"
# purge_bench --isolation: the MariaDB isolation level of the bench and its child processes.
if os.environ.get("BENCH_ISOLATION") and DATABASES["default"]["ENGINE"].endswith("mysql"):  # noqa: F405
    DATABASES["default"]["OPTIONS"]["isolation_level"] = os.environ["BENCH_ISOLATION"]  # noqa: F405
SILENCED_SYSTEM_CHECKS = ["django_outbox.W004"]
# Warnings and errors only: the relay's INFO lines would be timed along with the work.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_outbox": {"handlers": ["console"], "level": "WARNING"}},
}
# soak_bench --mode delete: the relay child deletes what the broker confirmed.
if os.environ.get("BENCH_RETENTION_DAYS"):
    OUTBOX_RETENTION_DAYS = float(os.environ["BENCH_RETENTION_DAYS"])

# bench/tasks_bench.py: Django's Tasks API on the outbox ("default"), against django-tasks-db
# ("db") when it is installed (the anchor; pip install django-tasks-db).
import importlib.util  # noqa: E402

TASKS = {
    "default": {
        "BACKEND": "django_outbox.tasks_backend.OutboxTaskBackend",
        "OPTIONS": {"BROKER_QUEUE_PREFIX": f"{OUTBOX_EXCHANGE}.tasks."},
    }
}
if importlib.util.find_spec("django_tasks_db") is not None:
    INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]  # noqa: F405
    TASKS["db"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}
