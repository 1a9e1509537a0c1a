"""OpenTelemetry traces (services/contract/tracing.py): the span maker and the traceparent
alone, then one trace per request over the live mesh.

Unit: a span's traceparent, carried as a message would carry it, parents a span made from
it in another tracer (another process); the endpoint comes from the argument, else the
standard variables, and without one tracing is off (no tracer at all).

Live: `prfaas serve` children as in tests/test_migration.py (router, cache directory, link,
a PrfaaS and a PD prefill worker, two PD decode workers, the shipped checkpoint in float32),
every service exporting to an OTLP/HTTP endpoint this test serves on 127.0.0.1 (POST
/v1/traces, decoded with opentelemetry-proto's ExportTraceServiceRequest). An offloaded
request (with a client's traceparent header), a local one, and one whose decode worker is
killed mid-stream are each found as one trace: the router's spans, the prefill worker's and
the decode worker's under the router's attempt span (parented across processes through the
messages' `trace` field), the KV lanes through the link or not, a migration span on the
third, the time to first token equal to the one the router's histogram observed, and the
spans on the way to that first token (the prefill's wait and compute, the KV's arrival, the
decode worker's first token) inside it.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.cli.launch import launch
from services.contract.tracing import (
    Tracer,
    endpoint_from_env,
    failed,
    trace_id,
    traceparent,
    tracer_for,
)
from tests.polling import wait_until
from tests.ports import free_port, free_ports
from tests.topologies import launched_toml


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


WORKER = ('family = "kimi-linear", size = "default", checkpoint = "auto", threads = 1, '
          'dtype = "float32"')
SCALE = 0.005  # t = 19,400 x 0.005 = 97 router tokens
LONG_PROMPT = "a long prompt that the threshold sends to the PrfaaS cluster. " * 12
SHORT_PROMPT = "ROMEO: what light through yonder window breaks"
DECODERS = ("pd-decode-0", "pd-decode-1")
MAX_TOKENS = 24
KILL_AFTER = 8  # tokens the client has seen when the decode worker is killed
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
DECISION_INPUTS = ("total_len", "cached_prfaas", "cached_pd", "incremental_len", "threshold",
                   "link_utilisation", "queue_prfaas", "queue_pd", "bandwidth_scarce",
                   "prefill_worker", "decode_worker", "policy")


@dataclass
class Span:
    """One exported span as the collector received it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, Any]
    events: dict[str, int]
    ok: bool

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@dataclass
class Collector:
    """An OTLP/HTTP traces endpoint: every span exported to it."""

    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                with self.lock:
                    self.spans.extend(Span(
                        service=attrs["service.name"], name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        start=s.start_time_unix_nano, end=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events={e.name: e.time_unix_nano for e in s.events},
                        ok=s.status.code != 2) for s in scope.spans)

    def trace(self, trace: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace]

    def request_span(self, request_id: str) -> Span | None:
        with self.lock:
            return next((s for s in self.spans if s.name == "request"
                         and s.attributes.get("gen_ai.request.id") == request_id), None)


@contextmanager
def collector_at(port: int, hosts: tuple[str, ...] = ("127.0.0.1",)) -> Iterator[Collector]:
    """An OTLP/HTTP endpoint at `port` of each of `hosts`, one collector behind them."""
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            ok = self.path == "/v1/traces"
            if ok:
                collector.take(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if ok else 404)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer((host, port), Handler) for host in hosts]
    threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in servers]
    for thread in threads:
        thread.start()
    try:
        yield collector
    finally:
        for server, thread in zip(servers, threads, strict=True):
            server.shutdown()
            server.server_close()
            thread.join(timeout=10)


def topology_text(ports: list[int], otlp: str) -> str:
    router = f'scale = {SCALE}, tick_s = 0.25, migration_limit = 1, otlp_endpoint = "{otlp}"'
    worker = f'{WORKER}, otlp_endpoint = "{otlp}"'
    return launched_toml(ports, worker=worker, router=router, decoders=2)


@dataclass
class Mesh:
    url: str
    collector: Collector
    children: dict[str, subprocess.Popen[str]]

    def ttft_sum(self) -> float:
        """The router's prfaas_time_to_first_token_seconds_sum over every series."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("prfaas_time_to_first_token_seconds_sum"))

    def kill_serving_decoder(self) -> str:
        state = httpx.get(f"{self.url}/admin/state", timeout=10).json()
        running = [w["name"] for w in state["workers"]
                   if w["name"] in DECODERS and w["running"] and w["up"]]
        assert len(running) == 1, state["workers"]
        self.children[running[0]].send_signal(signal.SIGKILL)
        return str(running[0])


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """os.environ with `values` set (the children inherit it), restored after."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("tracing-mesh")
    ports, otlp_port = free_ports(10), free_port()
    path = root / "topology.toml"
    path.write_text(topology_text(ports, f"http://127.0.0.1:{otlp_port}/v1/traces"))
    names = ["cachedir", "link-0", "prfaas-prefill-0", "pd-prefill-0", *DECODERS, "router"]
    with ExitStack() as stack:
        collector = stack.enter_context(collector_at(otlp_port))
        # Spans leave every 100 ms rather than the SDK's 5 s.
        stack.enter_context(environment(OTEL_BSP_SCHEDULE_DELAY="100"))
        children = stack.enter_context(launch(path, names, log_dir=root))
        mesh = Mesh(f"http://127.0.0.1:{ports[1]}", collector, children)
        wait_until(lambda: httpx.get(f"{mesh.url}/health", timeout=10).json().get(
            "workers_up", 0) == 4, "four workers up")
        yield mesh


