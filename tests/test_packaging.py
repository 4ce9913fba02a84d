"""The package as a team gets it: the sdist and the wheel, their metadata, the support matrix
stated the same way everywhere, and the wheel installed into a brand-new Django project that
follows docs/installation.md step by step against real PostgreSQL and RabbitMQ.

The distributions are built once per session. These tests are marked ``packaging``: they do
not depend on the database pass or on the Django of the environment, so scripts/test runs
them once (in its SQLite pass) and the tox cells leave them out.
"""

from __future__ import annotations

import configparser
import email.parser
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import django_outbox
from tests.conftest import IN_CI, require_service

ROOT = Path(__file__).resolve().parent.parent
INSTALLATION = ROOT / "docs" / "installation.md"
PG_URL = os.environ.get("PG_URL", "postgres://postgres@127.0.0.1:5432/test")

pytestmark = [pytest.mark.once, pytest.mark.packaging]

#: The Pythons each Django release supports (Django's own release notes). Ours is the part
#: of this that lies within requires-python and our Python classifiers.
DJANGO_PYTHONS = {
    "5.2": {"3.10", "3.11", "3.12", "3.13", "3.14"},
    "6.0": {"3.12", "3.13", "3.14"},
    "6.1": {"3.12", "3.13", "3.14"},
}
#: Django feature releases around ours, to pin the Requires-Dist range on both sides.
DJANGO_RELEASES = ["4.2", "5.0", "5.1", "5.2", "6.0", "6.1", "6.2", "7.0"]


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path

    def metadata(self) -> Message:
        with zipfile.ZipFile(self.wheel) as wheel:
            name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            return email.parser.Parser().parsestr(wheel.read(name).decode())


