"""Shared fixtures. Services are real; in CI a missing one fails the test, elsewhere it skips."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import closing
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pytest

from django_outbox.backends import locmem
from tests.utils.amqp import Broker
from tests.utils.proxy import TcpProxy

if TYPE_CHECKING:
    from django.test import Client

    from tests.utils.nats import NatsBroker
    from tests.utils.packaging import Dist
    from tests.utils.redis import RedisBroker

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
NATS_URL = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

START_HINTS = {
    "rabbitmq": "start it with `rabbitmq-server -detached` (or set AMQP_URL)",
    "rabbitmq-management": "enable it with `rabbitmq-plugins enable rabbitmq_management`",
    "postgresql": (
        "start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start`"
    ),
    "nats": (
        "start it with `start-stop-daemon --start --oknodo --background --exec "
        "/usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server` (or set "
        "NATS_URL)"
    ),
    "redis": (
        "start it with `start-stop-daemon --start --oknodo --background --exec "
        "/usr/bin/redis-server -- --bind 127.0.0.1 --port 6379` (or set REDIS_URL)"
    ),
    "mariadb": (
        "start it with `start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd`"
    ),
}


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def require_service(name: str, url: str, default_port: int) -> None:
    """Fail in CI, skip elsewhere (saying how to start it) when a service is down."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or default_port
    if _reachable(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}; {START_HINTS.get(name, '')}"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


DATABASE_FIXTURES = frozenset(
    {"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback"}
)


def uses_database(item: pytest.Item) -> bool:
    """Whether a test asks pytest-django for the database (which it must, to touch it), or
    depends on its engine all the same (marked ``engine``)."""
    if item.get_closest_marker("django_db") or item.get_closest_marker("engine"):
        return True
    return not DATABASE_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each database pass runs what can differ on its database (scripts/test runs SQLite,
    PostgreSQL and MariaDB in turn): the database-independent tests (marked ``once``, or
    asking for no database) in the SQLite pass only, and the broker's side of a scenario
    (marked ``transport``) once: in the SQLite pass, or in the PostgreSQL pass when it is
    a long one (marked ``slow``: the fault suite, an outage, the demo)."""
    scheme = os.environ.get("DATABASE_URL", "sqlite").split(":", 1)[0]
    sqlite, postgres = scheme.startswith("sqlite"), scheme.startswith("postgres")

    def here(item: pytest.Item) -> bool:
        if item.get_closest_marker("transport") is not None:
            # Once: a long scenario (the fault suite, an outage, the demo) needs a server.
            return postgres if item.get_closest_marker("slow") else sqlite
        return sqlite or (item.get_closest_marker("once") is None and uses_database(item))

    keep = [item for item in items if here(item)]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


@pytest.fixture
def amqp_url() -> str:
    require_service("rabbitmq", AMQP_URL, 5672)
    return AMQP_URL


@pytest.fixture
def management_url(amqp_url: str) -> str:
    """The RabbitMQ management HTTP API of the test broker (outbox_check reads bindings
    there): its host, port 15672, unless RABBITMQ_MANAGEMENT_URL says otherwise."""
    host = urlparse(amqp_url).hostname or "127.0.0.1"
    url = os.environ.get("RABBITMQ_MANAGEMENT_URL", f"http://{host}:15672/")
    require_service("rabbitmq-management", url, 15672)
    return url


@pytest.fixture
def broker(amqp_url: str) -> Iterator[Broker]:
    """This test's own exchange and queues on the real RabbitMQ, deleted afterwards."""
    with closing(Broker(amqp_url)) as b:
        yield b


@pytest.fixture
def proxied(broker: Broker) -> Iterator[tuple[TcpProxy, str]]:
    """A TcpProxy in front of RabbitMQ, and the AMQP URL that goes through it: the way
    tests cut, pause or refuse the broker without touching the shared server."""
    with TcpProxy.in_front_of(broker.url) as pair:
        yield pair


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """The sdist and the wheel, built once per session (tests/utils/packaging.py)."""
    from tests.utils.packaging import build

    return build(tmp_path_factory.mktemp("dist"))


@pytest.fixture
def fresh_database() -> Iterator[str]:
    """A PostgreSQL database of its own for a brand-new project, dropped afterwards."""
    from tests.utils.packaging import fresh_postgres_database

    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def superuser_client() -> Client:
    """The admin, logged in as a superuser."""
    from tests.utils.admin import superuser_client

    return superuser_client()


@pytest.fixture
def nats_url() -> str:
    require_service("nats", NATS_URL, 4222)
    return NATS_URL


@pytest.fixture
def nats_broker(nats_url: str) -> Iterator[NatsBroker]:
    """This test's own stream (and dead-letter stream) on the real NATS, deleted afterwards."""
    from tests.utils.nats import NatsBroker

    with closing(NatsBroker(nats_url)) as b:
        yield b


@pytest.fixture
def nats_proxied(nats_broker: NatsBroker) -> Iterator[tuple[TcpProxy, str]]:
    """A TcpProxy in front of NATS, and the URL that goes through it."""
    with TcpProxy.in_front_of(nats_broker.url) as pair:
        yield pair


@pytest.fixture
def redis_url() -> str:
    require_service("redis", REDIS_URL, 6379)
    return REDIS_URL


@pytest.fixture
def redis_broker(redis_url: str) -> Iterator[RedisBroker]:
    """This test's own streams (and dead-letter stream) on the real Redis, deleted
    afterwards: other test runs on the same server use other names."""
    from tests.utils.redis import RedisBroker

    with closing(RedisBroker(redis_url)) as b:
        yield b


@pytest.fixture
def redis_proxied(redis_broker: RedisBroker) -> Iterator[tuple[TcpProxy, str]]:
    """A TcpProxy in front of Redis, and the URL that goes through it."""
    with TcpProxy.in_front_of(redis_broker.url) as pair:
        yield pair


@pytest.fixture(autouse=True)
def _reset_locmem() -> Iterator[None]:
    locmem.reset()
    yield
    locmem.reset()


@pytest.fixture
def db_vendor() -> str:
    from django.db import connection

    return connection.vendor
