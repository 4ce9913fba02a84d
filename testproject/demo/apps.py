from django.apps import AppConfig


class DemoConfig(AppConfig):
    """``manage.py demo``: the outbox story end to end (no models)."""

    name = "demo"
