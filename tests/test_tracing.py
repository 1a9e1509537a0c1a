"""OpenTelemetry traces (services/contract/tracing.py): the span maker and the traceparent.

A span's traceparent, carried as a message would carry it, parents a span made from
it in another tracer (another process); the endpoint comes from the argument, else the
standard variables, and without one tracing is off (no tracer at all).
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.contract.tracing import (
    Tracer,
    endpoint_from_env,
    failed,
    trace_id,
    traceparent,
    tracer_for,
)


def memory_tracer(service: str) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracer(service, exporter, batch=False), exporter


def test_a_traceparent_parents_a_span_in_another_service() -> None:
    router, router_spans = memory_tracer("router")
    worker, worker_spans = memory_tracer("worker")
    attempt = router.start("attempt 0")
    carried = traceparent(attempt)
    with worker.span("prefill", carried, {"prfaas.worker": "w"}):
        pass
    attempt.end()
    (prefill,) = worker_spans.get_finished_spans()
    (sent,) = router_spans.get_finished_spans()
    assert prefill.parent is not None and prefill.parent.span_id == sent.context.span_id
    assert prefill.context.trace_id == sent.context.trace_id
    version, trace, span, flags = carried.split("-")
    assert (version, trace, span) == ("00", trace_id(attempt), f"{sent.context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    assert prefill.resource.attributes["service.name"] == "worker"


def test_a_client_traceparent_is_continued_and_an_empty_one_starts_a_trace() -> None:
    tracer, spans = memory_tracer("router")
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tracer.start("continued", client).end()
    tracer.start("fresh", "").end()
    continued, fresh = spans.get_finished_spans()
    assert f"{continued.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert continued.parent is not None and continued.parent.span_id == 0xB7AD6B7169203331
    assert fresh.parent is None and fresh.context.trace_id != continued.context.trace_id


def test_an_error_leaving_a_span_marks_it_failed() -> None:
    tracer, spans = memory_tracer("router")
    with pytest.raises(ValueError, match="bad"), tracer.span("step"):
        raise ValueError("bad")
    marked = tracer.start("marked")
    failed(marked, "queue_full")
    marked.end()
    step, mark = spans.get_finished_spans()
    assert not step.status.is_ok and "ValueError: bad" in (step.status.description or "")
    assert [event.name for event in step.events] == ["exception"]
    assert mark.status.description == "queue_full"


def test_the_endpoint_comes_from_the_standard_variables_and_none_means_off() -> None:
    assert endpoint_from_env({}) == ""
    assert endpoint_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == (
        "http://c:4318/v1/traces")
    assert endpoint_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                              "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}) == "http://t/x"
    assert endpoint_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                              "OTEL_SDK_DISABLED": "true"}) == ""
    assert tracer_for("router", "", environ={}) is None
    tracer = tracer_for("router", "", environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:1"})
    assert tracer is not None
    tracer.shutdown()
