"""Dead-letter alert channels, against a real HTTP server on loopback and Django's locmem mail."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import django
import pytest
from django.core import mail
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_outbox.alerts import (
    DeadLetter,
    EmailChannel,
    LoggingChannel,
    WebhookChannel,
    build_channel,
    get_channels,
    notify_dead,
)
from django_outbox.checks import Codes, check_alerts
from django_outbox.masking import mask_webhook_url

TOKEN = "s3cr3t-t0ken-1234567890"


def letters(n: int) -> list[DeadLetter]:
    return [
        DeadLetter(
            event_id=f"evt-{i:04d}",
            event_type="ORDER_CREATED",
            aggregate_type="ORDER",
            aggregate_id=str(1000 + i),
            retry_count=11,
            last_error="NOT_ROUTED: no queue bound for ORDER_CREATED " + "x" * 400,
        )
        for i in range(n)
    ]


@dataclass
class Hook:
    """A webhook receiver on 127.0.0.1; ``mode`` picks how it answers."""

    server: ThreadingHTTPServer
    received: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "ok"

    @property
    def base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, path: str = "/hook") -> str:
        return f"{self.base}{path}?key={TOKEN}"


@pytest.fixture
def hook() -> Iterator[Hook]:
    state: dict[str, Hook] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            h = state["hook"]
            body = self.rfile.read(int(self.headers["Content-Length"]))
            h.received.append(
                {
                    "path": self.path,
                    "query": parse_qs(urlsplit(self.path).query),
                    "headers": dict(self.headers),
                    "json": json.loads(body),
                }
            )
            if h.mode == "slow":
                time.sleep(1.5)
            status, answer = {
                "ok": (200, b'{"errcode":0,"errmsg":"ok"}'),
                "500": (500, b"boom"),
                "slow": (200, b'{"errcode":0}'),
                "errcode": (200, b'{"errcode":310000,"errmsg":"keywords not in content"}'),
            }[h.mode]
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            with contextlib.suppress(OSError):  # the client gave up (timeout test)
                self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.block_on_close = False
    state["hook"] = Hook(server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state["hook"]
    server.shutdown()
    server.server_close()


def refused_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there any more: connection refused
    return f"http://127.0.0.1:{port}/hook?access_token={TOKEN}"


# --- shapes ------------------------------------------------------------------------------


def test_generic_shape_posts_the_dead_letters_as_json(hook):
    WebhookChannel(url=hook.url(), headers={"Authorization": "Bearer x"}).send(letters(3))
    (request,) = hook.received
    body = request["json"]
    assert body["count"] == 3 and body["omitted"] == 0
    assert [d["event_id"] for d in body["dead_letters"]] == ["evt-0000", "evt-0001", "evt-0002"]
    assert set(body["dead_letters"][0]) == {
        "event_id",
        "event_type",
        "aggregate_type",
        "aggregate_id",
        "retry_count",
        "last_error",
    }
    assert request["headers"]["Authorization"] == "Bearer x"
    assert request["headers"]["Content-Type"].startswith("application/json")


def test_dingtalk_markdown_shape_and_signing(hook):
    channel = WebhookChannel(url=hook.url(), shape="dingtalk", secret="SECabc", title="订单服务")
    channel.send(letters(2))
    (request,) = hook.received
    body = request["json"]
    assert body["msgtype"] == "markdown"
    assert body["markdown"]["title"] == "订单服务"
    text = body["markdown"]["text"]
    assert text.startswith("**订单服务: 2 outbox event(s) became DEAD**")
    assert "`evt-0001` ORDER_CREATED ORDER:1001 retries=11" in text
    # 加签: timestamp in ms and an HMAC-SHA256 signature, next to the access token.
    assert set(request["query"]) == {"key", "timestamp", "sign"}
    assert len(request["query"]["timestamp"][0]) == 13


def test_dingtalk_text_shape(hook):
    WebhookChannel(url=hook.url(), shape="dingtalk", msgtype="text").send(letters(1))
    body = hook.received[0]["json"]
    assert body["msgtype"] == "text"
    assert "event_id=evt-0000" in body["text"]["content"]


def test_wecom_markdown_and_text_shapes(hook):
    WebhookChannel(url=hook.url(), shape="wecom").send(letters(2))
    WebhookChannel(url=hook.url(), shape="wecom", msgtype="text").send(letters(2))
    markdown, text = (r["json"] for r in hook.received)
    assert markdown == {
        "msgtype": "markdown",
        "markdown": {"content": markdown["markdown"]["content"]},
    }
    assert "evt-0001" in markdown["markdown"]["content"]
    assert text["msgtype"] == "text" and "evt-0001" in text["text"]["content"]


def test_wecom_content_stays_under_its_byte_limit(hook):
    WebhookChannel(url=hook.url(), shape="wecom", max_rows=500).send(letters(200))
    content = hook.received[0]["json"]["markdown"]["content"]
    assert len(content.encode()) <= 4096
    assert content.endswith("...")


def test_slack_shape(hook):
    WebhookChannel(url=hook.url(), shape="slack").send(letters(1))
    body = hook.received[0]["json"]
    assert list(body) == ["text"]
    assert body["text"].startswith("*Outbox dead letters: 1 outbox event(s) became DEAD*")


def test_many_dead_letters_make_one_message_with_a_cap(hook):
    WebhookChannel(url=hook.url(), shape="dingtalk").send(letters(150))
    WebhookChannel(url=hook.url()).send(letters(150))
    assert len(hook.received) == 2
    text = hook.received[0]["json"]["markdown"]["text"]
    assert text.count("`evt-") == 20
    assert "... and 130 more" in text
    generic = hook.received[1]["json"]
    assert generic["count"] == 150 and generic["omitted"] == 130
    assert len(generic["dead_letters"]) == 20


def test_long_errors_are_shortened():
    (d,) = letters(1)
    assert len(d.short_error) == 300 and d.short_error.endswith("…")
    assert len(d.last_error) > 300


# --- email -------------------------------------------------------------------------------


def test_email_to_recipients():
    EmailChannel(recipients=["ops@example.com"], subject_prefix="[orders] ").send(letters(3))
    (message,) = mail.outbox
    assert message.to == ["ops@example.com"]
    assert message.subject == "[orders] 3 outbox event(s) became DEAD"
    assert "event_id:     evt-0002" in message.body
    assert "aggregate:    ORDER:1002" in message.body


@override_settings(
    # Django 6.0 takes plain addresses and deprecates the (name, address) pairs 5.2 needs.
    ADMINS=["admin@example.com"] if django.VERSION >= (6, 0) else [("Ops", "admin@example.com")],
    EMAIL_SUBJECT_PREFIX="[Django] ",
)
def test_email_without_recipients_goes_to_admins():
    EmailChannel(max_rows=2).send(letters(5))
    (message,) = mail.outbox
    assert message.to == ["admin@example.com"]
    assert message.subject == "[Django] [outbox] 5 outbox event(s) became DEAD"
    assert "... and 3 more." in message.body


# --- failures never raise, other channels still get theirs -------------------------------


@pytest.mark.parametrize("mode", ["500", "slow", "errcode", "refused"])
def test_a_failing_channel_is_logged_and_the_others_still_send(hook, mode, caplog):
    broken = refused_url() if mode == "refused" else hook.url("/broken")
    hook.mode = "ok" if mode == "refused" else mode
    alerts = [
        {
            "BACKEND": "django_outbox.alerts.WebhookChannel",
            "OPTIONS": {"url": broken, "shape": "dingtalk", "timeout": 0.5},
        },
        {"BACKEND": "django_outbox.alerts.EmailChannel", "OPTIONS": {"recipients": ["a@b.c"]}},
        {"BACKEND": "django_outbox.alerts.LoggingChannel"},
    ]
    with override_settings(OUTBOX_ALERTS=alerts), caplog.at_level(logging.ERROR):
        notify_dead(letters(2))  # must not raise
    assert len(mail.outbox) == 1
    messages = [r.getMessage() for r in caplog.records]
    failure = [m for m in messages if "failed" in m]
    assert len(failure) == 1
    assert "evt-0000, evt-0001" in failure[0]
    expected = {
        "500": "HTTP 500",
        "slow": "unreachable",
        "errcode": "errcode=310000",
        "refused": "unreachable",
    }[mode]
    assert expected in failure[0]
    assert any("2 outbox event(s) became DEAD" in m for m in messages)  # LoggingChannel
    # The webhook's token never reaches the log, not even in a traceback.
    assert all(TOKEN not in m for m in messages)
    assert all(TOKEN not in (r.exc_text or "") for r in caplog.records)


def test_a_misconfigured_channel_is_skipped_and_the_rest_still_alert(caplog):
    alerts = [
        {"BACKEND": "django_outbox.alerts.WebhookChannel", "OPTIONS": {"shape": "dingding"}},
        {"BACKEND": "django_outbox.alerts.LoggingChannel"},
    ]
    with override_settings(OUTBOX_ALERTS=alerts), caplog.at_level(logging.ERROR):
        notify_dead(letters(1))
    messages = [r.getMessage() for r in caplog.records]
    assert any("entry 0 is skipped" in m for m in messages)
    assert any("evt-0000" in m and "became DEAD" in m for m in messages)


def test_when_every_channel_is_broken_the_log_still_says_it(caplog):
    alerts = [{"BACKEND": "nowhere.Channel"}]
    with override_settings(OUTBOX_ALERTS=alerts), caplog.at_level(logging.ERROR):
        notify_dead(letters(1))
    assert any("evt-0000" in r.getMessage() for r in caplog.records)


def test_a_channel_whose_send_raises_anything_does_not_raise(caplog, monkeypatch):
    from django_outbox import alerts

    class Exploding(LoggingChannel):
        def send(self, dead):
            raise RuntimeError("kaput")

    monkeypatch.setattr(alerts, "_usable_channels", lambda: [Exploding(), LoggingChannel()])
    with caplog.at_level(logging.ERROR):
        notify_dead(letters(1))
    messages = [r.getMessage() for r in caplog.records]
    assert any("failed" in m for m in messages)
    assert any("became DEAD" in m for m in messages)


# --- options are validated when the channel is built ------------------------------------


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({}, "url"),
        ({"url": "ftp://x"}, "'url' must be an http"),
        ({"url": "https://x", "shape": "dingding"}, "'shape' must be one of"),
        ({"url": "https://x", "timeout": 0}, "'timeout' must be a positive"),
        ({"url": "https://x", "msgtype": "card"}, "'msgtype'"),
        ({"url": "https://x", "secret": "SEC1"}, "only shape 'dingtalk'"),
        ({"url": "https://x", "max_rows": 0}, "'max_rows'"),
        ({"url": "https://x", "colour": "red"}, "colour"),
    ],
)
def test_webhook_options_are_validated(options, error):
    with pytest.raises(ImproperlyConfigured, match=error):
        build_channel({"BACKEND": "django_outbox.alerts.WebhookChannel", "OPTIONS": options})


def test_email_options_are_validated():
    with pytest.raises(ImproperlyConfigured, match="'recipients' must be a list"):
        EmailChannel(recipients=["not-an-address"])


# `check` runs the model checks, which ask every database (SQLite, MariaDB) about JSON support
@pytest.mark.django_db(databases="__all__")
def test_system_check_reports_bad_channel_options():
    alerts = [
        {"BACKEND": "django_outbox.alerts.LoggingChannel"},
        {"BACKEND": "django_outbox.alerts.WebhookChannel", "OPTIONS": {"url": "x"}},
    ]
    with override_settings(OUTBOX_ALERTS=alerts):
        errors = [e for e in check_alerts() if e.id == Codes.ALERTS]
        assert len(errors) == 1
        assert "entry 1" in errors[0].msg and "'url' must be an http" in errors[0].msg
        with pytest.raises(SystemCheckError):
            call_command("check")


def test_get_channels_builds_the_configured_channels():
    alerts = [
        {"BACKEND": "django_outbox.alerts.LoggingChannel"},
        {"BACKEND": "django_outbox.alerts.WebhookChannel", "OPTIONS": {"url": "https://x/y"}},
    ]
    with override_settings(OUTBOX_ALERTS=alerts):
        kinds = [type(c) for c in get_channels()]
    assert kinds == [LoggingChannel, WebhookChannel]


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (
            "https://oapi.dingtalk.com/robot/send?access_token=abc123def456",
            "https://oapi.dingtalk.com/robot/send?access_token=***",
        ),
        (
            "https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=693a91f6-7xxx",
            "https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=***",
        ),
        (
            "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX",
            "https://hooks.slack.com/services/***/***/***",
        ),
        ("https://user:pw@example.com:8443/alerts", "https://example.com:8443/alerts"),
    ],
)
def test_mask_url_hides_tokens(url, masked):
    assert mask_webhook_url(url) == masked


# --- end to end: the relay's DEAD rows reach the webhook ---------------------------------


@pytest.mark.django_db(transaction=True)
def test_relay_pass_sends_one_webhook_for_all_its_dead_rows(hook, settings):
    from django_outbox import outbox
    from django_outbox.backends import locmem
    from django_outbox.backends.base import Reason
    from django_outbox.models import OutboxEvent, Status
    from django_outbox.relay import Relay

    settings.OUTBOX_RETRY_SCHEDULE = [1]
    settings.OUTBOX_ALERTS = [
        {"BACKEND": "django_outbox.alerts.WebhookChannel", "OPTIONS": {"url": refused_url()}},
        {"BACKEND": "django_outbox.alerts.WebhookChannel", "OPTIONS": {"url": hook.url()}},
    ]
    with outbox.atomic() as box:
        for i in range(3):
            box.emit("ORDER_PAID", aggregate_type="ORDER", aggregate_id=str(i), payload={})
    OutboxEvent.objects.update(retry_count=1)
    locmem.fail_next.extend([Reason.NACKED] * 3)
    result = Relay(backend=locmem.LocmemBackend()).drain()
    assert result.dead == 3
    assert OutboxEvent.objects.filter(status=Status.DEAD).count() == 3
    (request,) = hook.received
    body = request["json"]
    assert body["count"] == 3
    assert {d["event_id"] for d in body["dead_letters"]} == set(
        OutboxEvent.objects.values_list("event_id", flat=True)
    )
    assert all(d["event_type"] == "ORDER_PAID" for d in body["dead_letters"])
