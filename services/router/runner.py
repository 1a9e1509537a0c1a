"""Runs one placed request over the mesh, from its prefill to its last token.

`drive` is the data path, the one request driver: the prefill call (`PrefillRequest` to the
prefill worker, which streams the KV the decode worker lacks straight to it) beside the decode
worker's token stream (`DecodeRequest`). `RequestRunner` runs a router's request on it: the
tokens go through a `TextAssembler` into the request's outbox, with their logprobs when asked
(named by services/router/openai/logprobs.py); a stop token (stop_token_ids) counts but, as in
vLLM, adds no text. The first error either side meets is the request's (`UpstreamFailed`)
and cancels the other; cancelling the request's scope (the client left) aborts the decode
stream at its worker and gives up the prefill call. `prfaas send` (services/cli/send.py)
drives a prompt through two workers it names on the same `drive`. Counting and events of the
request's end are the scheduler's (services/router/scheduler.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
import msgspec

from mesh.errors import MeshError
from mesh.events import EventBus
from mesh.node import Node
from services.contract.events import Event, RequestPhase
from services.contract.messages import DecodeRequest, PrefillDone, PrefillRequest, TokenChunk
from services.contract.types import Phase
from services.model.tokenizer import TokenizerLike
from services.router.errors import UpstreamFailed
from services.router.openai.logprobs import TokenRecord, chat_entry, text_offsets
from services.router.openai.text import TextAssembler
from services.router.requests import Delta, Finished, RequestHandle
from services.router.workers import WorkerTable

if TYPE_CHECKING:
    from services.router.config import SchedulerConfig


class Driven(msgspec.Struct, frozen=True, kw_only=True):
    """How one request's data path ended: the prefill worker's report, the finish reason."""

    prefill: PrefillDone
    finish_reason: str


def _nothing() -> None:
    pass


async def drive(node: Node, prefill_worker: str, prefill: PrefillRequest, decode_worker: str,
                decode: DecodeRequest, *, timeout: float,
                on_chunk: Callable[[TokenChunk], str | None],
                on_prefilled: Callable[[], None] = _nothing, grace_s: float = 0.0) -> Driven:
    """The data path of one placed request: the prefill call beside the decode worker's token
    stream. The one request driver: the router's `RequestRunner` and `prfaas send` use it.

    Each chunk goes to `on_chunk`, which returns the finish reason once the request is done;
    done before the worker (a stop string, max_tokens), leaving the stream aborts the rest of
    the generation there. `on_prefilled` runs when the prefill call ends, either way. Raises
    UpstreamFailed naming the worker: the first error either side met, which cancels the
    other; after a failed prefill the token stream has `grace_s` to report its own, more
    specific error first (a cut KV stream), which is then the one raised.
    """
    failures: list[tuple[str, UpstreamFailed]] = []
    done: list[PrefillDone] = []
    reason: str | None = None
    reading = anyio.CancelScope()

    async def call_prefill() -> None:
        try:
            done.append(await node.call(prefill_worker, prefill, PrefillDone, timeout=timeout))
        except MeshError as exc:
            failures.append(("prefill", _failed(f"prefill on {prefill_worker} failed", exc)))
            reading.deadline = min(reading.deadline, anyio.current_time() + grace_s)
        finally:
            on_prefilled()

    async with anyio.create_task_group() as group:
        group.start_soon(call_prefill)
        with reading:
            reason = await _read_tokens(node, decode_worker, decode, timeout, on_chunk,
                                        failures)
        if failures:
            group.cancel_scope.cancel()
    if failures:
        decoded = [f for kind, f in failures if kind == "decode"]
        raise decoded[0] if decoded and grace_s > 0 else failures[0][1]
    if reason is None:
        raise UpstreamFailed(f"decode on {decode_worker} ended request {decode.request_id} "
                             "without a finish reason")
    return Driven(prefill=done[0], finish_reason=reason)


async def _read_tokens(node: Node, worker: str, decode: DecodeRequest, timeout: float,
                       on_chunk: Callable[[TokenChunk], str | None],
                       failures: list[tuple[str, UpstreamFailed]]) -> str | None:
    """Feeds the decode worker's token stream to `on_chunk`; the finish reason it gave."""
    try:
        async with node.open_stream(worker, decode, timeout=timeout) as chunks:
            async for chunk in chunks:
                assert isinstance(chunk, TokenChunk)
                reason = on_chunk(chunk)
                if reason is not None and chunk.finish_reason is None:
                    return reason
                if reason is not None:
                    # The worker has finished: its End follows at once; reading it spares it
                    # an Abort (bench-router: 3% of the router's CPU).
                    extra = await _after_end(chunks)
                    if extra is not None:
                        failures.append(("decode", UpstreamFailed(
                            f"decode on {worker} sent {extra} after the finish reason")))
                    return reason
    except MeshError as exc:
        failures.append(("decode", _failed(f"decode on {worker} failed", exc)))
    return None


def _failed(what: str, exc: MeshError) -> UpstreamFailed:
    """UpstreamFailed for `exc`, which stays its cause (a RemoteError's kind and detail)."""
    failure = UpstreamFailed(f"{what}: {exc}")
    failure.__cause__ = exc
    return failure


