"""What the Redis transport asks of redis-py beyond its command methods, in one place.

The relay pipelines its ``XADD`` commands across calls (a batch written by ``send()``, its
answers read by ``wait()``, other batches in between), which redis-py's ``Pipeline`` cannot
do: it writes and reads in one ``execute()``. So the backend drives one connection itself
through the methods ``Pipeline`` is built on, ``Connection.pack_commands``,
``send_packed_command`` and ``read_response``, here; tests/test_compat_redis.py checks that
the oldest and newest supported redis-py still have them. The names the relay and the
consumer both need (the stream of a routing key, how a connection is made and its errors
described) live here too: the consumer may not import a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.exceptions
from redis.connection import ConnectionPool

from ..exceptions import error_text

__all__ = [
    "CONNECTION_ERRORS",
    "PINNED",
    "connection_pool",
    "describe",
    "open_connection",
    "pack_words",
    "read_answer",
    "stream_for",
    "stream_name",
    "write_commands",
    "write_packed",
]

#: The redis-py releases this module was checked with (the oldest and the newest: 5.0.0,
#: 8.2.0); the redis extra of pyproject.toml.
PINNED = "redis>=5.0"

#: What redis-py raises when a connection is lost, refused or times out.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
)


def stream_name(prefix: str, key: str) -> str:
    """The stream of routing key ``key`` when OUTBOX_REDIS_STREAMS names none:
    ``<prefix>.<key>``, or ``key`` when the prefix (``OUTBOX_EXCHANGE``) is empty."""
    return f"{prefix}.{key}" if prefix else key


def stream_for(streams: dict[str, str], prefix: str, key: str) -> str:
    """The stream events of routing key ``key`` go to: OUTBOX_REDIS_STREAMS's, else
    :func:`stream_name`'s. The relay and the consumer both ask here."""
    return streams.get(key) or stream_name(prefix, key)


def connection_pool(url: str, *, connect_timeout: float, timeout: float | None) -> ConnectionPool:
    """A pool for ``url`` (``redis://``, ``rediss://`` for TLS; the database index is the
    path), its connections timing out as given."""
    return ConnectionPool.from_url(
        url,
        socket_connect_timeout=connect_timeout,
        socket_timeout=timeout,
        socket_keepalive=True,
    )


def open_connection(url: str, *, connect_timeout: float, timeout: float | None) -> Any:
    """One connection of its own to ``url``, connected (authenticated, database selected)."""
    connection = connection_pool(url, connect_timeout=connect_timeout, timeout=timeout)
    made = connection.make_connection()
    made.connect()
    return made


def write_commands(connection: Any, commands: Sequence[Sequence[Any]]) -> None:
    """Write ``commands`` in one piece; their answers are read with :func:`read_answer`."""
    connection.send_packed_command(connection.pack_commands(commands), check_health=False)


def pack_words(words: Sequence[bytes | str | int]) -> bytes:
    """The protocol's bulk strings of ``words`` (text as UTF-8, redis-py's default; an int
    as its digits), without the array's ``*<n>`` line: what ``pack_commands`` writes for
    them, built in one ``%`` each. Commands sent by the thousand are packed with this
    (:func:`write_packed`): ``pack_commands`` took about 8 us a command, checking and
    encoding every word on its own, and the relay waits for it under the GIL."""
    parts = []
    for word in words:
        data = word if isinstance(word, bytes) else str(word).encode()
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def write_packed(connection: Any, data: bytes) -> None:
    """Write ``data``, whole commands in the protocol's form (``*<n>`` and :func:`pack_words`),
    in one piece; their answers are read with :func:`read_answer`."""
    connection.send_packed_command([data], check_health=False)


def read_answer(connection: Any) -> Any:
    """The next answer on ``connection``; an error reply raises ``ResponseError``, and the
    connection stays in step for the answers after it."""
    return connection.read_response()


def describe(error: BaseException) -> str:
    """A short, password-free description of a redis-py error."""
    if isinstance(error, redis.exceptions.TimeoutError):
        return "no answer in time"
    return error_text(error)
