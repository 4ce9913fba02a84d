"""The backend contract (django_outbox.backends.base) and what every backend shares."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timezone

import celery
import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_outbox.backends import get_backend_class
from django_outbox.backends.base import (
    BaseBackend,
    PublishResult,
    SyncBackend,
    contract_problem,
    describe_error,
)
from django_outbox.backends.celery import CeleryBackend
from django_outbox.backends.console import ConsoleBackend
from django_outbox.backends.locmem import LocmemBackend
from django_outbox.backends.pika import PikaBackend
from django_outbox.checks import Codes, check_backend
from django_outbox.exceptions import ImproperlyConfiguredBackend
from django_outbox.models import OutboxEvent

pytestmark = pytest.mark.once

HERE = __name__


def make_rows(count: int, start: int = 1) -> list[OutboxEvent]:
    return [
        OutboxEvent(
            pk=start + i,
            event_id=uuid.uuid4().hex,
            event_type="ORDER_CREATED",
            aggregate_type="orders.Order",
            aggregate_id=str(start + i),
            payload={},
            headers={},
            occurred_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
            retry_count=0,
        )
        for i in range(count)
    ]


# -- backends that break the contract, by dotted path for OUTBOX_BACKEND -----------------------
class PublishOnBase(BaseBackend):
    """How a publish-only backend was written before the one contract."""

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        return [PublishResult.sent() for _ in events]


class NoAbandon(BaseBackend):
    def send(self, events: Sequence[OutboxEvent]) -> None:
        pass

    def wait(self) -> list[PublishResult]:
        return []


class Pipelined(BaseBackend):
    """A backend with asynchronous confirms: each batch is confirmed when waited for."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.sent: list[list[str]] = []
        self.calls: list[str] = []

    def send(self, events: Sequence[OutboxEvent]) -> None:
        self.calls.append("send")
        self.sent.append([e.event_id for e in events])

    def wait(self) -> list[PublishResult]:
        self.calls.append("wait")
        return [PublishResult.sent() for _ in self.sent.pop(0)] if self.sent else []

    def abandon(self) -> None:
        self.sent.clear()


class PublishOverPipeline(Pipelined):
    """The demo's old mistake: a wrapper whose publish() the relay would never call."""

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        raise AssertionError("never called by the relay")


class Recording(SyncBackend):
    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.published: list[list[str]] = []

    def publish(self, events: Sequence[OutboxEvent]) -> list[PublishResult]:
        self.published.append([e.event_id for e in events])
        return [PublishResult.sent() for _ in events]


# -- the contract ----------------------------------------------------------------------------
def test_a_publish_only_backend_on_base_backend_is_told_to_use_sync_backend() -> None:
    with pytest.raises(TypeError) as info:
        PublishOnBase()
    message = str(info.value)
    assert "PublishOnBase implements publish() only" in message
    assert "send(), wait() and abandon()" in message
    assert "Derive it from django_outbox.backends.base.SyncBackend" in message


def test_a_backend_missing_part_of_the_contract_is_told_what_is_missing() -> None:
    with pytest.raises(TypeError, match=r"NoAbandon does not implement abandon\(\)"):
        NoAbandon()


def test_overriding_publish_below_a_pipelined_backend_is_refused() -> None:
    with pytest.raises(TypeError) as info:
        PublishOverPipeline()
    message = str(info.value)
    assert "PublishOverPipeline overrides publish(), but the relay never calls it" in message
    assert "Pipelined.send()" in message
    assert "Override send(), wait() and abandon() instead" in message
    # A backend that defines publish() beside its own send()/wait() is fine.
    assert PikaBackend(broker_url="amqp://127.0.0.1:1/").publish([]) == []


def test_sync_backend_publishes_each_batch_when_the_relay_waits_for_it() -> None:
    backend = Recording()
    first, second, third = make_rows(2), make_rows(1, start=10), make_rows(3, start=20)
    backend.send(first)
    backend.send(second)
    assert backend.published == []  # nothing reaches the broker before the relay waits
    assert [r.ok for r in backend.wait()] == [True, True]
    assert backend.published == [[e.event_id for e in first]]
    backend.send(third)
    assert len(backend.wait()) == 1 and len(backend.wait()) == 3  # oldest first
    assert backend.wait() == []
    backend.send(first)
    backend.abandon()  # the relay stopped with it in flight: never published
    assert backend.wait() == []
    assert len(backend.published) == 3


def test_publish_is_send_then_wait_on_a_pipelined_backend() -> None:
    backend = Pipelined()
    assert backend.publish([]) == []
    assert [r.ok for r in backend.publish(make_rows(2))] == [True, True]
    assert backend.calls == ["send", "wait"]


def test_confirm_timeout_is_part_of_the_contract() -> None:
    """The relay sends a batch claimed ahead only while its lease covers this wait."""
    with override_settings(OUTBOX_CONFIRM_TIMEOUT=3):
        assert Recording().confirm_timeout == 0.0  # answered at once
        assert LocmemBackend().confirm_timeout == ConsoleBackend().confirm_timeout == 0.0
        assert PikaBackend(broker_url="amqp://rabbit/").confirm_timeout == 3.0
        assert CeleryBackend(app=celery.Celery("contract")).confirm_timeout == 3.0
        assert Pipelined().confirm_timeout == 0.0


def test_the_shipped_synchronous_backends_use_the_adapter() -> None:
    for backend in (LocmemBackend, ConsoleBackend):
        assert issubclass(backend, SyncBackend), backend
    # Pipelined confirms of their own (the Celery backend writes through the pika one's).
    for backend in (PikaBackend, CeleryBackend):
        assert not issubclass(backend, SyncBackend), backend
        assert contract_problem(backend) == ""


# -- configuring a backend that breaks the contract ---------------------------------------------
def test_get_backend_class_refuses_a_backend_that_breaks_the_contract() -> None:
    with pytest.raises(ImproperlyConfiguredBackend) as info:
        get_backend_class(f"{HERE}.PublishOnBase")
    assert str(info.value).startswith(f"OUTBOX_BACKEND '{HERE}.PublishOnBase': PublishOnBase")
    assert "SyncBackend" in str(info.value)
    assert get_backend_class(f"{HERE}.Recording") is Recording


def test_manage_py_check_reports_it() -> None:
    with override_settings(OUTBOX_BACKEND=f"{HERE}.PublishOverPipeline"):
        [error] = check_backend()
    assert error.id == Codes.BACKEND
    assert "overrides publish(), but the relay never calls it" in error.msg


@pytest.mark.django_db  # the command connects to the database before it builds the backend
def test_publish_outbox_exits_2_with_the_fix() -> None:
    with (
        override_settings(OUTBOX_BACKEND=f"{HERE}.PublishOnBase"),
        pytest.raises(CommandError) as info,
    ):
        call_command("publish_outbox", "--once")
    assert info.value.returncode == 2
    assert "Derive it from django_outbox.backends.base.SyncBackend" in str(info.value)


# -- shared helpers ----------------------------------------------------------------------------
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
