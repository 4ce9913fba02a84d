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
    """The URL with its password replaced by ``***``, as a client reads it.

    ``amqp://app:s3cret@rabbitmq:5672/%2F`` becomes ``amqp://app:***@rabbitmq:5672/%2F``.
    Works for any ``scheme://user:password@host`` URL (AMQP, PostgreSQL, MySQL, Redis), and
    for several URLs joined by ``;`` (each is masked, see :func:`split_urls`).

    A password with an unencoded ``/``, ``?`` or ``#`` (``amqp://u:2024/pw@h/``) ends the
    host part early for every client that parses URLs as RFC 3986 says (``urlsplit``,
    ``pika.URLParameters``): it then connects to a host, port and vhost read from the
    password (``u``, port 2024). Such a URL is shown as ``amqp://u:***@***``: what the text
    after the last ``@`` suggests is not what was tried, and what was tried is the
    password's (:func:`password_overruns`; ``manage.py check`` reports it, E026).
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
    if password_overruns(url):
        return f"{scheme}{sep}{user}:{MASK}@{MASK}"
    return f"{scheme}{sep}{user}:{MASK}{rest[at:]}"


#: Where the host part (RFC 3986's authority) of a URL ends: its first "/", "?" or "#".
_AUTHORITY_END = re.compile(r"[/?#]")


def _host_end(rest: str) -> int:
    """Where the authority of ``rest`` (a URL after its ``scheme://``) ends."""
    end = _AUTHORITY_END.search(rest)
    return len(rest) if end is None else end.start()


def password_overruns(url: str) -> bool:
    """Whether a client would read the host, port or path of ``url`` from its password.

    True when an ``@`` with a password before it comes after the host part has ended:
    the password holds an unencoded ``/``, ``?`` or ``#``, and the client (``urlsplit``,
    ``pika.URLParameters``) takes the text after it for the host, port and vhost (or the
    vhost or query holds an unencoded ``@``, which reads the same way). Percent-encoding
    the password (``urllib.parse.quote(password, safe="")``) makes the URL say one thing.
    """
    _, sep, rest = url.partition("://")
    at = rest.rfind("@")
    return bool(sep) and at >= 0 and ":" in rest[:at] and _host_end(rest) < at


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
