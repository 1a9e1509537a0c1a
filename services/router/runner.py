"""Runs one placed request over the mesh, from its prefill to its last token.

The prefill call (`PrefillRequest` to the prefill worker, which streams the KV the decode
worker lacks straight to it) runs beside the decode worker's token stream (`DecodeRequest`);
the tokens go through a `TextAssembler` into the request's outbox, with their logprobs when
asked (named by services/router/openai/logprobs.py); a stop token (stop_token_ids) counts
but, as in vLLM, adds no text. The first error either
side meets is the request's (`UpstreamFailed`) and cancels the other; cancelling the
request's scope (the client left) aborts the decode stream at its worker and gives up the
prefill call. Counting and events of the request's end are the scheduler's
(services/router/scheduler.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio

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
    from services.router.scheduler import SchedulerConfig



class RequestRunner:
    """Runs placed requests (module docstring); `phase` publishes a request's progress."""

    def __init__(self, node: Node, workers: WorkerTable, tokenizer: TokenizerLike,
                 config: SchedulerConfig, events: EventBus[Event],
                 clock: Callable[[], float]) -> None:
        self.node, self.workers, self.tokenizer = node, workers, tokenizer
        self.config, self.events, self.clock = config, events, clock

    async def run(self, handle: RequestHandle) -> Finished:
        """1. call the prefill worker beside, 2. read the decode worker's tokens into the
        outbox until a finish reason, 3. the first error either side met, else the result."""
        p = handle.placement
        assembler = TextAssembler(self.tokenizer, handle.request.stop,
                                  handle.request.sampling.min_tokens)
        self.phase(p.request_id, "prefill", p.prefill_worker, f"cluster {p.cluster}")
        async with anyio.create_task_group() as group:
            group.start_soon(self._prefill, handle, group.cancel_scope)
            reason = await self._decode(handle, assembler, group.cancel_scope)
        if handle.error is not None:
            raise handle.error
        handle.outbox.put(assembler.finish())
        if reason is None:
            raise UpstreamFailed(f"decode on {p.decode_worker} ended request {p.request_id} "
                                 "without a finish reason")
        cached = handle.prefill.reused_tokens if handle.prefill else p.cached_tokens
        return Finished(finish_reason=reason, prompt_tokens=p.prompt_tokens,
                        completion_tokens=assembler.tokens, cached_tokens=cached)

    def _prefill_request(self, handle: RequestHandle) -> PrefillRequest:
        p, request = handle.placement, handle.request
        lanes = min(self.config.connections, self.workers.lanes(p.prefill_worker))
        return PrefillRequest(
            request_id=p.request_id, prompt=request.prompt, decode_worker=p.decode_worker,
            decode_has_tokens=p.decode_has_tokens, sampling=request.sampling,
            connections=lanes if p.cluster == "prfaas" else 1, pull=p.pull)

    async def _prefill(self, handle: RequestHandle, scope: anyio.CancelScope) -> None:
        worker = handle.placement.prefill_worker
        try:
            handle.prefill = await self.node.call(worker, self._prefill_request(handle),
                                                  PrefillDone,
                                                  timeout=self.config.request_timeout_s)
        except MeshError as exc:
            handle.error = handle.error or UpstreamFailed(f"prefill on {worker} failed: {exc}")
            scope.cancel()
        finally:
            self.workers.prefilled(worker)

    async def _decode(self, handle: RequestHandle, assembler: TextAssembler,
                      scope: anyio.CancelScope) -> str | None:
        """Feeds the decode worker's token stream to the outbox; its finish reason."""
        p, cfg = handle.placement, self.config
        decode = DecodeRequest(request_id=p.request_id, prompt=handle.request.prompt,
                               sampling=handle.request.sampling, kv_timeout=cfg.kv_timeout_s)
        try:
            async with self.node.open_stream(p.decode_worker, decode,
                                             timeout=cfg.request_timeout_s) as chunks:
                async for chunk in chunks:
                    assert isinstance(chunk, TokenChunk)
                    reason = self._take(handle, chunk, assembler)
                    if reason is not None and chunk.finish_reason is None:
                        # Done before the worker (a stop string, max_tokens): leaving the
                        # stream aborts the rest of the generation at the worker.
                        return reason
                    if reason is not None:
                        # The worker has finished: its End follows at once; reading it
                        # spares it an Abort (bench-router: 3% of the router's CPU).
                        extra = await _after_end(chunks)
                        if extra is not None:
                            handle.error = handle.error or UpstreamFailed(
                                f"decode on {p.decode_worker} sent {extra} after the finish "
                                "reason")
                        return reason
        except MeshError as exc:
            handle.error = handle.error or UpstreamFailed(
                f"decode on {p.decode_worker} failed: {exc}")
            scope.cancel()
        return None

    def _take(self, handle: RequestHandle, chunk: TokenChunk,
              assembler: TextAssembler) -> str | None:
        """Feeds one chunk to the outbox; the finish reason once the request is done."""
        if handle.first_token_at == 0.0 and chunk.tokens:
            handle.first_token_at = self.clock()
            self.phase(chunk.request_id, "decode", handle.placement.decode_worker)
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
        self.events.publish(RequestPhase(ts=self.clock(), source="router", request_id=request_id,
                                         phase=phase, worker=worker, detail=detail))


async def _after_end(chunks: AsyncIterator[object]) -> str | None:
    """Reads a finished stream's End; the type of anything else after the last token (it
    breaks the protocol), None when the End came."""
    async for extra in chunks:
        return type(extra).__name__
    return None
