"""Fixtures of the fault-injection suite and its summary table.

The suite needs PostgreSQL or MariaDB: its scenarios run several relay processes at once,
which SQLite cannot do safely (no row locks; system check W004). On SQLite every test here
is skipped with that reason; ``scripts/test`` runs the suite in its PostgreSQL and MariaDB
passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.utils.amqp import Broker

from .harness import Processes, Verdict

_VERDICTS: list[tuple[str, Verdict]] = []


@pytest.fixture(autouse=True)
def _needs_row_locks(db_vendor: str) -> None:
    if db_vendor not in {"postgresql", "mysql"}:
        pytest.skip(
            "the fault-injection suite runs several relays at once and needs PostgreSQL or "
            "MariaDB/MySQL (SQLite has no row locks); run it with DATABASE_URL=postgres://... "
            "or mysql://..."
        )


@pytest.fixture
def procs(tmp_path: Path, broker: Broker) -> Iterator[Processes]:
    with Processes(tmp_path, broker) as p:
        yield p


@pytest.fixture
def record(db_vendor: str) -> Callable[[Verdict], None]:
    def add(verdict: Verdict) -> None:
        _VERDICTS.append((db_vendor, verdict))

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _VERDICTS:
        return
    tr = terminalreporter
    tr.section("fault-injection summary")
    width = max(len("scenario"), *(len(v.scenario) for _, v in _VERDICTS))
    header = (
        f"{'scenario':<{width}} {'database':<10} {'events':>7} {'lost':>5} {'dups':>5} "
        f"{'dead':>5}  verdict"
    )
    tr.write_line(header)
    tr.write_line("-" * len(header))
    for vendor, v in _VERDICTS:
        verdict = "ok" if v.ok else "FAILED"
        if v.ok and v.duplicates:
            verdict += " (duplicates allowed: crash or lost confirm)"
        if v.unconfirmed_sent:
            verdict += f" ({len(v.unconfirmed_sent)} SENT unconfirmed)"
        tr.write_line(
            f"{v.scenario:<{width}} {vendor:<10} {v.events:>7} {len(v.lost):>5} "
            f"{v.duplicates:>5} {v.dead:>5}  {verdict}"
        )
