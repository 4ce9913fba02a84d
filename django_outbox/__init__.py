"""django-outbox: the transactional outbox pattern for Django.

Write events in the same transaction as your business rows with
:func:`django_outbox.outbox.atomic`; ``manage.py publish_outbox`` relays committed events to
RabbitMQ and marks them SENT only after a publisher confirm.
"""

__version__ = "1.0.0rc1"

__all__ = ["__version__"]
