"""What every long-running command shares: the serving loop, its backoff, signals,
heartbeat, and the broker nodes it connects to.

``publish_outbox`` (the relay) and ``consume_outbox`` (the consumer) are both a loop that
must never die on a transient failure (a broker restart, a database failover) and must stop
cleanly when Kubernetes sends SIGTERM. The loop is :func:`keep_running`: it calls one step
after another, and after a failure waits a growing pause (:class:`Backoff`) before the next,
unless the failure was a broker node's and another node is left to try
(:class:`BrokerNodes`): then it tries that one at once.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from .conf import broker_urls
from .masking import mask_url

_T = TypeVar("_T")

#: ``manage.py <command> -v N`` -> the level of the ``django_outbox`` loggers.
VERBOSITY_LEVELS = {0: logging.ERROR, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


#: The format of the handler a command adds when the project's ``LOGGING`` has none for
#: the ``django_outbox`` loggers (the one the demo's settings use).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record comes, not as it was when the
    handler was made (a test runner swaps it per test)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(verbosity: int) -> None:
    """Set the ``django_outbox`` loggers' level from a command's ``--verbosity``, and give
    them a handler on stderr when the project's ``LOGGING`` gives them none.

    Without a handler, Python's last resort prints WARNING and above only, bare: the INFO
    and DEBUG lines that ``-v 1`` and ``-v 2`` ask for would go nowhere. A project that
    routes the loggers (or the root logger) anywhere keeps its own handlers alone.
    """
    logger = logging.getLogger("django_outbox")
    logger.setLevel(VERBOSITY_LEVELS.get(verbosity, logging.INFO))
    if not logger.hasHandlers():
        logger.addHandler(_StderrHandler())


class Backoff:
    """Exponential pause after a failure: ``initial`` (0.5 s), twice that, ... up to
    ``maximum``. Every wait of the relay and the consumer is one of these: a lost broker or
    database (:meth:`next`, :meth:`reset`), and the pause before a failed message is
    delivered again (:meth:`pause` of its delivery number)."""

    def __init__(self, *, initial: float = 0.5, maximum: float = 30.0) -> None:
        self.initial, self.maximum = initial, maximum
        self.failures = 0

    def pause(self, failures: int) -> float:
        """The pause after ``failures`` failures in a row (none: 0)."""
        if failures < 1 or self.initial <= 0:
            return 0.0
        # The exponent is capped: 2**64 times any initial is past every maximum.
        return min(self.maximum, self.initial * 2 ** min(failures - 1, 64))

    def next(self) -> float:
        """One more failure: the pause to wait before trying again."""
        self.failures += 1
        return self.pause(self.failures)

    def reset(self) -> None:
        self.failures = 0


class BrokerNodes:
    """The broker nodes a worker connects to, and which one is next: the one place the relay's
    backend and the consumer keep them.

    ``OUTBOX_BROKER_URL`` names one node, or several (the nodes of a cluster, see
    :func:`~django_outbox.conf.broker_urls`). A worker connects to :attr:`current`. When that
    node does not answer, or a connection to it is lost, :meth:`failed` moves on to the next
    one (round robin), which the worker tries at once. Once every node has failed since the
    last pause (a *round*), ``failed()`` says so and the worker pauses with its backoff; the
    next round starts at the node after the last one tried. With one URL every failure ends
    a round, which is how a worker with a single broker has always behaved.

    A connection that works for a while does not start a new round: nodes that fail in turn
    (a flapping cluster) still get the pause after each of them has failed once.
    """

    def __init__(self, urls: object) -> None:
        self.urls = broker_urls(urls)
        self._index = 0
        self._failed = 0  # nodes that failed in this round

    def __len__(self) -> int:
        return len(self.urls)

    def __str__(self) -> str:
        """Every node, passwords masked: for a line that names what a worker may connect to."""
        return "; ".join(mask_url(url) for url in self.urls)

    @property
    def current(self) -> str:
        """The URL to connect to now (``""`` when there is none)."""
        return self.urls[self._index] if self.urls else ""

    @property
    def masked(self) -> str:
        """The current URL with its password masked."""
        return mask_url(self.current)

    def name(self) -> str:
        """The current node for a log line: the masked URL and, with several, which one."""
        if len(self.urls) < 2:
            return self.masked
        return f"{self.masked} (node {self._index + 1} of {len(self.urls)})"

    def start(self) -> None:
        """Before connecting: if the last round ended (every node failed, the worker has
        paused since), a new one begins."""
        if self._failed >= len(self.urls):
            self._failed = 0

    def connect(
        self,
        attempt: Callable[[], _T],
        *,
        errors: type[Exception] | tuple[type[Exception], ...],
        on_next: Callable[[str, Exception], None],
    ) -> _T:
        """Connect to the first node that answers, from the current one on: the one node
        loop of the relay's backend and the consumer.

        ``attempt()`` connects to :attr:`current`. One that raises ``errors`` moves on to the
        next node (:meth:`failed`), which is tried at once after ``on_next(node, error)``
        said so; once every node has failed in this round, the last error propagates (the
        worker pauses with its backoff and calls this again).
        """
        self.start()
        while True:
            node = self.name()
            try:
                return attempt()
            except errors as exc:
                if not self.failed():
                    raise
                on_next(node, exc)

    def failed(self) -> bool:
        """The current node did not answer, or the connection to it was lost: move on to the
        next. True: that node has not failed in this round, connect to it at once. False:
        every node has failed since the last pause (or there is one): pause first. Once a
        round is over, calling it again changes nothing until :meth:`start`."""
        if self._failed >= len(self.urls):
            return False
        self._failed += 1
        self._index = (self._index + 1) % len(self.urls)
        return self._failed < len(self.urls)


def keep_running(
    stop: threading.Event,
    step: Callable[[], bool],
    *,
    backoff: Backoff,
    on_error: Callable[[Exception, float], None],
    recoverable: type[Exception] | tuple[type[Exception], ...] = Exception,
    fail_over: Callable[[Exception], bool] | None = None,
) -> None:
    """Call ``step()`` until it returns True (the loop is over) or ``stop`` is set.

    A step that raises a ``recoverable`` error is reported with ``on_error(exc, pause)``
    (log it, close what it broke), then tried again after ``pause`` seconds, the backoff's
    next; ``stop`` cuts the pause short. A step that returns resets the backoff. Any other
    error propagates.

    ``fail_over(exc)`` is asked first: True means the error was a broker node's and the
    worker has moved on to another node not yet tried in this round (:meth:`BrokerNodes.failed`),
    so the step is tried again at once (``pause`` 0) and the backoff does not grow.
    """
    while not stop.is_set():
        try:
            if step():
                return
        except recoverable as exc:
            if stop.is_set():
                return
            if fail_over is not None and fail_over(exc):
                on_error(exc, 0.0)
                continue
            pause = backoff.next()
            on_error(exc, pause)
            stop.wait(pause)
            continue
        backoff.reset()


class Heartbeat:
    """Touches a file on every loop, for a liveness probe (``OUTBOX_HEARTBEAT_FILE``)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None

    def beat(self) -> None:
        if self.path is None:
            return
        try:
            self.path.touch()
        except FileNotFoundError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()


@contextmanager
def stop_on_signals(stop: threading.Event, log: Callable[[str], None]) -> Iterator[None]:
    """First SIGTERM/SIGINT: set ``stop`` (the loop finishes what it holds, then exits 0).
    Second: exit 1 at once."""

    def handler(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log(f"{name} again: exiting at once")
            raise SystemExit(1)
        log(f"{name} received: finishing the batch in flight, then exiting")
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
