"""The backend contract (django_outbox.backends.base) and what every backend shares."""

from __future__ import annotations

import pytest

from django_outbox.backends.base import describe_error

pytestmark = pytest.mark.once


class Refused(Exception):
    pass


@pytest.mark.parametrize(
    ("error", "described"),
    [
        (ValueError("bad value"), "ValueError: bad value"),
        (ConnectionRefusedError(), "ConnectionRefusedError"),
        # py-amqp's errors start with their own type: it is not said twice.
        (Refused("Refused: 406 PRECONDITION_FAILED"), "Refused: 406 PRECONDITION_FAILED"),
    ],
)
def test_describe_error_names_the_type_once(error: Exception, described: str) -> None:
    assert describe_error(error) == described
