"""Run manage.py commands in a child process against the test database of this test."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

ROOT = Path(__file__).resolve().parents[2]
MANAGE = ROOT / "testproject" / "manage.py"

_SCHEMES = {
    "django.db.backends.postgresql": "postgres",
    "django.db.backends.mysql": "mysql",
    "django.db.backends.sqlite3": "sqlite",
}


def database_url(alias: str = "default") -> str:
    """A DATABASE_URL naming the database the running test uses (its test database).

    Only meaningful in ``transaction=True`` tests: otherwise the child cannot see the rows
    of the test's uncommitted transaction. An in-memory SQLite database cannot be shared:
    the test is skipped with the fix (a file name in TEST_DATABASE_NAME).
    """
    from django.db import connections

    conf = connections[alias].settings_dict
    scheme = _SCHEMES.get(conf["ENGINE"])
    if scheme is None:
        pytest.skip(f"no DATABASE_URL scheme for {conf['ENGINE']}")
    name = str(conf["NAME"])
    if scheme == "sqlite":
        if "memory" in name or not name:
            pytest.skip(
                "a child process cannot open an in-memory SQLite test database; run with "
                "TEST_DATABASE_NAME=/tmp/test_<you>.sqlite3"
            )
        return f"sqlite:///{name}"
    auth = quote(conf.get("USER") or "", safe="")
    if conf.get("PASSWORD"):
        auth += ":" + quote(conf["PASSWORD"], safe="")
    host = conf.get("HOST") or "127.0.0.1"
    port = f":{conf['PORT']}" if conf.get("PORT") else ""
    return f"{scheme}://{auth + '@' if auth else ''}{host}{port}/{quote(name, safe='')}"


def other_database_url() -> str:
    """The URL of the test's ``other`` database (tests/settings.py), or ``none`` when this
    test did not create it: the child then has no such alias."""
    from django.db import connections

    if "other" not in connections.settings:
        return "none"
    conf = connections["other"].settings_dict
    test_name = (conf.get("TEST") or {}).get("NAME")
    if not test_name or conf["NAME"] != test_name:
        return "none"
    return database_url("other")


def django_env(**extra: str) -> dict[str, str]:
    """Environment for ``python testproject/manage.py ...`` using this test's database
    (or the DATABASE_URL given in ``extra``)."""
    env = dict(os.environ)
    env.pop("TEST_DATABASE_NAME", None)
    paths = [str(ROOT), str(ROOT / "testproject")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=os.pathsep.join(paths),
        DATABASE_URL=extra.get("DATABASE_URL") or database_url(),
        PYTHONUNBUFFERED="1",
    )
    env["OTHER_DATABASE_URL"] = other_database_url()
    env.update(extra)
    return env


def manage_command(*args: str) -> list[str]:
    return [sys.executable, str(MANAGE), *args]
