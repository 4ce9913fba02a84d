"""The consumer side: idempotent handlers and the loops that feed them.

- :mod:`~django_outbox.consumer.handlers`: the handler API (:class:`IdempotentHandler`,
  :class:`SourceEventModel`, the ordered check) and how handlers are found;
- :mod:`~django_outbox.consumer.dispatch`: a delivered message in, one decision out
  (acknowledge, retry later, dead-letter with a reason, hold);
- :mod:`~django_outbox.consumer.base`: the loop every transport shares, and the contract
  a transport implements (:class:`BaseConsumer`);
- :mod:`~django_outbox.consumer.amqp`: the RabbitMQ transport (:class:`Consumer`).

Every public name is importable from here. The transport's loop is imported on first use,
so that code needing only the handler API (Celery's ``IdempotentTask``) never loads a
broker client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..message import Delivery
from .base import (
    LOST_CONNECTION_RETRIES,
    BaseConsumer,
    BrokerUnreachable,
    CannotConnect,
    ImproperlyConfiguredConsumer,
    dead_letter_queue_name,
    default_queue_name,
)
from .dispatch import (
    REASON_HEADER,
    Action,
    ConsumeResult,
    Decision,
    Dispatcher,
    message_outcome,
    process_messages,
)
from .handlers import (
    HandlerResult,
    IdempotentHandler,
    ImproperlyConfiguredHandler,
    Outcome,
    SourceEventModel,
    connection_lost,
    discover_handlers,
    get_handlers,
    load_handler,
)

if TYPE_CHECKING:
    from .amqp import DELIVERY_HEADER, Consumer, queue_arguments

#: Names of the RabbitMQ module, loaded when first asked for.
_AMQP = frozenset({"DELIVERY_HEADER", "Consumer", "queue_arguments"})

__all__ = [
    "DELIVERY_HEADER",
    "LOST_CONNECTION_RETRIES",
    "REASON_HEADER",
    "Action",
    "BaseConsumer",
    "BrokerUnreachable",
    "CannotConnect",
    "ConsumeResult",
    "Consumer",
    "Decision",
    "Delivery",
    "Dispatcher",
    "HandlerResult",
    "IdempotentHandler",
    "ImproperlyConfiguredConsumer",
    "ImproperlyConfiguredHandler",
    "Outcome",
    "SourceEventModel",
    "connection_lost",
    "dead_letter_queue_name",
    "default_queue_name",
    "discover_handlers",
    "get_handlers",
    "load_handler",
    "message_outcome",
    "process_messages",
    "queue_arguments",
]


def __getattr__(name: str) -> Any:
    if name in _AMQP:
        from . import amqp

        return getattr(amqp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
