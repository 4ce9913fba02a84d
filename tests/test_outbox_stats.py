"""manage.py outbox_stats: figures, --json, --since, thresholds and exit codes 0/1/2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from django_outbox.models import Status
from tests.utils.rows import make_events

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command("outbox_stats", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def rows():
    return make_events(
        {"age": 900, "retry_count": 0},
        {"age": 60, "retry_count": 3},
        {"status": Status.DEAD, "retry_count": 7, "event_type": "ORDER_PAID", "age": 120},
        {"status": Status.SENT, "age": 1200, "sent_age": 1100},
        {"status": Status.SENT, "age": 5400, "sent_age": 5300},
    )


def test_text_output_has_figures_and_triage_table(rows):
    out = run()
    figures = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines()[:6])
    assert figures == {
        "PENDING": "2",
        "scheduled": "0",
        "oldest PENDING age": "15 min",
        "DEAD": "1",
        "SENT (last 1 h)": "1",
        "created (last 1 h)": "4",
    }
    assert "status x retry_count" in out
    table = {
        line.split()[0]: line.split()[1:]
        for line in out.splitlines()
        if line[:4] in {"pend", "sent", "dead"}
    }
    assert table["pending"] == ["1", "1", "0"]  # retry counts 0, 3, 7
    assert table["sent"] == ["1", "0", "0"]
    assert table["dead"] == ["0", "0", "1"]
    assert "ORDER_PAID" in out


def test_json_output_matches_the_database(rows):
    data = json.loads(run("--json", "--since", "2h"))
    assert data["pending"] == 2
    assert data["dead"] == 1
    assert data["sent_in_window"] == 2
    assert data["created_in_window"] == 5
    assert data["window_seconds"] == 7200
    assert 900 <= data["oldest_pending_age_seconds"] < 960
    assert data["top_dead_event_types"] == [{"event_type": "ORDER_PAID", "count": 1}]
    assert data["thresholds_crossed"] == []
    assert len(data["trend"]) == 60
    assert sum(b["created"] for b in data["trend"]) == 5


def test_since_narrows_the_window(rows):
    data = json.loads(run("--json", "--since", "10m"))
    assert data["created_in_window"] == 2
    assert data["sent_in_window"] == 0
    # PENDING and DEAD counts are not windowed: a backlog is a backlog.
    assert (data["pending"], data["dead"]) == (2, 1)


@pytest.mark.parametrize(
    "args",
    [["--max-pending", "1"], ["--max-oldest-age", "10m"], ["--max-dead", "0"]],
)
def test_crossed_threshold_exits_1(rows, args):
    with pytest.raises(CommandError) as info:
        run(*args)
    assert info.value.returncode == 1
    assert "threshold crossed" in str(info.value)


def test_thresholds_not_crossed_exit_0(rows):
    out = run("--max-pending", "2", "--max-oldest-age", "1h", "--max-dead", "1")
    assert "THRESHOLD CROSSED" not in out


def test_crossed_threshold_is_reported_in_json(rows):
    out = StringIO()
    with pytest.raises(CommandError):
        call_command("outbox_stats", "--json", "--max-dead", "0", stdout=out)
    assert json.loads(out.getvalue())["thresholds_crossed"] == [
        "1 DEAD events, more than --max-dead 0"
    ]


def test_empty_outbox():
    data = json.loads(
        run("--json", "--max-pending", "0", "--max-dead", "0", "--max-oldest-age", "1")
    )
    assert (data["pending"], data["dead"], data["oldest_pending_age_seconds"]) == (0, 0, 0)
    assert "(no rows)" in run()


@pytest.mark.once
def test_bad_duration_is_a_usage_error():
    with pytest.raises(CommandError, match="not a duration"):
        call_command("outbox_stats", "--since", "soon")


@pytest.mark.once
def test_unreachable_database_exits_2():
    """A real process: the exit status itself is what a deployment gate sees."""
    env = {
        **os.environ,
        "DATABASE_URL": "postgres://nobody@127.0.0.1:9/outbox",  # port 9: nothing listens
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONPATH": os.pathsep.join([".", "testproject"]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "django", "outbox_stats"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "outbox_stats: the database 'default' (postgres://nobody@127.0.0.1:9/outbox) is "
        "unreachable: " in proc.stderr
    )
    assert "Traceback" not in proc.stderr
