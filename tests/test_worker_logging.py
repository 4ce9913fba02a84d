"""The commands' ``-v`` shows the ``django_outbox`` log lines with or without the project's
``LOGGING`` (worker.configure_logging), in a child process: pytest puts its own handlers on
the root logger, which would hide what a project without any sees."""

from __future__ import annotations

import subprocess
import sys

from tests.utils.subprocess import django_env

SCRIPT = """
import logging, django
django.setup()
from django_outbox.worker import configure_logging
configure_logging({verbosity})
configure_logging({verbosity})  # a second command in the same process adds nothing
log = logging.getLogger("django_outbox.relay")
log.debug("a debug line")
log.info("relay started")
log.warning("a warning")
"""


def run(verbosity: int, settings: str = "tests.settings") -> list[str]:
    env = django_env(DATABASE_URL="sqlite:///:memory:", DJANGO_SETTINGS_MODULE=settings)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(verbosity=verbosity)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_without_a_handler_in_logging_the_command_adds_one_on_stderr():
    # tests.settings: LOGGING names no handler, as Django's default does not for these loggers.
    lines = run(verbosity=1)
    assert len(lines) == 2, lines
    assert lines[0].endswith(" INFO django_outbox.relay relay started")
    assert lines[1].endswith(" WARNING django_outbox.relay a warning")
    assert any(line.endswith("DEBUG django_outbox.relay a debug line") for line in run(2))
    assert run(verbosity=0) == []


def test_the_projects_own_handler_is_used_alone():
    # The demo's settings route django_outbox to a console handler of their own.
    lines = run(verbosity=1, settings="config.settings")
    assert [line.split(" ", 2)[2] for line in lines] == [
        "INFO django_outbox.relay relay started",
        "WARNING django_outbox.relay a warning",
    ]
