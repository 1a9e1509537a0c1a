"""The OpenAI streaming client: open-loop arrivals, one task per session, timings per token.

Sessions start at their arrival offsets whatever the server's state (open loop, as vLLM's
`bench serve`); the turns of one session run in order, each after the previous answer plus
its think time. Requests go to `/v1/completions` (prompt text) or `/v1/chat/completions`
(the session's history as messages) with `stream: true` and `stream_options.include_usage`.
Time is anyio's clock, so a test can run the whole client on trio's virtual clock.
The router reports where a request prefilled in the `x-prfaas-cluster` header and in a
`prfaas` field of the final chunk; both are optional here.
"""

from __future__ import annotations

from typing import Any, Literal

import anyio
import httpx
import msgspec
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no stubs

from mesh.http import CLIENT_KEEPALIVE_S
from services.bench.errors import BenchError
from services.bench.sse import DONE, ChunkInfo, SSEDecoder, read_chunk
from services.bench.stats import RequestResult
from services.bench.workloads import Session, Turn, next_prompt

CLUSTER_HEADER = "x-prfaas-cluster"


class ClientConfig(msgspec.Struct, frozen=True, kw_only=True):
    base_url: str = "http://127.0.0.1:8000"
    endpoint: Literal["completions", "chat"] = "completions"
    model: str = "prfaas"
    timeout_s: float = 600.0
    max_concurrency: int | None = None  # at most this many requests in flight (None: open)
    ignore_eos: bool = False  # ask for exactly max_tokens (a vLLM extension field)
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if not self.timeout_s > 0:
            raise BenchError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


class Conversation:
    """A session's context so far: one growing prompt, or the chat messages."""

    def __init__(self) -> None:
        self.prompt = ""
        self.messages: list[dict[str, str]] = []

    def add_turn(self, text: str) -> None:
        answer = self.messages[-1]["content"] if self.messages else ""
        self.prompt = next_prompt(self.prompt, answer, text)
        self.messages.append({"role": "user", "content": text})

    def add_answer(self, answer: str) -> None:
        self.messages.append({"role": "assistant", "content": answer})


def build_payload(config: ClientConfig, conversation: Conversation, turn: Turn) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": config.model, "max_tokens": turn.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": config.temperature,
    }
    if config.endpoint == "chat":
        payload["messages"] = list(conversation.messages)
    else:
        payload["prompt"] = conversation.prompt
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


class _Stream:
    """What one response has streamed so far."""

    def __init__(self, start: float, cluster: str | None) -> None:
        self.start = self.last = start
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.text: list[str] = []
        self.info = ChunkInfo(cluster=cluster)
        self.done = False
        self.empty = 0

    def add(self, data: str, now: float) -> None:
        if data.strip() == DONE:
            self.done = True
            return
        chunk = read_chunk(data)
        self.empty += chunk.empty
        if chunk.text:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last = now
            self.text.append(chunk.text)
        self.info = _merge(self.info, chunk)


def _merge(old: ChunkInfo, new: ChunkInfo) -> ChunkInfo:
    """Later non-None fields win (usage and the prfaas field come in the final chunk)."""
    fields = msgspec.structs.asdict(new)
    kept = {k: v for k, v in msgspec.structs.asdict(old).items() if fields.get(k) is None}
    return ChunkInfo(**{**fields, **kept, "text": "", "empty": False})


class TurnKey(msgspec.Struct, frozen=True, kw_only=True):
    """Which turn of which session a request is, and when the run started."""

    session_id: str
    index: int
    turn: Turn
    run_start: float

    @property
    def request_id(self) -> str:
        return f"{self.session_id}/{self.index}"


