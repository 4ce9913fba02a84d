from __future__ import annotations

from decimal import Decimal

import pytest

from django_outbox.testing import assert_emitted, captured_messages, relay_now
from orders.services import create_order

pytestmark = pytest.mark.django_db(transaction=True)


def test_captured_messages_and_relay_now():
    with captured_messages() as messages:
        order = create_order(user_id=1, amount=Decimal("5"))
        assert relay_now().sent == 1
    assert [m.type for m in messages] == ["ORDER_CREATED"]
    assert_emitted("ORDER_CREATED", aggregate_id=order.number)


def test_assert_emitted_fails_with_what_it_found():
    create_order(user_id=1, amount=Decimal("5"))
    with pytest.raises(AssertionError, match="found 1"):
        assert_emitted("ORDER_CREATED", count=2)
