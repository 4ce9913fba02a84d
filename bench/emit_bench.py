"""What emit() costs, with and without OpenTelemetry tracing, on a real database.

Per mode, ``--count`` events are emitted as the demo's orders service emits them: one
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

    python -m bench.emit_bench [--smoke] [--count 20000] [--repeat 3]
        [--database postgres|mariadb] [--database-url URL]
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.common import (
    count_from,
    emit_sample,
    parser,
    report,
)
from bench.relay_bench import SERVERS, bench_database, server_url, setup_django
from django_outbox.masking import mask_url

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


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--database", choices=sorted(SERVERS), default="postgres")
    p.add_argument("--database-url", default=None, help="the server (its database is unused)")
    args = p.parse_args()
    count = count_from(args)
    server = server_url(args.database, args.database_url)
    print(
        f"emit bench: {args.database} {mask_url(server)}, {count:,} events per mode, "
        f"{args.repeat} run(s)",
        flush=True,
    )
    with bench_database(server) as database_url:
        setup_django(database_url, "bench.emit.unused", args.url)
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
