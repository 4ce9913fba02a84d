"""Hide credentials in connection URLs before they reach a log line or an error message."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit, urlunsplit

MASK = "***"


#: Where the next URL of a ``;``-separated list (kombu's failover form) begins: a ``;``
#: followed by a scheme. A ``;`` inside a password is not followed by one.
_NEXT_URL = re.compile(r";(?=\s*[A-Za-z][A-Za-z0-9+.-]*://)")


def split_urls(text: str) -> list[str]:
    """``"amqp://a/%2F;amqp://b/%2F"`` -> the two URLs: split before each ``;`` that starts
    another URL, each stripped of spaces and stray ``;``; blank entries left out."""
    return [url for part in _NEXT_URL.split(text) if (url := part.strip().strip(";").strip())]


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***``; everything else is kept.

    ``amqp://app:s3cret@rabbitmq:5672/%2F`` becomes ``amqp://app:***@rabbitmq:5672/%2F``.
    Works for any ``scheme://user:password@host`` URL (AMQP, PostgreSQL, MySQL, Redis), and
    for several URLs joined by ``;`` (each is masked, see :func:`split_urls`).

    The credentials are everything before the last ``@``, not what ``urlsplit`` calls the
    netloc: a password with an unescaped ``/``, ``?`` or ``#`` (``amqp://u:2024/pw@h/``)
    ends the netloc early, and would be printed whole. Where that rule masks more than the
    password (an ``@`` in the path or query), it hides, never shows.
    """
    if not url:
        return url
    if _NEXT_URL.search(url):
        return ";".join(mask_url(part) for part in _NEXT_URL.split(url))
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = rest.rfind("@")
    if at < 0:
        return url
    user, has_password, _ = rest[:at].partition(":")
    if not has_password:
        return url
    return f"{scheme}{sep}{user}:{MASK}{rest[at:]}"


#: What looks like a URL inside a longer text (an exception's message, a log line).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


def mask_urls_in(text: str) -> str:
    """``text`` with the password of every URL in it masked (:func:`mask_url`): for error
    messages that a library may have written a connection URL into."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda match: mask_url(match.group(0)), text)


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
