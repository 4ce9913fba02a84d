"""The story ``manage.py demo`` tells: orders -> outbox -> relay -> broker -> points.

Everything that can go wrong in the article goes wrong once, on purpose, for real:

1. N orders are created with ``orders.services.create_order`` (order and event in one
   transaction); one more is rolled back after its event was written.
2. A real ``publish_outbox`` child process relays them in batches and is killed with SIGKILL
   right after the broker confirmed one batch, before the relay marked it SENT.
3. A consumer handles a few messages, commits, and loses its connection before its acks:
   the broker delivers them again.
4. The points consumer reads the broker: the re-deliveries are duplicates, suppressed by
   the ledger's unique ``source_event_id``.
5. A restarted ``publish_outbox`` sends the rest and, once the dead relay's lease ran out,
   the killed batch a second time; it is stopped with SIGTERM.
6. The consumer reads again: the killed batch comes back as duplicates.
7. Each order also enqueued a ``send_receipt`` Django task in its transaction
   (``OutboxTaskBackend``); the relay published those rows with the events, to a task queue
   of their own, and the task worker runs them, once each, despite the killed batch: an
   ``outbox_worker --once`` child process on a real broker; on the embedded one its handler
   and dispatcher, run here (the worker has no transport for the in-process broker). Not
   on Django 5.2 without the Tasks backport: the story then has no step 7, and says so.

Then :func:`reconcile` compares orders, outbox rows, points rows and receipts. With ``BROKER_URL``
the broker is RabbitMQ (an exchange and queues named for this run), Redis Streams (streams
and consumer groups named for this run) or NATS JetStream (a stream and durable consumers
named for this run; JetStream drops the killed batch's second copy, so steps 6 and 7 find no
duplicate of it), deleted at the end, also when the run fails; the consumer is a
``consume_outbox`` child process and the task queue is :class:`TaskQueue`. Without it, the
broker is :class:`demo.broker.InProcessBroker` in this process and the consumer runs here too.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import IO, Any, Protocol

from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction
from django.db.migrations.executor import MigrationExecutor

from django_outbox import message
from django_outbox.conf import broker_urls, outbox_settings
from django_outbox.consumer import Action, Decision, Dispatcher, Outcome
from django_outbox.masking import mask_url
from django_outbox.models import OutboxEvent, OutboxTaskResult, Status
from orders.models import Order
from orders.services import create_order
from points.models import PointsLedger

from . import backends
from .broker import EVENTS, TASKS, InProcessBroker
from .models import Receipt
from .receipts import send_receipt

logger = logging.getLogger("demo")

MANAGE = Path(__file__).resolve().parents[1] / "manage.py"
AWARD = "points.handlers.AwardPointsHandler"
PREFIX = "demo-"
STEP_TIMEOUT = 90.0
WIDTH = 92


class DemoError(Exception):
    """The demo could not run a step (a child failed, a service is missing)."""


# -- the consumer's tally and the reconciliation -------------------------------------------
@dataclass
class Tally:
    """Messages the points handler ran on, by outcome."""

    handled: int = 0
    processed: int = 0
    duplicates: int = 0
    failed: int = 0
    other: int = 0  # unknown type, undecodable
    #: Decoded messages by the format they came in (OUTBOX_MESSAGE_FORMAT of the relays).
    formats: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: Outcome, n: int = 1, message_format: str = "") -> None:
        if message_format and n:
            self.formats[message_format] = self.formats.get(message_format, 0) + n
        self.handled += n
        if outcome is Outcome.PROCESSED:
            self.processed += n
        elif outcome is Outcome.DUPLICATE:
            self.duplicates += n
        elif outcome is Outcome.FAILED:
            self.failed += n
        else:
            self.other += n

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.handled + other.handled,
            self.processed + other.processed,
            self.duplicates + other.duplicates,
            self.failed + other.failed,
            self.other + other.other,
            {
                k: self.formats.get(k, 0) + other.formats.get(k, 0)
                for k in {*self.formats, *other.formats}
            },
        )

    @classmethod
    def from_totals(cls, totals: dict[str, Any]) -> Tally:
        """From ``ConsumeResult.as_dict()``, which ``consume_outbox --json`` prints."""
        tally = cls()
        for value, n in totals["outcomes"].items():
            tally.add(Outcome(value), n)
        for name, n in totals.get("formats", {}).items():
            if n:
                tally.formats[name] = n
        if tally.handled != totals["messages"]:
            raise DemoError(f"consume_outbox's totals do not add up: {totals!r}")
        return tally


@dataclass
class Figures:
    """What the reconciliation compares; every number is this run's only."""

    orders: int
    events: int
    sent: int
    pending: int
    dead: int
    points_rows: int
    lost: int  # orders without a points row
    extra_points: int  # points rows beyond one per order
    consumer: Tally
    lost_acks: int  # messages committed by the crashing consumer, delivered again
    killed_batch: int  # messages the killed relay had confirmed, sent again
    receipts: int | None = None  # receipts sent (None: the run enqueued no tasks)
    tasks: Tally = field(default_factory=Tally)  # the send_receipt messages the worker read
    killed_tasks: int = 0  # tasks the killed relay had confirmed, sent again

    @property
    def expected_duplicates(self) -> int:
        return self.lost_acks + self.killed_batch