def _result(stream: _Stream, key: TurnKey, error: str = "") -> RequestResult:
    ok = not error and stream.ttft is not None
    info = stream.info
    return RequestResult(
        request_id=key.request_id, session_id=key.session_id, turn=key.index, ok=ok,
        error=error or ("" if ok else "no token streamed"), start_s=stream.start - key.run_start,
        ttft_s=stream.ttft if ok else None, latency_s=stream.last - stream.start if ok else None,
        itl_s=tuple(stream.itl) if ok else (),
        output_tokens=info.completion_tokens or len(stream.text),
        prompt_tokens=info.prompt_tokens or key.turn.planned_tokens,
        cached_tokens=info.cached_tokens, cluster=info.cluster, empty_chunks=stream.empty)


async def _consume(response: httpx.Response, stream: _Stream) -> None:
    decoder = SSEDecoder()
    async for text in response.aiter_text():
        now = anyio.current_time()
        for event in decoder.feed(text):
            stream.add(event.data, now)
    for event in decoder.close():
        stream.add(event.data, anyio.current_time())


async def stream_turn(client: httpx.AsyncClient, config: ClientConfig, payload: dict[str, Any],
                      key: TurnKey) -> tuple[RequestResult, str]:
    """Send one streaming request; its result and the answer text. Failures are results."""
    stream = _Stream(anyio.current_time(), None)
    try:
        async with client.stream("POST", config.path, json=payload,
                                 headers={"x-request-id": key.request_id}) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")[:200]
                return _result(stream, key, f"HTTP {response.status_code}: {body}"), ""
            stream.info = ChunkInfo(cluster=response.headers.get(CLUSTER_HEADER))
            await _consume(response, stream)
    except (httpx.HTTPError, BenchError) as exc:
        return _result(stream, key, f"{type(exc).__name__}: {exc}"), ""
    return _result(stream, key), "".join(stream.text)


class BenchRun(msgspec.Struct, frozen=True):
    results: list[RequestResult]
    duration_s: float


class _Runner:
    def __init__(self, client: httpx.AsyncClient, config: ClientConfig, bar: Any,
                 run_start: float) -> None:
        self.client, self.config, self.bar, self.run_start = client, config, bar, run_start
        self.results: list[RequestResult] = []
        limit = config.max_concurrency
        self.limiter = anyio.CapacityLimiter(limit) if limit is not None else None

    async def _send(self, session: Session, conversation: Conversation, index: int,
                    turn: Turn) -> tuple[RequestResult, str]:
        payload = build_payload(self.config, conversation, turn)
        key = TurnKey(session_id=session.session_id, index=index, turn=turn,
                      run_start=self.run_start)
        if self.limiter is None:
            return await stream_turn(self.client, self.config, payload, key)
        async with self.limiter:
            return await stream_turn(self.client, self.config, payload, key)

    async def session(self, session: Session) -> None:
        conversation = Conversation()
        for index, turn in enumerate(session.turns):
            if index and turn.think_s > 0:
                await anyio.sleep(turn.think_s)
            conversation.add_turn(turn.text)
            result, answer = await self._send(session, conversation, index, turn)
            self.results.append(result)
            self.bar.update(1)
            if not result.ok:
                self.bar.update(len(session.turns) - index - 1)
                return
            conversation.add_answer(answer)


async def run_benchmark(sessions: list[Session], config: ClientConfig, *, progress: bool = True,
                        transport: httpx.AsyncBaseTransport | None = None) -> BenchRun:
    """Run every session open-loop; the results in completion order and the run's duration."""
    total = sum(len(s.turns) for s in sessions)
    # Idle connections go before the server's keep-alive timeout closes them (hypercorn's
    # and uvicorn's are 5 s): open-loop gaps are often longer.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                          keepalive_expiry=CLIENT_KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=config.timeout_s,
                                 limits=limits, transport=transport) as client:
        with tqdm(total=total, desc="prfaas bench", unit="req", disable=not progress) as bar:
            start = anyio.current_time()
            runner = _Runner(client, config, bar, start)
            async with anyio.create_task_group() as tg:
                for session in sorted(sessions, key=lambda s: s.arrival_s):
                    await anyio.sleep_until(start + session.arrival_s)
                    tg.start_soon(runner.session, session)
            duration = anyio.current_time() - start
    return BenchRun(runner.results, duration)
