"""Write events in the caller's transaction: ``atomic()`` and ``emit()``.

Nothing here talks to a broker or depends on an ``on_commit`` hook: events become rows of
the outbox table inside the same transaction as the business write, and the relay
(``publish_outbox``) moves committed rows to RabbitMQ. (On PostgreSQL one hook wakes the
relays after the commit, see ``notify.py``; without it they find the rows at their
next poll.) If the transaction rolls back, the
events roll back with it; if it commits, the events are there for the relay, whatever
happens to this process afterwards.

    with outbox.atomic() as box:
        order = Order.objects.create(...)
        box.emit("ORDER_CREATED", aggregate=order, payload={"order_id": order.pk})
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, NamedTuple

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, models, router, transaction
from django.utils import timezone

from . import tracing
from ._compat.django import PREPARED, has_commit_hook, innermost_atomic, insert_rows
from .conf import outbox_settings
from .exceptions import DuplicateEventId, InvalidEvent, NotInTransaction, PayloadTooLarge
from .message import PRIORITY_HEADER, is_reserved_header
from .models import OutboxEvent, outbox_db
from .notify import request_wake

__all__ = ["MAX_JSON_DEPTH", "Outbox", "atomic", "emit"]

#: The deepest JSON ``emit()`` accepts in the payload and in the headers, counting objects
#: and arrays (``{"a": [1]}`` is 2 deep). MariaDB refuses a JSON document nested 32 deep
#: (its JSON columns are ``CHECK (JSON_VALID(...))``), so 31 is what every supported
#: database stores: an event valid on one database is valid on all.
MAX_JSON_DEPTH = 31
#: AMQP short strings (the message type, routing key, message_id and header names) hold
#: at most 255 bytes of UTF-8.
SHORT_STRING_BYTES = 255
#: The longest ``delay`` emit() accepts: a hundred years, far below what any database's
#: date arithmetic overflows at.
MAX_DELAY = timedelta(days=36524)
_CONTAINERS = (dict, list, tuple)  # what json.dumps writes as an object or an array
# "\u0000" in JSON text is an escaped NUL unless its backslash is itself escaped: it must
# follow an even run of backslashes (none, or pairs that each stand for one backslash).
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

_local = threading.local()


def _stack(using: str) -> list[Outbox]:
    stacks: dict[str, list[Outbox]] = _local.__dict__.setdefault("stacks", {})
    return stacks.setdefault(using, [])


def _surrogate(what: str, exc: UnicodeEncodeError) -> InvalidEvent:
    near = exc.object[max(0, exc.start - 30) : exc.end + 30]
    return InvalidEvent(
        f"{what} contains a lone surrogate ({exc.object[exc.start : exc.end]!r}), which is "
        f"not Unicode and cannot be encoded as UTF-8, near {near!r}. It usually comes from "
        "bytes decoded with errors='surrogateescape' (file names, environment variables): "
        "decode them with the right encoding, or with errors='replace'."
    )


def _nul(what: str) -> InvalidEvent:
    return InvalidEvent(
        f"{what} contains a NUL character (\\x00), which PostgreSQL cannot store in text "
        "or JSON and an AMQP short string may not carry; the outbox refuses it on every "
        "database. Remove it, or send binary data base64-encoded."
    )


def _too_deep(what: str) -> InvalidEvent:
    return InvalidEvent(
        f"The event {what} nests objects and arrays more than {MAX_JSON_DEPTH} levels "
        "deep, the most the outbox stores on every database (MariaDB's JSON columns "
        "refuse deeper documents). Flatten it, or send the deep part as a JSON string."
    )


def _deeper_than_limit(value: Any) -> bool:
    """Whether objects and arrays nest in ``value`` more than MAX_JSON_DEPTH deep."""
    # Level by level without recursion, so a structure deeper than Python's recursion
    # limit is measured too; it stops one level past the limit, however deep it goes.
    level = [value] if isinstance(value, _CONTAINERS) else []
    for _ in range(MAX_JSON_DEPTH):
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, _CONTAINERS)
        ]
        if not level:
            return False
    return True


def _serialise(value: Any, what: str) -> tuple[str, int]:
    """``value`` as the JSON text it is stored and sent as, and its size in UTF-8 bytes.

    Raises InvalidEvent for what a database or the broker would refuse later: not JSON,
    lone surrogates, NUL, nesting deeper than MAX_JSON_DEPTH. Every check but the
    serialisation itself is a scan of the text in C, unless the text has more brackets
    than the depth limit (then the structure is walked, up to the limit).
    """
    try:
        text = json.dumps(value, cls=DjangoJSONEncoder, ensure_ascii=False, allow_nan=False)
    except RecursionError as exc:
        raise _too_deep(what) from exc
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(
            f"The event {what} is not JSON-serialisable: {exc}. Pass plain JSON types "
            "(dict, list, str, int, float, bool, None); Decimal, datetime, date, time, "
            "timedelta and UUID are converted by DjangoJSONEncoder. Convert other objects "
            "(e.g. a model instance) to one of these before emitting."
        ) from exc
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise _surrogate(f"The event {what}", exc) from exc
    # json.dumps escapes NUL as \u0000, which PostgreSQL's jsonb refuses.
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        raise _nul(f"The event {what}")
    # The number of brackets bounds the depth (brackets inside strings only add to it).
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _deeper_than_limit(value):
        raise _too_deep(what)
    return text, size


def _short_str(
    value: Any, field: str, max_length: int, *, required: bool, short_string: bool = False
) -> str:
    """``value`` as the text of a varchar column; ``short_string`` if the message also
    carries it as an AMQP short string (at most SHORT_STRING_BYTES bytes of UTF-8)."""
    text = "" if value is None else str(value)
    if required and not text.strip():
        raise InvalidEvent(f"{field} must be a non-empty string, got {value!r}.")
    if len(text) > max_length:
        raise InvalidEvent(
            f"{field} is {len(text)} characters long; the outbox column holds at most "
            f"{max_length}: {text[:80]!r}..."
        )
    if "\x00" in text:
        raise _nul(field)
    # ASCII text (isascii() is a flag lookup) has neither surrogates nor multi-byte
    # characters; the columns' limits keep it within a short string.
    if not text.isascii():
        try:
            size = len(text.encode())
        except UnicodeEncodeError as exc:
            raise _surrogate(field, exc) from exc
        if short_string and size > SHORT_STRING_BYTES:
            raise InvalidEvent(
                f"{field} is {size} bytes in UTF-8; the message carries it as an AMQP short "
                f"string, which holds at most {SHORT_STRING_BYTES} bytes. Use a shorter "
                "value (a character outside ASCII takes 2 to 4 bytes): "
                f"{text[:40]!r}..."
            )
    return text


def _aggregate(
    aggregate: models.Model | None, aggregate_type: str | None, aggregate_id: Any, using: str
) -> tuple[str, str]:
    if aggregate is not None:
        if not isinstance(aggregate, models.Model):
            raise InvalidEvent(
                f"aggregate must be a model instance, got {type(aggregate).__name__}; pass "
                "aggregate_type= and aggregate_id= for anything else."
            )
        if aggregate.pk is None:
            raise InvalidEvent(
                f"The aggregate {aggregate._meta.label} has no primary key yet: save it "
                "before emitting its event."
            )
        if aggregate._state.db != using and aggregate._state.db is not None:
            _check_same_database(aggregate, using)
        if aggregate_type is None:
            aggregate_type = aggregate._meta.label
        if aggregate_id is None:
            aggregate_id = aggregate.pk
    return (
        _short_str(aggregate_type, "aggregate_type", 64, required=False),
        _short_str(aggregate_id, "aggregate_id", 64, required=False),
    )


def _check_same_database(aggregate: models.Model, using: str) -> None:
    """Raise NotInTransaction if ``aggregate``'s writes go to another database than
    ``using``, the events': two databases are two transactions (a database router that
    sends the outbox apart from the business models, or ``using=`` on one side only)."""
    # Where its writes go, not where it was read: a row read from a replica is written to
    # the primary, with the events (the router decides, as for its save()).
    written = router.db_for_write(type(aggregate), instance=aggregate)
    if written == using:
        return
    raise NotInTransaction(
        f"The aggregate {aggregate._meta.label} {aggregate.pk!r} is written to database "
        f"{written!r}, but this event goes to the outbox of database {using!r}: two "
        "databases are two transactions, so the event would not commit or roll back with "
        "the business write. Write both to one database: open the block there, "
        f"outbox.atomic(using={written!r}) (or emit(..., using={written!r}); run "
        f"`manage.py migrate django_outbox --database {written}` once), or make your "
        f"database router send django_outbox's models to {written!r} too "
        '(docs/writing-events.md, "Several databases").'
    )


# AMQP 0-9-1 field tables (what RabbitMQ carries as message headers) have no JSON float in
# pika's encoder, signed 64-bit integers only, and keys of at most 255 bytes. A header the
# broker cannot carry would fail every publish of the row, so it is refused here, inside the
# caller's transaction, where the business write can still roll back with it.
_INT64 = range(-(2**63), 2**63)


def _check_amqp_table(value: Any, path: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if len(key.encode()) > 255:
                raise InvalidEvent(
                    f"{path} key {key[:40]!r}... is longer than 255 bytes, the AMQP limit "
                    "for a header name; use a shorter name."
                )
            _check_amqp_table(item, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_amqp_table(item, f"{path}[{index}]")
    elif isinstance(value, float):
        raise InvalidEvent(
            f"{path} is a float ({value!r}), which AMQP headers cannot carry through pika; "
            "send it as a string (e.g. str(value) or a Decimal) or put it in the payload."
        )
    elif isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        raise InvalidEvent(
            f"{path} is {value}, outside the signed 64-bit range AMQP headers carry; "
            "send it as a string or put it in the payload."
        )


def _check_datetime(value: Any, field: str) -> None:
    """Raise InvalidEvent unless ``value`` is a datetime that matches ``USE_TZ``."""
    if not isinstance(value, datetime):
        raise InvalidEvent(f"{field} must be a datetime, got {type(value).__name__}.")
    if settings.USE_TZ and timezone.is_naive(value):
        # Django would store it as local time in TIME_ZONE with only a RuntimeWarning:
        # the time would be a guess.
        raise InvalidEvent(
            f"{field} {value.isoformat()} is naive (no tzinfo) while USE_TZ = True. Pass "
            "an aware datetime: timezone.now(), or timezone.make_aware(value) if it is a "
            "local time in TIME_ZONE."
        )
    if not settings.USE_TZ and timezone.is_aware(value):
        # SQLite and MySQL/MariaDB refuse it at INSERT, PostgreSQL converts it: the same
        # rule on every database, raised here.
        raise InvalidEvent(
            f"{field} {value.isoformat()} is aware while USE_TZ = False, and the database "
            "stores naive local times. Pass timezone.make_naive(value) (local time in "
            "TIME_ZONE)."
        )
    # Only a time within a day of the ends of Python's range can fall outside it in UTC.
    if not 1 < value.year < 9999:
        _check_utc_range(value, field)


def _check_utc_range(value: datetime, field: str) -> None:
    """Raise InvalidEvent if ``value`` in UTC is outside years 1-9999: SQLite and
    MySQL/MariaDB fail converting it (OverflowError), PostgreSQL stores it and every read
    of the row fails (Python has no year 0 or 10000)."""
    try:
        (value if timezone.is_aware(value) else timezone.make_aware(value)).astimezone(
            dt_timezone.utc
        )
    except OverflowError:
        raise InvalidEvent(
            f"{field} {value.isoformat()} is outside years 1 to 9999 in UTC, the range "
            "every database stores and reads back. Pass a time from 0001-01-01 to "
            "9999-12-31 in UTC."
        ) from None


def _schedule(deliver_at: Any, delay: Any) -> dict[str, Any]:
    """``deliver_at``/``delay`` checked, as the arguments of ``new_pending()``."""
    if deliver_at is None and delay is None:
        return {}
    if deliver_at is not None and delay is not None:
        raise InvalidEvent(
            "Pass deliver_at or delay, not both: deliver_at is a point in time, delay a "
            "duration counted from when the event is written, by the database clock."
        )
    if deliver_at is not None:
        _check_datetime(deliver_at, "deliver_at")
        return {"deliver_at": deliver_at}
    if isinstance(delay, (int, float)) and not isinstance(delay, bool):
        if not math.isfinite(delay):
            raise InvalidEvent(f"delay must be a finite number of seconds, got {delay!r}.")
        try:
            delay = timedelta(seconds=delay)
        except OverflowError:
            delay = timedelta.max
    elif not isinstance(delay, timedelta):
        raise InvalidEvent(
            f"delay must be a timedelta or a number of seconds, got {type(delay).__name__}."
        )
    if delay < timedelta(0):
        raise InvalidEvent(
            f"delay must not be negative, got {delay}. Pass delay=0 (or no delay) for an "
            "event due at once."
        )
    if delay > MAX_DELAY:
        # Beyond this, date arithmetic in the database (MySQL's DATE_ADD, SQLite's
        # datetime()) overflows or yields NULL, which the INSERT would fail on.
        raise InvalidEvent(
            f"delay {delay} is longer than the outbox schedules ({MAX_DELAY.days} days); "
            "pass deliver_at= for a date that far ahead."
        )
    return {"delay": delay}


class EventArgs(NamedTuple):
    """What ``emit()`` was given for one event, as given: built once where the caller's
    arguments come in (``emit()``, ``Outbox.emit()``) and passed on whole to
    :func:`build_event`, which checks every field.

    A named tuple: emit() is on every request's path, and a frozen dataclass took ten
    times as long to build (its ``__init__`` sets each field through
    ``object.__setattr__``). The entry points build it with ``tuple.__new__`` and every
    field in order, which skips the named tuple's own ``__new__`` (a Python function): 0.15
    us against 0.3 us, 1.6 us for the dataclass.
    """

    event_type: str
    payload: Any
    aggregate: models.Model | None = None
    aggregate_type: str | None = None
    aggregate_id: Any = None
    event_id: str | uuid.UUID | None = None
    headers: Mapping[str, Any] | None = None
    occurred_at: datetime | None = None
    deliver_at: datetime | None = None
    delay: timedelta | float | None = None


def build_event(args: EventArgs, using: str = DEFAULT_DB_ALIAS) -> OutboxEvent:
    """Validate and serialise one event into an unsaved row for the outbox of database
    ``using``; raise InvalidEvent if bad, NotInTransaction if its aggregate's writes go to
    another database."""
    event_type = args.event_type
    if not isinstance(event_type, str):
        raise InvalidEvent(f"event_type must be a string, got {type(event_type).__name__}.")
    # The message type and the default routing key.
    event_type = _short_str(event_type, "event_type", 128, required=True, short_string=True)
    agg_type, agg_id = _aggregate(args.aggregate, args.aggregate_type, args.aggregate_id, using)

    body, size = _serialise(args.payload, "payload")
    limit = outbox_settings.MAX_PAYLOAD_BYTES
    if size > limit:
        raise PayloadTooLarge(
            f"The {event_type} payload is {size} bytes serialised, over the limit of {limit} "
            "(OUTBOX_MAX_PAYLOAD_BYTES). Put large data in storage and send a reference, or "
            "raise the setting if your broker and consumers accept bigger messages."
        )
    headers = args.headers
    if headers is None:
        header_values: dict[str, Any] = {}
    elif isinstance(headers, Mapping):
        if not all(isinstance(k, str) for k in headers):
            raise InvalidEvent("headers must be a mapping with string keys.")
        clash = sorted(name for name in headers if is_reserved_header(name))
        if clash:
            raise InvalidEvent(
                f"headers may not use the names {clash}: the relay sets aggregate_type, "
                "aggregate_id, occurred_at, attempt, sequence and previous_sequence from "
                "the event, and the broker and the consumer count deliveries in "
                "x-delivery-count, x-death and x-outbox-* headers; cloudEvents:* and "
                "cloudEvents_* headers would read as CloudEvents attributes. Rename your "
                "headers (e.g. prefix them with your service name)."
            )
        priority = headers.get(PRIORITY_HEADER)
        if priority is not None and (
            isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255
        ):
            raise InvalidEvent(
                f"headers[{PRIORITY_HEADER!r}] is {priority!r}: the message's AMQP priority is "
                "a whole number from 0 to 255."
            )
        header_values = json.loads(_serialise(dict(headers), "headers")[0])
        _check_amqp_table(header_values, "headers")
    else:
        raise InvalidEvent(f"headers must be a mapping, got {type(headers).__name__}.")

    event_id = args.event_id
    if event_id is None:
        event_id = str(uuid.uuid4())
    # The message_id.
    event_id = _short_str(event_id, "event_id", 64, required=True, short_string=True)

    occurred_at = args.occurred_at
    if occurred_at is None:
        occurred_at = timezone.now()
    else:
        _check_datetime(occurred_at, "occurred_at")
    schedule = _schedule(args.deliver_at, args.delay)

    event = OutboxEvent.objects.new_pending(
        **schedule,
        event_id=event_id,
        aggregate_type=agg_type,
        aggregate_id=agg_id,
        event_type=event_type,
        # Stored as the JSON it will be sent as, so Decimal/datetime/UUID are already
        # strings and the row never holds something the relay cannot serialise.
        payload=json.loads(body),
        headers=header_values,
        occurred_at=occurred_at,
    )
    # Here, at emit time, not at relay time: each event keeps the context of the request
    # that wrote it, however its batch is made up later.
    tracing.capture(event)
    # The INSERT writes the payload and headers as checked here, not serialised again from
    # the row's dicts (which the caller may still change). Escaped where not ASCII, as the
    # JSONField writes them: a MySQL connection in utf8 (Django's default there) cannot
    # carry a 4-byte character.
    prepared = {
        "payload": body if body.isascii() else json.dumps(event.payload),
        "headers": json.dumps(event.headers) if event.headers else "{}",
    }
    setattr(event, PREPARED, prepared)
    return event


def _require_transaction(using: str) -> None:
    if not connections[using].in_atomic_block:
        raise NotInTransaction(
            "emit() was called outside a transaction (the connection is in autocommit "
            f"mode on database {using!r}), so the event would not commit together with the "
            "business write. Wrap both in one block: `with outbox.atomic() as box: ...; "
            "box.emit(...)`, or call emit() inside `transaction.atomic()`."
        )


def _check_unique(events: list[OutboxEvent]) -> None:
    seen: set[str] = set()
    for event in events:
        if event.event_id in seen:
            raise DuplicateEventId(
                f"event_id {event.event_id!r} was emitted twice in the same block; each "
                "event needs its own id (leave event_id unset to get a fresh UUID)."
            )
        seen.add(event.event_id)


def _insert(events: list[OutboxEvent], using: str) -> None:
    """One INSERT for all events in the current transaction; on PostgreSQL, a wake-up for
    the relays once the transaction commits."""
    _check_unique(events)
    connection = connections[using]
    try:
        # A failed insert marks the caller's transaction for rollback, as a failed save()
        # does, so the business write cannot commit without its events even if the caller
        # catches the error. bulk_create() no longer does it on every Django version and
        # database, hence the explicit mark. A caller who means to go on wraps the emit in
        # a savepoint (docs/writing-events.md, "Emitting idempotently").
        with transaction.mark_for_rollback_on_error(using):
            # What bulk_create() writes, without its per-call work in Python, which cost
            # more than the INSERT itself (docs/benchmarks.md, "What an event costs").
            insert_rows(OutboxEvent, using, events)
    except IntegrityError as exc:
        if "event_id" in str(exc) or "django_outbox_event_id_uniq" in str(exc):
            ids = ", ".join(repr(e.event_id) for e in events)
            raise DuplicateEventId(
                f"An outbox event with one of these event_ids exists already: {ids}. "
                "event_id must be globally unique; leave it unset to get a fresh UUID, or "
                "derive it from something unique to this change. The transaction is rolled "
                "back so the business write is not kept without its event."
            ) from exc
        raise
    if connection.vendor == "postgresql" and outbox_settings.NOTIFY:
        # Right after the commit, on this connection: a NOTIFY in this transaction would
        # serialise its commit with every other one that notifies (notify.py).
        hook = _wake_hook(using)
        # Once per transaction however many emits it makes; a savepoint rolled back takes
        # its hook along, and the next emit registers it again.
        if not has_commit_hook(connection, hook):
            transaction.on_commit(hook, using=using)


@functools.cache
def _wake_hook(using: str) -> Callable[[], None]:
    """The ``on_commit`` hook that wakes the relays of database ``using``: one function per
    alias, so a transaction registers it once."""
    return functools.partial(request_wake, using)


#: Builds an EventArgs from a tuple of all its fields, in order (see EventArgs).
_new_args = tuple.__new__


class Outbox:
    """The events of one ``atomic()`` block, inserted with one INSERT when it exits."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.events: list[OutboxEvent] = []
        self._atomic: transaction.Atomic | None = None

    def emit(
        self,
        event_type: str,
        *,
        payload: Any,
        aggregate: models.Model | None = None,
        aggregate_type: str | None = None,
        aggregate_id: Any = None,
        event_id: str | uuid.UUID | None = None,
        headers: Mapping[str, Any] | None = None,
        occurred_at: datetime | None = None,
        deliver_at: datetime | None = None,
        delay: timedelta | float | None = None,
    ) -> OutboxEvent:
        """Add an event to this block; it is written when the block exits without error."""
        args = _new_args(
            EventArgs,
            (
                event_type,
                payload,
                aggregate,
                aggregate_type,
                aggregate_id,
                event_id,
                headers,
                occurred_at,
                deliver_at,
                delay,
            ),
        )
        return self._add(args)

    def _add(self, args: EventArgs) -> OutboxEvent:
        if self._atomic is None:
            raise NotInTransaction(
                "box.emit() was called after its `with outbox.atomic() as box:` block "
                "ended; emit inside the block so the event commits with the business write."
            )
        event = build_event(args, self.using)
        self.events.append(event)
        return event

    def flush(self) -> None:
        """Insert the events collected so far now (normally done at block exit)."""
        if self.events:
            events, self.events = self.events, []
            _insert(events, self.using)

    def _is_innermost(self) -> bool:
        block = innermost_atomic(connections[self.using])
        return block is not None and block is self._atomic


