"""Publish outbox-shaped messages to a private RabbitMQ exchange, as the relay would."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pika
from django.utils import timezone

from django_outbox.message import CONTENT_TYPE, encode_body, encode_headers
from django_outbox.models import OutboxEvent


def make_event(
    event_type: str = "ORDER_CREATED", *, payload: Any = None, pk: int = 1, **fields: Any
) -> OutboxEvent:
    """An unsaved OutboxEvent, only to go through message.py's encoders."""
    now = timezone.now()
    if payload is None:
        payload = {"order_id": pk, "number": f"N{pk}", "user_id": 7, "amount": Decimal("12.50")}
    return OutboxEvent(
        pk=pk,
        event_id=fields.pop("event_id", uuid.uuid4().hex),
        event_type=event_type,
        aggregate_type="ORDER",
        aggregate_id=f"N{pk}",
        payload=payload,
        headers={},
        occurred_at=now,
        next_retry_time=now,
        created_at=now,
        **fields,
    )


def properties(event: OutboxEvent) -> pika.BasicProperties:
    return pika.BasicProperties(
        content_type=CONTENT_TYPE,
        delivery_mode=2,
        message_id=event.event_id,
        type=event.event_type,
        headers=encode_headers(event),
    )


@dataclass
class Broker:
    url: str
    exchange: str
    queue: str
    channel: Any

    @property
    def dlq(self) -> str:
        return f"{self.queue}.dlq"

    def publish(self, event: OutboxEvent, routing_key: str | None = None) -> None:
        self.channel.basic_publish(
            self.exchange, routing_key or event.event_type, encode_body(event), properties(event)
        )

    def publish_raw(self, body: bytes, props: pika.BasicProperties, routing_key: str) -> None:
        self.channel.basic_publish(self.exchange, routing_key, body, props)

    def count(self, queue: str) -> int:
        return int(self.channel.queue_declare(queue, passive=True).method.message_count)

    def get(self, queue: str) -> tuple[Any, Any, bytes] | None:
        method, props, body = self.channel.basic_get(queue, auto_ack=True)
        return None if method is None else (method, props, body)


@contextmanager
def private_broker(url: str) -> Iterator[Broker]:
    """A uniquely named exchange and queue name; everything is deleted afterwards."""
    suffix = uuid.uuid4().hex[:10]
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    exchange, queue = f"test_h3.{suffix}", f"test_h3.{suffix}.q"
    channel.exchange_declare(exchange, "topic", durable=True)
    try:
        yield Broker(url=url, exchange=exchange, queue=queue, channel=channel)
    finally:
        for name in (queue, f"{queue}.dlq"):
            channel.queue_delete(name)
        channel.exchange_delete(exchange)
        connection.close()
