"""The wheel ships what an installed app needs (migrations, templates, py.typed), not tests."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.once
def test_wheel_contents(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("django_transactional_outbox-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "django_outbox/py.typed" in names
    assert "django_outbox/migrations/0001_initial.py" in names
    assert any(n.startswith("django_outbox/templates/admin/django_outbox/") for n in names)
    assert not any(n.startswith(("tests/", "testproject/", "bench/")) for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Name: django-transactional-outbox" in text
    assert "Requires-Dist: pika" in text
    assert "Provides-Extra: celery" in text
