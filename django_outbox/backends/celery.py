"""Publish outbox events through the project's Celery app, with publisher confirms.

For teams that already run Celery on RabbitMQ: the relay uses the Celery app's broker
settings (URL, failover, SSL, transport options) and sends each event either

* as a **task message** for the task named in ``OUTBOX_CELERY_TASKS[event_type]``, routed
  by the app's ``task_routes`` like any ``send_task()``; the task gets one argument, the
  event envelope of :func:`django_outbox.message.encode_task_envelope`, and its task id is
  the ``event_id``; or
* as a **plain message** to ``OUTBOX_EXCHANGE``, exactly as
  :class:`~django_outbox.backends.pika.PikaBackend` sends it (``consume_outbox`` and other
  AMQP consumers read it unchanged), for event types with no task.

Sent means confirmed here too. The backend opens its own connection with
``app.connection_for_write()``, forcing the py-amqp transport option ``confirm_publish``
on whatever the app's ``broker_transport_options`` say, and publishes with
``mandatory=True``. With ``confirm_publish`` py-amqp waits for each message's confirm
before the next is written (kombu offers no pipelined confirms for AMQP), so a batch costs
one round trip per event; the pika backend pipelines them. Outcome of each message:

* ``basic.ack``: sent, unless a ``basic.return`` came first: UNROUTABLE;
* ``basic.nack`` (py-amqp raises ``MessageNacked``): NACKED;
* no confirm within ``confirm_timeout``: TIMEOUT for that event; the connection is
  dropped (a late confirm would be taken for the next message's) and the rest of the batch
  is reported CONNECTION_LOST, unsent, so the relay backs off instead of waiting
  ``confirm_timeout`` per event;
* the connection breaks: CONNECTION_LOST for it and the rest of the batch;
* a channel error (e.g. a task routed to an exchange that does not exist): ERROR for that
  event, and a new channel for the next one.

kombu's docstring calls ``mandatory`` unsupported; py-amqp passes it on, and since the
broker sends ``basic.return`` before the ack that ``confirm_publish`` waits for, the return
reaches :meth:`CeleryBackend._on_return` while the publish call is still waiting (the
tests check this on a real RabbitMQ).

Only RabbitMQ (the ``amqp``/``pyamqp`` transports) has publisher confirms: with any other
Celery broker the backend refuses to publish and ``manage.py check`` says so (E013).

Importing this module imports Celery; nothing else in django_outbox does (besides
``django_outbox.celery`` and ``django_outbox.tasks``), so Celery stays an optional extra.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

try:
    import celery
    from amqp.exceptions import MessageNacked
    from kombu import Connection, Exchange, Producer
    from kombu.exceptions import OperationalError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"django_outbox.backends.celery.CeleryBackend needs Celery ({exc}); install it "
        "with `pip install 'django-transactional-outbox[celery]'`."
    ) from exc

from django.core.checks import CheckMessage, Error
from django.utils.module_loading import import_string

from ..checks import Codes
from ..conf import outbox_settings
from ..message import encode_task_envelope
from .base import (
    AmqpBackend,
    BrokerUnavailable,
    PublishResult,
    Reason,
    SyncBackend,
    describe_error,
)

if TYPE_CHECKING:
    from ..models import OutboxEvent

logger = logging.getLogger("django_outbox.backends.celery")

#: How long close() waits for the broker's close-ok before dropping the socket anyway.
CLOSE_TIMEOUT = 2.0
#: Celery transports with publisher confirms (py-amqp); "amqp" is Celery's alias of pyamqp.
CONFIRMING_TRANSPORTS = ("amqp", "pyamqp", "amqps")


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


class CeleryBackend(SyncBackend, AmqpBackend):
    """Publish through the project's Celery app: task messages or plain outbox messages.

    Options (``OUTBOX_BACKEND_OPTIONS``), each defaulting to its setting: ``app``
    (``OUTBOX_CELERY_APP``: a dotted path or a Celery instance), ``tasks``
    (``OUTBOX_CELERY_TASKS``), ``exchange_type``, ``exchange_passive``,
    ``confirm_timeout``, ``connect_timeout``; plus the base class's ``exchange``,
    ``routing_keys`` and ``routing_key_func`` for plain messages.
    """

    def __init__(
        self,
        *,
        app: str | celery.Celery | None = None,
        tasks: dict[str, str] | None = None,
        **options: Any,  # exchange_type, exchange_passive, ...: see AmqpBackend
    ) -> None:
        super().__init__(**options)
        self._app_path = app
        self._app: celery.Celery | None = app if isinstance(app, celery.Celery) else None
        self.tasks = dict(outbox_settings.CELERY_TASKS if tasks is None else tasks)
        self._connection: Connection | None = None
        self._channel: Any = None
        self._producer: Producer | None = None
        self._exchange_declared = False
        self._returned: str = ""  # why the broker sent back the message just published

    @property
    def app(self) -> celery.Celery:
        if self._app is None:
            self._app = load_app(self._app_path)
        return self._app

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
        """Connect with publisher confirms on (idempotent)."""
        if self._producer is not None:
            return
        app = self.app
        transport = _transport_name(app)
        if transport not in CONFIRMING_TRANSPORTS:
            raise BrokerUnavailable(
                f"the Celery app's broker transport {transport!r} has no publisher confirms; "
                "run `manage.py check` (django_outbox.E013)"
            )
        connection = app.connection_for_write(
            transport_options={"confirm_publish": True},
            connect_timeout=self.connect_timeout,
        )
        url = connection.as_uri()  # the password is masked
        try:
            connection.connect()
            channel = connection.channel()
        except Exception as exc:
            connection.collect()
            raise BrokerUnavailable(
                f"cannot connect to the Celery broker at {url}: {describe_error(exc)}. Check the "
                "app's broker_url; the relay retries with backoff."
            ) from exc
        self._connection = connection
        # Bound every read and write, not only the confirm wait: declaring the exchange or
        # a task's queue is a round trip too, and py-amqp would wait for it forever.
        with contextlib.suppress(Exception):
            channel.connection.transport.sock.settimeout(self.confirm_timeout)
        self._use_channel(channel)
        logger.info("connected to the Celery broker at %s (app %s)", url, app.main)

    def _use_channel(self, channel: Any) -> None:
        channel.events["basic_return"].add(self._on_return)
        self._channel = channel
        self._producer = Producer(channel, auto_declare=False)
        self._exchange_declared = False

    def close(self) -> None:
        self._release(graceful=True)

    def _release(self, *, graceful: bool) -> None:
        connection, self._connection = self._connection, None
        channel, self._channel, self._producer = self._channel, None, None
        self._exchange_declared = False
        if connection is None:
            return
        if graceful:
            # py-amqp waits for the broker's close-ok without a timeout: bound it, or a
            # broker that stopped answering keeps a stopping relay (or worker) forever.
            with contextlib.suppress(Exception):
                channel.connection.transport.sock.settimeout(CLOSE_TIMEOUT)
            try:
                connection.release()
                return
            except Exception:
                logger.debug("closing the Celery broker connection failed", exc_info=True)
        # Without a word to the broker: after a timeout or a broken socket a close could
        # wait for an answer that never comes.
        connection.collect()

    def _new_channel(self) -> None:
        """After a channel error: a fresh channel on the same connection."""
        assert self._connection is not None
        self._use_channel(self._connection.channel())

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        # py-amqp calls this while waiting for the confirm of the message just published.
        self._returned = (
            f"returned by RabbitMQ: {exc} (no queue bound to exchange {exchange!r} for "
            f"routing key {routing_key!r})"
        )

    # -- publishing ------------------------------------------------------------------------
    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        if not events:
            return []
        self.open()
        results: list[PublishResult] = []
        for index, event in enumerate(events):
            result = self._publish_one(event)
            results.append(result)
            if self._producer is not None:
                continue
            # The connection was dropped. After a timeout or a lost connection the broker
            # is in trouble: the rest is not sent (the relay releases it and backs off).
            error = ""
            if result.reason in (Reason.TIMEOUT, Reason.CONNECTION_LOST):
                error = f"not sent: the connection was dropped after event {event.event_id}"
            else:
                try:
                    self.open()
                except BrokerUnavailable as exc:
                    error = f"not sent: {exc}"
            if error:
                results.extend(
                    PublishResult.failed(Reason.CONNECTION_LOST, error) for _ in events[index + 1 :]
                )
                break
        return results

    def _publish_one(self, event: OutboxEvent) -> PublishResult:
        task = self.tasks.get(event.event_type)
        self._returned = ""
        try:
            if task:
                self._send_task(task, event)
            else:
                self._send_message(event)
        except Exception as exc:
            return self._failure(event, exc)
        if self._returned:
            return PublishResult.failed(Reason.UNROUTABLE, self._returned)
        return PublishResult.sent()

    def _send_task(self, name: str, event: OutboxEvent) -> None:
        self.app.send_task(
            name,
            args=[encode_task_envelope(event)],
            task_id=event.event_id,
            # What worker logs and monitors show instead of the payload: no personal data
            # in logs, and no repr of a large payload per message.
            argsrepr=f"(<{event.event_type} event {event.event_id}>,)",
            kwargsrepr="{}",
            producer=self._producer,
            add_to_parent=False,
            # The relay retries (with its backoff and lease); kombu must not block on it.
            retry=False,
            mandatory=True,
            timeout=self.confirm_timeout,
            confirm_timeout=self.confirm_timeout,
        )

    def _send_message(self, event: OutboxEvent) -> None:
        producer = self._producer
        assert producer is not None
        if not self._exchange_declared and self.exchange:
            Exchange(
                self.exchange, type=self.exchange_type, durable=True, passive=self.exchange_passive
            )(producer.channel).declare()
            self._exchange_declared = True
        message_format = self.message_format
        producer.publish(
            message_format.encode_body(event),
            exchange=self.exchange,
            routing_key=self.routing_key(event),
            content_type=message_format.content_type,
            content_encoding="utf-8",
            headers=message_format.encode_headers(event),
            delivery_mode=2,
            mandatory=True,
            retry=False,
            timeout=self.confirm_timeout,
            confirm_timeout=self.confirm_timeout,
            message_id=event.event_id,
            type=event.event_type,
            timestamp=int(event.occurred_at.timestamp()),
        )

    def _failure(self, event: OutboxEvent, exc: Exception) -> PublishResult:
        # send_task() wraps transport errors in kombu's OperationalError.
        cause = exc.__cause__ if isinstance(exc, OperationalError) and exc.__cause__ else exc
        connection = self._connection
        if isinstance(cause, MessageNacked):
            return PublishResult.failed(Reason.NACKED, "RabbitMQ refused the message (basic.nack)")
        if isinstance(cause, socket.timeout | TimeoutError):
            self._release(graceful=False)
            return PublishResult.failed(
                Reason.TIMEOUT,
                f"no publisher confirm from RabbitMQ within {self.confirm_timeout:g} s "
                "(OUTBOX_CONFIRM_TIMEOUT)",
            )
        if connection is not None and (
            isinstance(cause, connection.connection_errors) or isinstance(exc, OperationalError)
        ):
            self._release(graceful=False)
            logger.warning("connection to the Celery broker lost: %s", describe_error(cause))
            return PublishResult.failed(
                Reason.CONNECTION_LOST, f"connection lost: {describe_error(cause)}"
            )
        if connection is not None and isinstance(cause, connection.channel_errors):
            # py-amqp reopens a channel the broker closed; otherwise open a new one.
            self._exchange_declared = False
            if not (self._channel is not None and self._channel.is_open):
                try:
                    self._new_channel()
                except Exception:
                    self._release(graceful=False)
            return PublishResult.failed(Reason.ERROR, f"channel error: {describe_error(cause)}")
        if isinstance(cause, TypeError | ValueError):
            return PublishResult.failed(
                Reason.SERIALISATION,
                f"cannot build the message: {type(cause).__name__}: {cause}",
            )
        logger.exception("publishing event %s through Celery failed", event.event_id)
        # The channel's state is unknown: start the next message on a fresh one.
        self._release(graceful=False)
        return PublishResult.failed(Reason.ERROR, f"{type(cause).__name__}: {cause}")


def _transport_name(app: celery.Celery) -> str:
    url = app.conf.broker_write_url or app.conf.broker_url or ""
    if isinstance(url, list | tuple):  # failover URLs
        url = url[0] if url else ""
    url = str(url).split(";", 1)[0]
    transport = app.conf.broker_transport or (url.split("://", 1)[0] if "://" in url else "")
    return str(transport or "amqp").split("+", 1)[0].lower()
