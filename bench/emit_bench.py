"""What emit() costs: against one more business row, under concurrent writers, and with
OpenTelemetry tracing, on a real database.

**cost** (issue 18, item 4: an event should cost about what one more business row costs):
transactions of the demo's orders service, timed whole (BEGIN to COMMIT):

- ``order``: one ``Order`` row (``transaction.atomic()``);
- ``order + order``: the same transaction writing a second plain order;
- ``order + event``: an order and its event (``outbox.atomic()``, ``emit()``), with the
  wake-up as configured (``OUTBOX_NOTIFY``, on by default);
- ``order + event, no wake-up``: the same with ``OUTBOX_NOTIFY = False`` (PostgreSQL only).

They take turns in interleaved rounds of ``--per-round`` transactions each; per round and
kind the median transaction, and over the rounds the median of those and of the ratio
``order + event`` / ``order + order`` (the target is <= 1.15).

**block**: one ``outbox.atomic()`` block emitting 1000 events: the number of INSERT
statements into the outbox table it sends (1: the rows are one round trip) and its time.

**writers**: ``--writers`` processes (8), each with its own connection, commit ``order +
event`` transactions as fast as they can for ``--writer-seconds``, with the wake-up on and
off in alternating rounds, while one relay-like listener (``PostgresNotifyWaker``) waits on
the channel: commits/s of each and the ratio on/off. NOTIFY inside a transaction makes
PostgreSQL serialise the commits of all notifying transactions on one lock; this shows
whether the wake-up does.

**tracing**: per mode, ``--count`` events are emitted as the demo's orders service emits them: one
transaction per event (``outbox.atomic()``, one ``emit()``, the INSERT and the commit), and,
apart, the ``emit()`` call alone (validation, serialisation and the trace capture: no
INSERT). The modes:

1. **baseline**: the tracing hook skipped, as without ``opentelemetry-api``;
2. **no span**: the OpenTelemetry SDK configured, no span active (a job, a command);
3. **span**: inside an active span (a traced request): a create span is recorded and its
   context stored (the default);
4. **span, no create span**: ``OUTBOX_TRACING_CREATE_SPANS = False``: the active span's
   context is stored.

The modes take turns event by event, so that a change of the machine's load during a run
hits them all alike.

The SDK exports through a ``SimpleSpanProcessor`` to an exporter that drops the spans: each
span's cost lands where it ends (a ``BatchSpanProcessor``'s thread would wake up in whatever
is being timed), and the network work a production exporter does on its own thread is not
measured. The request span around each
transaction is started outside the timed part: the application pays for it with or without
the outbox. Every figure is events/s with the ratio to the baseline of the same run; the
database is the benchmark's own (created on the server, dropped afterwards).

    python -m bench.emit_bench [--smoke] [--part cost|block|writers|tracing|all]
        [--database postgres|mariadb] [--database-url URL] [--rounds 15] [--per-round 40]
        [--writers 8] [--writer-seconds 3] [--count 20000] [--repeat 3]

``--count``/``--repeat`` are the tracing part's; ``--smoke`` shrinks every part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from bench.common import (
    CpuMeter,
    count_from,
    emit_sample,
    parser,
    proc_cpu_seconds,
    report,
)
from bench.relay_bench import (
    DATABASE_PROCESS,
    SERVERS,
    bench_database,
    server_url,
    setup_django,
)
from django_outbox.masking import mask_url

#: The amount of the bench's orders.
AMOUNT = Decimal("129.90")
#: Events per transaction of the emit()-only measurement (its INSERT is not timed).
CALLS_PER_BLOCK = 100


def install_sdk() -> Any:
    """The OpenTelemetry SDK as an application configures it, exporting nowhere."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Dropping(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Dropping()))
    trace.set_tracer_provider(provider)
    return trace.get_tracer("bench")


