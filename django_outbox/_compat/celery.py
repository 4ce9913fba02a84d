"""Celery internals the Celery backend relies on (celery>=5.3,<6, pinned in pyproject.toml).

``backends/celery.py`` writes Celery's task messages itself, through the pika backend's
pipelined confirms, instead of calling ``app.send_task()``, whose publisher waits for each
message's confirm in turn. It must then write what ``send_task()`` writes, and send it where
``send_task()`` sends it, which rests on more than Celery documents as its API:

* :func:`route`: what the app's router answers for a task (``app.amqp.router.route()``),
  turned into an exchange, a routing key, a delivery mode and the queue to declare by the
  rules of ``app.amqp.send_task_message()``; :func:`routes_by_name`: whether every route
  of the app is a ``MapRoute`` (task names and patterns), so that a route holds for every
  message of a task;
* :func:`task_message`: the message of task protocol v2 (documented: ``docs/internals/
  protocol`` in Celery), with the headers ``app.amqp.as_task_v2()`` writes that say
  something here, the body ``[args, kwargs, embed]`` encoded through kombu's serializer
  registry (or, for JSON, written directly), and ``before_task_publish`` and
  ``after_task_publish`` sent as ``send_task_message()`` sends them;
* :func:`origin`: the ``origin`` header, as ``as_task_v2()`` names this process.

``tests/test_compat.py`` compares each with what the installed Celery does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import celery
from celery import signals
from celery.app.routes import MapRoute
from celery.utils.nodenames import anon_nodename
from kombu import Exchange, Queue
from kombu.common import Broadcast
from kombu.compression import compress
from kombu.serialization import dumps

#: The Celery releases these internals are known to behave as assumed (tests/test_compat.py).
PINNED = "celery>=5.3,<6"

#: kombu's names of the delivery modes (``task_default_delivery_mode = "persistent"``).
DELIVERY_MODES = {"transient": 1, "persistent": 2}
#: The third element of a task message's body: no callbacks, errbacks, chain or chord.
EMBED: dict[str, None] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_EMBED_JSON = json.dumps(EMBED, separators=(",", ":")).encode()


@dataclass(frozen=True)
class TaskRoute:
    """Where and how a task message goes (see :func:`route`)."""

    exchange: str
    routing_key: str
    delivery_mode: int
    queue: Queue | None  # declared before the first message to it
    serializer: str
    compression: str | None
    priority: int | None


@dataclass(frozen=True)
class TaskMessage:
    """A task message as ``send_task()`` would publish it, ready for the wire."""

    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    correlation_id: str
    reply_to: str | None


def origin() -> str:
    """The ``origin`` header of the task messages this process writes."""
    return anon_nodename()


def routes_by_name(app: celery.Celery) -> bool:
    """Whether the app routes by task name only (``task_routes`` of names and patterns, or
    none): then a task's route holds for every message; a router function may look at the
    arguments."""
    return all(isinstance(r, MapRoute) for r in app.amqp.routes)


def route(app: celery.Celery, name: str, args: list[Any]) -> TaskRoute:
    """Where the app's router sends task ``name`` with ``args``, with what serializer,
    compression, priority and delivery mode. Raises what the router raises (a queue the app
    does not know: ``QueueNotFound``)."""
    conf = app.conf
    options = app.amqp.router.route({}, name, args, {})
    exchange, routing_key, delivery_mode, queue = _destination(app, options)
    return TaskRoute(
        exchange=exchange,
        routing_key=routing_key,
        delivery_mode=delivery_mode,
        queue=queue,
        serializer=options.get("serializer") or conf.task_serializer,
        compression=options.get("compression") or conf.task_compression,
        priority=options.get("priority"),
    )


def _destination(app: celery.Celery, route: dict[str, Any]) -> tuple[str, str, int, Queue | None]:
    """Exchange, routing key, delivery mode and queue to declare of a routed task message:
    the rules of Celery's ``send_task_message()``."""
    amqp = app.amqp
    queue = route.get("queue")
    exchange = route.get("exchange")
    routing_key = route.get("routing_key")
    exchange_type = route.get("exchange_type")
    delivery_mode = route.get("delivery_mode")
    if isinstance(exchange, Exchange):
        # Its own type, where send_task_message() reads only a queue's exchange's: Celery
        # would send a route's fanout Exchange to the default exchange, which drops it.
        exchange_type = exchange_type or exchange.type
        exchange = exchange.name
    qname = queue
    if queue is None and exchange is None:
        queue = amqp.default_queue
    if queue is not None:
        if isinstance(queue, str):
            qname, queue = queue, amqp.queues[queue]
        else:
            qname = queue.name
    if delivery_mode is None:
        delivery_mode = getattr(getattr(queue, "exchange", None), "delivery_mode", None)
        delivery_mode = delivery_mode or app.conf.task_default_delivery_mode
    if exchange_type is None:
        exchange_type = getattr(getattr(queue, "exchange", None), "type", None) or "direct"
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", qname
    elif exchange is None:
        assert queue is not None  # no queue and no exchange: the default queue, above
        exchange = queue.exchange.name or amqp.default_exchange.name
        routing_key = routing_key or queue.routing_key or app.conf.task_default_routing_key
    declare = queue if queue is not None and not isinstance(queue, Broadcast) else None
    mode = DELIVERY_MODES.get(delivery_mode, delivery_mode)
    return exchange or "", routing_key or "", int(mode or 2), declare


