"""Django internals the outbox relies on (Django>=5.2,<6.2, pinned in pyproject.toml).

* :func:`build_rows`: model instances straight from a cursor's records, as
  ``Model.from_db()`` builds them but without ``Model.__init__``: ``Model.__new__``, the
  ``__dict__`` a loaded row has (a missing attname is a deferred field), ``ModelState``
  (``django.db.models.base``, undocumented) and the database converters that Django's SQL
  compiler applies. With ``__init__``, its per-field work and the ``pre_init``/``post_init``
  signals, building the instances took the relay twice as long as running its claim.
* :func:`forget_connection`: a connection's transaction bookkeeping (attributes of
  ``BaseDatabaseWrapper`` that Django documents nowhere) reset, as ``connect()`` resets it,
  after its private ``_close()``.
* :func:`had_errors` and :func:`clear_errors`: the undocumented flag Django's error
  wrapper sets on a connection that raised a database error.
* :func:`innermost_atomic`: the ``Atomic`` block a connection is in, from its undocumented
  ``atomic_blocks`` stack.
* :func:`insert_rows`: unsaved instances written as ``bulk_create()`` writes them (one
  INSERT where the database allows, the field's ``pre_save()`` and ``get_db_prep_save()``,
  expressions compiled by an ``InsertQuery``'s compiler, primary keys from ``RETURNING``
  where ``can_return_rows_from_bulk_insert``, ``_state`` as saved; a value the instance
  carries prepared already, under :data:`PREPARED`, written as it is) without the rest of
  ``bulk_create()``'s work per call: on an ``emit()`` of one event, ``bulk_create()`` spent
  more time in Python than the database spent on the INSERT. A primary key the database
  does not make (a task result's id) is written; a ``prefix`` goes before the INSERT in
  the same query (a task's ``SET LOCAL synchronous_commit``: one round trip).
* :func:`has_commit_hook`: whether a function is among a connection's ``on_commit`` hooks,
  from its undocumented ``run_on_commit`` list.
* :func:`delete_rows`: a queryset's rows deleted by one ``DELETE ... WHERE`` of its filter
  (``QuerySet._raw_delete()``), whatever signal receivers the project connected: with one
  for ``pre_delete``/``post_delete`` of any model, ``delete()`` first selects the rows and
  then deletes them by primary key, two statements and no longer the one fence.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import suppress
from typing import Any, TypeVar

from django.conf import settings
from django.db import DatabaseError, connections, models
from django.db.models import sql
from django.db.models.base import ModelState
from django.db.models.expressions import DatabaseDefault
from django.db.models.functions import Now

#: The Django releases these internals are known to behave as assumed (tests/test_compat.py).
PINNED = "Django>=5.2,<6.2"

_Model = TypeVar("_Model", bound=models.Model)


def build_rows(
    model: type[_Model], using: str, field_names: Sequence[str], records: Sequence[Sequence[Any]]
) -> list[_Model]:
    """Instances of ``model`` from ``records`` (their columns are ``field_names``, in order)
    read on database ``using``: the field converters applied, the other fields deferred,
    ``_state`` as a loaded row's. One call per batch: the loop over rows is here."""
    if not records:
        return []
    connection = connections[using]
    fields: list[Any] = [model._meta.get_field(name) for name in field_names]
    attnames = [field.attname for field in fields]
    converters = []
    for index, field in enumerate(fields):
        column = field.get_col(model._meta.db_table)
        functions = connection.ops.get_db_converters(column) + field.get_db_converters(connection)
        if functions:
            converters.append((index, functions, column))
    rows: list[_Model] = []
    for record in records:
        values = list(record)
        for index, functions, column in converters:
            value = values[index]
            for function in functions:
                value = function(value, column, connection)
            values[index] = value
        row = model.__new__(model)
        row.__dict__.update(zip(attnames, values, strict=True))
        row._state = ModelState()
        row._state.adding = False
        row._state.db = using
        rows.append(row)
    return rows


