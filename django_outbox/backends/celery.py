"""Publish outbox events to the Celery app's RabbitMQ, with pipelined publisher confirms.

For teams that already run Celery on RabbitMQ: the relay uses the Celery app's broker
(``broker_url``, failover URLs, ``broker_use_ssl``, ``broker_login_method``) and routing,
and sends each event either

* as a **task message** for the task named in ``OUTBOX_CELERY_TASKS[event_type]``, routed
  by the app's ``task_routes`` like any ``send_task()``; the task gets one argument, the
  event envelope of :func:`django_outbox.message.encode_task_envelope`, and its task id is
  the ``event_id``; or
* as a **plain message** to ``OUTBOX_EXCHANGE``, exactly as
  :class:`~django_outbox.backends.pika.PikaBackend` sends it (``consume_outbox`` and other
  AMQP consumers read it unchanged), for event types with no task.

The messages are written by the pika backend's machinery: a whole batch goes out before
any confirm is awaited, and ``basic.ack``/``basic.nack``/``basic.return`` are matched back
to the rows by delivery tag and ``message_id`` (see :mod:`django_outbox.backends.pika` for
the outcome of each message). kombu cannot do this: with ``confirm_publish`` py-amqp waits
for each message's confirm before the next is written, one round trip per event, and
``app.send_task()`` alone costs more per message than the whole pika path.

A task message is built in Celery's task message protocol v2 (documented and stable:
``docs/internals/protocol`` in Celery) by :mod:`django_outbox._compat.celery`, which holds
everything here that rests on Celery's internals: the headers ``app.amqp.as_task_v2()``
writes, the body ``[args, kwargs, embed]`` encoded with the app's ``task_serializer`` (and
``task_compression``) through kombu's serializer registry, ``correlation_id`` = task id.
What Celery decides is asked of Celery: the destination comes from the app's router
(``task_routes``, ``task_queues``, ``task_default_queue``/``_exchange``/``_routing_key``,
``task_default_delivery_mode``) with ``send_task()``'s rules, and a queue a task is routed
to is declared with kombu, as ``send_task()`` declares it, once per connection, on a
short-lived connection of its own, before the first message to it is written; an exchange
named by a route without a queue is checked (passively) the same way. A failed
declaration fails that row only (ERROR, or TIMEOUT when the broker does not answer, and
then the rest of the batch is not sent). ``before_task_publish`` and
``after_task_publish`` are sent for each task message when they have receivers, so
instrumentation that adds headers there still works.

Only RabbitMQ (the ``amqp``/``pyamqp`` transports) has publisher confirms: with any other
Celery broker the backend refuses to publish and ``manage.py check`` says so (E013).

Importing this module imports Celery; nothing else in django_outbox does (besides
``django_outbox._compat.celery``, ``django_outbox.celery`` and ``django_outbox.tasks``), so
Celery stays an optional extra.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
from typing import TYPE_CHECKING, Any

try:
    import celery

    from .._compat import celery as compat
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"django_outbox.backends.celery.CeleryBackend needs Celery ({exc}); install it "
        "with `pip install 'django-transactional-outbox[celery]'`."
    ) from exc

import pika
from django.core.checks import CheckMessage, Error
from django.core.serializers.json import DjangoJSONEncoder
from django.utils.module_loading import import_string
from pika import spec

from ..checks import Codes
from ..conf import broker_urls, outbox_settings
from ..message import encode_body, encode_headers, encode_task_envelope
from ..worker import BrokerNodes
from .base import BrokerUnavailable, PublishResult, Reason, describe_error
from .pika import CLOSE_TIMEOUT, PikaBackend, Unsendable

if TYPE_CHECKING:
    from kombu import Queue

    from ..models import OutboxEvent

__all__ = ["CLOSE_TIMEOUT", "CeleryBackend", "load_app"]

logger = logging.getLogger("django_outbox.backends.celery")

#: Celery transports with publisher confirms (py-amqp); "amqp" is Celery's alias of pyamqp.
CONFIRMING_TRANSPORTS = ("amqp", "pyamqp", "amqps")
# The envelope's headers as encode_task_envelope() writes them (DjangoJSONEncoder).
_HEADERS_ENCODER = DjangoJSONEncoder(ensure_ascii=False, separators=(",", ":"))


def load_app(path: str | celery.Celery | None = None) -> celery.Celery:
    """The Celery app at ``path`` (or OUTBOX_CELERY_APP); Celery's current app if empty."""
    target = outbox_settings.CELERY_APP if path is None else path
    if isinstance(target, celery.Celery):
        return target
    if not target:
        return celery.current_app
    app = import_string(target)
    if not isinstance(app, celery.Celery):
        raise TypeError(f"{target!r} is a {type(app).__name__}, not a Celery app")
    return app