def task_message(
    name: str,
    task_id: str,
    route: TaskRoute,
    *,
    args: Callable[[], list[Any]],
    json_args: Callable[[], bytes],
    argsrepr: str,
    origin: str,
) -> TaskMessage:
    """The message ``app.send_task(name, args=args(), task_id=task_id)`` would publish
    (protocol v2) on ``route``, and the publish signals sent for it.

    ``args()`` are the task's positional arguments; ``json_args()`` the same list as JSON,
    written by the caller, which is the body's first element when the route's serializer
    is JSON and no ``before_task_publish`` receiver may change the body: then neither is
    encoded, decoded and encoded again (a test compares the two).
    """
    # The protocol's required headers and the optional ones that say something here; the
    # rest (eta, expires, retries, timelimit, shadow, stamps...) are left at the worker's
    # defaults, which are what send_task() would write: every header is encoded per
    # message, and they are most of a task message's cost. ignore_result is left to the
    # task's own setting, as apply_async() does.
    headers: dict[str, Any] = {
        "lang": "py",
        "task": name,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "argsrepr": argsrepr,
        "kwargsrepr": "{}",
        "origin": origin,
    }
    properties: dict[str, Any] = {"correlation_id": task_id, "reply_to": ""}
    body: tuple[list[Any], dict[str, Any], dict[str, Any]] | None = None
    if route.serializer == "json" and not signals.before_task_publish.receivers:
        content_type, content_encoding = "application/json", "utf-8"
        data: bytes | str = b"".join((b"[", json_args(), b",{},", _EMBED_JSON, b"]"))
    else:
        body = (args(), {}, dict(EMBED))
        if signals.before_task_publish.receivers:
            signals.before_task_publish.send(
                sender=name,
                body=body,
                exchange=route.exchange,
                routing_key=route.routing_key,
                declare=[route.queue] if route.queue is not None else [],
                headers=headers,
                properties=properties,
                retry_policy={},
            )
        content_type, content_encoding, data = dumps(body, serializer=route.serializer)
    if route.compression:
        data, headers["compression"] = compress(data, route.compression)
    if signals.after_task_publish.receivers:
        # Sent once the message is built; the relay writes it next, and SENT still waits
        # for the broker's confirm.
        if body is None:
            body = (args(), {}, dict(EMBED))
        signals.after_task_publish.send(
            sender=name,
            body=body,
            headers=headers,
            exchange=route.exchange,
            routing_key=route.routing_key,
        )
    return TaskMessage(
        body=data if isinstance(data, bytes) else data.encode(),
        content_type=content_type,
        content_encoding=content_encoding,
        headers=headers,
        correlation_id=properties.get("correlation_id", task_id),
        reply_to=properties.get("reply_to") or None,
    )
