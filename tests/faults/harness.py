"""The fault-injection harness: a private RabbitMQ queue, relay child processes, the verdict.

Every scenario emits events with ``outbox.atomic()`` in the test process, runs the real
commands (``publish_outbox``, ``compensate_outbox``) as child processes on the test
database, breaks something, and ends with :func:`check_invariants`, which compares the
table with what reached the test's own queue, by event_id:

* no committed event is lost: each one reached the queue at least once, or it is DEAD and
  a dead-letter alert named it;
* no row is SENT that the broker did not confirm: a confirmed message was routed to the
  queue (the queue is bound to every routing key of the exchange), so a SENT row whose
  event_id is not in the queue was marked SENT without a confirm;
* duplicates only after a crash: a scenario without a crash must deliver each event once.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import connection

from django_outbox import outbox
from django_outbox.models import OutboxEvent, Status
from tests.utils.amqp import Broker
from tests.utils.subprocess import django_env, manage_command

CHILD_SETTINGS = "tests.faults.child_settings"


# --- child processes ---------------------------------------------------------------------
@dataclass
class Child:
    """A manage.py command running in its own process; output goes to files (no pipes)."""

    name: str
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def wait(self, timeout: float = 60.0) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def tail(self, lines: int = 15) -> str:
        text = self.stderr().splitlines()[-lines:]
        return f"--- {self.name} (pid {self.pid}, rc {self.popen.poll()}):\n" + "\n".join(text)

    def summary(self) -> dict[str, int]:
        """found/sent/failed/dead from the command's last summary line on stdout."""
        found = re.findall(r"found=(\d+) sent=(\d+) failed=(\d+) dead=(\d+)", self.stdout())
        if not found:
            return {}
        return dict(zip(("found", "sent", "failed", "dead"), map(int, found[-1]), strict=True))


class Processes:
    """Starts relay/compensator children against the test database and the test's exchange.

    Keyword arguments of :meth:`start` and :meth:`run` are ``OUTBOX_*`` settings of the
    child (without the prefix), on top of tests/faults/child_settings.py.
    """

    def __init__(self, workdir: Path, broker: Broker) -> None:
        self.workdir = workdir
        self.broker = broker
        self.children: list[Child] = []

    def env(self, database_url: str = "", **outbox_settings: Any) -> dict[str, str]:
        values = {"BROKER_URL": self.broker.url, "EXCHANGE": self.broker.exchange}
        values.update(outbox_settings)
        env = django_env(
            DJANGO_SETTINGS_MODULE=CHILD_SETTINGS,
            FAULTS_OUTBOX=json.dumps({f"OUTBOX_{k}": v for k, v in values.items()}),
        )
        if database_url:
            env["DATABASE_URL"] = database_url
        return env

    def start(
        self,
        command: str,
        *args: str,
        name: str = "",
        database_url: str = "",
        **outbox_settings: Any,
    ) -> Child:
        name = name or f"{command}-{len(self.children) + 1}"
        out = self.workdir / f"{name}.out"
        err = self.workdir / f"{name}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            popen = subprocess.Popen(
                manage_command(command, *args),
                env=self.env(database_url, **outbox_settings),
                stdout=stdout,
                stderr=stderr,
            )
        child = Child(name, popen, out, err)
        self.children.append(child)
        return child

    def relay(self, *args: str, name: str = "", **options: Any) -> Child:
        """A long-running publish_outbox with a short poll interval."""
        return self.start("publish_outbox", "--interval", "200ms", *args, name=name, **options)

    def run(self, command: str, *args: str, timeout: float = 90.0, **outbox_settings: Any) -> Child:
        child = self.start(command, *args, **outbox_settings)
        child.wait(timeout)
        return child

    def tails(self) -> str:
        return "\n".join(child.tail() for child in self.children)

    def alerts(self) -> tuple[int, Counter[str]]:
        """Dead-letter alerts the children logged: how many, and how often each event_id."""
        alerts, named = 0, Counter[str]()
        for child in self.children:
            text = child.stderr()
            alerts += len(re.findall(r"ERROR django_outbox\.alerts \d+ outbox event", text))
            named.update(re.findall(r"event_id=([\w-]+) event_type=", text))
        return alerts, named

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()  # before the database is flushed: a frozen relay would hold its locks

    def cleanup(self) -> None:
        for child in self.children:
            if child.alive():
                child.signal(signal.SIGCONT)
                child.signal(signal.SIGKILL)
                child.popen.wait(timeout=30)


# --- the database side -------------------------------------------------------------------
def emit(count: int, event_type: str = "EV", *, chunk: int = 500) -> list[str]:
    """Commit ``count`` events, ``chunk`` per transaction; returns their event_ids."""
    ids: list[str] = []
    for start in range(0, count, chunk):
        with outbox.atomic() as box:
            for i in range(start, min(count, start + chunk)):
                box.emit(event_type, aggregate_type="FAULT", aggregate_id=str(i), payload={"i": i})
            ids += [event.event_id for event in box.events]
    return ids


def counts() -> dict[str, int]:
    """Rows by state: sent, dead, pending, leased (PENDING under a relay's claim)."""
    by_status = OutboxEvent.objects.status_counts()
    return {
        "sent": by_status.get(Status.SENT, 0),
        "dead": by_status.get(Status.DEAD, 0),
        "pending": by_status.get(Status.PENDING, 0),
        "leased": OutboxEvent.objects.pending().exclude(lease_token="").count(),
    }


