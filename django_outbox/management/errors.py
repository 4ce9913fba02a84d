"""The one place the commands turn "the database is unreachable" into exit code 2.

An unreachable database is an operations problem, not a failed event: a CronJob or a
deployment gate must see exit 2 (a service is unreachable, like the broker-down path) and
one line that names the database, never exit 1 and a hundred lines of driver traceback.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from django.core.management.base import (
    BaseCommand,
    CommandError,
    CommandParser,
    SystemCheckError,
)
from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.utils.connection import ConnectionDoesNotExist

if TYPE_CHECKING:
    from django.db.models import Model

from ..checks import publishing
from ..db import database_answers, missing_tables
from ..exceptions import OutboxError
from ..masking import mask_url
from ..models import outbox_db

#: What drivers raise when a connection cannot be opened or is dropped (Django's wrappers).
CONNECTION_ERRORS = (OperationalError, InterfaceError)

_SCHEMES = {"postgresql": "postgres", "mysql": "mysql", "sqlite": "sqlite"}


def describe(using: str) -> str:
    """``'default' (postgres://app:***@db:5432/shop)``: the alias and where it points,
    with the password masked."""
    connection = connections[using]
    conf = connection.settings_dict
    name = str(conf.get("NAME") or "")
    scheme = _SCHEMES.get(connection.vendor, connection.vendor)
    if connection.vendor == "sqlite":
        return f"{using!r} ({scheme}:///{name})"
    auth = quote(str(conf.get("USER") or ""), safe="")
    if conf.get("PASSWORD"):
        auth += ":" + quote(str(conf["PASSWORD"]), safe="")
    host = conf.get("HOST") or "localhost"
    port = f":{conf['PORT']}" if conf.get("PORT") else ""
    url = f"{scheme}://{auth + '@' if auth else ''}{host}{port}/{quote(name, safe='')}"
    return f"{using!r} ({mask_url(url)})"


def unreachable(command: str, using: str, exc: BaseException) -> CommandError:
    # Drivers spread their message over lines (psycopg adds "Is the server running...");
    # one line keeps a CronJob's log and an alert readable, and keeps the hint.
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return CommandError(
        f"{command}: the database {describe(using)} is unreachable: {reason}", returncode=2
    )


def unknown_alias(command: str, using: str) -> CommandError:
    known = ", ".join(repr(alias) for alias in connections.settings)
    return CommandError(
        f"{command}: there is no database {using!r} in DATABASES; pass --database with one "
        f"of {known}.",
        returncode=2,
    )


def require_database(command: str, using: str) -> None:
    """Connect to ``using`` now: exit 2 with one line if it cannot be reached, or if it
    is not an alias of DATABASES (a typo in ``--database`` or in a router)."""
    if using not in connections.settings:
        raise unknown_alias(command, using)
    try:
        connections[using].ensure_connection()
    except CONNECTION_ERRORS as exc:
        raise unreachable(command, using, exc) from exc


def require_tables(command: str, needed: dict[str, dict[type[Model], str]]) -> None:
    """Exit 2 in one line when a database lacks a table the run writes: per alias, each
    model and who needs it (a handler's name). What to migrate is named, app by app."""
    missing: list[str] = []
    apps: dict[str, set[str]] = {}
    for using, models in needed.items():
        for model in missing_tables(using, models):
            missing.append(
                f"{model._meta.db_table} ({model._meta.label}, for {models[model]}) on "
                f"{describe(using)}"
            )
            apps.setdefault(using, set()).add(model._meta.app_label)
    if not missing:
        return
    run = "; ".join(
        f"`manage.py migrate {' '.join(sorted(labels))} --database {using}`"
        for using, labels in apps.items()
    )
    raise CommandError(
        f"{command}: missing table(s): {'; '.join(missing)}. Run {run} first.", returncode=2
    )


def require_outbox_table(command: str, using: str) -> None:
    """Exit 2 in one line when ``using`` has no outbox table: a relay there would fail
    every pass, and a database added for the outbox is easily left unmigrated."""
    from ..gauges import holds_outbox_table

    if not holds_outbox_table(using):
        raise CommandError(
            f"{command}: the database {describe(using)} has no outbox table; run "
            f"`manage.py migrate django_outbox --database {using}`.",
            returncode=2,
        )


def command_help(doc: str) -> str:
    """A command's ``--help`` text from its module's docstring, so that what it does and
    its exit codes are written once: every paragraph but the first (the "manage.py name:
    ..." title), without the reST markup; argparse reflows it."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")[1:]
    return "\n\n".join(" ".join(p.split()) for p in paragraphs).replace("``", "")


class DatabaseCommand(BaseCommand):
    """A command whose work needs the database: it connects before anything else. Its
    ``help`` is its module's docstring (:func:`command_help`).

    Before Django's system checks too, which open a connection on MySQL/MariaDB and would
    end in a driver traceback and exit 1. A database down at start is most often a wrong
    DATABASE_URL; the long-running commands ride out a later outage with backoff instead.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "help" not in vars(cls):
            cls.help = command_help(sys.modules[cls.__module__].__doc__ or "")

    #: Whether the run needs the outbox table on its databases (consume_outbox does not).
    needs_outbox_table = True
    #: Whether the command publishes: then the checks that only publishing needs (a broker
    #: URL) are errors, and a failed system check is exit 2 (misconfigured).
    publishes = False

    def add_database_argument(self, parser: CommandParser) -> None:
        """``--database ALIAS``: the outbox this run works on, for a project whose outbox
        lives in several databases (one process per alias; docs/operations.md)."""
        parser.add_argument(
            "--database",
            default=None,
            help="Alias of the database whose outbox to work on (default: the database "
            "router's choice for the outbox, usually 'default').",
        )

    def databases_needed(self, options: dict[str, Any]) -> list[str]:
        """The aliases this run will use; the outbox's (``--database`` if given)."""
        return [outbox_db(options.get("database"))]

    @property
    def command_name(self) -> str:
        return type(self).__module__.rpartition(".")[2]

    def tables_needed(self, options: dict[str, Any]) -> dict[str, dict[type[Model], str]]:
        """Tables the run writes besides the outbox's, by alias: model -> who needs it.
        Checked at start, after the connection (exit 2 naming what to migrate)."""
        return {}

    def execute(self, *args: Any, **options: Any) -> str | None:
        for using in self.databases_needed(options):
            require_database(self.command_name, using)
            if self.needs_outbox_table:
                require_outbox_table(self.command_name, using)
        require_tables(self.command_name, self.tables_needed(options))
        return super().execute(*args, **options)  # type: ignore[no-any-return]

    def check(self, *args: Any, **kwargs: Any) -> None:
        # Django's system checks connect to every database in DATABASES on MySQL/MariaDB
        # (for --list and --database ALIAS too, which need no outbox connection).
        try:
            with publishing() if self.publishes else nullcontext():
                super().check(*args, **kwargs)
        except SystemCheckError as exc:
            if self.publishes:
                exc.returncode = 2  # misconfigured, as the exit code tables say
            raise
        except CONNECTION_ERRORS:
            for using in connections:
                require_database(self.command_name, using)  # raises for the one down
            raise


@contextmanager
def backend_errors() -> Iterator[None]:
    """Around building the outbox backend (or a relay, which builds one): a wrong
    OUTBOX_BACKEND or OUTBOX_BACKEND_OPTIONS exits 2 in one line (misconfigured)."""
    try:
        yield
    except (OutboxError, TypeError) as exc:
        raise CommandError(f"Cannot build the outbox backend: {exc}", returncode=2) from exc


@contextmanager
def database_errors(command: str, using: str) -> Iterator[None]:
    """Around a command's work: the database going away mid-run exits 2 in one line.

    A connection error is only "unreachable" when a new connection cannot be opened
    either; a deadlock or a lock timeout (also ``OperationalError``) on a database that
    answers propagates as the failure it is.
    """
    try:
        yield
    except CONNECTION_ERRORS as exc:
        # On the connection that failed, then on a new one.
        if database_answers(using, attempts=2):
            raise
        raise unreachable(command, using, exc) from exc


@contextmanager
def database_work(command: str, using: str, *, unfinished: str) -> Iterator[None]:
    """:func:`database_errors` for a command that changes rows in batches, which also
    exits 2 in one line for an alias not in DATABASES and for a statement that failed on a
    database that answers; ``unfinished`` says what such a failure leaves behind (the
    batches before it are committed)."""
    try:
        with database_errors(command, using):
            yield
    except ConnectionDoesNotExist as exc:
        raise CommandError(
            f"{command}: {exc}; pass an alias from DATABASES.", returncode=2
        ) from exc
    except DatabaseError as exc:
        raise CommandError(
            f"{command}: the database failed ({' '.join(str(exc).split())}); {unfinished}.",
            returncode=2,
        ) from exc
