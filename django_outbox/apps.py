from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class OutboxConfig(AppConfig):
    name = "django_outbox"
    label = "django_outbox"
    verbose_name = _("Outbox")
    # The model declares its id explicitly; this keeps makemigrations quiet whatever the
    # project's DEFAULT_AUTO_FIELD is.
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import setting_changed

        from . import checks  # noqa: F401  (registers the system checks)
        from .conf import PREFIX, reset_caches
        from .metrics import register_collector

        def _on_setting_changed(*, setting: str, **kwargs: object) -> None:
            if setting.startswith(PREFIX):
                reset_caches()

        setting_changed.connect(_on_setting_changed, weak=False, dispatch_uid="django_outbox")
        # The database gauges, served by django-prometheus's /metrics and --metrics-port.
        register_collector()
