"""What django_outbox/_compat/redis.py asks of redis-py beyond its command methods, on the
installed release: the relay's pipelining across send() and wait() rests on it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import redis.exceptions
from redis.connection import Connection, ConnectionPool

from django_outbox._compat.redis import PINNED, open_connection, read_answer, write_commands

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
