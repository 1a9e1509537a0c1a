"""The OpenAI response formats: the bodies of a completion or a chat, whole or chunk by chunk,
the server-sent events of a streamed generation, and the logprob formats.

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
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from typing import Generic, Literal, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import msgspec

from services.router.errors import RouterError
from services.router.requests import Delta, Finished, GenerationRequest, RequestHandle
from services.router.text import ChatTokenLogprob, TokenRecord

_json = msgspec.json.Encoder()
# A body's choice type (`_Body`).
C = TypeVar("C")


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


class _Body(msgspec.Struct, Generic[C], frozen=True, kw_only=True, omit_defaults=True):
    """A completion's or a chat's body (whole or a chunk): the fields both share."""

    id: str
    object: str
    created: int
    model: str
    choices: list[C]
    usage: Usage | None = None
    prfaas: PrfaasInfo | None = None


class Completion(_Body[CompletionChoice], frozen=True, kw_only=True, omit_defaults=True):
    """A completion's body."""


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


class ChatCompletion(_Body[ChatChoice | ChatChunkChoice], frozen=True, kw_only=True,
                     omit_defaults=True):
    """A chat's body: whole choices, or chunk choices in a chunk."""


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
            delta = handles[index].poll_delta()
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