#: Fields whose ``get_db_prep_save()`` returns a ``str``/``int`` value unchanged, and
#: ``None`` as ``None``, on every backend: their values skip it (most of a row's fields).
_PLAIN_FIELDS = (models.CharField, models.TextField, models.IntegerField)
_PLAIN_TYPES = (str, int)


#: An instance attribute: a dict of attname -> the value as the database takes it
#: (``get_db_prep_save()``'s result), for fields whose value the caller has prepared already
#: (:func:`insert_rows` writes it as it is).
PREPARED = "_prepared_for_db"
_NOTHING: dict[str, Any] = {}


def _prepare(field: Any) -> tuple[Any, bool, bool]:
    """(field, whether its value comes from ``pre_save()``, whether it is plain)."""
    pre_save = type(field).pre_save not in (
        models.Field.pre_save,
        models.DateField.pre_save,
        models.DateTimeField.pre_save,
    ) or bool(getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False))
    return field, pre_save, isinstance(field, _PLAIN_FIELDS)


@functools.cache
def _insert_sql(
    model: type[models.Model], using: str, vendor: str, returning: bool
) -> tuple[list[Any], str, str]:
    """The fields an INSERT of ``model`` writes (all but a primary key the database makes),
    each with how its value is read (:func:`_prepare`), and the SQL before (``INSERT INTO t
    (a, b, ...) VALUES``) and after (``RETURNING t.id``) its rows, quoted for database
    ``using`` (of ``vendor``)."""
    opts = model._meta
    fields = [_prepare(f) for f in opts.concrete_fields if not _made_by_database(f)]
    qn = connections[using].ops.quote_name
    table = qn(opts.db_table)
    columns = ", ".join(qn(str(f.column)) for f, _, _ in fields)
    head = f"INSERT INTO {table} ({columns}) VALUES "
    tail = f" RETURNING {table}.{qn(str(opts.pk.column))}" if returning else ""
    return fields, head, tail


def _made_by_database(field: Any) -> bool:
    """A primary key the database makes (an auto-incremented one): not written."""
    return bool(field.primary_key and field.db_returning)


def insert_rows(
    model: type[_Model], using: str, objs: Sequence[_Model], *, prefix: str = ""
) -> None:
    """Insert ``objs`` (unsaved instances of ``model``) as ``bulk_create()`` does: one
    INSERT, or as many as the database's parameter limit needs (SQLite); an
    auto-incremented primary key set where the database returns it, any other written.

    ``prefix``: SQL sent in the same query before each INSERT (``SET LOCAL ...; ``), for a
    model whose primary key is written (nothing is read back) and a connection that binds
    parameters on the client (Django's default on PostgreSQL)."""
    connection = connections[using]
    returning = bool(
        connection.features.can_return_rows_from_bulk_insert and _made_by_database(model._meta.pk)
    )
    fields, head, tail = _insert_sql(model, using, connection.vendor, returning)
    head = prefix + head
    compiler: Any = None
    # Expressions other than the clock compiled once per call and object (a scheduled
    # row's due time caches its own SQL).
    compiled: dict[Any, tuple[str, Sequence[Any]]] = {}
    batch = max(1, connection.ops.bulk_batch_size([f for f, _, _ in fields], objs))
    attname = model._meta.pk.attname
    with connection.cursor() as cursor:
        for start in range(0, len(objs), batch):
            chunk = objs[start : start + batch]
            rows: list[str] = []
            params: list[Any] = []
            for obj in chunk:
                placeholders = []
                ready = obj.__dict__.get(PREPARED, _NOTHING)
                for field, pre_save, plain in fields:
                    if field.attname in ready:
                        placeholders.append("%s")
                        params.append(ready[field.attname])
                        continue
                    value = field.pre_save(obj, True) if pre_save else getattr(obj, field.attname)
                    if plain and (value is None or type(value) in _PLAIN_TYPES):
                        placeholders.append("%s")
                        params.append(value)
                        continue
                    if isinstance(value, DatabaseDefault):
                        value = field.db_default
                    if isinstance(value, Now):
                        # The clock: the same SQL for every row and call on this database.
                        clock: Any = type(value)
                        fragment, fragment_params = _now_sql(
                            model, using, connection.vendor, clock, settings.USE_TZ
                        )
                        placeholders.append(fragment)
                        params.extend(fragment_params)
                    elif hasattr(value, "resolve_expression"):
                        key = id(value)
                        if key not in compiled:
                            if compiler is None:
                                compiler = sql.InsertQuery(model).get_compiler(using=using)
                            compiled[key] = _compile(compiler, value)
                        fragment, fragment_params = compiled[key]
                        placeholders.append(fragment)
                        params.extend(fragment_params)
                    else:
                        placeholders.append("%s")
                        params.append(field.get_db_prep_save(value, connection))
                rows.append(f"({', '.join(placeholders)})")
            cursor.execute(head + ", ".join(rows) + tail, params)
            if returning:
                for obj, (pk,) in zip(chunk, cursor.fetchall(), strict=True):
                    setattr(obj, attname, pk)
    for obj in objs:
        obj._state.adding = False
        obj._state.db = using


