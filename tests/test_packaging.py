"""The package as a team gets it: the sdist and the wheel, their metadata, and the support
matrix stated the same way everywhere. The wheel in a brand-new project that follows the
documentation is tests/test_docs_examples.py.

The distributions are built once per session (the ``dist`` fixture). These tests are marked
``packaging``: they do not depend on the database pass or on the Django of the environment,
so scripts/test runs them once (in its SQLite pass) and the tox cells leave them out.
"""

from __future__ import annotations

import configparser
import itertools
import re
import sys
import tarfile
import zipfile

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import django_outbox
from tests.utils.packaging import ROOT, run

INSTALLATION = ROOT / "docs" / "installation.md"

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
    result = run([sys.executable, "-m", "twine", "check", "--strict", dist.sdist, dist.wheel])
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