def reconcile(f: Figures) -> list[str]:
    """The problems the figures show; an empty list means the story ended well."""
    problems = []
    if f.lost:
        problems.append(f"{f.lost} order(s) never got their points: lost")
    if f.extra_points:
        problems.append(f"{f.extra_points} order(s) got their points more than once")
    if f.points_rows != f.orders:
        problems.append(f"{f.points_rows} points rows for {f.orders} orders")
    if f.events != f.orders:
        problems.append(f"{f.events} outbox events for {f.orders} orders")
    if f.sent != f.events or f.pending or f.dead:
        problems.append(f"outbox not fully sent: PENDING {f.pending}, SENT {f.sent}, DEAD {f.dead}")
    if f.consumer.processed != f.points_rows:
        problems.append(
            f"the consumer committed {f.consumer.processed} events but the ledger holds "
            f"{f.points_rows} rows"
        )
    if f.consumer.failed or f.consumer.other:
        problems.append(
            f"the consumer failed on {f.consumer.failed} message(s) and could not use "
            f"{f.consumer.other}"
        )
    if f.consumer.duplicates != f.expected_duplicates:
        problems.append(
            f"{f.consumer.duplicates} duplicates suppressed, {f.expected_duplicates} expected"
        )
    if f.receipts is not None:
        if f.receipts != f.orders:
            problems.append(f"{f.receipts} receipts sent for {f.orders} orders")
        if f.tasks.failed or f.tasks.other:
            problems.append(
                f"the task worker failed on {f.tasks.failed} message(s) and could not use "
                f"{f.tasks.other}"
            )
        if f.tasks.duplicates != f.killed_tasks:
            problems.append(
                f"{f.tasks.duplicates} task duplicates, {f.killed_tasks} expected (the killed "
                "batch's)"
            )
    return problems


# -- child processes ---------------------------------------------------------------------
class Child:
    """A ``manage.py`` command in a child process; output goes to files in ``workdir``."""

    def __init__(
        self, name: str, args: list[str], *, env: dict[str, str], workdir: Path, echo: bool
    ) -> None:
        self.name = name
        self._out = open(workdir / f"{name}.out", "w+b")  # noqa: SIM115 - closed in output()
        self._err: IO[bytes] | None = None
        if not echo:
            self._err = open(workdir / f"{name}.err", "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(MANAGE), *args], env=env, stdout=self._out, stderr=self._err
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int, timeout: float = 30.0) -> int:
        if self.running():
            self.proc.send_signal(signum)
        return self.proc.wait(timeout)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise DemoError(f"{self.name} did not finish within {timeout:g} s") from None

    def output(self) -> tuple[str, str]:
        texts = []
        for stream in (self._out, self._err):
            if stream is None:
                texts.append("")
                continue
            stream.flush()
            stream.seek(0)
            texts.append(stream.read().decode(errors="replace"))
        return texts[0], texts[1]

    def failure(self, what: str) -> DemoError:
        out, err = self.output()
        tail = "\n".join((out + err).strip().splitlines()[-15:])
        return DemoError(f"{what} (pid {self.pid}, exit {self.proc.poll()}):\n{tail}")

    def close(self) -> None:
        if self.running():
            self.proc.kill()
            self.proc.wait()
        for stream in (self._out, self._err):
            if stream is not None:
                stream.close()


def wait_until(predicate: Callable[[], bool], *, child: Child, what: str) -> None:
    """Poll ``predicate`` until true; fail if ``child`` exits first or time runs out."""
    deadline = time.monotonic() + STEP_TIMEOUT
    while not predicate():
        if not child.running():
            raise child.failure(f"{child.name} exited before {what}")
        if time.monotonic() > deadline:
            raise child.failure(f"{child.name}: no {what} within {STEP_TIMEOUT:g} s")
        time.sleep(0.05)


# -- the two brokers ---------------------------------------------------------------------
class Transport(Protocol):
    description: str
    # The relay children's lease: long enough for a batch, short enough that the killed
    # relay's rows come back within the demo (the production default is 60 s). The confirm
    # timeout must stay below it (check django_outbox.E008); a confirm that times out would
    # be retried and delivered once more than the reconciliation expects.
    lease_seconds: float
    confirm_timeout: float
    #: The broker stores the killed batch again when the next relay republishes it (False:
    #: it drops what it has by message id, as JetStream does in its duplicate window).
    stores_republished: bool
    #: The run's task queue on a real broker (None: embedded, or no receipts).
    tasks: TaskQueue | None

    def relay_env(self) -> dict[str, str]: ...

    def waiting(self) -> int: ...

    def crash_consumer(self, *, lose: int, unacked: int) -> tuple[Tally, int]: ...

    def consume(self) -> Tally: ...

    def declare_tasks(self) -> None:
        """Declare the task queue (with receipts), before the relay publishes anything."""

    def run_tasks(self) -> Tally: ...

    def close(self) -> None:
        """Delete what the run declared on the broker (called also when the run fails)."""


#: How the story names OUTBOX_MESSAGE_FORMAT (the environment variable of the same name).
MESSAGE_FORMATS = {
    "native": "native messages",
    "cloudevents": "messages as CloudEvents (binary content mode)",
    "cloudevents-structured": "messages as CloudEvents (structured, application/cloudevents+json)",
}


def receive(dispatcher: Dispatcher, delivery: message.Delivery, tally: Tally) -> Decision:
    """The consumer's own path (every transport's loop runs it too), minus settling with the
    broker: the demo acknowledges, or crashes before it does. Counted in ``tally``."""
    decision = dispatcher.receive(delivery)
    tally.add(decision.outcome, message_format=decision.message_format)
    return decision


def run_once(
    spawn: Callable[..., Child], command: str, args: list[str], env: dict[str, str] | None = None
) -> Tally:
    """``<command> --once --json`` in a child process (consume_outbox, outbox_worker): its
    totals."""
    child = spawn(command, [command, *args, "--once", "--json"], env)
    try:
        if child.wait(STEP_TIMEOUT) != 0:
            raise child.failure(f"{command} failed")
        out, _ = child.output()
        lines = out.strip().splitlines()
        try:
            return Tally.from_totals(json.loads(lines[-1]))
        except (IndexError, ValueError, KeyError) as exc:
            raise DemoError(f"{command} printed no totals ({exc}): {out!r}") from exc
    finally:
        child.close()


def consume_outbox(
    spawn: Callable[..., Child], queue: str, exchange: str, env: dict[str, str] | None = None
) -> Tally:
    """``consume_outbox --once --json`` in a child process, on ``queue``: its totals."""
    args = ["--queue", queue, "--exchange", exchange, "--handler", AWARD]
    return run_once(spawn, "consume_outbox", args, env)


