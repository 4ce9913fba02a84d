"""Each command's --help is its module's docstring: what it does and its exit codes,
written once (management/errors.py, command_help)."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import call_command, load_command_class

import django_outbox

COMMANDS = sorted(
    p.stem
    for p in (Path(django_outbox.__file__).parent / "management" / "commands").glob("*.py")
    if p.stem != "__init__"
)

pytestmark = pytest.mark.once


@pytest.mark.parametrize("name", COMMANDS)
def test_the_help_is_the_docstring_without_its_title(name):
    command = load_command_class("django_outbox", name)
    assert "Exit codes:" in command.help
    assert not command.help.startswith("manage.py")
    assert "``" not in command.help


def test_help_shows_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        call_command("purge_outbox", "--help")
    out = " ".join(capsys.readouterr().out.split())
    assert "Delete SENT outbox rows older than the retention" in out
    assert "Exit codes: 0 done" in out
