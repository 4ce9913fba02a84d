"""Spans recorded by the OpenTelemetry SDK's in-memory exporter, for the tracing tests.

The SDK's tracer provider is global and can be set once per process: :func:`recorder` sets
it the first time a test asks and keeps it for the session. That changes nothing for the
other tests: django_outbox captures a context only inside an active span, which only the
tracing tests start.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_exporter = InMemorySpanExporter()


def recorder() -> InMemorySpanExporter:
    """The exporter every finished span goes to (emptied: only this test's spans)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        trace.set_tracer_provider(provider)
    _exporter.clear()
    return _exporter


def tracer() -> trace.Tracer:
    """The application's tracer: the spans a test wraps emit() or a handler in."""
    return trace.get_tracer("tests")


def named(spans: Sequence[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    """The spans whose name starts with ``prefix`` (``"create"``, ``"publish"``, ...)."""
    return [s for s in spans if s.name.split(" ", 1)[0] == prefix]


def one(spans: Sequence[ReadableSpan], prefix: str) -> ReadableSpan:
    found = named(spans, prefix)
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def traceparent(span: ReadableSpan | trace.Span) -> str:
    """The W3C ``traceparent`` of a span."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
