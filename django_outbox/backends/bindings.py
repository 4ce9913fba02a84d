"""Which queues a routing key reaches on a RabbitMQ exchange, for ``manage.py outbox_check``.

AMQP 0-9-1 has no method that lists an exchange's bindings, and the only way to learn over
AMQP whether a routing key reaches a queue is to publish to it, which would deliver a
message to every consumer bound. The RabbitMQ management plugin's HTTP API lists them
(``GET /api/exchanges/{vhost}/{name}/bindings/source``); :func:`routes` reads them there
with the broker URL's credentials and matches each routing key by the exchange type's rules
(:func:`matches`), following exchange-to-exchange bindings. Without the plugin (or with a
user it refuses) it raises :class:`BindingsUnknown`, which says what to enable.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from .base import Route

#: Exchange-to-exchange bindings followed at most this deep (and never round a cycle).
MAX_HOPS = 5


class BindingsUnknown(Exception):
    """The bindings could not be read; the message says why and what to change."""


@dataclass(frozen=True)
class ManagementApi:
    """The management HTTP API of one RabbitMQ node: its base URL and the credentials."""

    url: str  # e.g. http://rabbitmq:15672/
    user: str
    password: str
    timeout: float = 10.0

    @classmethod
    def for_broker(
        cls, host: str, *, tls: bool, user: str, password: str, url: str = "", timeout: float
    ) -> ManagementApi:
        """The API of the node at ``host``: ``url`` when given (the pika backend's
        ``management_url`` option), else the plugin's default port on that host (15672,
        15671 with TLS)."""
        if not url:
            url = f"https://{host}:15671/" if tls else f"http://{host}:15672/"
        return cls(url if url.endswith("/") else url + "/", user, password, timeout)

    @property
    def where(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}/"

    def get(self, path: str) -> Any:
        request = urllib.request.Request(self.url + path.lstrip("/"))
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise BindingsUnknown(
                    f"the RabbitMQ management API at {self.where} refused the user "
                    f"{self.user!r} ({exc.code}); it needs the management or monitoring tag "
                    f"(rabbitmqctl set_user_tags {self.user} monitoring)"
                ) from exc
            raise BindingsUnknown(
                f"the RabbitMQ management API at {self.where} answered {exc.code} for {path}"
            ) from exc
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise BindingsUnknown(
                f"the RabbitMQ management API at {self.where} did not answer ({reason}); "
                "enable it (rabbitmq-plugins enable rabbitmq_management), or give its URL as "
                "OUTBOX_BACKEND_OPTIONS['management_url']"
            ) from exc


def routes(
    api: ManagementApi, vhost: str, exchange: str, routing_keys: Sequence[str]
) -> list[Route]:
    """Where each routing key published to ``exchange`` goes: the queues bound for it."""
    return [Route(key, tuple(_destinations(api, vhost, exchange, key))) for key in routing_keys]


def _destinations(api: ManagementApi, vhost: str, exchange: str, key: str) -> list[str]:
    found: list[str] = []
    seen: set[str] = set()
    todo = [(exchange, 0)]
    while todo:
        name, hops = todo.pop(0)
        if name in seen or hops > MAX_HOPS:
            continue
        seen.add(name)
        base = f"api/exchanges/{quote(vhost, safe='')}/{quote(name, safe='')}"
        kind = api.get(base)["type"]
        for binding in api.get(f"{base}/bindings/source"):
            if not matches(kind, binding["routing_key"], key):
                continue
            if binding["destination_type"] == "queue":
                found.append(f"queue {binding['destination']!r}")
            else:
                todo.append((binding["destination"], hops + 1))
    return found


def matches(exchange_type: str, binding_key: str, routing_key: str) -> bool:
    """Whether a binding with ``binding_key`` takes a message published with
    ``routing_key`` to an exchange of ``exchange_type``. A type whose routing does not
    depend on the key alone (``headers``, plugins' types) counts every binding: the
    message may reach it."""
    if exchange_type == "direct":
        return binding_key == routing_key
    if exchange_type == "topic":
        return _topic(binding_key.split("."), routing_key.split("."))
    return True


def _topic(pattern: list[str], words: list[str]) -> bool:
    """AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more."""
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_topic(rest, words[skip:]) for skip in range(len(words) + 1))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _topic(rest, words[1:])
