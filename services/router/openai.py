"""The router's OpenAI-compatible face: the HTTP app, the request and response schema, the
response bodies and server-sent events, and the logprob formats, in the order a request meets
them. It turns a body into the router's own request (services/router/requests.py) and that
request's deltas back into OpenAI's bodies; nothing below it knows HTTP or OpenAI.

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

Requests are decoded straight into frozen msgspec Structs; anything the Structs refuse (a
wrong type, a value out of range, an unknown field inside a known one) becomes a 400
`InvalidRequest` that names the parameter, as the OpenAI API does. Unknown top-level fields
(other vendors' extensions) are ignored: `unknown_fields` names them for the `Warning` header.
`completion_generation` and `chat_generation` then tokenize the prompt and check it against
the model's context, giving the scheduler a `GenerationRequest` (vLLM's extensions
ignore_eos, min_tokens and stop_token_ids included).

Chat prompt template (a flat prompt for a small base model; `render_chat`):

    System: {content}\\n        (role "system" or "developer")
    User: {content}\\n
    Assistant:{content}\\n      (no space: the answer continues right after the colon)
    Tool: {content}\\n
    Assistant:                  (the generation prompt, no trailing space)

An assistant turn is rendered exactly where its generation began, so the next turn's prompt
is the previous prompt, then its answer, then the new messages: the prefix cache sees
multi-turn chat as incremental prefill (only the new text's KV is computed and sent).

Responses: every response to a generation carries header `x-prfaas-cluster` and, in its body
(the final chunk when streaming), `prfaas: {"request_id", "cluster", "cached_tokens", ...}`,
this project's extension: where the request ran. `omit_defaults` keeps a streamed chunk to
what it carries (no `usage` or `prfaas` until the last), as OpenAI's own chunks do. A request
with `n` choices runs as n generations, one handle each. `Responder` builds a completion's or
a chat's body, whole or chunk by chunk; `stream_events` is the event stream of a streamed
generation (OpenAI's order, per choice: a chat's role chunk first, the text, the final chunk
with finish_reason and `prfaas`; then the usage chunk if asked, then `[DONE]`). The choices'
chunks interleave as their text comes. Every chunk between the role chunk and the final one
carries text (tokens without text yet wait for it); with `continuous_usage_stats` every chunk
carries the usage so far, summed over the choices, as vLLM does. Token logprobs are returned
as the OpenAI API returns them: chat's `choices[i].logprobs.content`, a list of
`ChatTokenLogprob`; completions' one `CompletionLogprobs` of parallel lists.

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
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

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
from mesh.http import serve_http
from mesh.metrics import register_process
from mesh.transport import Address
from services.contract.access import (
    allowed_hosts,
    check_admin,
    require_token_beyond_loopback,
    token_from_env,
)
from services.contract.sampling import Sampling
from services.contract.tracing import Tracer, tracer_for
from services.model.tokenizer import ByteTokenizer, TokenizerLike, load_default
from services.router.config import RouterConfig, link_ends, router_config
from services.router.control import ControlConfig, RouterControl, http_link_probe, link_urls
from services.router.errors import ContextTooLong, InvalidRequest, NotFound, RouterError
from services.router.load import DemoWorkload, WorkloadConfig, corpus_tokens
from services.router.policies import create_policy
from services.router.requests import Delta, Finished, GenerationRequest, RequestHandle
from services.router.scheduler import Scheduler, SchedulerCollector
from services.router.text import ChatTokenLogprob, TokenRecord
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
        # The Host names /admin/* answers (services.contract.access.allowed_hosts; None: any).
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

    async def _parse(self, raw: bytes, kind: type[R],
                     build: Callable[[R, TokenizerLike, Limits], GenerationRequest],
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

    async def _traced_parse(self, raw: bytes, kind: type[R],
                            build: Callable[[R, TokenizerLike, Limits], GenerationRequest],
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


MAX_STOPS = 4  # the OpenAI API's own limit on `stop`
MAX_CHOICES = 8  # `n`: each choice is a generation of its own
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (the OpenAI API's limit; completions allow 5)

MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Stop = str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOPS)] | None
# The mesh carries seeds as msgpack integers; OpenAI documents an int64 seed.
Seed = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
# "text", ["text"], [ids...] or [[ids...]]: typed to two levels, so that no body, however
# deeply nested, makes the decoder recurse past them (a 400 at the first level too deep).
Prompt = str | list[int | str | list[int]]


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False
    # vLLM's extension: with include_usage, usage on every chunk too
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    """Parameters both endpoints share (unsupported ones accept only their neutral value)."""

    model: str
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's extensions: no end-of-text or stop before min_tokens; token ids that stop
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    prompt: Prompt
    echo: bool = False
    best_of: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    suffix: None = None


class TextPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: None = None
    tool_choice: Literal["none"] | None = None
    response_format: dict[str, Literal["text"]] | None = None


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """What the served model allows (tokens): context = prompt + generated tokens."""

    max_context: int = 8192
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    chat_max_tokens: int = 256  # chat without max_tokens: at most this, within the context
    models: tuple[str, ...] = ("prfaas",)


R = TypeVar("R", CompletionRequest, ChatCompletionRequest)
_PARAM_PREFIX = "- at `$."


def _param_of(error: str) -> str | None:
    """The parameter a msgspec ValidationError message points at ("$.a.b[0]" -> "a.b[0]")."""
    where = error.split(_PARAM_PREFIX, 1)[1].rstrip("`") if _PARAM_PREFIX in error else ""
    for marker in ("unknown field `", "missing required field `"):
        if marker in error:
            name = error.split(marker, 1)[1].split("`", 1)[0]
            return f"{where}.{name}" if where else name
    return where or None


def decode_request(body: bytes, kind: type[R]) -> R:
    """The request in a JSON body; InvalidRequest naming the parameter when it is not one."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        param = _param_of(str(exc))
        where = f" (parameter {param!r})" if param else ""
        raise InvalidRequest(f"invalid request{where}: {exc}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        # Typed fields stop deep nesting early; this is the edge's last word on the rest.
        raise InvalidRequest("request body nests JSON too deeply") from exc


def unknown_fields(body: bytes, kind: type[R]) -> list[str]:
    """The top-level fields of a decoded request's body that `kind` does not know (ignored).

    The typed decode skips unknown keys unread, so a key that is not UTF-8 shows here first:
    a 400, as any other body that is not JSON."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    return [name for name in fields if name not in kind.__struct_fields__]


def _prompt_tokens(prompt: Prompt | list[int], tokenizer: TokenizerLike,
                   nested: bool = False) -> tuple[list[int], str]:
    """A single prompt as token ids, and its text ("" when given as ids).

    Accepted: "text", ["text"], [ids...], [[ids...]]; a batch of several prompts is not.
    """
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list) and not nested:
        return _prompt_tokens(prompt[0], tokenizer, nested=True)
    ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
    if prompt and len(ids) == len(prompt):
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must lie in [0, {tokenizer.vocab_size}), "
                                 f"got {bad[0]}", param="prompt")
        return ids, ""
    raise InvalidRequest("prompt must be one string or one list of token ids (batches of "
                         f"prompts are not supported), got {str(prompt)[:80]!r}", param="prompt")


def _check_unsupported(request: _Common) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) != 0.0:
            raise InvalidRequest(f"{name} is not supported, got {getattr(request, name)!r}; "
                                 "use 0", param=name)
    if request.logit_bias:
        raise InvalidRequest("logit_bias is not supported; omit it", param="logit_bias")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true",
                             param="stream_options")
    if request.stop is not None and any(not s for s in _stops(request.stop)):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    if request.n > MAX_CHOICES:
        raise InvalidRequest(f"n={request.n} is more choices than this server generates per "
                             f"request (at most {MAX_CHOICES})", param="n")
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        raise InvalidRequest("give max_tokens or max_completion_tokens, not both",
                             param="max_completion_tokens")


def _check_token_ids(request: _Common, tokenizer: TokenizerLike, max_tokens: int) -> None:
    bad = [t for t in request.stop_token_ids or () if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise InvalidRequest(f"stop_token_ids must lie in [0, {tokenizer.vocab_size}), got "
                             f"{bad[0]}", param="stop_token_ids")
    if request.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens={request.min_tokens} exceeds the request's "
                             f"max_tokens={max_tokens}", param="min_tokens")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _check_model(model: str, limits: Limits) -> None:
    if model not in limits.models:
        raise NotFound(f"model {model!r} does not exist; served: {', '.join(limits.models)}",
                       param="model", code="model_not_found")


def _max_tokens(asked: int | None, prompt_len: int, limits: Limits, default: int,
                prompt_param: str) -> int:
    room = limits.max_context - prompt_len
    if room < 1:
        raise ContextTooLong(f"prompt has {prompt_len} tokens; this model's context is "
                             f"{limits.max_context} tokens (prompt + output)",
                             param=prompt_param, code="context_length_exceeded")
    if asked is None:
        return min(default, room)
    if asked > room:
        raise ContextTooLong(f"max_tokens={asked} plus the prompt's {prompt_len} tokens exceeds "
                             f"this model's context of {limits.max_context} tokens",
                             param="max_tokens", code="context_length_exceeded")
    return asked


def _generation(request: _Common, prompt: list[int], max_tokens: int,
                logprobs: int | None, echo_text: str = "") -> GenerationRequest:
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=request.seed, stop_on_eos=not request.ignore_eos, logprobs=logprobs,
        min_tokens=request.min_tokens, stop_token_ids=tuple(request.stop_token_ids or ()))
    options = request.stream_options
    usage = options is not None and options.include_usage
    return GenerationRequest(
        prompt=prompt, sampling=sampling, stop=_stops(request.stop), stream=request.stream,
        include_usage=usage, continuous_usage=usage and options is not None
        and options.continuous_usage_stats, model=request.model, echo_text=echo_text,
        n=request.n)


def _asked_max_tokens(request: _Common) -> int | None:
    return request.max_completion_tokens or request.max_tokens


def completion_generation(request: CompletionRequest, tokenizer: TokenizerLike,
                          limits: Limits) -> GenerationRequest:
    _check_model(request.model, limits)
    _check_unsupported(request)
    prompt, text = _prompt_tokens(request.prompt, tokenizer)
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if request.echo and not text:
        text = tokenizer.decode(prompt)
    max_tokens = _max_tokens(_asked_max_tokens(request), len(prompt), limits,
                             limits.default_max_tokens, "prompt")
    _check_token_ids(request, tokenizer, max_tokens)
    return _generation(request, prompt, max_tokens, request.logprobs,
                       text if request.echo else "")


_CHAT_NAMES = {"system": "System", "developer": "System", "user": "User",
               "assistant": "Assistant", "tool": "Tool"}


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The flat prompt of a conversation (template in the module docstring)."""
    lines = []
    for message in messages:
        name = _CHAT_NAMES[message.role]
        gap = "" if message.role == "assistant" else " "
        lines.append(f"{name}:{gap}{message.text()}\n")
    return "".join(lines) + "Assistant:"


def chat_generation(request: ChatCompletionRequest, tokenizer: TokenizerLike,
                    limits: Limits) -> GenerationRequest:
    _check_model(request.model, limits)
    _check_unsupported(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    prompt = tokenizer.encode(render_chat(request.messages))
    max_tokens = _max_tokens(_asked_max_tokens(request), len(prompt), limits,
                             limits.chat_max_tokens, "messages")
    _check_token_ids(request, tokenizer, max_tokens)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _generation(request, prompt, max_tokens, logprobs)


class PromptDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(prompt, completion, prompt + completion, PromptDetails(cached))


class PrfaasInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where the request ran (the bench client and the dashboard read it)."""

    request_id: str
    cluster: str
    cached_tokens: int
    prefill_worker: str
    decode_worker: str


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prfaas: PrfaasInfo | None = None


class ChatResponseMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice] | list[ChatChunkChoice]
    usage: Usage | None = None
    prfaas: PrfaasInfo | None = None


def now_s() -> int:
    """`created` of a response: Unix seconds (the API's field, not a timing measurement)."""
    return int(time.time())


Kind = Literal["completion", "chat"]


def _prfaas_info(handle: RequestHandle, finished: Finished | None) -> PrfaasInfo:
    p = handle.placement
    cached = finished.cached_tokens if finished else p.cached_tokens
    return PrfaasInfo(request_id=p.request_id, cluster=p.cluster, cached_tokens=cached,
                      prefill_worker=p.prefill_worker, decode_worker=p.decode_worker)


def _usage(finished: Sequence[Finished]) -> Usage:
    """The prompt once (the first choice's), the choices' completions summed."""
    first = finished[0]
    return Usage.of(first.prompt_tokens, sum(f.completion_tokens for f in finished),
                    first.cached_tokens)


class Responder:
    """Builds the bodies of one generation (completion or chat, n choices), whole or as
    chunks; choice i is handles[i]."""

    def __init__(self, kind: Kind, handles: RequestHandle | Sequence[RequestHandle],
                 model: str, echo_text: str = "", continuous_usage: bool = False) -> None:
        self.kind, self.model = kind, model
        self.handles = [handles] if isinstance(handles, RequestHandle) else list(handles)
        self.handle = self.handles[0]
        self.echo_text, self.continuous_usage = echo_text, continuous_usage
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.id = f"{prefix}-{self.handle.placement.request_id}"
        self.created = now_s()
        self._tokens = 0  # completion tokens streamed so far, all choices

    def whole(self, outputs: Delta | str | Sequence[Delta],
              finished: Finished | Sequence[Finished]) -> Completion | ChatCompletion:
        """The body of the finished choices: each one's output and result."""
        deltas = _as_deltas(outputs)
        results = [finished] if isinstance(finished, Finished) else list(finished)
        info, usage = _prfaas_info(self.handle, results[0]), _usage(results)
        if self.kind == "completion":
            return Completion(id=self.id, object="text_completion", created=self.created,
                              model=self.model, usage=usage, prfaas=info, choices=[
                                  self._completion_choice(i, d, r)
                                  for i, (d, r) in enumerate(zip(deltas, results, strict=True))])
        return ChatCompletion(id=self.id, object="chat.completion", created=self.created,
                              model=self.model, usage=usage, prfaas=info, choices=[
                                  ChatChoice(index=i,
                                             message=ChatResponseMessage("assistant", d.text),
                                             logprobs=chat_logprobs(d.logprobs),
                                             finish_reason=r.finish_reason)
                                  for i, (d, r) in enumerate(zip(deltas, results, strict=True))])

    def _completion_choice(self, index: int, delta: Delta, finish: Finished) -> CompletionChoice:
        """A whole choice: the echoed prompt (echo=true) and the output."""
        logprobs = completion_logprobs(delta.logprobs, len(self.echo_text))
        return CompletionChoice(index=index, text=self.echo_text + delta.text,
                                logprobs=logprobs, finish_reason=finish.finish_reason)

    def chunk(self, text: str | Delta | None, finish: Finished | None = None, *,
              role: bool = False, index: int = 0) -> bytes:
        """One chunk of choice `index`: its new text, tokens and logprobs (a final chunk's
        tokens are those left without text)."""
        delta = text if isinstance(text, Delta) else Delta(text or "")
        self._tokens += delta.tokens
        info = _prfaas_info(self.handles[index], finish) if finish else None
        usage = self._usage_so_far() if self.continuous_usage else None
        body: Completion | ChatCompletion
        if self.kind == "completion":
            choice = CompletionChoice(
                index=index, text=delta.text, finish_reason=finish.finish_reason if finish
                else None, logprobs=completion_logprobs(delta.logprobs, len(self.echo_text)))
            body = Completion(id=self.id, object="text_completion", created=self.created,
                              model=self.model, prfaas=info, usage=usage, choices=[choice])
        else:
            content = delta.text if delta.text or role else None
            chat = ChatDelta(role="assistant" if role else None, content=content)
            body = ChatCompletion(id=self.id, object="chat.completion.chunk",
                                  created=self.created, model=self.model, prfaas=info,
                                  usage=usage, choices=[ChatChunkChoice(
                                      index=index, delta=chat,
                                      logprobs=chat_logprobs(delta.logprobs),
                                      finish_reason=finish.finish_reason if finish else None)])
        return sse(body)

    def _usage_so_far(self) -> Usage:
        p = self.handle.placement
        return Usage.of(p.prompt_tokens, self._tokens, p.cached_tokens)

    def usage_chunk(self, finished: Finished | Sequence[Finished]) -> bytes:
        results = [finished] if isinstance(finished, Finished) else list(finished)
        kind = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = Completion(id=self.id, object=kind, created=self.created, model=self.model,
                          choices=[], usage=_usage(results))
        return sse(body)


def _as_deltas(outputs: Delta | str | Sequence[Delta]) -> list[Delta]:
    if isinstance(outputs, str):
        return [Delta(outputs)]
    return [outputs] if isinstance(outputs, Delta) else list(outputs)


def sse(body: object) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


async def _any_change(handles: Sequence[RequestHandle]) -> None:
    """Until one of the handles' outboxes changes."""
    if len(handles) == 1:
        await handles[0].wait()
        return

    async def wait(handle: RequestHandle, scope: anyio.CancelScope) -> None:
        await handle.wait()
        scope.cancel()

    async with anyio.create_task_group() as group:
        for handle in handles:
            group.start_soon(wait, handle, group.cancel_scope)


async def _choice_chunks(responder: Responder) -> AsyncGenerator[bytes, None]:
    """The choices' text chunks as they come, and each one's final chunk when it ends.
    Only a pass that found nothing waits: the wait is for a change after the last wait, so a
    change that came before a pass took its text (the request's end right behind its last
    token, say) would never wake it."""
    handles = responder.handles
    live = list(range(len(handles)))
    while live:
        found = False
        for index in list(live):
            delta = handles[index].take()
            if delta is not None:
                found = True
                yield responder.chunk(delta, index=index)
            elif handles[index].outbox.closed:
                live.remove(index)
                tail = handles[index].finish()
                assert handles[index].result is not None
                yield responder.chunk(tail, handles[index].result, index=index)
        if live and not found:
            await _any_change([handles[i] for i in live])


async def stream_events(responder: Responder,
                        generation: GenerationRequest) -> AsyncIterator[bytes]:
    """The server-sent events of one streamed generation; cancels it if the client leaves."""
    handles = responder.handles
    try:
        for index in range(len(handles)):
            if responder.kind == "chat":
                yield responder.chunk("", role=True, index=index)
            if generation.echo_text:
                yield responder.chunk(generation.echo_text, index=index)
        async with aclosing(_choice_chunks(responder)) as chunks:
            async for chunk in chunks:
                yield chunk
        if generation.include_usage:
            yield responder.usage_chunk([h.result for h in handles if h.result is not None])
        yield b"data: [DONE]\n\n"
    except RouterError as exc:
        yield sse(exc.body())
    finally:
        for handle in handles:
            handle.release()


class ChatLogprobs(msgspec.Struct, frozen=True):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct, frozen=True):
    """The completions format: parallel lists, one entry per output token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def chat_logprobs(records: Sequence[TokenRecord] | None) -> ChatLogprobs | None:
    return None if records is None else ChatLogprobs([r.entry for r in records])


def completion_logprobs(records: Sequence[TokenRecord] | None,
                        shift: int = 0) -> CompletionLogprobs | None:
    """The completions format; `shift` moves the offsets past an echoed prompt."""
    if records is None:
        return None
    return CompletionLogprobs(
        tokens=[r.entry.token for r in records],
        token_logprobs=[r.entry.logprob for r in records],
        top_logprobs=[{t.token: t.logprob for t in r.entry.top_logprobs} for r in records],
        text_offset=[r.offset + shift for r in records])


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
