"""A loopback TCP proxy for outage tests: cut every connection through it on demand.

Tests never stop the shared RabbitMQ; they connect through this proxy and call
:meth:`TcpProxy.cut` to drop their own connections (new ones are accepted again),
:meth:`TcpProxy.refuse` to turn new ones away too (an outage until :meth:`TcpProxy.allow`),
or :meth:`TcpProxy.pause` to stop forwarding broker-to-client bytes while the connection
stays up (a broker that never answers: confirm timeouts) until :meth:`TcpProxy.resume`.
:meth:`TcpProxy.hold_upstream_after` lets only so many more client-to-broker bytes through,
so a test knows part of what it sent never reached the broker. :meth:`TcpProxy.wait_quiet`
waits until nothing has passed either way for a while: the client has read every answer.
:func:`closed_port` is a loopback port nobody listens on (a connection is refused).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._refusing = False
        self._downstream = threading.Event()  # set: broker->client bytes flow
        self._downstream.set()
        self._upstream_budget: int | None = None  # None: no limit
        self._upstream_open = threading.Event()
        self._upstream_open.set()
        self.downstream_bytes = 0  # broker->client bytes forwarded so far
        self._last_traffic = time.monotonic()
        threading.Thread(target=self._accept, daemon=True).start()

    @classmethod
    def for_url(cls, url: str) -> tuple[TcpProxy, str]:
        """A proxy in front of the URL's host, and the same URL pointing at the proxy."""
        parts = urlsplit(url)
        proxy = cls(parts.hostname or "127.0.0.1", parts.port or 5672)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth + '@' if auth else ''}127.0.0.1:{proxy.port}"
        return proxy, urlunsplit(parts._replace(netloc=netloc))

    @classmethod
    @contextmanager
    def in_front_of(cls, url: str) -> Iterator[tuple[TcpProxy, str]]:
        """:meth:`for_url`, closed at the end of the block."""
        proxy, proxied_url = cls.for_url(url)
        try:
            yield proxy, proxied_url
        finally:
            proxy.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self._refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, up), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                self._last_traffic = time.monotonic()
                if upstream:
                    while data:
                        n = self._allowance(len(data))
                        sink.sendall(data[:n])
                        data = data[n:]
                    continue
                self._downstream.wait()
                self.downstream_bytes += len(data)
                sink.sendall(data)
                self._last_traffic = time.monotonic()
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def wait_quiet(self, seconds: float = 0.5, timeout: float = 30.0) -> bool:
        """Wait until no byte has passed either way for ``seconds`` (False after ``timeout``).

        Seeing a client's commit from another connection does not mean the client has read
        the server's answer to it; once the proxy has been quiet, it has."""
        deadline = time.monotonic() + timeout
        while (quiet := time.monotonic() - self._last_traffic) < seconds:
            if time.monotonic() + seconds - quiet > deadline:
                return False
            time.sleep(seconds - quiet)
        return True

    def cut(self) -> None:
        """Drop every connection made through the proxy so far."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def refuse(self) -> None:
        """Close new connections at once (existing ones are untouched: ``cut()`` them)."""
        self._refusing = True

    def allow(self) -> None:
        self._refusing = False

    def pause(self) -> None:
        """Hold back everything the broker sends (the client's bytes still go through)."""
        self._downstream.clear()

    def resume(self) -> None:
        """Forward both ways again, without limit."""
        with self._lock:
            self._upstream_budget = None
        self._upstream_open.set()
        self._downstream.set()

    def hold_upstream_after(self, nbytes: int) -> None:
        """Forward at most ``nbytes`` more client-to-broker bytes, hold the rest."""
        with self._lock:
            self._upstream_budget = nbytes

    def _allowance(self, wanted: int) -> int:
        """How many of ``wanted`` bytes may go upstream now; waits while the budget is 0."""
        while True:
            with self._lock:
                budget = self._upstream_budget
                if budget is None:
                    return wanted
                if budget > 0:
                    n = min(budget, wanted)
                    self._upstream_budget = budget - n
                    return n
                self._upstream_open.clear()
            self._upstream_open.wait()

    def close(self) -> None:
        self._closed = True
        self.resume()
        self._server.close()
        self.cut()
