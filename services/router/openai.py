"""The router's OpenAI-compatible HTTP app: it decodes a body into the router's own request
(services/router/openai_schema.py), submits it, and answers with OpenAI's bodies or events
(services/router/openai_responses.py); nothing below it knows HTTP or OpenAI.

    POST /v1/completions, /v1/chat/completions   stream true/false (server-sent events as
                                                 OpenAI sends them), usage, prfaas field
    GET  /v1/models, /health, /metrics
    POST /admin/policy {"policy"}, /admin/threshold {"t"}, /admin/workload {"action", "rate",
         "kind"}, /admin/workers/{name}/role {"role"}, /admin/workers/{name}/drain
    GET  /admin/state

The admin API shares the API's port (one URL for the dashboard to know) and is guarded
instead (services/contract/access.py): with PRFAAS_ADMIN_TOKEN set (`prfaas up` sets one) every
/admin/* request needs `Authorization: Bearer TOKEN` (401 otherwise), a router bound beyond
loopback refuses to start without a token, and a request whose Origin is not the router's
own is refused (403) whatever its token.

Errors of the OpenAI API are OpenAI-style JSON (`{"error": {"message", "type", "param",
"code"}}`, services/router/errors.py); errors of the admin API are `{"error": message,
"status": code}`, as the link's control API answers (the dashboard reads both). An error after
the first byte can only be reported in the stream, as an error event. A client that
disconnects cancels its request: Quart closes the response generator, whose `finally` cancels
the scheduler's task for every choice.

Quart is asyncio-only (docs/engineering-notes.md G6): `run_router` refuses the trio backend
and serves with `hypercorn.asyncio.serve` and a shutdown trigger. Everything else (the
scheduler, the control loops, the demo workload) is anyio and runs on trio in the tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import anyio.to_thread
import httpx
import msgspec
import sniffio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from mesh.errors import ConfigError
from mesh.hosts import allowed_hosts
from mesh.http import serve_http
from mesh.metrics import register_process
from mesh.transport import Address
from services.contract.access import (
    check_admin,
    require_token_beyond_loopback,
    token_from_env,
)
from services.contract.tracing import Tracer, tracer_for
from services.model.tokenizer import ByteTokenizer, TokenizerLike, load_default
from services.router.config import RouterConfig, link_ends, router_config
from services.router.control import ControlConfig, RouterControl, http_link_probe, link_urls
from services.router.errors import RouterError
from services.router.load import DemoWorkload, WorkloadConfig, corpus_tokens
from services.router.openai_responses import Kind, Responder, stream_events
from services.router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    RequestBody,
    chat_generation,
    completion_generation,
    decode_request,
    unknown_fields,
)
from services.router.policies import create_policy
from services.router.requests import GenerationRequest, RequestHandle
from services.router.scheduler import Scheduler, SchedulerCollector
from services.router.workers import WorkerTable
from services.service import ServiceContext, http_bind_host, serve_events

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

CLUSTER_HEADER = "x-prfaas-cluster"
TRACEPARENT = "traceparent"  # W3C trace context: a client's trace continues in the mesh
# A request body at least this large is decoded, checked and tokenized in a worker thread,
# not on the event loop, where a long prompt's encoding would stall every other request's
# token stream as long; from a thread the loop gets the GIL back at least every switch
# interval. Below it the thread hop costs more than it saves (docs/engineering-notes.md,
# section 3b, has the measurements).
THREAD_BODY_BYTES = 16_384
# Bodies tokenized at once in threads, more wait: half the cores, so that the loop and the
# mesh keep some (on two cores one thread let short requests through faster than two).
PARSE_THREADS = max(1, (os.cpu_count() or 2) // 2)
_json = msgspec.json.Encoder()


def _json_response(body: object, status: int = 200) -> Response:
    return Response(_json.encode(body), status=status, mimetype="application/json")


def ignored_warning(fields: list[str], most: int = 16) -> str:
    """The `Warning` header (RFC 9111's 299, "miscellaneous persistent warning") naming the
    request's ignored fields: printable ASCII only, quotes escaped, at most `most` names."""
    def safe(name: str) -> str:
        name = "".join(c if " " <= c <= "~" else "?" for c in name[:64])
        return name.replace("\\", "\\\\").replace('"', '\\"')
    names = ", ".join(safe(name) for name in fields[:most])
    more = f" and {len(fields) - most} more" if len(fields) > most else ""
    return f'299 - "ignored fields: {names}{more}"'


class PolicyBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: str


class ThresholdBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    t: float | None


class WorkloadBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    action: Literal["start", "stop"]
    rate: float = 2.0
    kind: str = "mixed"


class RoleBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["prefill", "decode"]


class AdminError(Exception):
    """An admin request that cannot be served; answered as {"error", "status"}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RouterApp:
    """The Quart app over one scheduler, its control plane and its demo workload."""

    def __init__(self, scheduler: Scheduler, control: RouterControl, workload: DemoWorkload,
                 limits: Limits, admin_token: str | None = None,
                 hosts: frozenset[str] | None = None) -> None:
        self.scheduler, self.control, self.workload = scheduler, control, workload
        self.limits = limits
        self.admin_token = admin_token
        # The Host names /admin/* answers (mesh.hosts.allowed_hosts; None: any).
        self.hosts = hosts
        self.registry = CollectorRegistry(auto_describe=False)
        register_process(self.registry)
        self.registry.register(SchedulerCollector(scheduler))
        # The request histograms are appended at each scrape (`metrics`), their counters here.
        self.registry.register(scheduler.metrics.cache)
        self._parse_threads: anyio.CapacityLimiter | None = None
        self.app = Quart(__name__)
        # Streams last as long as generation does; Quart's default cuts them at 60 s.
        self.app.config["RESPONSE_TIMEOUT"] = None
        self._routes()

    def _routes(self) -> None:
        app = self.app
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/chat/completions", view_func=self.chat, methods=["POST"])
        app.add_url_rule("/v1/models", view_func=self.models, methods=["GET"])
        app.add_url_rule("/health", view_func=self.health, methods=["GET"])
        app.add_url_rule("/metrics", view_func=self.metrics, methods=["GET"])
        app.add_url_rule("/admin/state", view_func=self.state, methods=["GET"])
        app.add_url_rule("/admin/policy", view_func=self.set_policy, methods=["POST"])
        app.add_url_rule("/admin/threshold", view_func=self.set_threshold, methods=["POST"])
        app.add_url_rule("/admin/workload", view_func=self.set_workload, methods=["POST"])
        app.add_url_rule("/admin/workers/<name>/role", view_func=self.set_role,
                         methods=["POST"])
        app.add_url_rule("/admin/workers/<name>/drain", view_func=self.drain,
                         methods=["POST"])
        app.before_request(self._check_admin)
        app.register_error_handler(RouterError, self._router_error)
        app.register_error_handler(AdminError, self._admin_error)
        app.register_error_handler(HTTPException, self._http_error)
        app.register_error_handler(Exception, self._internal_error)

    async def _check_admin(self) -> None:
        """/admin/*: the run's admin token when one is set, one of its own Host names, and no
        foreign Origin."""
        if not request.path.startswith("/admin/"):
            return
        headers = {key.lower(): value for key, value in request.headers.items()}
        refusal = check_admin(headers, self.admin_token, f"{request.scheme}://{request.host}",
                              self.hosts)
        if refusal is not None:
            raise AdminError(refusal.status, refusal.message)

    async def completions(self) -> Response:
        if self.scheduler.tracer is not None:
            return await self._traced(self._completions)
        return await self._completions(None)

    async def chat(self) -> Response:
        if self.scheduler.tracer is not None:
            return await self._traced(self._chat)
        return await self._chat(None)

    async def _completions(self, span: Span | None) -> Response:
        raw = await request.get_data(True, False, False)
        generation = await self._parse(raw, CompletionRequest, completion_generation, span)
        return await self._generate("completion", generation,
                                    unknown_fields(raw, CompletionRequest), span)

    async def _chat(self, span: Span | None) -> Response:
        raw = await request.get_data(True, False, False)
        generation = await self._parse(raw, ChatCompletionRequest, chat_generation, span)
        return await self._generate("chat", generation, unknown_fields(raw, ChatCompletionRequest),
                                    span)

    async def _traced(self, handler: Callable[[Span], Awaitable[Response]]) -> Response:
        """`handler` inside the HTTP request's span, which continues the client's trace when
        it sent a W3C `traceparent` header. A streamed response's span ends as its stream
        begins; each choice's `request` span, its child, runs to the last token."""
        assert self.scheduler.tracer is not None
        with self.scheduler.tracer.span(
                f"{request.method} {request.path}", request.headers.get(TRACEPARENT, ""),
                {"http.request.method": request.method, "url.path": request.path},
                kind="server") as span:
            response = await handler(span)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    async def _parse(self, raw: bytes, kind: type[RequestBody],
                     build: Callable[[RequestBody, TokenizerLike, Limits], GenerationRequest],
                     span: Span | None = None) -> GenerationRequest:
        """The body's generation request (its prompt tokenized, in a `tokenize` span under
        `span` if given); in a worker thread from THREAD_BODY_BYTES on. Its errors (400s) are
        raised here either way."""
        if span is not None:
            return await self._traced_parse(raw, kind, build, span)

        def parse() -> GenerationRequest:
            return build(decode_request(raw, kind), self.scheduler.tokenizer, self.limits)
        if len(raw) < THREAD_BODY_BYTES:
            return parse()
        if self._parse_threads is None:
            self._parse_threads = anyio.CapacityLimiter(PARSE_THREADS)
        return await anyio.to_thread.run_sync(parse, limiter=self._parse_threads)

    async def _traced_parse(self, raw: bytes, kind: type[RequestBody],
                            build: Callable[[RequestBody, TokenizerLike, Limits],
                                            GenerationRequest],
                            span: Span) -> GenerationRequest:
        assert self.scheduler.tracer is not None
        with self.scheduler.tracer.span("tokenize", span, {"prfaas.body_bytes": len(raw)}) as step:
            generation = await self._parse(raw, kind, build)
            step.set_attribute("gen_ai.usage.input_tokens", len(generation.prompt))
            return generation

    async def _submit(self, generation: GenerationRequest,
                      span: Span | None = None) -> list[RequestHandle]:
        """One handle per choice; a choice refused (the router is full) cancels the others."""
        handles: list[RequestHandle] = []
        try:
            for choice in generation.choices():
                handles.append(await self.scheduler.submit(choice, span))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    async def _generate(self, kind: Kind, generation: GenerationRequest,
                        ignored: list[str], span: Span | None = None) -> Response:
        handles = await self._submit(generation, span)
        responder = Responder(kind, handles, generation.model, generation.echo_text,
                              generation.continuous_usage)
        first = handles[0].placement
        headers = {CLUSTER_HEADER: first.cluster, "x-request-id": first.request_id}
        if ignored:
            headers["warning"] = ignored_warning(ignored)
        if generation.stream:
            response = Response(stream_events(responder, generation), mimetype="text/event-stream",
                                headers={**headers, "cache-control": "no-cache"})
            response.timeout = None
            return response
        try:
            outputs = [await handle.collect_delta() for handle in handles]
        finally:
            for handle in handles:
                handle.release()
        response = _json_response(responder.whole([delta for delta, _ in outputs],
                                                  [finished for _, finished in outputs]))
        response.headers.update(headers)
        return response

    async def models(self) -> Response:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "prfaas"}
                for name in self.limits.models]
        return _json_response({"object": "list", "data": data})

    async def health(self) -> Response:
        """200 {"status": "ready"} once a decode worker and a prefill worker of each cluster
        kind have answered a status poll and serve (WorkerTable.ready); 503
        {"status": "starting"} before (or while that does not hold)."""
        table = self.scheduler.workers
        workers, ready = table.statistics(), table.ready()
        return _json_response({"status": "ready" if ready else "starting",
                               "workers": len(workers.workers), "workers_up": workers.up,
                               "inflight": len(self.scheduler.active())},
                              200 if ready else 503)

    async def metrics(self) -> Response:
        histograms = self.scheduler.metrics.histogram_exposition().encode()
        return Response(generate_latest(self.registry) + histograms,
                        mimetype=CONTENT_TYPE_LATEST)

    def _state(self) -> Response:
        workload = msgspec.to_builtins(self.workload.statistics())
        return _json_response({**self.control.state(), "workload": workload})

    async def state(self) -> Response:
        return self._state()

    async def _admin_body(self, kind: type[msgspec.Struct]) -> Any:
        try:
            body = await request.get_data(True, False, False)
            return msgspec.json.decode(body or b"{}", type=kind)
        except msgspec.DecodeError as exc:
            raise AdminError(400, f"bad request body: {exc}") from exc

    async def set_policy(self) -> Response:
        body: PolicyBody = await self._admin_body(PolicyBody)
        self.control.set_policy(body.policy)
        return self._state()

    async def set_threshold(self) -> Response:
        body: ThresholdBody = await self._admin_body(ThresholdBody)
        self.control.set_threshold(body.t)
        return self._state()

    async def set_workload(self) -> Response:
        body: WorkloadBody = await self._admin_body(WorkloadBody)
        if body.action == "start":
            self.workload.start(body.rate, body.kind)
        else:
            self.workload.stop()
        return self._state()

    async def set_role(self, name: str) -> Response:
        body: RoleBody = await self._admin_body(RoleBody)
        self.control.convert(name, body.role, f"converted to {body.role} from the admin API")
        return self._state()

    async def drain(self, name: str) -> Response:
        self.control.drain(name)
        return self._state()

    async def _router_error(self, error: RouterError) -> Response:
        if request.path.startswith("/admin/"):
            response = _json_response({"error": error.message, "status": error.status},
                                      error.status)
        else:
            response = _json_response(error.body(), error.status)
        response.headers.update(error.headers())
        return response

    async def _admin_error(self, error: AdminError) -> Response:
        return _json_response({"error": str(error), "status": error.status}, error.status)

    async def _http_error(self, error: HTTPException) -> Response:
        status = error.code or 500
        message = f"{request.method} {request.path}: {error.name}"
        if request.path.startswith("/admin/"):
            return _json_response({"error": message, "status": status}, status)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return _json_response({"error": {"message": message, "type": kind, "param": None,
                                         "code": None}}, status)

    async def _internal_error(self, error: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path,
                      exc_info=error)
        body = RouterError(f"internal error: {type(error).__name__}: {error}").body()
        return _json_response(body, 500)



def build_scheduler(ctx: ServiceContext, config: RouterConfig,
                    tracer: Tracer | None = None) -> Scheduler:
    """The router's scheduler over the topology's workers, its policy from `config`."""
    tokenizer: TokenizerLike = ByteTokenizer() if config.tokenizer == "byte" else load_default()
    policy = create_policy(config.policy, config.policy_options().get(config.policy))
    return Scheduler(ctx.node(), policy, WorkerTable.from_topology(ctx.topology), tokenizer,
                     config.scheduler_config(link_ends(ctx.topology)), tracer=tracer)


async def run_router(ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address] = (
        anyio.TASK_STATUS_IGNORED)) -> None:
    """The `router` runner of `prfaas serve` (asyncio or uvloop backend).

    1. build the scheduler, the demo workload and the HTTP app; 2. listen on the mesh and
    start the scheduler; 3. run the control loop's first tick (it refuses workers of another
    block size) and keep it ticking; 4. serve HTTP until cancelled, then stop hypercorn.
    """
    if sniffio.current_async_library() != "asyncio":
        raise ConfigError("the router needs --backend uvloop or asyncio (Quart is asyncio-only, "
                          "docs/engineering-notes.md G6), not trio")
    config = router_config(ctx.spec.options)
    http_host = http_bind_host(ctx.spec)
    admin_token = token_from_env()
    require_token_beyond_loopback(http_host, admin_token, "the router's admin API")
    scheduler = build_scheduler(ctx, config, tracer_for(ctx.name, config.otlp_endpoint))
    serve_events(scheduler.node, scheduler.events)
    workload = DemoWorkload(scheduler, corpus_tokens(scheduler.tokenizer), WorkloadConfig(
        scale=config.scale, max_prompt=config.max_context - 64))
    limits = Limits(max_context=config.max_context, models=(config.model,))
    urls = link_urls(ctx.topology)
    async with httpx.AsyncClient(timeout=2.0) as client, scheduler.node, \
            anyio.create_task_group() as group:
        control = RouterControl(scheduler, ControlConfig(tick_s=config.tick_s),
                                link_probes=[http_link_probe(client, url, name)
                                             for name, url in urls.items()],
                                policy_options=config.policy_options())
        app = RouterApp(scheduler, control, workload, limits, admin_token,
                        allowed_hosts(http_host, ctx.spec.host))
        address = await scheduler.node.listen()
        await group.start(scheduler.run)
        await group.start(control.run)
        group.start_soon(workload.run)
        host, port = await group.start(partial(
            serve_http, app.app, http_host, config.http_port, log_name="router.http"))
        log.info("router: OpenAI API on http://%s:%d/v1, policy %s", host, port, config.policy)
        task_status.started(address)