def stream(mesh: Mesh, prompt: str, headers: dict[str, str] | None = None,
           on_event: Callable[[int], None] = lambda n: None) -> str:
    """A greedy streamed completion; its request id. `on_event(n)` after the n-th text."""
    body = {"model": "prfaas", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "temperature": 0}
    seen = 0
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, headers=headers or {},
                      timeout=60) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                if any(c.get("text") for c in event.get("choices", [])):
                    seen += 1
                    on_event(seen)
    return request_id


class Trace:
    """One request's spans, by name, with the checks every trace passes."""

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans
        self.by_id = {s.span_id: s for s in spans}

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]

    def one(self, name: str) -> Span:
        (span,) = self.named(name)
        return span

    def children(self, parent: Span, name: str | None = None) -> list[Span]:
        return [s for s in self.spans if s.parent_id == parent.span_id
                and (name is None or s.name == name)]

    def check_timing(self) -> None:
        """Every span starts after its parent (one host's clock here; 5 ms of slack) and
        ends after it starts."""
        for span in self.spans:
            parent = self.by_id.get(span.parent_id)
            if parent is not None:
                assert parent.start <= span.start + 5e6, (span.name, parent.name)
            assert span.end >= span.start, span.name


def traced(mesh: Mesh, request_id: str, complete: Callable[[Trace], bool]) -> Trace:
    """The request's trace once `complete` holds for it (spans arrive in batches)."""
    found: list[Trace] = []

    def arrived() -> bool:
        root = mesh.collector.request_span(request_id)
        if root is None:
            return False
        found[:] = [Trace(mesh.collector.trace(root.trace_id))]
        return complete(found[0])

    wait_until(arrived, f"the whole trace of {request_id}")
    return found[0]


def attempt_complete(trace: Trace, attempt: int = 0) -> bool:
    """Whether the attempt's span and its workers' spans have all arrived."""
    spans = trace.named(f"attempt {attempt}")
    if not spans:
        return False
    prefill, decode = (trace.children(spans[0], name) for name in ("prefill", "decode"))
    return bool(prefill and decode and trace.children(prefill[0], "kv.transfer")
                and trace.children(decode[0], "decode.kv"))


def check_attempt(trace: Trace, request: Span, attempt: int, prefill_worker: str,
                  link: str) -> tuple[Span, Span]:
    """The attempt's prefill and decode spans, each in its own worker, under the attempt."""
    (span,) = trace.children(request, f"attempt {attempt}")
    (prefill,) = trace.children(span, "prefill")
    (decode,) = trace.children(span, "decode")
    assert prefill.service == prefill_worker == span.attributes["prfaas.prefill_worker"]
    assert prefill.attributes["prfaas.prefill.computed_tokens"] > 0
    assert (prefill.attributes["prfaas.prefill.cached_tokens"]
            + prefill.attributes["prfaas.prefill.computed_tokens"]
            == prefill.attributes["gen_ai.usage.input_tokens"])
    assert {s.name for s in trace.children(prefill)} >= {"prefill.queue", "prefill.compute",
                                                          "kv.transfer"}
    lanes = trace.children(prefill, "kv.transfer")
    assert len(lanes) == prefill.attributes["prfaas.kv.lanes"]
    assert sum(s.attributes["prfaas.kv.bytes"] for s in lanes) == prefill.attributes[
        "prfaas.kv.bytes"] > 0
    assert {s.attributes["prfaas.kv.link"] for s in lanes} == {link}
    assert {s.attributes["prfaas.kv.via_link"] for s in lanes} == {link != "local"}
    # A lane's own timing (open to accepted, on the event loop's clock: uvloop's counts
    # milliseconds) is inside its span.
    assert all(0 < s.attributes["prfaas.kv.seconds"] <= s.seconds + 1e-3 for s in lanes)
    assert decode.service == span.attributes["prfaas.decode_worker"]
    assert {s.name for s in trace.children(decode)} >= {"decode.kv", "decode.queue"}
    assert "first_token" in decode.events
    return prefill, decode