def _compile(compiler: Any, value: Any) -> tuple[str, Sequence[Any]]:
    resolved = value.resolve_expression(compiler.query, allow_joins=False, for_save=True)
    return compiler.compile(resolved)  # type: ignore[no-any-return]


@functools.cache
def _now_sql(
    model: type[models.Model], using: str, vendor: str, now: Any, use_tz: bool
) -> tuple[str, Sequence[Any]]:
    """The SQL of ``now()`` (a ``Now`` subclass) in an INSERT of ``model`` on database
    ``using`` (of ``vendor``): it depends on nothing else (``USE_TZ`` picks the clock on
    some databases)."""
    return _compile(sql.InsertQuery(model).get_compiler(using=using), now())


def has_commit_hook(conn: Any, func: Any) -> bool:
    """Whether ``func`` is among the ``on_commit`` hooks of ``conn``'s transaction (those of
    a savepoint rolled back are gone from the list)."""
    return any(hook[1] is func for hook in conn.run_on_commit)


def forget_connection(conn: Any) -> None:
    """Drop ``conn`` (a ``BaseDatabaseWrapper``) and the transaction Django believes open
    on it, leaving the state a new connection starts from."""
    with suppress(DatabaseError):
        conn.close()  # inside a transaction Django only flags it as closed
    with suppress(DatabaseError):
        if conn.connection is not None:
            conn._close()
    conn.connection = None
    conn.in_atomic_block = False
    conn.savepoint_ids = []
    conn.atomic_blocks = []
    conn.needs_rollback = False
    conn.closed_in_transaction = False
    conn.commit_on_exit = True
    # close() drops the dead transaction's on_commit hooks, except where it does nothing
    # (an in-memory SQLite database): a later commit must not run them.
    conn.run_on_commit = []


def had_errors(conn: Any) -> bool:
    """Whether a database error was raised through ``conn`` (a ``BaseDatabaseWrapper``)
    since :func:`clear_errors`; ``close_if_unusable_or_obsolete()`` reads the same flag."""
    return bool(conn.errors_occurred)


def clear_errors(conn: Any) -> None:
    """``conn`` was checked after its errors and still works."""
    conn.errors_occurred = False


def innermost_atomic(conn: Any) -> Any:
    """The ``Atomic`` instance of the innermost ``atomic()`` block open on ``conn`` (a
    ``BaseDatabaseWrapper``), or None outside any."""
    blocks = conn.atomic_blocks
    return blocks[-1] if blocks else None


def delete_rows(queryset: models.QuerySet[Any]) -> int:
    """Delete the rows of ``queryset`` with one ``DELETE`` of its filter, on its database;
    no signal, no cascade (nothing references the row). Returns how many went."""
    return int(queryset._raw_delete(queryset.db))
