"""What django_outbox/_compat/redis.py asks of redis-py beyond its command methods, on the
installed release: the relay's pipelining across send() and wait() rests on it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import redis.exceptions
from redis.connection import Connection, ConnectionPool

from django_outbox._compat.redis import (
    PINNED,
    open_connection,
    pack_words,
    read_answer,
    write_commands,
    write_packed,
)

pytestmark = pytest.mark.once


def test_the_pin_is_the_packaging_one():
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    assert f'redis = ["{PINNED}"]' in pyproject.read_text()


def test_the_connection_methods_the_backend_drives_are_there():
    assert callable(ConnectionPool.make_connection)
    assert callable(Connection.pack_commands)
    assert "check_health" in inspect.signature(Connection.send_packed_command).parameters
    assert callable(Connection.read_response)


def test_answers_are_read_in_order_and_an_error_reply_keeps_the_connection_in_step(redis_broker):
    connection = open_connection(redis_broker.url, connect_timeout=5, timeout=5)
    key = redis_broker.stream("compat")
    try:
        redis_broker.client.set(f"{key}.string", "x")
        write_commands(
            connection,
            [
                ["XADD", key, "*", "a", "1"],
                ["XADD", f"{key}.string", "*", "a", "1"],  # WRONGTYPE
                ["XADD", key, "*", "a", "2"],
            ],
        )
        first = read_answer(connection)
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            read_answer(connection)
        third = read_answer(connection)
    finally:
        connection.disconnect()
    assert [first, third] == [entry for entry, _ in redis_broker.entries(key)]


def test_words_are_packed_as_redis_py_packs_them():
    words = [
        b"XADD",
        "stream.key",
        b"MAXLEN",
        b"~",
        1000,
        b"*",
        "h\u00e9llo %d",
        b"\x00\r\n" * 3000,
    ]
    packed = b"*%d\r\n%b" % (len(words), pack_words(words))
    assert packed == b"".join(Connection().pack_commands([words]))


def test_packed_commands_are_answered_in_order(redis_broker):
    connection = open_connection(redis_broker.url, connect_timeout=5, timeout=5)
    key = redis_broker.stream("compat")
    try:
        words = [["XADD", key, "*", "a", str(n)] for n in range(3)]
        write_packed(connection, b"".join(b"*5\r\n" + pack_words(w) for w in words))
        answers = [read_answer(connection) for _ in words]
    finally:
        connection.disconnect()
    assert answers == [entry for entry, _ in redis_broker.entries(key)]
