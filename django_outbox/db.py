"""Small database helpers shared by the model, the emit helper and the relay."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import connections
from django.db.models.functions import Now


class DbNow(Now):
    """``Now()`` that is UTC on MySQL/MariaDB too.

    Django stores naive UTC datetimes on MySQL when ``USE_TZ`` is on, but its ``Now()``
    renders ``CURRENT_TIMESTAMP`` in the *session* time zone; a server not running in UTC
    would then see every event as due hours early or late. ``UTC_TIMESTAMP`` does not
    depend on the session.
    """

    def as_mysql(self, compiler: Any, connection: Any, **extra_context: Any) -> Any:
        template = "UTC_TIMESTAMP(6)" if settings.USE_TZ else "CURRENT_TIMESTAMP(6)"
        return self.as_sql(compiler, connection, template=template, **extra_context)


def vendor(using: str) -> str:
    return connections[using].vendor