class CeleryBackend(PikaBackend):
    """Publish through the project's Celery app: task messages or plain outbox messages,
    with the pika backend's pipelined confirms.

    Options (``OUTBOX_BACKEND_OPTIONS``), each defaulting to its setting: ``app``
    (``OUTBOX_CELERY_APP``: a dotted path or a Celery instance), ``tasks``
    (``OUTBOX_CELERY_TASKS``), ``exchange_type``, ``exchange_passive``,
    ``confirm_timeout``, ``connect_timeout``; plus the base class's ``exchange``,
    ``routing_keys`` and ``routing_key_func`` for plain messages. The broker is the app's:
    there is no ``broker_url`` option.
    """

    url_setting = "the Celery app's broker_url"

    def __init__(
        self,
        *,
        app: str | celery.Celery | None = None,
        tasks: dict[str, str] | None = None,
        **options: Any,  # exchange_type, exchange_passive, ...: see AmqpBackend
    ) -> None:
        if "broker_url" in options:
            raise TypeError(
                "CeleryBackend publishes to the Celery app's broker and takes no broker_url "
                "option: set the app's broker_url, or use PikaBackend with OUTBOX_BROKER_URL."
            )
        # The nodes are the app's, read when the backend first connects (open()): loading
        # the app is left until it is needed, as before.
        super().__init__(broker_url=[], **options)
        self._app_path = app
        self._app: celery.Celery | None = app if isinstance(app, celery.Celery) else None
        self.tasks = dict(outbox_settings.CELERY_TASKS if tasks is None else tasks)
        # Destinations of task messages declared (or checked) on the connection named by
        # _declared_on; a new connection declares them again, as kombu would.
        self._declared: set[tuple[str, str]] = set()
        self._declared_on: object = None
        self._origin = compat.origin()
        self._routes: dict[str, compat.TaskRoute] = {}  # task name -> route, when routed by name
        self._by_name: bool | None = None  # whether the app routes by task name only

    @property
    def app(self) -> celery.Celery:
        if self._app is None:
            self._app = load_app(self._app_path)
        return self._app

    def __repr__(self) -> str:
        return f"<CeleryBackend {self.nodes or '(app not loaded)'} exchange={self.exchange!r}>"

    # -- system checks ---------------------------------------------------------------------
    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        path = outbox_settings.BACKEND_OPTIONS.get("app", outbox_settings.CELERY_APP)
        try:
            app = load_app(path)
        except (ImportError, TypeError) as exc:
            return [
                Error(
                    f"The Celery app {path!r} cannot be loaded: {exc}.",
                    hint="Set OUTBOX_CELERY_APP to the dotted path of your Celery instance, "
                    "e.g. 'config.celery.app'.",
                    id=Codes.CELERY_APP,
                )
            ]
        transport = _transport_name(app)
        if transport not in CONFIRMING_TRANSPORTS:
            return [
                Error(
                    f"The Celery app's broker uses the {transport!r} transport, which has no "
                    "publisher confirms: the outbox could not know that an event was sent.",
                    hint="Use RabbitMQ as the Celery broker (amqp://...), or "
                    "OUTBOX_BACKEND = 'django_outbox.backends.pika.PikaBackend' with "
                    "OUTBOX_BROKER_URL.",
                    id=Codes.CELERY_NO_CONFIRMS,
                )
            ]
        return []

    # -- connection ------------------------------------------------------------------------
    def open(self) -> None:
        """Connect to the app's broker (the first of its URLs that answers, as the pika
        backend does with OUTBOX_BROKER_URL), with publisher confirms on (idempotent)."""
        if not self.nodes:
            app = self.app
            transport = _transport_name(app)
            if transport not in CONFIRMING_TRANSPORTS:
                raise BrokerUnavailable(
                    f"the Celery app's broker transport {transport!r} has no publisher "
                    "confirms; run `manage.py check` (django_outbox.E013)"
                )
            self.nodes = BrokerNodes(_app_broker_urls(app))
        super().open()

    def _node_parameters(self) -> pika.ConnectionParameters:
        """The current node as kombu reads it with the app's settings: host, port, vhost
        and credentials of the URL (kombu's defaults and URL forms, ``//`` for ``/``),
        ``broker_login_method`` and ``broker_use_ssl``."""
        info = self.app.connection_for_write(self.nodes.current).info()
        use_ssl = info.get("ssl") or self.nodes.current.lower().startswith("amqps://")
        if str(info.get("login_method") or "").upper() == "EXTERNAL":
            credentials: Any = pika.credentials.ExternalCredentials()
        else:
            credentials = pika.PlainCredentials(info["userid"] or "", info["password"] or "")
        return pika.ConnectionParameters(
            host=info["hostname"] or "localhost",
            port=int(info["port"] or (5671 if use_ssl else 5672)),
            virtual_host=info["virtual_host"] or "/",
            credentials=credentials,
            ssl_options=_ssl_options(use_ssl, info["hostname"]) if use_ssl else None,
        )

    # -- messages --------------------------------------------------------------------------
    def _message(self, event: OutboxEvent) -> tuple[str, str, bytes, spec.BasicProperties]:
        name = self.tasks.get(event.event_type)
        if not name:
            return super()._message(event)
        return self._task_message(name, event)

    def _task_message(
        self, name: str, event: OutboxEvent
    ) -> tuple[str, str, bytes, spec.BasicProperties]:
        """``event`` as the message ``app.send_task(name, args=[envelope],
        task_id=event_id)`` would publish (protocol v2)."""
        task_id = event.event_id
        args: list[Any] | None = None

        def task_args() -> list[Any]:
            nonlocal args
            if args is None:
                args = [encode_task_envelope(event)]
            return args

        route = self._routes.get(name)
        if route is None:
            try:
                route = self._route(name, task_args())
            except Exception as exc:  # QueueNotFound, a router function's own error
                raise Unsendable(
                    PublishResult.failed(
                        Reason.ERROR, f"cannot route task {name!r}: {describe_error(exc)}"
                    )
                ) from exc
        self._declare(route.queue, route.exchange)
        message = compat.task_message(
            name,
            task_id,
            route,
            args=task_args,
            json_args=lambda: _envelope_json(event),
            # What worker logs and monitors show instead of the payload: no personal data
            # in logs, and no repr of a large payload per message.
            argsrepr=f"(<{event.event_type} event {task_id}>,)",
            origin=self._origin,
        )
        props = spec.BasicProperties(
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            headers=message.headers,
            delivery_mode=route.delivery_mode,
            priority=route.priority,
            # message_id: how a basic.return is matched to its row (and what the pika
            # backend's messages carry); Celery itself sets only correlation_id.
            message_id=task_id,
            correlation_id=message.correlation_id,
            reply_to=message.reply_to,
        )
        return route.exchange, route.routing_key, message.body, props

    def _route(self, name: str, args: list[Any]) -> compat.TaskRoute:
        """Where the app's router sends task ``name`` with ``args`` (:func:`compat.route`),
        kept per task name when the app routes by name only; a router function may look at
        the arguments, so then it is asked for every message."""
        app = self.app
        if self._by_name is None:
            self._by_name = compat.routes_by_name(app)
        route = compat.route(app, name, args)
        if self._by_name:
            self._routes[name] = route
        return route

    def _declare(self, queue: Queue | None, exchange: str) -> None:
        """Declare the task's queue (as ``send_task()`` does) and check that the exchange it
        is published to exists, once per connection; raise :class:`Unsendable` if not."""
        if self._declared_on is not self._connection:
            self._declared.clear()
            self._declared_on = self._connection
        key = (queue.name if queue is not None else "", exchange)
        if key in self._declared:
            return
        queue_exchange = queue.exchange.name if queue is not None and queue.exchange else ""
        check_exchange = bool(exchange) and exchange != queue_exchange
        if queue is None and not check_exchange:
            self._declared.add(key)
            return
        connection = self.app.connection_for_write(
            self.nodes.current, connect_timeout=self.connect_timeout
        )
        what = f"queue {queue.name!r}" if queue is not None else f"exchange {exchange!r}"
        try:
            connection.connect()
            channel = connection.channel()
            # py-amqp waits for each answer without a bound otherwise.
            with contextlib.suppress(Exception):
                channel.connection.transport.sock.settimeout(self.confirm_timeout)
            if queue is not None:
                queue(channel).declare()
            if check_exchange:
                channel.exchange_declare(exchange, "direct", passive=True)
        except TimeoutError as exc:
            connection.collect()
            raise Unsendable(
                PublishResult.failed(
                    Reason.TIMEOUT,
                    f"declaring the task's {what}: no answer from RabbitMQ within "
                    f"{self.confirm_timeout:g} s (OUTBOX_CONFIRM_TIMEOUT)",
                ),
                rest=f"not sent: RabbitMQ did not answer the declaration of {what}",
            ) from exc
        except Exception as exc:
            connection.collect()
            if isinstance(exc, connection.channel_errors):
                raise Unsendable(
                    PublishResult.failed(
                        Reason.ERROR, f"cannot declare the task's {what}: {describe_error(exc)}"
                    )
                ) from exc
            raise Unsendable(
                PublishResult.failed(
                    Reason.CONNECTION_LOST,
                    f"cannot declare the task's {what}: {describe_error(exc)}",
                ),
                rest=f"not sent: the declaration of {what} failed",
            ) from exc
        with contextlib.suppress(Exception):
            channel.connection.transport.sock.settimeout(CLOSE_TIMEOUT)
        try:
            connection.release()
        except Exception:
            connection.collect()
        self._declared.add(key)