class RequestRunner:
    """Runs placed requests (module docstring); `phase` publishes a request's progress."""

    def __init__(self, node: Node, workers: WorkerTable, tokenizer: TokenizerLike,
                 config: SchedulerConfig, events: EventBus[Event],
                 clock: Callable[[], float]) -> None:
        self.node, self.workers, self.tokenizer = node, workers, tokenizer
        self.config, self.events, self.clock = config, events, clock

    async def run(self, handle: RequestHandle) -> Finished:
        """`drive` with the tokens going through a TextAssembler into the request's outbox;
        the result, or the first error either side met."""
        p, request, cfg = handle.placement, handle.request, self.config
        assembler = TextAssembler(self.tokenizer, request.stop, request.sampling.min_tokens)
        self.phase(p.request_id, "prefill", p.prefill_worker, f"cluster {p.cluster}")
        # A whole (non-streamed) answer without stop strings needs no token before the last
        # but the first (its time is the TTFT): the worker sends the rest at the finish.
        decode = DecodeRequest(request_id=p.request_id, prompt=request.prompt,
                               sampling=request.sampling, kv_timeout=cfg.kv_timeout_s,
                               incremental=request.stream or bool(request.stop))
        driven = await drive(
            self.node, p.prefill_worker, self._prefill_request(handle), p.decode_worker, decode,
            timeout=cfg.request_timeout_s,
            on_chunk=lambda chunk: self._take(handle, chunk, assembler),
            on_prefilled=lambda: self.workers.prefilled(p.prefill_worker))
        handle.prefill = driven.prefill
        handle.outbox.put(assembler.finish())
        return Finished(finish_reason=driven.finish_reason, prompt_tokens=p.prompt_tokens,
                        completion_tokens=assembler.tokens,
                        cached_tokens=driven.prefill.reused_tokens)

    def _prefill_request(self, handle: RequestHandle) -> PrefillRequest:
        p, request = handle.placement, handle.request
        lanes = min(self.config.connections, self.workers.lanes(p.prefill_worker))
        return PrefillRequest(
            request_id=p.request_id, prompt=request.prompt, decode_worker=p.decode_worker,
            decode_has_tokens=p.decode_has_tokens, sampling=request.sampling,
            connections=lanes if p.cluster == "prfaas" else 1, pull=p.pull)

    def _take(self, handle: RequestHandle, chunk: TokenChunk,
              assembler: TextAssembler) -> str | None:
        """Feeds one chunk to the outbox; the finish reason once the request is done."""
        if chunk.tokens:
            self._token_times(handle, len(chunk.tokens))
        sampling = handle.request.sampling
        tokens = chunk.tokens[:sampling.max_tokens - assembler.tokens]
        stop_token = (chunk.finish_reason == "stop" and tokens == chunk.tokens
                      and tokens[-1:] != [] and tokens[-1] in sampling.stop_token_ids)
        shown = tokens[:-1] if stop_token else tokens
        before = assembler.chars
        text = assembler.push(shown)
        assembler.skip(len(tokens) - len(shown))
        records = self._records(chunk, tokens, before, assembler.chars)
        handle.outbox.put(Delta(text, len(tokens), records))
        if assembler.stopped:
            return "stop"
        if assembler.tokens >= sampling.max_tokens:
            return chunk.finish_reason or "length"
        return chunk.finish_reason

    def _token_times(self, handle: RequestHandle, tokens: int) -> None:
        """The first token's time, then the gap before each later token (the ITL histogram):
        `tokens` arriving g after the last one count as `tokens` gaps of g / tokens (a whole
        answer's tokens after the first come together at its end)."""
        now = self.clock()
        if handle.first_token_at == 0.0:
            handle.first_token_at = handle.last_token_at = now
            self.phase(handle.placement.request_id, "decode", handle.placement.decode_worker)
            tokens -= 1
        if tokens > 0 and handle.series is not None:
            handle.series.itl.observe((now - handle.last_token_at) / tokens, tokens)
        handle.last_token_at = now

    def _records(self, chunk: TokenChunk, tokens: list[int], start: int,
                 end: int) -> tuple[TokenRecord, ...] | None:
        """The logprobs of `tokens` (a chunk's first ones), their text at [start, end)."""
        if chunk.logprobs is None:
            return None
        offsets = text_offsets(self.tokenizer, tokens, start, end)
        return tuple(TokenRecord(chat_entry(self.tokenizer, token, logprob), offset)
                     for token, logprob, offset in zip(tokens, chunk.logprobs, offsets,
                                                       strict=False))

    def phase(self, request_id: str, phase: Phase, worker: str, detail: str = "") -> None:
        if not self.events.subscribed:  # the dashboard's and the simulation's
            return
        self.events.publish(RequestPhase(ts=self.clock(), source="router", request_id=request_id,
                                         phase=phase, worker=worker, detail=detail))


async def _after_end(chunks: AsyncIterator[object]) -> str | None:
    """Reads a finished stream's End; the type of anything else after the last token (it
    breaks the protocol), None when the End came."""
    async for extra in chunks:
        return type(extra).__name__
    return None
