"""What Django's error pages and error e-mails may show of the settings."""

from __future__ import annotations

import re

from django.views.debug import SafeExceptionReporterFilter


class SecretSettingsFilter(SafeExceptionReporterFilter):
    """Django's filter hides settings whose names contain API, TOKEN, KEY, SECRET, PASS or
    SIGNATURE; connection URLs carry passwords too (``OUTBOX_BROKER_URL``, ``AMQP_URL``,
    ``CELERY_BROKER_URL``, ``DATABASE_URL``, a cache's ``LOCATION``), so any setting whose
    name ends in ``URL`` or contains ``BROKER`` or ``LOCATION`` is hidden as well."""

    hidden_settings = re.compile(
        "API|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|BROKER|LOCATION|URL$",
        flags=re.IGNORECASE,
    )