def check_router(trace: Trace, ttft_s: float) -> Span:
    """The router's spans: HTTP, tokenize, request with admission, lookup, policy; its TTFT."""
    (http,) = trace.named("POST /v1/completions")
    assert http.service == "router"
    assert trace.children(http, "tokenize")
    request = trace.one("request")
    assert request.parent_id == http.span_id
    assert {s.name for s in trace.children(request)} >= {"admission", "cachedir.lookup",
                                                         "policy", "attempt 0"}
    policy = trace.children(request, "policy")[0]
    assert policy.attributes["prfaas.decision.reason"]
    # Every input the policy decided on, as the dashboard's RoutingDecision has it.
    assert {f"prfaas.decision.{name}" for name in DECISION_INPUTS} <= policy.attributes.keys()
    assert policy.attributes["prfaas.decision.total_len"] == request.attributes[
        "gen_ai.usage.input_tokens"]
    assert policy.attributes["prfaas.decision.cluster"] == request.attributes["prfaas.cluster"]
    # The span's TTFT is the histogram's; its first_token event is when the router saw it.
    assert request.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(
        ttft_s, abs=1e-6)
    seen = (request.events["first_token"] - request.start) / 1e9
    assert seen == pytest.approx(ttft_s, abs=0.02)
    return request


def check_first_token_path(trace: Trace, request: Span, ttft_s: float) -> None:
    """Durations consistent with the router's TTFT: the first attempt's prefill waited and
    computed within it, and (where its decode worker lived to export) the compute ended
    before the KV was in, the KV before the worker's first token, that before the router's
    (one host's clock here)."""
    (attempt,) = trace.children(request, "attempt 0")
    (prefill,) = trace.children(attempt, "prefill")
    (queue,) = trace.children(prefill, "prefill.queue")
    (compute,) = trace.children(prefill, "prefill.compute")
    assert queue.seconds + compute.seconds <= ttft_s
    assert compute.end <= request.events["first_token"]
    for decode in trace.children(attempt, "decode"):
        (kv,) = trace.children(decode, "decode.kv")
        assert compute.end <= kv.end <= decode.events["first_token"]
        assert decode.events["first_token"] <= request.events["first_token"]


def ttft_of(mesh: Mesh, send: Callable[[], str]) -> tuple[str, float]:
    before = mesh.ttft_sum()
    request_id = send()
    return request_id, mesh.ttft_sum() - before


@pytest.mark.slow
def test_an_offloaded_request_is_one_trace_continuing_the_clients(mesh: Mesh) -> None:
    header = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    request_id, ttft = ttft_of(mesh, lambda: stream(mesh, LONG_PROMPT, header))
    trace = traced(mesh, request_id, attempt_complete)
    assert {s.trace_id for s in trace.spans} == {CLIENT_TRACE}
    assert trace.one("POST /v1/completions").parent_id == CLIENT_SPAN
    request = check_router(trace, ttft)
    assert request.attributes["prfaas.cluster"] == "prfaas"
    check_attempt(trace, request, 0, "prfaas-prefill-0", "link-0")
    check_first_token_path(trace, request, ttft)
    trace.check_timing()


@pytest.mark.slow
def test_a_local_request_is_one_trace_without_the_link(mesh: Mesh) -> None:
    request_id, ttft = ttft_of(mesh, lambda: stream(mesh, SHORT_PROMPT))
    trace = traced(mesh, request_id, attempt_complete)
    assert len({s.trace_id for s in trace.spans}) == 1
    assert trace.one("POST /v1/completions").parent_id == ""
    request = check_router(trace, ttft)
    assert request.attributes["prfaas.cluster"] == "pd"
    check_attempt(trace, request, 0, "pd-prefill-0", "local")
    check_first_token_path(trace, request, ttft)
    trace.check_timing()
    assert {s.service for s in trace.spans} == {"router", "pd-prefill-0",
                                                trace.one("decode").service}


@pytest.mark.slow
def test_a_request_whose_decode_worker_is_killed_shows_its_migration(mesh: Mesh) -> None:
    killed: list[str] = []

    def kill(n: int) -> None:
        if n == KILL_AFTER:
            killed.append(mesh.kill_serving_decoder())

    request_id, ttft = ttft_of(mesh, lambda: stream(mesh, SHORT_PROMPT + " again", on_event=kill))
    assert killed
    trace = traced(mesh, request_id, lambda t: attempt_complete(t, 1))
    request = check_router(trace, ttft)
    (migration,) = trace.children(request, "migration")
    assert migration.attributes["prfaas.migration.reason"] == "decode_lost"
    assert migration.attributes["prfaas.migration.failed_worker"] == killed[0]
    survivor = migration.attributes["prfaas.migration.decode_worker"]
    assert survivor != killed[0] and survivor in DECODERS
    assert migration.attributes["prfaas.migration.tokens_kept"] >= KILL_AFTER
    # The new attempt's lookup and decision are the migration's children.
    assert {s.name for s in trace.children(migration)} == {"cachedir.lookup", "policy"}
    (first,) = trace.children(request, "attempt 0")
    assert not first.ok and first.end <= migration.start + 5e6
    # The break came after the first token the histogram timed (the client had seen 8).
    check_first_token_path(trace, request, ttft)
    assert request.events["first_token"] <= migration.start
    _, decode = check_attempt(trace, request, 1, "pd-prefill-0", "local")
    assert decode.service == survivor
    # The killed worker's decode span died with it: only the survivor's was exported.
    assert {s.service for s in trace.named("decode")} == {survivor}
    assert request.attributes["prfaas.attempts"] == 2 and request.ok
    trace.check_timing()