#: The TASKS alias of send_receipt's backend (testproject/config/settings.py).
TASK_BACKEND = "default"


@dataclass(frozen=True)
class TaskQueue:
    """The send_receipt tasks' queue on a real broker, this run's own: ``outbox_worker``
    reads Django task queue ``name`` from the broker queue ``prefix + name`` (the backend's
    ``BROKER_QUEUE_PREFIX``, ``TASKS_BROKER_QUEUE_PREFIX`` in the worker's environment), so
    that no other run's worker takes this run's tasks, nor this one theirs."""

    name: str
    prefix: str

    @property
    def broker_queue(self) -> str:
        return f"{self.prefix}{self.name}"

    def consumer(self, consumer_class: type[Any], **options: Any) -> Any:
        """``outbox_worker``'s own consumer of this queue (``tasks_worker.task_consumer``),
        not connected yet: connected, it declares the queue as the worker child finds it
        (the relay publishes with ``mandatory``: a task with no queue is unroutable)."""
        from django_outbox.tasks_worker import task_consumer

        return task_consumer(
            TASK_BACKEND,
            self.name,
            consumer_class=consumer_class,
            queue=self.broker_queue,
            **options,
        )

    def declare(self, consumer: Any) -> None:
        try:
            consumer.connect()
        except Exception as exc:
            raise DemoError(
                f"Cannot declare the task queue {self.broker_queue} ({type(exc).__name__}: {exc})."
            ) from exc
        finally:
            consumer.close()

    def run_worker(
        self, spawn: Callable[..., Child], exchange: str, env: dict[str, str] | None = None
    ) -> Tally:
        """``outbox_worker --once --json`` in a child process, on this queue: its totals."""
        args = ["--queue", self.name, "--exchange", exchange]
        worker_env = {"TASKS_BROKER_QUEUE_PREFIX": self.prefix, **(env or {})}
        return run_once(spawn, "outbox_worker", args, worker_env)


class EmbeddedTransport:
    """The in-process broker; the consumer is this process."""

    lease_seconds = 3.0
    confirm_timeout = 2.0
    stores_republished = True
    tasks = None  # the broker routes tasks to its own TASKS queue

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.broker = InProcessBroker()
        self.description = "the demo's in-process broker"

    def relay_env(self) -> dict[str, str]:
        return {
            backends.INNER_ENV: "demo.broker.InProcessBrokerBackend",
            **self.broker.client_env(),
        }

    def waiting(self) -> int:
        return len(self.broker)

    def crash_consumer(self, *, lose: int, unacked: int) -> tuple[Tally, int]:
        lost = 0
        for _ in range(lose):
            delivery = self.broker.get()
            if delivery is None:
                break
            self.broker.ack(delivery.tag)  # acknowledged, never handled
            lost += 1
        tally = Tally()
        for _ in range(unacked):
            delivery = self.broker.get()
            if delivery is None:
                break
            receive(self.dispatcher, delivery.received(), tally)  # committed, not acked
        self.broker.recover()  # the connection drops: what was not acked goes back
        return tally, lost

    def consume(self) -> Tally:
        return self._drain(EVENTS, self.dispatcher)

    def declare_tasks(self) -> None:
        """Nothing to declare: the broker routes tasks to :data:`~demo.broker.TASKS`."""

    def run_tasks(self) -> Tally:
        """What ``outbox_worker --once`` does, on the broker's task queue: its handler and
        dispatcher, here (the worker has no transport for the in-process broker)."""
        from django_outbox.tasks_worker import TaskDispatcher, task_handler

        queue = send_receipt.queue_name
        return self._drain(TASKS, TaskDispatcher(handlers=[task_handler("default", [queue])]))

    def _drain(self, queue: str, dispatcher: Dispatcher) -> Tally:
        tally = Tally()
        while (delivery := self.broker.get(queue)) is not None:
            decision = receive(dispatcher, delivery.received(), tally)
            if decision.action is Action.ACKNOWLEDGE:
                self.broker.ack(delivery.tag)
            else:
                self.broker.reject(delivery.tag)
        return tally

    def close(self) -> None:
        self.broker.close()


