"""The base of the backends that publish to the node, or the nodes of a cluster, of
OUTBOX_BROKER_URL (NATS, Redis): the node loop, the failover and the URL check they share.
Not imported by ``backends/__init__``: it reads the checks, which import the backends."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.checks import CheckMessage

from ..conf import outbox_settings
from ..worker import BrokerNodes
from .base import BaseBackend, BrokerUnavailable, timeouts

if TYPE_CHECKING:
    from ..transports import Transport


class NodeProblem(Exception):
    """Why one node of OUTBOX_BROKER_URL could not be used (the next one is tried)."""


class NodesBackend(BaseBackend):
    """Base of the backends that publish to the node, or the nodes of a cluster, of
    OUTBOX_BROKER_URL (NATS, Redis): they connect to the first node that answers and go
    on to the next when the relay loses one.

    ``broker_url`` (``OUTBOX_BROKER_URL``), ``confirm_timeout``
    (``OUTBOX_CONFIRM_TIMEOUT``) and ``connect_timeout`` (``OUTBOX_CONNECT_TIMEOUT``), each
    defaulting to its setting.
    """

    url_setting = "OUTBOX_BROKER_URL"
    #: The broker's name in the log and in the errors ("NATS at nats://...").
    broker_name = "the broker"
    #: The transport whose URLs the backend takes, and a hint with an example URL.
    transport: ClassVar[Transport]
    url_hint: ClassVar[str] = ""

    @classmethod
    def check(cls, **kwargs: Any) -> list[CheckMessage]:
        from ..checks import broker_url_problems

        return broker_url_problems(cls.transport, cls.url_hint) + cls.settings_problems()

    @classmethod
    def settings_problems(cls) -> list[CheckMessage]:
        """The problems of the transport's own settings (checks run at start)."""
        return []

    def __init__(
        self,
        *,
        broker_url: str | Sequence[str] | None = None,
        confirm_timeout: float | None = None,
        connect_timeout: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.broker_url = outbox_settings.BROKER_URL if broker_url is None else broker_url
        self.nodes = BrokerNodes(self.broker_url)
        self.confirm_timeout, self.connect_timeout = timeouts(confirm_timeout, connect_timeout)

    @property
    def masked_url(self) -> str:
        """The URL of the node connected to (or to connect to next), password masked."""
        return self.nodes.masked

    @property
    def _logger(self) -> logging.Logger:
        return logging.getLogger(type(self).__module__)

    def connect_to_a_node(self, attempt: Callable[[], None], *, check: str) -> None:
        """Call ``attempt()`` for the current node, then the next ones, until one raises
        no :class:`NodeProblem`. When none answers: BrokerUnavailable naming each node's
        problem, then ``check`` (what to check)."""
        problems: list[str] = []

        def each() -> None:
            node = self.nodes.name()
            try:
                attempt()
            except NodeProblem as exc:
                problems.append(f"{node}: {exc}")
                raise

        def on_next(node: str, problem: Exception) -> None:
            self._logger.warning(
                "cannot connect to %s at %s: %s; trying the next node, %s",
                self.broker_name,
                node,
                problem,
                self.nodes.name(),
            )

        try:
            self.nodes.connect(each, errors=NodeProblem, on_next=on_next)
        except NodeProblem:
            where = (
                f"{self.broker_name} at "
                if len(problems) == 1
                else f"any {self.broker_name} node of {self.url_setting}: "
            )
            raise BrokerUnavailable(
                f"cannot connect to {where}{'; '.join(problems)}. {check}"
            ) from None

    def next_node(self) -> bool:
        """The relay lost this node: the next connection goes to the next one."""
        lost = self.nodes.name()
        at_once = self.nodes.failed()
        if at_once:
            self._logger.warning(
                "%s at %s is lost; failing over to %s", self.broker_name, lost, self.nodes.name()
            )
        return at_once