class Modes:
    """Switches between the modes at no cost to the timed part: the settings tracing reads
    are swapped in directly (``override_settings`` would make the next emit() read them
    again, inside the timing)."""

    NAMES = ("baseline", "no span", "span", "span, no create span")

    def __init__(self, tracer: Any) -> None:
        import dataclasses

        from django_outbox import tracing

        self.tracing = tracing
        self.tracer = tracer
        self.api = tracing.trace
        self.on = tracing._read_settings()
        self.no_create = dataclasses.replace(self.on, create_spans=False)

    def enter(self, name: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """Set up mode ``name``; returns what to wrap a transaction in (its request span)."""
        self.tracing.trace = None if name == "baseline" else self.api  # type: ignore[assignment]
        self.tracing._settings = self.no_create if name == "span, no create span" else self.on
        if name.startswith("span"):
            return lambda: self.tracer.start_as_current_span("POST /orders")
        return contextlib.nullcontext

    def restore(self) -> None:
        self.tracing.trace = self.api  # type: ignore[assignment]
        self.tracing._settings = None


def one_transaction(request: Callable[[], Any], sequence: int) -> float:
    """Seconds of one transaction with one event: atomic(), emit(), INSERT, commit."""
    from django_outbox import outbox

    with request():
        started = time.perf_counter()
        with outbox.atomic() as box:
            emit_sample(box, sequence)
        return time.perf_counter() - started


def emit_calls(request: Callable[[], Any], sequence: int) -> float:
    """Seconds of CALLS_PER_BLOCK emit() calls alone (the block's INSERT is not timed)."""
    from django_outbox import outbox

    timed = 0.0
    with request(), outbox.atomic() as box:
        for i in range(CALLS_PER_BLOCK):
            started = time.perf_counter()
            emit_sample(box, sequence + i)
            timed += time.perf_counter() - started
    return timed


def measure(modes: Modes, count: int) -> dict[tuple[str, str], float]:
    """Events/s per (measurement, mode). The modes take turns event by event (block by
    block for the calls), each turn starting with the next mode, so that a change of the
    machine's load meanwhile, or what one mode leaves behind for the next (garbage to
    collect), hits all alike."""
    seconds = {(what, name): 0.0 for what in WHAT for name in Modes.NAMES}
    try:
        for i in range(count):
            for name in turn(i):
                seconds["transaction", name] += one_transaction(modes.enter(name), i)
        blocks = max(1, count // CALLS_PER_BLOCK)
        for i in range(blocks):
            for name in turn(i):
                seconds["emit()", name] += emit_calls(modes.enter(name), i * CALLS_PER_BLOCK)
    finally:
        modes.restore()
    events = {"transaction": count, "emit()": blocks * CALLS_PER_BLOCK}
    return {key: events[key[0]] / value for key, value in seconds.items()}


WHAT = ("transaction", "emit()")


def turn(i: int) -> tuple[str, ...]:
    """The modes in the order of turn ``i``: rotated by one each turn."""
    names = Modes.NAMES
    return names[i % len(names) :] + names[: i % len(names)]


def clear() -> None:
    from django.db import connection

    from django_outbox.models import OutboxEvent

    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {connection.ops.quote_name(OutboxEvent._meta.db_table)}")


# -- cost: an event against one more business row ------------------------------------------
COST_KINDS = ("order", "order + order", "order + event", "order + event, no wake-up")


def _order() -> Any:
    from orders.models import Order

    return Order.objects.create(number=uuid.uuid4().hex[:16], user_id=42, amount=AMOUNT)


def cost_transaction(kind: str, sequence: int) -> float:
    """Seconds of one transaction of ``kind``, BEGIN to COMMIT."""
    from django.db import transaction

    from django_outbox import outbox

    started = time.perf_counter()
    if kind == "order":
        with transaction.atomic():
            _order()
    elif kind == "order + order":
        with transaction.atomic():
            _order()
            _order()
    else:
        with outbox.atomic() as box:
            order = _order()
            emit_sample(box, order.pk)
    return time.perf_counter() - started


@contextlib.contextmanager
def wake_up(on: bool) -> Iterator[None]:
    from django.test import override_settings

    with override_settings(OUTBOX_NOTIFY=on):
        yield


def measure_cost(rounds: int, per_round: int, kinds: tuple[str, ...]) -> dict[str, list[float]]:
    """Per kind, the median seconds of a transaction in each round. The kinds take turns
    (rotated each round) so a change of the machine's load hits them all alike."""
    medians: dict[str, list[float]] = {kind: [] for kind in kinds}
    sequence = 0
    for r in range(rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            times = []
            with wake_up(kind != "order + event, no wake-up"):
                for _ in range(per_round):
                    sequence += 1
                    times.append(cost_transaction(kind, sequence))
            medians[kind].append(statistics.median(times))
    return medians


def show_cost(medians: dict[str, list[float]], per_round: int) -> None:
    base = medians["order + order"]
    print(
        f"-- cost: median transaction over {len(base)} interleaved rounds of {per_round}, "
        "and the median of the per-round ratios to 'order + order' (target <= 1.15)"
    )
    for kind, values in medians.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(
            f"{kind:<40}  {statistics.median(values) * 1e3:8.3f} ms  "
            f"{1 / statistics.median(values):>8,.0f} tx/s  ratio {ratio:5.2f}",
            flush=True,
        )


# -- block: 1000 events stay one INSERT ---------------------------------------------------
BLOCK_EVENTS = 1000


def measure_block(events: int = BLOCK_EVENTS) -> tuple[int, float]:
    """(INSERTs into the outbox table, seconds) of one block emitting ``events`` events."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_outbox import outbox
    from django_outbox.models import OutboxEvent

    table = OutboxEvent._meta.db_table
    with CaptureQueriesContext(connection) as queries:
        started = time.perf_counter()
        with outbox.atomic() as box:
            for i in range(events):
                emit_sample(box, i)
        seconds = time.perf_counter() - started
    inserts = [
        q for q in queries if q["sql"].lstrip().upper().startswith("INSERT") and table in q["sql"]
    ]
    return len(inserts), seconds


# -- writers: commits/s of concurrent writers, wake-up on and off ---------------------------
def _writer(on: bool, start: Any, stop_at: Any, results: Any, finish: Any) -> None:
    """A writer process: order + event transactions on its own connection until stop_at;
    puts its commits and the CPU seconds it used meanwhile (all its threads)."""
    from django.db import connections

    connections.close_all()  # the parent's sockets are not ours
    commits = 0
    with wake_up(on):
        cost_transaction("order + event", 0)  # connect and warm up outside the timing
        start.wait()
        cpu = proc_cpu_seconds()
        deadline = stop_at.value
        while time.time() < deadline:
            cost_transaction("order + event", 0)
            commits += 1
        results.put((commits, proc_cpu_seconds() - cpu))
        finish.wait()  # connections open until the parent has read the server's CPU
    connections.close_all()


class Listener:
    """A relay's wake-up waiting on the channel in a thread, counting its wake-ups, so the
    notifications are consumed as in production."""

    def __init__(self) -> None:
        from django.db import DEFAULT_DB_ALIAS, connection

        from django_outbox.relay.wake import make_waker

        self.stop = threading.Event()
        self.wakes = 0
        self.waker = (
            make_waker(DEFAULT_DB_ALIAS, self.stop) if connection.vendor == "postgresql" else None
        )
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        assert self.waker is not None
        while not self.stop.is_set():
            self.waker.wait(0.5)
            self.wakes += 1

    def __enter__(self) -> Listener:
        if self.waker is not None:
            self.waker.wait(0.01)  # LISTEN before the writers start
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.waker is not None:
            self.thread.join()
            self.waker.close()


@dataclasses.dataclass
class Writers:
    """One round of the writers: commits/s, and CPU microseconds per commit in the writer
    processes (their wake-up threads included) and in the database server (server-wide)."""

    rate: float
    writer_us: float
    database_us: float


def measure_writers(writers: int, seconds: float, on: bool, database: str) -> Writers:
    """``writers`` processes together, the wake-up ``on`` or off."""
    import multiprocessing

    from django.db import connections

    ctx = multiprocessing.get_context("fork")
    connections.close_all()
    start, finish, results = ctx.Event(), ctx.Event(), ctx.Queue()
    stop_at = ctx.Value("d", 0.0)
    procs = [
        ctx.Process(target=_writer, args=(on, start, stop_at, results, finish))
        for _ in range(writers)
    ]
    for proc in procs:
        proc.start()
    time.sleep(0.5 + 0.05 * writers)  # every writer connected and warmed up
    server = CpuMeter({"database": DATABASE_PROCESS[database]})
    server.start()
    stop_at.value = time.time() + seconds
    start.set()
    got = [results.get(timeout=seconds + 60) for _ in procs]
    server_cpu = server.stop()["database"]
    finish.set()
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"a writer exited with {proc.exitcode}")
    commits = sum(c for c, _ in got) or 1
    return Writers(
        commits / seconds, sum(cpu for _, cpu in got) / commits * 1e6, server_cpu / commits * 1e6
    )


def run_writers(writers: int, seconds: float, rounds: int, database: str) -> None:
    on: list[Writers] = []
    off: list[Writers] = []
    with Listener() as listener:
        for r in range(rounds):
            for flag in (r % 2 == 0, r % 2 != 0):
                (on if flag else off).append(measure_writers(writers, seconds, flag, database))
                clear()
    print(
        f"-- writers: {writers} processes, order + event, {seconds:g} s x {rounds} round(s) "
        f"each; listener woke {listener.wakes} times; CPU per commit is load-proof, the "
        "rate is not"
    )
    median = statistics.median
    for name, runs in (("wake-up on", on), ("wake-up off", off)):
        print(
            f"{name:<40}  {median(w.rate for w in runs):>10,.0f} commits/s  CPU per commit: "
            f"writers {median(w.writer_us for w in runs):,.0f} us, database "
            f"{median(w.database_us for w in runs):,.0f} us  "
            f"(runs {', '.join(f'{w.rate:,.0f}' for w in runs)})"
        )
    print(
        f"{'ratio on / off':<40}  {median(w.rate for w in on) / median(w.rate for w in off):10.2f}",
        flush=True,
    )


PARTS = ("cost", "block", "writers", "tracing")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--database", choices=sorted(SERVERS), default="postgres")
    p.add_argument("--database-url", default=None, help="the server (its database is unused)")
    p.add_argument("--part", choices=(*PARTS, "all"), default="all")
    p.add_argument("--rounds", type=int, default=15, help="cost: interleaved rounds")
    p.add_argument("--per-round", type=int, default=40, help="cost: transactions per kind")
    p.add_argument("--writers", type=int, default=8, help="writers: concurrent processes")
    p.add_argument("--writer-seconds", type=float, default=3.0, help="writers: per round")
    p.add_argument("--writer-rounds", type=int, default=3, help="writers: rounds on and off")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.per_round, args.writer_seconds, args.writer_rounds = 2, 5, 0.5, 1
    parts = PARTS if args.part == "all" else (args.part,)
    count = count_from(args)
    server = server_url(args.database, args.database_url)
    print(
        f"emit bench: {args.database} {mask_url(server)}, parts {', '.join(parts)}",
        flush=True,
    )
    with bench_database(server) as database_url:
        setup_django(database_url, "bench.emit.unused", args.url)
        if "cost" in parts:
            kinds = COST_KINDS if args.database == "postgres" else COST_KINDS[:3]
            measure_cost(1, 10, kinds)  # warm up: connection, caches
            show_cost(measure_cost(args.rounds, args.per_round, kinds), args.per_round)
            clear()
        if "block" in parts:
            measure_block(100)
            inserts, seconds = measure_block()
            print(
                f"-- block: {BLOCK_EVENTS} events in one outbox.atomic() block: {inserts} "
                f"INSERT statement(s) into the outbox table, {seconds * 1e3:.1f} ms",
                flush=True,
            )
            if inserts != 1:
                raise SystemExit(f"a block of {BLOCK_EVENTS} events sent {inserts} INSERTs")
            clear()
        if "writers" in parts and args.database != "postgres":
            print("-- writers: the wake-up is PostgreSQL's (LISTEN/NOTIFY); nothing to compare")
        elif "writers" in parts:
            run_writers(args.writers, args.writer_seconds, args.writer_rounds, args.database)
        if "tracing" in parts:
            run_tracing(args, count)


def run_tracing(args: Any, count: int) -> None:
    print(f"-- tracing: {count:,} events per mode, {args.repeat} run(s)", flush=True)
    modes = Modes(install_sdk())
    measure(modes, min(count, 100))  # warm up: connection, caches, the SDK
    clear()
    runs = []
    for run in range(1, args.repeat + 1):
        print(f"-- run {run}")
        rates = measure(modes, count)
        clear()
        runs.append(rates)
        show(rates, count)
    if args.repeat > 1:
        print(f"-- median of {args.repeat} runs (rates, and ratios to each run's baseline)")
        show(
            {key: statistics.median(r[key] for r in runs) for key in runs[0]},
            count,
            {
                key: statistics.median(r[key] / r[key[0], "baseline"] for r in runs)
                for key in runs[0]
            },
        )


def show(
    rates: dict[tuple[str, str], float],
    count: int,
    ratios: dict[tuple[str, str], float] | None = None,
) -> None:
    for what in WHAT:
        for name in Modes.NAMES:
            rate = rates[what, name]
            ratio = ratios[what, name] if ratios else rate / rates[what, "baseline"]
            report(f"{what}: {name}", rate, baseline=rate / ratio, count=count)


if __name__ == "__main__":
    main()