class RabbitTransport:
    """RabbitMQ, on an exchange and queue of this run; the consumer is ``consume_outbox``."""

    # Room for a slow confirm on a busy machine; the consume_outbox run before the restart
    # takes a few seconds of the lease anyway.
    lease_seconds = 6.0
    confirm_timeout = 5.0
    stores_republished = True

    def __init__(
        self,
        url: str,
        dispatcher: Dispatcher,
        run_id: str,
        spawn: Callable[..., Child],
        tasks: TaskQueue | None = None,
    ) -> None:
        import pika.exceptions

        from django_outbox.consumer import Consumer

        self.url = url
        self.dispatcher = dispatcher
        self.spawn = spawn
        self.tasks = tasks
        self.exchange = f"demo.{run_id}"
        self.queue = f"demo.{run_id}.points"
        queues = (
            f"queues {self.queue} and {tasks.broker_queue}, each with its .dlq"
            if tasks
            else f"queue {self.queue} and its .dlq"
        )
        self.description = (
            f"RabbitMQ at {mask_url(url)} (exchange {self.exchange}, {queues}; deleted at the end)"
        )
        # Declared before anything is published, by the consumer's own code, so that the
        # relay's first messages are routed (the relay publishes with mandatory=True).
        self._consumer = Consumer(
            handlers=[AWARD], url=url, queue=self.queue, exchange=self.exchange
        )
        self._declared = False
        try:
            self._consumer.connect()
        except pika.exceptions.AMQPError as exc:
            raise DemoError(
                f"Cannot reach RabbitMQ at {mask_url(url)} ({type(exc).__name__}: {exc}). "
                "Check AMQP_URL, or unset it to run on the in-process broker."
            ) from exc
        self._declared = True
        self._consumer.close()

    @contextmanager
    def _channel(self) -> Iterator[Any]:
        import pika

        # AMQP_URL may name several nodes ("amqp://...@a/vh;amqp://...@b/vh"): pika tries
        # each in turn until one answers.
        nodes = [pika.URLParameters(url) for url in broker_urls(self.url)]
        connection = pika.BlockingConnection(nodes)
        try:
            yield connection.channel()
        finally:
            if connection.is_open:
                connection.close()

    def relay_env(self) -> dict[str, str]:
        return {
            backends.INNER_ENV: "django_outbox.backends.pika.PikaBackend",
            backends.EXCHANGE_ENV: self.exchange,
        }

    def waiting(self) -> int:
        with self._channel() as channel:
            return int(channel.queue_declare(self.queue, passive=True).method.message_count)

    def crash_consumer(self, *, lose: int, unacked: int) -> tuple[Tally, int]:
        lost = 0
        tally = Tally()
        with self._channel() as channel:
            for _ in range(lose):
                method, _props, _body = channel.basic_get(self.queue, auto_ack=False)
                if method is None:
                    break
                channel.basic_ack(method.delivery_tag)  # acknowledged, never handled
                lost += 1
            for _ in range(unacked):
                method, props, body = channel.basic_get(self.queue, auto_ack=False)
                if method is None:
                    break
                delivery = message.Delivery(
                    body,
                    message_id=props.message_id,
                    message_type=props.type,
                    headers=dict(props.headers or {}),
                    content_type=props.content_type,
                    redelivered=method.redelivered,
                    transport="amqp",
                )
                receive(self.dispatcher, delivery, tally)  # committed, not acked
        # The connection is closed with those messages unacknowledged: RabbitMQ requeues them.
        return tally, lost

    def consume(self) -> Tally:
        return consume_outbox(self.spawn, self.queue, self.exchange)

    def declare_tasks(self) -> None:
        if self.tasks is not None:
            from django_outbox.consumer import Consumer

            self.tasks.declare(self.tasks.consumer(Consumer, url=self.url, exchange=self.exchange))

    def run_tasks(self) -> Tally:
        assert self.tasks is not None
        return self.tasks.run_worker(self.spawn, self.exchange)

    def close(self) -> None:
        import pika.exceptions

        if not self._declared:
            return
        queues = [self.queue]
        if self.tasks is not None:
            queues.append(self.tasks.broker_queue)
        queues += [f"{queue}.dlq" for queue in queues]
        try:
            with self._channel() as channel:
                for queue in queues:
                    channel.queue_delete(queue)  # one never declared: deleted all the same
                channel.exchange_delete(self.exchange)
        except pika.exceptions.AMQPError:
            logger.warning(
                "could not delete the demo's exchange %s and queues %s; delete them by hand",
                self.exchange,
                ", ".join(queues),
                exc_info=True,
            )


class NatsTransport:
    """NATS JetStream, on a stream and durable consumer of this run; the consumer is
    ``consume_outbox``."""

    lease_seconds = 6.0
    confirm_timeout = 5.0
    # JetStream drops a message whose Nats-Msg-Id it stored within the duplicate window.
    stores_republished = False
    # The durable consumer's ack wait here (30 s in production): JetStream delivers what a
    # crashed consumer held again once it has passed, not when the connection drops.
    ack_wait = 2.0

    def __init__(
        self,
        url: str,
        dispatcher: Dispatcher,
        run_id: str,
        spawn: Callable[..., Child],
        tasks: TaskQueue | None = None,
    ) -> None:
        import nats
        from nats.js.api import StreamConfig

        from django_outbox._compat.nats import LoopThread
        from django_outbox.consumer.nats import Consumer

        self.url = url
        self.dispatcher = dispatcher
        self.spawn = spawn
        self.tasks = tasks
        self.stream = f"DEMO_{run_id}"
        self.exchange = f"demo-{run_id}"
        # Outside the stream's subjects: its dead-letter subject must be (the task
        # queue's too).
        self.queue = f"demo.{run_id}.points"
        consumers = (
            f"durable consumers for {self.queue} and {tasks.broker_queue}, dead letters "
            "to their .dlq"
            if tasks
            else f"durable consumer for {self.queue}, dead letters {self.queue}.dlq"
        )
        self.description = (
            f"NATS JetStream at {mask_url(url)} (stream {self.stream}, {consumers}; deleted "
            "at the end)"
        )
        self._task_consumer: Any = None
        if tasks is not None:
            # Not connected yet (declare_tasks() does): what close() deletes, named.
            self._task_consumer = tasks.consumer(
                Consumer, url=url, exchange=self.exchange, stream=self.stream
            )
        self._loop = LoopThread("demo-nats")
        try:
            self._client = self._loop.run(nats.connect(broker_urls(url)), 15)
            self._js = self._client.jetstream()
            self._loop.run(
                self._js.add_stream(
                    StreamConfig(
                        name=self.stream, subjects=[f"{self.exchange}.>"], duplicate_window=120
                    )
                ),
                15,
            )
        except Exception as exc:
            self._loop.stop()
            raise DemoError(
                f"Cannot use NATS JetStream at {mask_url(url)} ({type(exc).__name__}: {exc}). "
                "Check BROKER_URL and that the server runs with -js, or unset it to run on "
                "the in-process broker."
            ) from exc
        # Declared before anything is published, by the consumer's own code.
        self._consumer = Consumer(
            handlers=[AWARD],
            url=url,
            queue=self.queue,
            exchange=self.exchange,
            stream=self.stream,
            ack_wait=self.ack_wait,
        )
        self._consumer.connect()
        self._consumer.close()

    def relay_env(self) -> dict[str, str]:
        return {
            backends.INNER_ENV: "django_outbox.backends.nats.NatsBackend",
            backends.EXCHANGE_ENV: self.exchange,
            "OUTBOX_NATS_STREAM": self.stream,
        }

    def waiting(self) -> int:
        info = self._loop.run(self._js.consumer_info(self.stream, self._consumer.durable), 15)
        return int(info.num_pending) + int(info.num_ack_pending)

    def crash_consumer(self, *, lose: int, unacked: int) -> tuple[Tally, int]:
        import nats.errors

        lost = 0
        tally = Tally()
        if not lose + unacked:
            return tally, lost

        async def fetch() -> list[Any]:
            sub = await self._js.pull_subscribe_bind(self._consumer.durable, stream=self.stream)
            try:
                return list(await sub.fetch(lose + unacked, timeout=5))
            except nats.errors.TimeoutError:
                return []

        held = self._loop.run(fetch(), 30)
        for msg in held[:lose]:
            self._loop.run(msg.ack_sync(), 15)  # acknowledged, never handled
            lost += 1
        for msg in held[lose:]:
            receive(self.dispatcher, self._consumer.delivery(msg), tally)  # committed, not acked
        # The consumer is gone with those messages unacknowledged: JetStream delivers them
        # again once the ack wait has passed.
        time.sleep(self.ack_wait + 0.5)
        return tally, lost

    def consume(self) -> Tally:
        stream = {"OUTBOX_NATS_STREAM": self.stream}
        return consume_outbox(self.spawn, self.queue, self.exchange, stream)

    def declare_tasks(self) -> None:
        if self.tasks is not None:
            self.tasks.declare(self._task_consumer)

    def run_tasks(self) -> Tally:
        assert self.tasks is not None
        return self.tasks.run_worker(self.spawn, self.exchange, {"OUTBOX_NATS_STREAM": self.stream})

    def close(self) -> None:
        # The durable consumers go with the run's stream; their dead letters have their own.
        streams = [self.stream, self._consumer.dead_letter_stream]
        if self._task_consumer is not None:
            streams.append(self._task_consumer.dead_letter_stream)
        for stream in streams:
            try:
                self._loop.run(self._js.delete_stream(stream), 15)
            except Exception:
                if stream == self.stream:
                    logger.warning(
                        "could not delete the demo's stream %s; delete it by hand", stream
                    )
        with suppress(Exception):
            self._loop.run(self._client.close(), 15)
        self._loop.stop()


