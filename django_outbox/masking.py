"""Hide credentials in connection URLs before they reach a log line or an error message."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

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


def mask_webhook_url(url: str) -> str:
    """The URL with its secrets replaced by ``***``, for logs and error messages.

    Webhook URLs carry their credential in the query (DingTalk ``access_token``, WeCom
    ``key``) or in the path (Slack ``/services/T…/B…/secret``): every query value is
    masked, and so is every path segment that looks like a token (8+ characters with a
    digit, or 20+ characters), as well as a user:password part.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    segments = [
        MASK if (len(s) >= 8 and re.search(r"\d", s)) or len(s) >= 20 else s
        for s in parts.path.split("/")
    ]
    query = "&".join(f"{k}={MASK}" for k, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, host, "/".join(segments), query, ""))