def _envelope_json(event: OutboxEvent) -> bytes:
    """The task's arguments ``[envelope]`` as JSON: :func:`encode_task_envelope`'s
    envelope, with the payload as :func:`~django_outbox.message.encode_body` writes it."""
    return b"".join(
        (
            b'[{"event_id":',
            json.dumps(event.event_id, ensure_ascii=False).encode(),
            b',"event_type":',
            json.dumps(event.event_type, ensure_ascii=False).encode(),
            b',"payload":',
            encode_body(event),
            b',"headers":',
            _HEADERS_ENCODER.encode(encode_headers(event)).encode(),
            b"}]",
        )
    )


def _app_broker_urls(app: celery.Celery) -> list[str]:
    """The app's broker URLs for writing, in its order (a list, or ``;`` between them)."""
    value = app.conf.broker_write_url or app.conf.broker_url
    if value:
        return broker_urls(value)
    return [app.connection_for_write().as_uri(include_password=True)]


def _ssl_options(value: object, host: str) -> pika.SSLOptions:
    """pika's TLS options for kombu's ``ssl`` (``broker_use_ssl``): ``True``, or a dict of
    ``ssl.wrap_socket()`` arguments (``ca_certs``, ``certfile``, ``keyfile``,
    ``cert_reqs``, ``server_hostname``) or with a ready ``context``."""
    options = dict(value) if isinstance(value, dict) else {}
    context = options.get("context")
    if context is None:
        context = ssl.create_default_context(cafile=options.get("ca_certs"))
        if options.get("certfile"):
            context.load_cert_chain(options["certfile"], options.get("keyfile"))
        if options.get("cert_reqs") == ssl.CERT_NONE:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    return pika.SSLOptions(context, options.get("server_hostname") or host)


def _transport_name(app: celery.Celery) -> str:
    url = app.conf.broker_write_url or app.conf.broker_url or ""
    if isinstance(url, list | tuple):  # failover URLs
        url = url[0] if url else ""
    url = str(url).split(";", 1)[0]
    transport = app.conf.broker_transport or (url.split("://", 1)[0] if "://" in url else "")
    return str(transport or "amqp").split("+", 1)[0].lower()
