"""The testproject's settings (config.settings) for a Celery worker started by a test.

Everything the worker declares on the shared RabbitMQ is named after the test's queue
(CELERY_TASK_DEFAULT_QUEUE) so the test can delete it; remote control, which declares
fixed-name objects, is off.
"""

from config.settings import *  # noqa: F403

CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_EVENT_EXCHANGE = f"{CELERY_TASK_DEFAULT_QUEUE}.events"  # noqa: F405
