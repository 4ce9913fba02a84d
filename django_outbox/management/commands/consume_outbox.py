"""manage.py consume_outbox: run the IdempotentHandlers over a RabbitMQ queue.

Consume outbox events from RabbitMQ and run the IdempotentHandlers, acknowledging each
message only after its handler's transaction committed. Runs until SIGTERM/SIGINT (the
message in hand is finished; a second signal exits 1).

Exit codes: 0 stopped by a signal, or ``--once``/``--max-messages`` done; 1 a second
signal; 2 misconfigured, the handlers' database unreachable or unmigrated at start, or
(``--once``) no broker node could be connected to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.management.base import CommandError, CommandParser

from ...consumer import (
    IdempotentHandler,
    ImproperlyConfiguredConsumer,
    ImproperlyConfiguredHandler,
    get_handlers,
)
from ...transports import UnknownTransport, consumer_class
from ...worker import configure_logging
from ..options import non_negative_duration, non_negative_int, positive_int
from ..serving import ConsumerCommand

if TYPE_CHECKING:
    from django.db.models import Model


class Command(ConsumerCommand):
    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue",
            default=None,
            help="Queue to declare and read (default OUTBOX_CONSUMER_QUEUE).",
        )
        parser.add_argument(
            "--handler",
            action="append",
            dest="handlers",
            default=None,
            metavar="DOTTED.PATH",
            help="Run this handler (repeatable); default OUTBOX_CONSUMER_HANDLERS or the "
            "IdempotentHandler subclasses in each installed app's handlers module.",
        )
        parser.add_argument(
            "--max-retries",
            type=non_negative_int,
            default=None,
            help="Retries of a failing message before the dead-letter queue "
            "(default OUTBOX_CONSUMER_MAX_RETRIES).",
        )
        parser.add_argument(
            "--retry-delay",
            type=non_negative_duration,
            default=1.0,
            help="Pause before a failed message is delivered again, doubled for each delivery "
            "after that, at most 30s (default 1s; 0 for none).",
        )
        parser.add_argument(
            "--max-messages",
            type=positive_int,
            default=None,
            help="Exit after this many messages (tests, one-off catch-up).",
        )
        parser.add_argument(
            "--list", action="store_true", help="List the handlers and their bindings, then exit."
        )
        self.add_broker_arguments(
            parser,
            prefetch="Unacknowledged messages held at once (default OUTBOX_CONSUMER_PREFETCH).",
            once="Exit as soon as the queue has been empty for a second.",
        )

    needs_outbox_table = False  # the handlers write inbox or business rows

    def _handlers(self, options: dict[str, Any]) -> list[type[IdempotentHandler]]:
        """The handlers this run takes; none for --list or when they cannot be loaded
        (handle() says what is wrong with them, exit 2)."""
        if options.get("list"):
            return []
        try:
            return get_handlers(options.get("handlers"))
        except ImproperlyConfiguredHandler:
            return []

    def databases_needed(self, options: dict[str, Any]) -> list[str]:
        """Where the handlers write (their de-duplication model's database). Once running,
        the consumer holds the message in hand through an outage."""
        return sorted({cls().database() for cls in self._handlers(options)})

    def tables_needed(self, options: dict[str, Any]) -> dict[str, dict[type[Model], str]]:
        """Each handler's de-duplication tables (its model or the inbox, the aggregates'
        sequences): a message taken while one is missing could only fail."""
        needed: dict[str, dict[type[Model], str]] = {}
        for cls in self._handlers(options):
            tables = needed.setdefault(cls().database(), {})
            for model in cls.models():
                tables.setdefault(model, f"handler {cls.handler_name()}")
        return needed

    def handle(
        self,
        *,
        queue: str | None,
        exchange: str | None,
        prefetch: int | None,
        handlers: list[str] | None,
        max_retries: int | None,
        queue_type: str | None,
        retry_delay: float,
        max_messages: int | None,
        once: bool,
        list: bool,
        json: bool,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        if list:
            self._list(handlers)
            return
        try:
            consumer = transport_consumer()(
                handlers=handlers,
                queue=queue,
                exchange=exchange,
                prefetch=prefetch,
                max_retries=max_retries,
                queue_type=queue_type,
                retry_delay=retry_delay,
            )
        except (ImproperlyConfiguredHandler, ImproperlyConfiguredConsumer) as exc:
            raise CommandError(str(exc), returncode=2) from exc
        if verbosity >= 1:
            self.stderr.write(f"consume_outbox: {consumer.queue} on {consumer.nodes}")
        self.serve(
            lambda stop: consumer.serve(stop=stop, max_messages=max_messages, until_idle=once),
            json=json,
        )

    def _list(self, handlers: list[str] | None) -> None:
        try:
            classes = get_handlers(handlers)
        except ImproperlyConfiguredHandler as exc:
            raise CommandError(str(exc), returncode=2) from exc
        if not classes:
            self.stdout.write("No handlers: set OUTBOX_CONSUMER_HANDLERS or add handlers.py")
        for cls in classes:
            self.stdout.write(cls.describe())


def transport_consumer() -> Any:
    """The consumer class of OUTBOX_BROKER_URL's transport; a URL that names none (or
    several) is a configuration error (exit 2)."""
    try:
        return consumer_class()
    except (UnknownTransport, ImportError) as exc:
        raise ImproperlyConfiguredConsumer(f"OUTBOX_BROKER_URL: {exc}") from exc
