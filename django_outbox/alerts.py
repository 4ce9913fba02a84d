"""Dead-letter alerts: every configured channel hears about rows that became DEAD.

Channels are configured in ``OUTBOX_ALERTS`` as ``{"BACKEND": dotted path, "OPTIONS": {}}``.
The relay calls :func:`notify_dead` after the DEAD state is committed, once per pass with
all the rows that died in it, so a channel gets one message per pass, not one per row. A
channel that fails is logged and skipped: it can neither block the relay nor undo the DEAD.

Shipped channels: :class:`LoggingChannel` (the default), :class:`EmailChannel` (Django's
mail) and :class:`WebhookChannel` (HTTP POST JSON, shaped for DingTalk, WeCom, Slack or our
own generic JSON). Options are checked when a channel is built, so a typo fails the system
check (``django_outbox.E010``) instead of the first alert at 3 a.m.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS
from django.utils.module_loading import import_string

from .conf import outbox_settings
from .masking import mask_webhook_url

logger = logging.getLogger("django_outbox.alerts")

#: How many dead letters a chat message lists before it says "... and N more".
DEFAULT_MAX_ROWS = 20
#: last_error is cut to this many characters in alerts; the admin shows all of it.
ERROR_CHARS = 300


class AlertError(Exception):
    """A channel could not deliver its alert. The message never contains secrets."""


@dataclass(frozen=True)
class DeadLetter:
    """What an alert says about one dead row."""

    event_id: str
    event_type: str
    aggregate_type: str
    aggregate_id: str
    retry_count: int
    last_error: str
    #: Ordered mode: what the dead row means for its aggregate's later events ('' if none).
    ordering: str = ""
    #: The alias of the outbox the row died in, when it is not 'default' (several databases).
    database: str = ""

    @classmethod
    def from_event(cls, event: Any) -> DeadLetter:
        from . import ordering

        alias = getattr(getattr(event, "_state", None), "db", None) or DEFAULT_DB_ALIAS
        return cls(
            event_id=str(event.event_id),
            event_type=event.event_type,
            aggregate_type=event.aggregate_type,
            aggregate_id=event.aggregate_id,
            retry_count=event.retry_count,
            last_error=event.last_error,
            ordering=ordering.dead_head_note(event),
            database="" if alias == DEFAULT_DB_ALIAS else alias,
        )

    @property
    def short_error(self) -> str:
        error = " ".join(self.last_error.split())
        return error if len(error) <= ERROR_CHARS else error[: ERROR_CHARS - 1] + "…"

    def summary(self) -> str:
        return (
            f"event_id={self.event_id} event_type={self.event_type} "
            f"aggregate={self.aggregate_type}:{self.aggregate_id} "
            f"retry_count={self.retry_count} last_error={self.short_error}"
            + (f" ordering={self.ordering}" if self.ordering else "")
            + (f" database={self.database}" if self.database else "")
        )

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for optional in ("ordering", "database"):
            if not data[optional]:
                del data[optional]
        return data


def headline(dead: Sequence[DeadLetter]) -> str:
    return f"{len(dead)} outbox event(s) became DEAD"


def split_rows(dead: Sequence[DeadLetter], max_rows: int) -> tuple[Sequence[DeadLetter], int]:
    """The rows to list and how many were left off."""
    return dead[:max_rows], max(0, len(dead) - max_rows)


class BaseChannel:
    """An alert channel; subclasses implement :meth:`send`.

    Subclasses take their ``OPTIONS`` as keyword arguments and raise
    ``ImproperlyConfigured`` from ``__init__`` when one is wrong; building a channel never
    touches the network, so the system check can build every configured channel.
    """

    def __init__(self, **options: Any) -> None:
        if options:
            raise ImproperlyConfigured(
                f"{type(self).__name__} got unknown options {sorted(options)}."
            )

    def send(self, dead: Sequence[DeadLetter]) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class LoggingChannel(BaseChannel):
    """Logs dead letters at ERROR on the ``django_outbox.alerts`` logger (the default)."""

    def send(self, dead: Sequence[DeadLetter]) -> None:
        lines = "\n".join(f"  {d.summary()}" for d in dead)
        logger.error("%s:\n%s", headline(dead), lines)


def _require(condition: bool, channel: str, message: str) -> None:
    if not condition:
        raise ImproperlyConfigured(f"{channel}: {message}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class EmailChannel(BaseChannel):
    """Mails the dead letters through Django's mail framework.

    Options: ``recipients`` (list of addresses; when empty, ``mail_admins()`` sends to
    ``ADMINS``), ``subject_prefix`` (default ``"[outbox] "``; ``mail_admins`` adds
    ``EMAIL_SUBJECT_PREFIX`` in front of it), ``from_email`` (default
    ``DEFAULT_FROM_EMAIL``), ``max_rows`` (rows listed, default 100).
    """

    def __init__(
        self,
        *,
        recipients: Sequence[str] | None = None,
        subject_prefix: str = "[outbox] ",
        from_email: str | None = None,
        max_rows: int = 100,
    ) -> None:
        name = type(self).__name__
        recipients = list(recipients or [])
        _require(
            all(isinstance(r, str) and "@" in r for r in recipients),
            name,
            f"'recipients' must be a list of e-mail addresses, got {recipients!r}.",
        )
        _require(isinstance(subject_prefix, str), name, "'subject_prefix' must be a string.")
        _require(
            from_email is None or isinstance(from_email, str),
            name,
            "'from_email' must be a string.",
        )
        _require(_positive_int(max_rows), name, "'max_rows' must be a positive integer.")
        self.recipients = recipients
        self.subject_prefix = subject_prefix
        self.from_email = from_email
        self.max_rows = max_rows

    def render(self, dead: Sequence[DeadLetter]) -> tuple[str, str]:
        shown, more = split_rows(dead, self.max_rows)
        lines = [
            f"{headline(dead)}. They will not be retried until someone requeues them",
            "(the admin dashboard's 'requeue all', manage.py outbox_requeue, or see "
            "docs/operations.md).",
            "",
        ]
        for d in shown:
            lines += [
                f"event_id:     {d.event_id}",
                f"event_type:   {d.event_type}",
                f"aggregate:    {d.aggregate_type}:{d.aggregate_id}",
                f"retry_count:  {d.retry_count}",
                f"last_error:   {d.short_error}",
                *([f"ordering:     {d.ordering}"] if d.ordering else []),
                "",
            ]
        if more:
            lines.append(f"... and {more} more.")
        return f"{self.subject_prefix}{headline(dead)}", "\n".join(lines)

    def send(self, dead: Sequence[DeadLetter]) -> None:
        from django.core.mail import mail_admins, send_mail

        subject, body = self.render(dead)
        if self.recipients:
            send_mail(subject, body, self.from_email, self.recipients)
        else:
            mail_admins(subject, body)

    def __repr__(self) -> str:
        return f"<EmailChannel to {self.recipients or 'ADMINS'}>"


class WebhookChannel(BaseChannel):
    """POSTs one JSON message per pass to a chat webhook (urllib from the standard library).

    Options:
      ``url`` (required), ``shape``: ``"generic"`` (default), ``"dingtalk"``, ``"wecom"``
      or ``"slack"``; ``timeout`` seconds (default 5); ``msgtype``: ``"markdown"``
      (default) or ``"text"`` for DingTalk/WeCom; ``title`` (default "Outbox dead
      letters", put first in every message, so a DingTalk keyword can match it);
      ``max_rows`` listed before "... and N more" (default 20); ``secret`` (DingTalk
      "加签" signing secret, ``SEC...``); ``headers`` (extra HTTP headers, e.g. a bearer
      token for a generic receiver).

    DingTalk and WeCom answer HTTP 200 with ``{"errcode": N}`` when they refuse a message:
    a non-zero ``errcode`` counts as a failure.
    """

    SHAPES = ("generic", "dingtalk", "wecom", "slack")
    MSGTYPES = ("markdown", "text")
    # WeCom documents 4096 bytes for markdown and 2048 for text content; DingTalk and Slack
    # accept far more, but a chat alert longer than this is unreadable anyway.
    BYTE_LIMITS = {
        ("wecom", "markdown"): 4096,
        ("wecom", "text"): 2048,
        ("dingtalk", "markdown"): 16000,
        ("dingtalk", "text"): 16000,
        ("slack", "markdown"): 16000,
        ("slack", "text"): 16000,
    }

    def __init__(
        self,
        *,
        url: str,
        shape: str = "generic",
        timeout: float = 5.0,
        msgtype: str = "markdown",
        title: str = "Outbox dead letters",
        max_rows: int = DEFAULT_MAX_ROWS,
        secret: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        name = type(self).__name__
        _require(
            isinstance(url, str) and urlsplit(url).scheme in ("http", "https"),
            name,
            "'url' must be an http:// or https:// URL.",
        )
        _require(
            shape in self.SHAPES,
            name,
            f"'shape' must be one of {', '.join(self.SHAPES)}, got {shape!r}.",
        )
        _require(
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0,
            name,
            f"'timeout' must be a positive number of seconds, got {timeout!r}.",
        )
        _require(
            msgtype in self.MSGTYPES,
            name,
            f"'msgtype' must be 'markdown' or 'text', got {msgtype!r}.",
        )
        _require(isinstance(title, str) and title != "", name, "'title' must be a string.")
        _require(_positive_int(max_rows), name, "'max_rows' must be a positive integer.")
        _require(
            isinstance(secret, str) and (not secret or shape == "dingtalk"),
            name,
            "'secret' is DingTalk's signing secret (SEC...); only shape 'dingtalk' uses it.",
        )
        _require(
            headers is None
            or all(isinstance(k, str) and isinstance(v, str) for k, v in dict(headers).items()),
            name,
            "'headers' must be a dict of strings.",
        )
        self.url = url
        self.shape = shape
        self.timeout = float(timeout)
        self.msgtype = msgtype
        self.title = title
        self.max_rows = max_rows
        self.secret = secret
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"<WebhookChannel {self.shape} {mask_webhook_url(self.url)}>"

    # --- message bodies ------------------------------------------------------------------
    def _markdown(self, dead: Sequence[DeadLetter], *, slack: bool = False) -> str:
        shown, more = split_rows(dead, self.max_rows)
        bold = "*{}*" if slack else "**{}**"
        lines = [bold.format(f"{self.title}: {headline(dead)}"), ""]
        for d in shown:
            lines.append(
                f"- `{d.event_id}` {d.event_type} {d.aggregate_type}:{d.aggregate_id} "
                f"retries={d.retry_count}: {d.short_error}"
                + (f" ({d.ordering})" if d.ordering else "")
                + (f" [database {d.database}]" if d.database else "")
            )
        if more:
            lines.append(f"- ... and {more} more")
        return "\n".join(lines)

    def _text(self, dead: Sequence[DeadLetter]) -> str:
        shown, more = split_rows(dead, self.max_rows)
        lines = [f"{self.title}: {headline(dead)}"]
        lines += [d.summary() for d in shown]
        if more:
            lines.append(f"... and {more} more")
        return "\n".join(lines)

    def _fit(self, text: str) -> str:
        limit = self.BYTE_LIMITS.get((self.shape, self.msgtype))
        if limit is None or len(text.encode()) <= limit:
            return text
        cut = text.encode()[: limit - 8].decode(errors="ignore")
        return cut.rsplit("\n", 1)[0] + "\n..."

    def payload(self, dead: Sequence[DeadLetter]) -> dict[str, Any]:
        """The JSON body for this channel's shape."""
        if self.shape == "generic":
            shown, more = split_rows(dead, self.max_rows)
            return {
                "title": self.title,
                "count": len(dead),
                "omitted": more,
                "dead_letters": [d.as_dict() for d in shown],
            }
        if self.shape == "slack":
            # Slack incoming webhooks (and Mattermost, Rocket.Chat) take {"text": ...} with
            # their own mrkdwn: *bold*, `code`.
            return {"text": self._fit(self._markdown(dead, slack=True))}
        body = self._markdown(dead) if self.msgtype == "markdown" else self._text(dead)
        body = self._fit(body)
        if self.shape == "dingtalk":
            if self.msgtype == "markdown":
                return {"msgtype": "markdown", "markdown": {"title": self.title, "text": body}}
            return {"msgtype": "text", "text": {"content": body}}
        # WeCom (企业微信) group robot.
        if self.msgtype == "markdown":
            return {"msgtype": "markdown", "markdown": {"content": body}}
        return {"msgtype": "text", "text": {"content": body}}

    def signed_url(self) -> str:
        """The URL to POST to; DingTalk signing adds ``timestamp`` and ``sign``."""
        if not self.secret:
            return self.url
        timestamp = str(round(time.time() * 1000))
        digest = hmac.new(
            self.secret.encode(), f"{timestamp}\n{self.secret}".encode(), hashlib.sha256
        ).digest()
        extra = urlencode({"timestamp": timestamp, "sign": base64.b64encode(digest).decode()})
        return f"{self.url}{'&' if urlsplit(self.url).query else '?'}{extra}"

    def send(self, dead: Sequence[DeadLetter]) -> None:
        data = json.dumps(self.payload(dead), ensure_ascii=False).encode()
        request = urllib.request.Request(
            self.signed_url(),
            data=data,
            method="POST",
            headers={"Content-Type": "application/json; charset=utf-8", **self.headers},
        )
        where = f"{self.shape} webhook {mask_webhook_url(self.url)}"
        # `from None`: the chained urllib exceptions would print the request, token and all.
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = response.read(64 * 1024)
        except urllib.error.HTTPError as exc:
            raise AlertError(f"{where} answered HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AlertError(f"{where} is unreachable: {reason}") from None
        if self.shape in ("dingtalk", "wecom"):
            try:
                result = json.loads(answer)
            except ValueError:
                raise AlertError(f"{where} answered something that is not JSON") from None
            if isinstance(result, dict) and result.get("errcode", 0) != 0:
                raise AlertError(
                    f"{where} refused the message: errcode={result.get('errcode')} "
                    f"errmsg={result.get('errmsg', '')}"
                )


def build_channel(entry: Mapping[str, Any]) -> BaseChannel:
    """Build one ``OUTBOX_ALERTS`` entry; raise ``ImproperlyConfigured`` saying what is wrong."""
    if not isinstance(entry, Mapping) or "BACKEND" not in entry:
        raise ImproperlyConfigured("an OUTBOX_ALERTS entry needs a 'BACKEND' key.")
    path = entry["BACKEND"]
    options = entry.get("OPTIONS", {})
    if not isinstance(options, Mapping):
        raise ImproperlyConfigured(f"{path}: 'OPTIONS' must be a dict.")
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"{path!r} cannot be imported ({exc}).") from exc
    try:
        channel = cls(**options)
    except TypeError as exc:
        # An unknown or missing keyword: say which channel and which options it got.
        raise ImproperlyConfigured(f"{path}: {exc} (OPTIONS given: {sorted(options)}).") from None
    if not isinstance(channel, BaseChannel):
        raise ImproperlyConfigured(f"{path} is not a django_outbox.alerts.BaseChannel.")
    return channel


def get_channels() -> list[BaseChannel]:
    """Every configured channel; raises ``ImproperlyConfigured`` at the first bad entry."""
    return [build_channel(entry) for entry in outbox_settings.ALERTS]


def _usable_channels() -> list[BaseChannel]:
    entries = outbox_settings.ALERTS
    if not isinstance(entries, (list, tuple)):
        logger.error("OUTBOX_ALERTS must be a list; falling back to the log channel.")
        return [LoggingChannel()]
    channels: list[BaseChannel] = []
    for index, entry in enumerate(entries):
        try:
            channels.append(build_channel(entry))
        except Exception as exc:
            logger.error("OUTBOX_ALERTS entry %d is skipped: %s", index, exc)
    if entries and not channels:
        # Every channel is broken: dead letters must still be said somewhere.
        channels.append(LoggingChannel())
    return channels


def notify_dead(events: Sequence[Any]) -> None:
    """Tell every channel about rows that just became DEAD; never raises.

    Called once per relay pass, after the DEAD state committed. A channel that cannot be
    built or fails to send is logged (with the event ids, never the webhook's secrets) and
    the next channel still gets its message.
    """
    if not events:
        return
    try:
        dead = [e if isinstance(e, DeadLetter) else DeadLetter.from_event(e) for e in events]
        channels = _usable_channels()
    except Exception:
        logger.exception("Cannot prepare dead-letter alerts for %d event(s)", len(events))
        return
    for channel in channels:
        try:
            channel.send(dead)
        except AlertError as exc:
            logger.error(
                "Alert channel %r failed for %d dead letter(s) (%s): %s",
                channel,
                len(dead),
                ", ".join(d.event_id for d in dead[:DEFAULT_MAX_ROWS]),
                exc,
            )
        except Exception:
            logger.exception(
                "Alert channel %r failed for %d dead letter(s): %s",
                channel,
                len(dead),
                ", ".join(d.event_id for d in dead[:DEFAULT_MAX_ROWS]),
            )