def snapshot() -> dict[str, tuple[Any, ...]]:
    """Every row's settle-able state, to prove nothing changed it."""
    return {
        row[0]: row[1:]
        for row in OutboxEvent.objects.values_list(
            "event_id",
            "status",
            "retry_count",
            "sent_at",
            "next_retry_time",
            "leased_until",
            "lease_token",
            "last_error",
        )
    }


def kill_database_connections() -> int:
    """Kill every other session on the test database (the relays'); returns how many."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return int(cursor.fetchone()[0])
        cursor.execute(
            "SELECT id FROM information_schema.processlist "
            "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        )
        ids = [row[0] for row in cursor.fetchall()]
        killed = 0
        for session in ids:
            try:
                cursor.execute(f"KILL {int(session)}")
                killed += 1
            except Exception:  # it ended by itself in between
                pass
        return killed


def wait_for(
    predicate: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    processes: Processes | None = None,
    every: float = 0.05,
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            detail = f"\n{processes.tails()}" if processes else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{detail}")
        time.sleep(every)


def wait_for_sent(
    count: int, *, timeout: float, what: str, processes: Processes, every: float = 0.05
) -> None:
    """Until at least ``count`` rows are SENT (all of them, when ``count`` is the total)."""
    wait_for(
        lambda: counts()["sent"] >= count,
        timeout=timeout,
        what=what,
        processes=processes,
        every=every,
    )


def kill_a_relay_mid_drain(processes: Processes, events: int, **settings: Any) -> int:
    """A relay drains ``events`` in batches of 200 and is killed (-9) once a quarter is
    SENT; returns how many were SENT at the kill (fewer than ``events``)."""
    relay = processes.relay("--batch-size", "200", name="relay-1", **settings)
    wait_for_sent(
        events // 4, timeout=120, what="the first relay draining", processes=processes, every=0.005
    )
    relay.kill9()
    sent_at_kill = counts()["sent"]
    assert sent_at_kill < events
    return sent_at_kill


def finish_the_drain(processes: Processes, events: int, **settings: Any) -> None:
    """A second relay (after a killed one's lease ran out) SENDs the rest and stops cleanly."""
    again = processes.relay(name="relay-2", **settings)
    wait_for_sent(
        events, timeout=180, what="the second relay finishing the drain", processes=processes
    )
    assert again.stop() == 0, again.tail()


def drain_while_node_1_stops(
    cluster: Any, processes: Processes, relay: Child, *, stop_at: int, total: int, timeout: float
) -> None:
    """The relay drains ``total`` rows through node 1 of ``cluster`` (a
    tests.utils.cluster.Cluster); node 1 is stopped once ``stop_at`` are SENT, the relay
    must SEND the rest through another node and stop cleanly. Node 1 is started again
    whatever happens."""
    try:
        wait_for_sent(
            stop_at, timeout=60, what="draining through node 1", processes=processes, every=0.01
        )
        cluster.node("stop", 1)
        wait_for_sent(total, timeout=timeout, what="draining through node 2", processes=processes)
        assert relay.stop() == 0, relay.tail()
    finally:
        cluster.node("start", 1)


# --- the verdict -------------------------------------------------------------------------
@dataclass
class Verdict:
    scenario: str
    events: int
    lost: list[str] = field(default_factory=list)
    unconfirmed_sent: list[str] = field(default_factory=list)
    duplicates: int = 0
    dead: int = 0
    crashed: bool = False
    unknown: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.lost
            and not self.unconfirmed_sent
            and not self.unknown
            and (self.crashed or not self.duplicates)
        )


def check_invariants(
    scenario: str,
    broker: Broker,
    record: Callable[[Verdict], None],
    *,
    crashed: bool,
    alerted: Iterable[str] = (),
    emitted: Iterable[str] = (),
) -> Verdict:
    """Compare the table with the queue; record the verdict for the summary, then assert.

    ``emitted``: the event ids committed, where the relay deletes rows it settled
    (OUTBOX_RETENTION_DAYS = 0): one with no row that the broker never got is lost."""
    received = broker.collect()
    alerted = set(alerted)
    rows = dict(OutboxEvent.objects.values_list("event_id", "status"))
    committed = {**dict.fromkeys(emitted), **rows}
    verdict = Verdict(scenario=scenario, events=len(committed), crashed=crashed)
    for event_id, status in committed.items():
        if not received[event_id] and not (status == Status.DEAD and event_id in alerted):
            verdict.lost.append(event_id)
        if status == Status.SENT and not received[event_id]:
            verdict.unconfirmed_sent.append(event_id)
        if status == Status.DEAD:
            verdict.dead += 1
    verdict.duplicates = sum(n - 1 for n in received.values() if n > 1)
    verdict.unknown = [event_id for event_id in received if event_id not in committed]
    record(verdict)
    assert not verdict.lost, f"{len(verdict.lost)} committed events lost: {verdict.lost[:5]}"
    assert not verdict.unconfirmed_sent, (
        f"{len(verdict.unconfirmed_sent)} rows SENT without reaching the broker: "
        f"{verdict.unconfirmed_sent[:5]}"
    )
    assert not verdict.unknown, f"messages for no row: {verdict.unknown[:5]}"
    if not crashed:
        assert verdict.duplicates == 0, f"{verdict.duplicates} duplicates without a crash"
    return verdict
