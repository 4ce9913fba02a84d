"""The distributions and brand-new projects for the packaging and documentation tests: the
sdist and wheel built once per session (the ``dist`` fixture, tests/conftest.py), commands
that must succeed, the Python the newest Django runs on, a PostgreSQL database of its own."""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tests.conftest import IN_CI, require_service

ROOT = Path(__file__).resolve().parents[2]
PG_URL = os.environ.get("PG_URL", "postgres://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path

    def metadata(self) -> Message:
        with zipfile.ZipFile(self.wheel) as wheel:
            name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
            return email.parser.Parser().parsestr(wheel.read(name).decode())


def run(
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


def build(out: Path) -> Dist:
    """`python -m build`: the sdist, then the wheel built from it, as a release is made."""
    run([sys.executable, "-m", "build", "--outdir", out, ROOT])
    (sdist,) = out.glob("django_transactional_outbox-*.tar.gz")
    (wheel,) = out.glob("django_transactional_outbox-*-py3-none-any.whl")
    return Dist(sdist, wheel)


def python_for_the_newest_django() -> str:
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


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
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
    try:
        yield f"postgres://{url.netloc}/{name}"
    finally:
        with psycopg.connect(**conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
