"""Hide credentials in connection URLs before they reach a log line or an error message."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

MASK = "***"


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***``; everything else is kept.

    ``amqp://app:s3cret@rabbitmq:5672/%2F`` becomes ``amqp://app:***@rabbitmq:5672/%2F``.
    Works for any ``scheme://user:password@host`` URL (AMQP, PostgreSQL, MySQL, Redis).
    A value that does not parse is masked whole rather than risk printing a secret.
    """
    if not url:
        return url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return MASK
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    masked_userinfo = f"{user}:{MASK}" if has_password else user
    return urlunsplit(parts._replace(netloc=f"{masked_userinfo}@{hostinfo}"))
