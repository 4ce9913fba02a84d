"""The brokers the outbox talks to, and which one a broker URL names: the one table of them.

``OUTBOX_BROKER_URL``'s scheme picks the transport: the relay's backend and the consumer's
loop (``amqp://`` and ``amqps://``: RabbitMQ through pika; ``nats://`` and ``tls://``:
NATS JetStream through nats-py; ``redis://`` and ``rediss://``: Redis Streams through
redis-py). ``OUTBOX_BACKEND``, when set,
still chooses the relay's backend (Celery, locmem, console, your own). A transport whose
client library is an optional extra is imported only when it is used, and a missing
library says which extra to install.

A new broker is one row here, a relay backend (``backends/<name>.py``) and a consumer
transport (``consumer/<name>.py``): docs/architecture.md, "Consumers: one seam".
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from django.utils.module_loading import import_string

from .conf import broker_urls, outbox_settings
from .masking import mask_url


@dataclass(frozen=True)
class Transport:
    """One broker: the URL schemes that name it, its relay backend and consumer loop."""

    name: str
    schemes: tuple[str, ...]
    #: Dotted path of the relay backend (a ``BaseBackend``).
    backend: str
    #: Dotted path of the consumer transport (a ``BaseConsumer``).
    consumer: str
    #: The pip extra that installs its client library; ``""`` when the app depends on it.
    extra: str = ""
    #: The client library's top-level module.
    client: str = ""

    def load(self, path: str) -> Any:
        """Import ``path`` (its backend or consumer), saying which extra to install when the
        client library is missing."""
        problem = self.missing()
        if problem:
            raise ImportError(problem)
        return import_string(path)

    def missing(self) -> str:
        """Why the transport cannot be used here (its client library is not installed, and
        the extra to install); ``""`` when it can. A backend module says it when imported."""
        if not self.client or importlib.util.find_spec(self.client) is not None:
            return ""
        return (
            f"The {self.name} transport ({', '.join(s + '://' for s in self.schemes)} "
            f"broker URLs) needs the {self.client} package; install it with `pip install "
            f"'django-transactional-outbox[{self.extra}]'`."
        )


AMQP = Transport(
    "amqp",
    ("amqp", "amqps"),
    backend="django_outbox.backends.pika.PikaBackend",
    consumer="django_outbox.consumer.amqp.Consumer",
)
NATS = Transport(
    "nats",
    ("nats", "tls"),
    backend="django_outbox.backends.nats.NatsBackend",
    consumer="django_outbox.consumer.nats.Consumer",
    extra="nats",
    client="nats",
)
REDIS = Transport(
    "redis",
    ("redis", "rediss"),
    backend="django_outbox.backends.redis.RedisBackend",
    consumer="django_outbox.consumer.redis.Consumer",
    extra="redis",
    client="redis",
)
#: Every transport, the default (RabbitMQ) first.
TRANSPORTS: tuple[Transport, ...] = (AMQP, NATS, REDIS)


class UnknownTransport(ValueError):
    """A broker URL whose scheme names no transport, or URLs that name several."""


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case; ``""`` when it has none or cannot be parsed."""
    try:
        return urlsplit(url).scheme.lower()
    except ValueError:
        return ""


def transport_for(urls: Sequence[str]) -> Transport:
    """The transport ``urls`` name (RabbitMQ when there is none). Several URLs are the
    nodes of one broker: they must name the same transport."""
    found: dict[str, list[str]] = {}
    for url in urls:
        transport = next((t for t in TRANSPORTS if scheme_of(url) in t.schemes), None)
        if transport is None:
            known = ", ".join(f"{s}://" for t in TRANSPORTS for s in t.schemes)
            raise UnknownTransport(
                f"broker URL {mask_url(url)} has no known scheme; use one of {known}"
            )
        found.setdefault(transport.name, []).append(url)
    if len(found) > 1:
        named = "; ".join(
            f"{name}: {', '.join(mask_url(u) for u in urls)}" for name, urls in found.items()
        )
        raise UnknownTransport(
            f"the broker URLs name several transports ({named}); list the nodes of one broker only"
        )
    if not found:
        return AMQP
    return next(t for t in TRANSPORTS if t.name in found)


def configured(urls: object = None) -> Transport:
    """The transport of ``urls`` (default ``OUTBOX_BROKER_URL``). Raises
    :class:`UnknownTransport`, or ``TypeError`` for a setting of the wrong type."""
    return transport_for(broker_urls(outbox_settings.BROKER_URL if urls is None else urls))


def backend_path() -> str:
    """The relay's backend: ``OUTBOX_BACKEND`` when set, else the broker URL's transport's
    (RabbitMQ's for a setting of the wrong type, which check E016 reports)."""
    if outbox_settings.BACKEND:
        return outbox_settings.BACKEND
    try:
        return configured().backend
    except TypeError:
        return AMQP.backend


def consumer_class(urls: object = None) -> Any:
    """The consumer transport class for ``urls`` (default ``OUTBOX_BROKER_URL``;
    RabbitMQ's for a setting of the wrong type, which the consumer refuses with the reason).
    Raises :class:`UnknownTransport`, or ``ImportError`` naming the extra to install."""
    try:
        transport = configured(urls)
    except TypeError:
        transport = AMQP
    return transport.load(transport.consumer)
