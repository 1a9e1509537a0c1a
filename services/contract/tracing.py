"""OpenTelemetry traces of a request across the mesh: one service's span maker (`Tracer`),
and the W3C `traceparent` that carries a span's context from one process to the next, in a
message (`PrefillRequest.trace`, `DecodeRequest.trace`) or in an HTTP header.

Tracing is off unless an OTLP endpoint is configured (`tracer_for`: the service's
`otlp_endpoint` argument, else the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else
OTEL_EXPORTER_OTLP_ENDPOINT with `/v1/traces` appended). Off, a service holds no tracer
(None), and each place that would make a span checks that once and builds nothing: no span,
no attribute, no traceparent. On, spans leave in batches over OTLP/HTTP (protobuf) from the
SDK's own thread (`BatchSpanProcessor`; OTEL_BSP_* tune it), each service named by its
`service.name`.

Every span is timed on the host that does its work: its start and end are that process's
`time.time_ns()` (the SDK's clock), never a time another host sent. On hosts whose clocks
differ each span's duration stays right; a child only sits shifted against its parent by the
two clocks' offset.

The SDK and its exporter are an optional extra (`pip install 'prfaas-mesh[otel]'`), imported
only when an endpoint is configured; the span type is OpenTelemetry's API `Span`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import msgspec

from mesh.errors import ConfigError
from services.contract.events import Event

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span
    from opentelemetry.util.types import AttributeValue

    Attributes = Mapping[str, AttributeValue]

TRACES_PATH = "/v1/traces"
INSTRUMENTATION = "prfaas-mesh"
Kind = Literal["internal", "server", "client", "producer", "consumer"]


def endpoint_from_env(environ: Mapping[str, str]) -> str:
    """The OTLP/HTTP traces URL the standard variables name, "" when none does."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return base.rstrip("/") + TRACES_PATH if base else ""


def tracer_for(service: str, endpoint: str = "",
               environ: Mapping[str, str] | None = None) -> Tracer | None:
    """The tracer of `service` exporting to `endpoint` (else the environment's), or None
    when no endpoint is configured: tracing is off."""
    url = endpoint or endpoint_from_env(os.environ if environ is None else environ)
    if not url:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ConfigError(f"service {service!r}: traces go to {url}, but the OpenTelemetry "
                          "SDK is not installed (pip install 'prfaas-mesh[otel]')") from exc
    return Tracer(service, OTLPSpanExporter(endpoint=url))


class Tracer:
    """One service's spans, handed to `exporter` in batches (`tracer_for` builds it)."""

    def __init__(self, service: str, exporter: SpanExporter, *, batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.service = service
        # Spans still queued at the process's exit are flushed then (shutdown_on_exit).
        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service, "service.namespace": "prfaas"}))
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer(INSTRUMENTATION)
        self._kinds = {kind.name.lower(): kind for kind in SpanKind}
        self._propagator = TraceContextTextMapPropagator()

    def start(self, name: str, parent: Span | str | None = None,
              attributes: Attributes | None = None, kind: Kind = "internal") -> Span:
        """A span started now, under `parent`; the caller ends it (`Span.end`, `failed`)."""
        return self._tracer.start_span(name, self._context(parent), self._kinds[kind],
                                       attributes)

    @contextmanager
    def span(self, name: str, parent: Span | str | None = None,
             attributes: Attributes | None = None, kind: Kind = "internal") -> Iterator[Span]:
        """A span around the block, marked failed by the error that leaves it."""
        span = self.start(name, parent, attributes, kind)
        try:
            yield span
        except BaseException as exc:
            failed(span, exc)
            raise
        finally:
            span.end()

    def mark(self, name: str, parent: Span, attributes: Attributes | None = None,
             ok: bool = True, why: str = "") -> None:
        """A step of no duration worth timing (a check): a span started and ended at once."""
        span = self.start(name, parent, attributes)
        if not ok:
            failed(span, why)
        span.end()

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter (blocks: at a service's end)."""
        self._provider.shutdown()

    def _context(self, parent: Span | str | None) -> Context:
        """The context a new span starts in: its parent's, else an empty one (a new trace,
        never the ambient context: spans here are parented explicitly)."""
        from opentelemetry.context import Context
        from opentelemetry.trace import set_span_in_context

        if parent is None or parent == "":
            return Context()
        if isinstance(parent, str):
            return self._propagator.extract({"traceparent": parent}, Context())
        return set_span_in_context(parent, Context())


def traceparent(span: Span) -> str:
    """The W3C traceparent of `span`: what a message or header carries to its children."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id(span: Span) -> str:
    """The trace's id as Jaeger and Tempo show it (32 hex digits)."""
    return f"{span.get_span_context().trace_id:032x}"


def failed(span: Span, error: BaseException | str) -> None:
    """Marks `span` failed (an exception is recorded as its event too)."""
    from opentelemetry.trace import Status, StatusCode

    if isinstance(error, BaseException):
        span.record_exception(error)
        error = f"{type(error).__name__}: {error}"
    span.set_status(Status(StatusCode.ERROR, error))


def event_attributes(event: Event, prefix: str) -> dict[str, AttributeValue]:
    """An event's fields as span attributes under `prefix` (None fields left out; the
    dashboard's ts, source and trace_id are the span's own time, service and trace)."""
    fields = msgspec.structs.asdict(event)
    return {f"{prefix}.{key}": value for key, value in fields.items()
            if value is not None and key not in ("ts", "source", "trace_id")
            and isinstance(value, bool | int | float | str)}
