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
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress
from typing import Any, TypeVar

from django.db import DatabaseError, connections, models
from django.db.models.base import ModelState

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