@contextmanager
def atomic(
    using: str | None = None, *, savepoint: bool = True, durable: bool = False
) -> Iterator[Outbox]:
    """A ``transaction.atomic`` block that collects events and writes them at its end.

    Nested in another atomic block it is a savepoint, exactly like ``transaction.atomic``:
    if it is rolled back, its events go with it. The events are inserted just before the
    block exits, inside it, with one INSERT however many were emitted.

    ``using`` is the database of the block and of its events; by default the router's
    choice for the outbox (``router.db_for_write(OutboxEvent)``), not ``"default"`` as for
    ``transaction.atomic``. Only writes to that database are in the block's transaction:
    ``emit()`` refuses an aggregate whose writes go elsewhere (docs/writing-events.md,
    "Several databases").
    """
    alias = outbox_db(using)
    box = Outbox(alias)
    block = transaction.atomic(using=alias, savepoint=savepoint, durable=durable)
    stack = _stack(alias)
    with block:
        box._atomic = block
        stack.append(box)
        try:
            yield box
            box.flush()
        finally:
            stack.pop()
            box._atomic = None


def emit(
    event_type: str,
    *,
    payload: Any,
    aggregate: models.Model | None = None,
    aggregate_type: str | None = None,
    aggregate_id: Any = None,
    event_id: str | uuid.UUID | None = None,
    headers: Mapping[str, Any] | None = None,
    occurred_at: datetime | None = None,
    deliver_at: datetime | None = None,
    delay: timedelta | float | None = None,
    using: str | None = None,
) -> OutboxEvent:
    """Write an event in the current transaction (any atomic block).

    Directly inside an ``outbox.atomic()`` block the event joins that block's single
    INSERT; inside a plain ``transaction.atomic()`` it is inserted at once, so a savepoint
    that rolls back takes it along. Outside any transaction it raises NotInTransaction.

    ``using``: the database whose outbox gets the event and whose transaction must be open;
    by default the router's choice for the outbox, as for ``atomic()``. An ``aggregate``
    whose writes go to another database raises NotInTransaction (two transactions).

    ``deliver_at`` (an aware datetime under ``USE_TZ``) or ``delay`` (a timedelta or
    seconds), at most one: the event commits now and the relay publishes it no earlier
    than then; ``delay`` counts from the INSERT by the database clock, a ``deliver_at``
    already past is due at once (docs/writing-events.md, "Scheduling an event").
    """
    alias = outbox_db(using)
    _require_transaction(alias)
    args = _new_args(
        EventArgs,
        (
            event_type,
            payload,
            aggregate,
            aggregate_type,
            aggregate_id,
            event_id,
            headers,
            occurred_at,
            deliver_at,
            delay,
        ),
    )
    stack = _stack(alias)
    if stack and stack[-1]._is_innermost():
        return stack[-1]._add(args)
    event = build_event(args, alias)
    _insert([event], alias)
    return event