class RedisTransport:
    """Redis Streams, on streams and a consumer group of this run; the consumer is
    ``consume_outbox``."""

    lease_seconds = 6.0
    confirm_timeout = 5.0
    # Redis keeps no message id: the killed batch is added again.
    stores_republished = True
    # OUTBOX_REDIS_VISIBILITY_TIMEOUT here (60 s in production): what a crashed consumer
    # held is claimed by the next one once it has been idle this long.
    visibility_timeout = 2.0

    def __init__(
        self,
        url: str,
        dispatcher: Dispatcher,
        run_id: str,
        spawn: Callable[..., Child],
        tasks: TaskQueue | None = None,
    ) -> None:
        from django_outbox.consumer.redis import Consumer

        self.url = url
        self.dispatcher = dispatcher
        self.spawn = spawn
        self.tasks = tasks
        self.exchange = f"demo-{run_id}"
        self.queue = f"demo.{run_id}.points"
        # The group is created by the consumer's own code before anything is published.
        self._consumer = Consumer(
            handlers=[AWARD],
            url=url,
            queue=self.queue,
            exchange=self.exchange,
            visibility_timeout=self.visibility_timeout,
        )
        self._task_consumer: Any = None
        if tasks is None:
            where = (
                f"stream {', '.join(self._consumer.streams)}, consumer group {self.queue}, "
                f"dead letters {self.queue}.dlq"
            )
        else:
            # Not connected yet (declare_tasks() does): what close() deletes, named.
            self._task_consumer = tasks.consumer(Consumer, url=url, exchange=self.exchange)
            where = (
                f"streams {', '.join(self._consumer.streams + self._task_consumer.streams)}, "
                f"consumer groups {self.queue} and {tasks.broker_queue}, dead letters to "
                "their .dlq"
            )
        self.description = f"Redis Streams at {mask_url(url)} ({where}; deleted at the end)"
        try:
            self._consumer.connect()
        except Exception as exc:
            raise DemoError(
                f"Cannot use Redis at {mask_url(url)} ({type(exc).__name__}: {exc}). Check "
                "BROKER_URL, or unset it to run on the in-process broker."
            ) from exc
        self._client = self._consumer._connected()

    def relay_env(self) -> dict[str, str]:
        return {
            backends.INNER_ENV: "django_outbox.backends.redis.RedisBackend",
            backends.EXCHANGE_ENV: self.exchange,
        }

    def waiting(self) -> int:
        waiting = 0
        for stream in self._consumer.streams:
            for group in self._client.xinfo_groups(stream):
                if _text(group["name"]) == self.queue:
                    waiting += int(group["pending"]) + int(group.get("lag") or 0)
        return waiting

    def crash_consumer(self, *, lose: int, unacked: int) -> tuple[Tally, int]:
        lost = 0
        tally = Tally()
        if not lose + unacked:
            return tally, lost
        self._consumer.prefetch = lose + unacked
        held = self._consumer._read()
        for entry in held[:lose]:
            self._client.xack(entry.stream, self.queue, entry.id)  # acknowledged, never handled
            lost += 1
        for entry in held[lose:]:
            receive(self.dispatcher, self._consumer.delivery(entry), tally)  # committed, not acked
        # The consumer is gone with those entries pending: the next one claims them once
        # they have been idle for the visibility timeout.
        time.sleep(self.visibility_timeout + 0.5)
        return tally, lost

    def consume(self) -> Tally:
        env = {"OUTBOX_REDIS_VISIBILITY_TIMEOUT": str(self.visibility_timeout)}
        return consume_outbox(self.spawn, self.queue, self.exchange, env)

    def declare_tasks(self) -> None:
        if self.tasks is not None:
            self.tasks.declare(self._task_consumer)

    def run_tasks(self) -> Tally:
        assert self.tasks is not None
        return self.tasks.run_worker(self.spawn, self.exchange)

    def close(self) -> None:
        keys = [*self._consumer.streams, self._consumer.dead_letter_queue]
        if self._task_consumer is not None:
            keys += [*self._task_consumer.streams, self._task_consumer.dead_letter_queue]
        try:
            self._client.delete(*keys)
        except Exception:
            logger.warning("could not delete the demo's streams %s; delete them by hand", keys)
        self._consumer.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- the story ---------------------------------------------------------------------------