def _run(
    cmd: list[str | Path], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    return result


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """`python -m build`: the sdist, then the wheel built from it, as a release is made."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", out, ROOT])
    (sdist,) = out.glob("django_transactional_outbox-*.tar.gz")
    (wheel,) = out.glob("django_transactional_outbox-*-py3-none-any.whl")
    return Dist(sdist, wheel)


# --- the distributions ---------------------------------------------------------------------


def test_wheel_holds_the_app_and_no_tests(dist):
    names = set(zipfile.ZipFile(dist.wheel).namelist())
    app = ROOT / "django_outbox"
    shipped = {
        path.relative_to(ROOT).as_posix()
        for path in app.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and (path.suffix in {".py", ".html"} or path.name == "py.typed")
    }
    assert {
        "django_outbox/py.typed",
        "django_outbox/migrations/0001_initial.py",
        "django_outbox/templates/admin/django_outbox/outboxevent/dashboard.html",
    } <= shipped
    assert shipped <= names, f"missing from the wheel: {sorted(shipped - names)}"
    assert not [n for n in names if n.startswith(("tests/", "testproject/", "bench/", "docs/"))]
    dist_info = f"django_transactional_outbox-{django_outbox.__version__}.dist-info"
    license_file = zipfile.ZipFile(dist.wheel).read(f"{dist_info}/licenses/LICENSE").decode()
    assert license_file == (ROOT / "LICENSE").read_text()
    assert license_file.startswith("MIT License")


def test_sdist_holds_license_changelog_and_migrations_and_no_tests(dist):
    with tarfile.open(dist.sdist) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "pyproject.toml",
        "django_outbox/py.typed",
        "django_outbox/migrations/0005_claim_index.py",
    } <= names
    assert not [n for n in names if n.startswith(("tests/", "testproject/", "bench/"))]


def test_twine_check_strict_passes(dist):
    result = _run([sys.executable, "-m", "twine", "check", "--strict", dist.sdist, dist.wheel])
    assert result.stdout.count("PASSED") == 2


def test_metadata(dist):
    meta = dist.metadata()
    assert meta["Name"] == "django-transactional-outbox"
    assert meta["Version"] == django_outbox.__version__
    version = Version(django_outbox.__version__)
    assert version >= Version("1.0.0rc1") and not version.is_devrelease
    assert meta["License-Expression"] == "MIT"
    requires = meta.get_all("Requires-Dist") or []
    assert any(r.startswith("pika") for r in requires)
    assert any(r.startswith("prometheus-client") for r in requires)
    # It pinned Django below the newest release: the app only needs prometheus_client.
    assert not any(r.startswith("django-prometheus") for r in requires)
    assert {"celery", "postgres", "mysql"} <= set(meta.get_all("Provides-Extra") or [])


# --- the support matrix, said the same way everywhere ---------------------------------------


def _expand(pattern: str) -> list[str]:
    """tox's brace expansion: django{60,61}-py{312,313} -> four names."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _dotted(compact: str) -> str:
    return f"{compact[0]}.{compact[1:]}"  # 52 -> 5.2, 310 -> 3.10


def test_support_matrix_is_the_same_in_metadata_tox_and_docs(dist):
    meta = dist.metadata()
    classifiers = meta.get_all("Classifier") or []
    djangos = {
        c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Framework :: Django ::")
    }
    pythons = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    assert djangos == {"5.2", "6.0", "6.1"}
    assert pythons == {"3.10", "3.11", "3.12", "3.13"}
    assert meta["Requires-Python"] == f">={min(pythons, key=Version)}"

    (django_req,) = [r for r in meta.get_all("Requires-Dist") or [] if re.match(r"Django\b", r)]
    spec = SpecifierSet(django_req.removeprefix("Django").split(";")[0].strip())
    admitted = {release for release in DJANGO_RELEASES if f"{release}.0" in spec}
    assert admitted == djangos, f"Requires-Dist {django_req} admits {sorted(admitted)}"

    matrix = {d: sorted(DJANGO_PYTHONS[d] & pythons, key=Version) for d in djangos}

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    envs = [e for line in tox["tox"]["env_list"].split() for e in _expand(line)]
    cells: dict[str, set[str]] = {}
    for env in envs:
        django, python, database = env.split("-")
        cells.setdefault(f"{_dotted(django[6:])}|{_dotted(python[2:])}", set()).add(database)
    assert set(cells) == {f"{d}|{p}" for d, ps in matrix.items() for p in ps}
    assert all(dbs == {"sqlite", "postgres", "mariadb"} for dbs in cells.values())
    labels = {line.split("=")[0].strip() for line in tox["tox"]["labels"].strip().splitlines()}
    assert labels == {f"django{d.replace('.', '')}" for d in djangos}

    documented = {}
    for row in re.findall(
        r"^\| (\d\.\d)(?: LTS)? \| ([\d., ]+) \|$", INSTALLATION.read_text(), re.M
    ):
        documented[row[0]] = [p.strip() for p in row[1].split(",")]
    assert documented == matrix, "docs/installation.md's table of supported versions"


# --- the wheel in a brand-new project, following docs/installation.md -----------------------


def _documented(text: str) -> str:
    """A line the installation guide gives, verbatim: the test does what a reader would."""
    assert text in INSTALLATION.read_text(), f"docs/installation.md no longer says {text!r}"
    return text


def _first_event_snippet() -> str:
    text = INSTALLATION.read_text()
    section = text[text.index("## A first event") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _python_for_the_newest_django() -> str:
    if sys.version_info >= (3, 12):
        return sys.executable
    for name in ("python3.13", "python3.12"):
        path = shutil.which(name)
        # A pyenv shim is on PATH even when its version is not selected: ask it.
        if path and subprocess.run([path, "-c", ""], capture_output=True).returncode == 0:
            return path
    message = (
        "the newest Django needs Python 3.12+ and no python3.12/python3.13 answers "
        "(with pyenv: `. scripts/pythons.sh`)"
    )
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def fresh_database() -> Iterator[str]:
    """A PostgreSQL database of its own (the servers are shared), dropped afterwards."""
    require_service("postgresql", PG_URL, 5432)
    import psycopg

    name = f"test_outbox_fresh_{uuid.uuid4().hex[:12]}"
    url = urlparse(PG_URL)
    conninfo = dict(
        host=url.hostname or "127.0.0.1",
        port=url.port or 5432,
        user=unquote(url.username or "postgres"),
        password=unquote(url.password or ""),
        dbname=url.path.lstrip("/") or "postgres",
    )
    with psycopg.connect(**conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgres://{url.netloc}/{name}"
    with psycopg.connect(**conninfo, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.slow
@pytest.mark.amqp
def test_the_wheel_in_a_new_project_migrates_checks_and_relays_to_rabbitmq(
    dist, tmp_path, amqp_url, fresh_database
):
    import pika

    # pip install, into a fresh virtualenv: pip takes the newest Django our range admits.
    venv = tmp_path / "venv"
    _run([_python_for_the_newest_django(), "-m", "venv", venv])
    python = venv / "bin" / "python"
    _documented("pip install 'django-transactional-outbox[postgres]'")
    _run([python, "-m", "pip", "install", "-q", f"{dist.wheel}[postgres]"])
    newest = max(
        (
            c.rsplit(" :: ", 1)[1]
            for c in dist.metadata().get_all("Classifier") or []
            if c.startswith("Framework :: Django ::")
        ),
        key=Version,
    )
    django_version = _run([python, "-c", "import django; print(django.__version__)"]).stdout
    assert django_version.startswith(f"{newest}."), django_version

    # django-admin startproject, then the settings the guide gives.
    project = tmp_path / "shop"
    project.mkdir()
    _run([venv / "bin" / "django-admin", "startproject", "shop", project])
    settings = project / "shop" / "settings.py"
    text = settings.read_text()
    apps_end = text.index("\n]", text.index("INSTALLED_APPS = ["))
    _documented('    "django_outbox",\n]')
    text = text[:apps_end] + '\n    "django_outbox",' + text[apps_end:]
    url = urlparse(fresh_database)
    exchange = f"outbox-wheel-test-{uuid.uuid4().hex[:8]}"
    text += "\n".join(
        [
            "",
            _documented("import os"),
            _documented('OUTBOX_BROKER_URL = os.environ["AMQP_URL"]'),
            # The guide's exchange is "outbox"; the test's broker is shared, so a name of its own.
            _documented('OUTBOX_EXCHANGE = "outbox"').replace('"outbox"', f'"{exchange}"'),
            "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
            f"'NAME': {url.path.lstrip('/')!r}, 'USER': {unquote(url.username or '')!r}, "
            f"'PASSWORD': {unquote(url.password or '')!r}, 'HOST': {url.hostname!r}, "
            f"'PORT': {url.port or 5432!r}}}}}",
            # What any project sets before `check --deploy`; Django's own findings about the
            # rest (HSTS, secure cookies) are warnings and not ours.
            "DEBUG = False",
            f"SECRET_KEY = {uuid.uuid4().hex + uuid.uuid4().hex!r}",
            "ALLOWED_HOSTS = ['shop.example.com']",
            "",
        ]
    )
    if "MAILERS" in text:  # Django 6.1's template mails to the console: a deploy-time error
        text += (
            "MAILERS = {'default': {'BACKEND': 'django.core.mail.backends.smtp.EmailBackend'}}\n"
        )
    settings.write_text(text)

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "VIRTUAL_ENV", "DATABASE_URL"}
    }
    env["AMQP_URL"] = amqp_url

    def manage(*args: str) -> subprocess.CompletedProcess[str]:
        return _run([python, "manage.py", *args], cwd=project, env=env)

    manage(*_documented("python manage.py migrate").split()[2:])
    check = manage(*_documented("python manage.py check --deploy --database default").split()[2:])
    assert "django_outbox." not in check.stdout + check.stderr

    # The guide's first event, verbatim, in `manage.py shell`.
    manage("shell", "-c", _first_event_snippet())
    row = json.loads(
        manage(
            "shell",
            "-c",
            "import json; from django_outbox.models import OutboxEvent; "
            "e = OutboxEvent.objects.get(); "
            "print(json.dumps([e.event_id, e.event_type, e.status]))",
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    event_id, event_type, status = row
    assert (event_type, status) == ("ORDER_CREATED", 0)

    # A consumer's queue, bound before the relay publishes (mandatory: else it comes back).
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.exchange_declare(exchange, exchange_type="topic", durable=True)
        queue = channel.queue_declare("", exclusive=True).method.queue
        channel.queue_bind(queue, exchange, routing_key=event_type)

        manage(*_documented("python manage.py publish_outbox --once").split()[2:])

        method, properties, body = channel.basic_get(queue, auto_ack=True)
        assert method is not None, "no message reached the bound queue"
        assert properties.message_id == event_id
        assert properties.type == "ORDER_CREATED"
        assert properties.delivery_mode == 2  # persistent
        assert json.loads(body) == {"order_id": 42}
        channel.exchange_delete(exchange)
    finally:
        connection.close()

    status = (
        manage(
            "shell",
            "-c",
            "from django_outbox.models import OutboxEvent; print(OutboxEvent.objects.get().status)",
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    assert status == "1"  # SENT