class PaymentDeclined(Exception):
    """Raised after create_order() returned, to roll the whole transaction back."""


@dataclass
class Demo:
    orders: int = 100
    duplicates: int = 5
    inject_loss: int = 0
    seed: int = 1
    verbosity: int = 1
    amqp_url: str = ""
    workdir: Path = field(default_factory=Path)
    write: Callable[[str], None] = print
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    #: Each order enqueues a send_receipt task too (step 7; not on Django 5.2 without the
    #: Tasks backport). Set by :meth:`run`.
    receipts: bool = False

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.run_id}-"

    @property
    def rows(self) -> int:
        """The outbox rows the orders write: an event each, and a task each with receipts."""
        return self.orders * (2 if self.receipts else 1)

    @property
    def batch_size(self) -> int:
        return max(1, min(500, -(-self.rows // 10)))

    @property
    def kill_batch(self) -> int:
        batches = -(-self.rows // self.batch_size)
        return -(-batches // 2)

    # -- output ----------------------------------------------------------------------------
    def say(self, text: str, *, step: str = "", indent: str = "   ") -> None:
        """A paragraph; a numbered step starts with a blank line."""
        if step:
            self.write("")
        head = f"{step}. " if step else indent
        self.write(textwrap.fill(text, WIDTH, initial_indent=head, subsequent_indent=indent))

    def outbox_line(self) -> str:
        c = self.status_counts()
        return f"Outbox: PENDING {c[Status.PENDING]}, SENT {c[Status.SENT]}, DEAD {c[Status.DEAD]}."

    # -- this run's rows -------------------------------------------------------------------
    def run_events(self) -> Any:
        return OutboxEvent.objects.filter(
            aggregate_type="ORDER", aggregate_id__startswith=self.prefix
        )

    def status_counts(self) -> dict[int, int]:
        counts = self.run_events().status_counts()
        return {s: counts.get(s, 0) for s in (Status.PENDING, Status.SENT, Status.DEAD)}

    # -- children --------------------------------------------------------------------------
    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> Child:
        env = dict(os.environ)
        env.update(PYTHONUNBUFFERED="1", **(extra_env or {}))
        # The relay and consumers run as deployed (publish_outbox warns about DEBUG).
        env.setdefault("DEBUG", "False")
        echo = self.verbosity >= 2
        args = [*args, "--verbosity", "2" if echo else "0"]
        return Child(name, args, env=env, workdir=self.workdir, echo=echo)

    def start_relay(self, name: str, transport: Transport, *, pause_after: int = 0) -> Child:
        env = {
            "OUTBOX_BACKEND": "demo.backends.DemoRelayBackend",
            "OUTBOX_LEASE_SECONDS": str(transport.lease_seconds),
            "OUTBOX_CONFIRM_TIMEOUT": str(transport.confirm_timeout),
            backends.PAUSE_AFTER_ENV: str(pause_after),
            backends.PAUSE_FILE_ENV: str(self.workdir / f"{name}.paused"),
            **transport.relay_env(),
        }
        args = ["publish_outbox", "--batch-size", str(self.batch_size), "--interval", "200ms"]
        return self.spawn(name, args, env)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> list[str]:
        """Tell the story; return the reconciliation's problems (empty: success)."""
        started = time.monotonic()
        try:
            migrated = migrate_if_needed()
        except OperationalError as exc:
            raise DemoError(
                f"Cannot use the database, {describe_database()}: {exc}. Check DATABASE_URL "
                "and that the database exists (e.g. createdb demo)."
            ) from exc
        self.clear_earlier_runs()
        dispatcher = Dispatcher(handlers=[AWARD])
        # Django 5.2 without the Tasks backport: the story without its receipts.
        self.receipts = send_receipt is not None
        tasks = (
            TaskQueue(send_receipt.queue_name, f"demo.{self.run_id}.tasks.")
            if self.receipts
            else None
        )
        transport: Transport
        url = self.amqp_url
        if url.lower().startswith(("nats://", "tls://")):
            transport = NatsTransport(url, dispatcher, self.run_id, self.spawn, tasks)
        elif url.lower().startswith(("redis://", "rediss://")):
            transport = RedisTransport(url, dispatcher, self.run_id, self.spawn, tasks)
        elif url:
            transport = RabbitTransport(url, dispatcher, self.run_id, self.spawn, tasks)
        else:
            transport = EmbeddedTransport(dispatcher)
        self.say(
            f"The transactional outbox, end to end: {self.orders} orders, "
            f"{describe_database()}, {transport.description}, "
            f"{MESSAGE_FORMATS.get(outbox_settings.MESSAGE_FORMAT, 'messages')}."
            + (f" The database was migrated first ({migrated} migrations)." if migrated else ""),
            indent="",
        )
        try:
            transport.declare_tasks()
            figures = self.story(transport)
        finally:
            transport.close()
        problems = reconcile(figures)
        self.report(figures, problems, time.monotonic() - started)
        return problems

    def story(self, transport: Transport) -> Figures:
        self.create_orders()
        killed = self.kill_relay(transport)
        crashed = self.crash_consumer(transport)
        first = self.consume(transport, step="4")
        self.restart_relay(transport, killed)
        second = self.consume(transport, step="6")
        tasks = self.run_tasks(transport) if self.receipts else None
        # The duplicates the points consumer sees: the killed batch's events; the task
        # worker, the rest of it: its tasks.
        killed_events = self.run_events().filter(event_id__in=killed).count()
        again = transport.stores_republished
        return self.figures(
            crashed + first + second,
            lost_acks=crashed.processed,
            killed_batch=killed_events if again else 0,
            tasks=tasks,
            killed_tasks=len(killed) - killed_events if again else 0,
        )

    def order(self, *, number: str, user_id: int, amount: Decimal) -> None:
        """create_order(), and with receipts its send_receipt task, in one transaction."""
        with transaction.atomic():
            create_order(user_id=user_id, amount=amount, number=number)
            if self.receipts:
                send_receipt.enqueue(number)

    def create_orders(self) -> None:
        rng = random.Random(self.seed)
        for i in range(1, self.orders + 1):
            self.order(
                user_id=rng.randint(1, 50),
                amount=Decimal(rng.randint(500, 25000)) / 100,
                number=f"{self.prefix}{i:05d}",
            )
        declined = f"{self.prefix}declined"
        try:
            with transaction.atomic():
                self.order(user_id=1, amount=Decimal("10.00"), number=declined)
                raise PaymentDeclined
        except PaymentDeclined:
            pass
        announced = OutboxEvent.objects.filter(aggregate_id=declined).exists()
        task = " and its send_receipt task" if self.receipts else ""
        self.say(
            f"Orders. create_order() saved {self.orders} orders, each with its ORDER_CREATED "
            + (
                "event and a send_receipt Django task (enqueued on the outbox) "
                if self.receipts
                else "event "
            )
            + "in the same database transaction; nothing is sent yet. One more order "
            "failed after create_order() returned (payment declined) and its transaction "
            "rolled back: "
            + (
                "its event row is STILL THERE."
                if announced
                else f"its event{task} went with it, so it is never announced."
            ),
            step="1",
        )
        if send_receipt is None:
            self.say(
                "(No send_receipt task: Django's Tasks API needs Django 6.0+, or on 5.2 "
                "pip install 'django-transactional-outbox[tasks]'.)"
            )
        self.say(self.outbox_line())

    def kill_relay(self, transport: Transport) -> list[str]:
        relay = self.start_relay("publish_outbox-1", transport, pause_after=self.kill_batch)
        paused = self.workdir / "publish_outbox-1.paused"
        try:
            wait_until(paused.exists, child=relay, what=f"batch {self.kill_batch} confirmed")
            report = json.loads(paused.read_text())
            relay.signal(signal.SIGKILL)
        finally:
            relay.close()
        confirmed: list[str] = report["confirmed"]
        leased = self.run_events().pending().exclude(lease_token="").count()
        self.say(
            f"Relay. publish_outbox (pid {relay.pid}) claims batches of "
            f"{n(self.batch_size, 'row')}, publishes them and marks them SENT only after the "
            "broker confirmed them. "
            f"Right after the broker confirmed batch {report['batch']} "
            f"({n(len(confirmed), 'message')}) the relay was killed with SIGKILL, before it "
            "could mark those rows SENT.",
            step="2",
        )
        self.say(
            f"{self.outbox_line()} {leased} of the PENDING rows stay leased by the dead relay "
            f"for {transport.lease_seconds:g} s. "
            f"Broker: {n(transport.waiting(), 'message')} waiting."
        )
        return confirmed

    def crash_consumer(self, transport: Transport) -> Tally:
        waiting = transport.waiting()
        lose = min(self.inject_loss, waiting)
        unacked = min(self.duplicates, waiting - lose)
        tally, lost = transport.crash_consumer(lose=lose, unacked=unacked)
        self.say(
            f"Consumer crash. A points consumer took {n(tally.handled, 'message')}, "
            "committed their points and lost its connection before acknowledging them: the "
            "broker keeps them and delivers them again.",
            step="3",
        )
        if lost:
            self.say(
                f"FAULT INJECTED (--inject-loss): {n(lost, 'more message')} "
                f"{'was' if lost == 1 else 'were'} acknowledged without being handled, as "
                "by a consumer that acknowledges before it commits and then crashes. The "
                "broker forgets them; only a reconciliation notices."
            )
        return tally

    def consume(self, transport: Transport, *, step: str) -> Tally:
        tally = transport.consume()
        who = (
            "The points consumer"
            if isinstance(transport, EmbeddedTransport)
            else "consume_outbox (a child process)"
        )
        counts = f"{tally.processed} processed, {n(tally.duplicates, 'duplicate')}" + (
            f", {tally.failed} failed" if tally.failed else ""
        )
        why = (
            "A duplicate hits the ledger's unique source_event_id: its transaction rolls "
            "back, no points are written twice, and the message is acknowledged."
            if step == "4"
            else "The duplicates are the killed batch, suppressed the same way."
            if transport.stores_republished
            else "None is the killed batch: JetStream had stored it already and dropped the "
            "relay's second copy by its Nats-Msg-Id (the event_id)."
        )
        self.say(
            f"Consumer. {who} read {n(tally.handled, 'message')}: {counts}. {why}",
            step=step,
        )
        return tally

    def restart_relay(self, transport: Transport, killed: list[str]) -> None:
        relay = self.start_relay("publish_outbox-2", transport)
        try:
            # Every row: the tasks too (clear_earlier_runs() saw no one else's PENDING).
            wait_until(
                lambda: not OutboxEvent.objects.pending().exists(),
                child=relay,
                what="every event SENT",
            )
            code = relay.signal(signal.SIGTERM)
            out, _ = relay.output()
        finally:
            relay.close()
        if code != 0:
            raise relay.failure("publish_outbox did not stop cleanly on SIGTERM")
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        self.say(
            f"Relay restarted. publish_outbox (pid {relay.pid}) sent the rows never sent "
            f"and, once the dead relay's lease ran out, the {n(len(killed), 'message')} of the "
            "killed batch again: the broker had them already, the outbox did not know. "
            f"Stopped with SIGTERM, exit {code} ({summary.partition(': ')[2] or 'no summary'}).",
            step="5",
        )
        self.say(self.outbox_line())

    def run_tasks(self, transport: Transport) -> Tally:
        tally = transport.run_tasks()
        who = (
            "The send_receipt tasks came in"
            if transport.tasks is None
            else "outbox_worker --once (a child process) read the send_receipt tasks from "
            f"their own queue, {transport.tasks.broker_queue}, in"
        )
        failed = f", {tally.failed} failed" if tally.failed else ""
        if tally.duplicates:
            again = (
                f"{n(tally.duplicates, 'duplicate')} (the killed batch's) found their task "
                "done and were acknowledged without running it again."
            )
        elif not transport.stores_republished:
            again = "none came twice: JetStream had dropped the killed batch's second copy."
        else:
            again = "none came twice."
        self.say(
            f"Task worker. {who} {n(tally.handled, 'message')}: {tally.processed} ran"
            f"{failed}, each writing its receipt in the transaction that records its "
            f"result; {again}",
            step="7",
        )
        return tally

    # -- the end ---------------------------------------------------------------------------
    def figures(
        self,
        consumer: Tally,
        *,
        lost_acks: int,
        killed_batch: int,
        tasks: Tally | None = None,
        killed_tasks: int = 0,
    ) -> Figures:
        counts = self.status_counts()
        orders = Order.objects.filter(number__startswith=self.prefix)
        ledger = PointsLedger.objects.filter(order_number__startswith=self.prefix)
        points_rows = ledger.count()
        return Figures(
            orders=orders.count(),
            events=self.run_events().count(),
            sent=counts[Status.SENT],
            pending=counts[Status.PENDING],
            dead=counts[Status.DEAD],
            points_rows=points_rows,
            lost=orders.exclude(number__in=ledger.values("order_number")).count(),
            extra_points=points_rows - ledger.values("order_number").distinct().count(),
            consumer=consumer,
            lost_acks=lost_acks,
            killed_batch=killed_batch,
            receipts=(
                None
                if tasks is None
                else Receipt.objects.filter(order_number__startswith=self.prefix).count()
            ),
            tasks=tasks or Tally(),
            killed_tasks=killed_tasks,
        )

    def report(self, f: Figures, problems: list[str], elapsed: float) -> None:
        rows = [
            ("orders created", str(f.orders), ""),
            ("events SENT", str(f.sent), ""),
            ("points rows", str(f.points_rows), ""),
            ("messages handled", str(f.consumer.handled), ""),
            (
                "duplicates suppressed",
                str(f.consumer.duplicates),
                f"expected {f.expected_duplicates}: {f.lost_acks} lost acks + "
                f"{f.killed_batch} of the killed batch",
            ),
            ("lost", str(f.lost), "orders without points"),
            (
                "message formats",
                " / ".join(f"{k}={v}" for k, v in sorted(f.consumer.formats.items())) or "-",
                "as the consumer read them",
            ),
            ("PENDING / SENT / DEAD", f"{f.pending} / {f.sent} / {f.dead}", ""),
        ]
        if f.receipts is not None:
            rows.append(
                (
                    "receipts sent",
                    str(f.receipts),
                    f"expected {f.orders}; {f.tasks.handled} task messages, "
                    f"{f.tasks.duplicates} duplicates",
                )
            )
        self.write("")
        self.write("Reconciliation")
        for label, value, note in rows:
            self.write(f"  {label:<22}{value:>12}" + (f"   ({note})" if note else ""))
        self.write("")
        if problems:
            self.say("FAILED: " + "; ".join(problems) + ".", indent="")
            return
        self.say(
            "OK: every order got its points exactly once, although a relay died mid-way and "
            f"{n(f.consumer.duplicates, 'message')} arrived twice"
            + ("; its receipt was sent once" if f.receipts is not None else "")
            + f". ({elapsed:.1f} s)",
            indent="",
        )

    def clear_earlier_runs(self) -> None:
        """Remove what earlier demo runs wrote; refuse to run beside foreign PENDING rows."""
        Order.objects.filter(number__startswith=PREFIX).delete()
        PointsLedger.objects.filter(order_number__startswith=PREFIX).delete()
        Receipt.objects.filter(order_number__startswith=PREFIX).delete()
        if send_receipt is not None:
            from django_outbox.tasks_backend import task_event_type

            OutboxTaskResult.objects.filter(task_path=send_receipt.module_path).delete()
            OutboxEvent.objects.filter(
                event_type=task_event_type(send_receipt.queue_name),
                payload__task=send_receipt.module_path,
            ).delete()
        OutboxEvent.objects.filter(aggregate_type="ORDER", aggregate_id__startswith=PREFIX).delete()
        foreign = OutboxEvent.objects.pending().count()
        if foreign:
            raise DemoError(
                f"The outbox already holds {foreign} PENDING events that are not the demo's; "
                "the demo's relay would send them too and its counts would not add up. Relay "
                "them first (manage.py publish_outbox --once) or set DATABASE_URL to another "
                "database."
            )


def n(count: int, noun: str) -> str:
    """``n(1, "message")`` is "1 message", ``n(2, "message")`` "2 messages"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def migrate_if_needed(using: str = DEFAULT_DB_ALIAS) -> int:
    """Apply unapplied migrations (a fresh clone's first command just works); how many."""
    executor = MigrationExecutor(connections[using])
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    if plan:
        call_command("migrate", database=using, interactive=False, verbosity=0)
    return len(plan)


def describe_database(using: str = DEFAULT_DB_ALIAS) -> str:
    conf = connections[using].settings_dict
    vendor = connections[using].vendor
    if vendor == "sqlite":
        name = Path(str(conf["NAME"]))
        with suppress(ValueError):
            name = name.relative_to(Path.cwd())
        return f"SQLite ({name})"
    label = {"postgresql": "PostgreSQL", "mysql": "MySQL/MariaDB"}.get(vendor, vendor)
    return f"{label} (database {conf['NAME']} on {conf.get('HOST') or 'localhost'})"
