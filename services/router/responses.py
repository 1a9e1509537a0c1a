"""The bodies of one generation as the OpenAI API sends them: whole, or as server-sent events.

`Responder` builds a completion's or a chat's body, whole or chunk by chunk; `stream_events`
is the event stream of a streamed generation (OpenAI's order: a chat's role chunk first, the
text, the final chunk with finish_reason and `prfaas`, the usage chunk if asked, then
`[DONE]`). An error after the first byte can only be reported in the stream, as an error
event; a client that leaves cancels the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

import msgspec

from services.router.errors import RouterError
from services.router.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatResponseMessage,
    Completion,
    CompletionChoice,
    PrfaasInfo,
    Usage,
    now_s,
)
from services.router.openai.schema import GenerationRequest
from services.router.requests import Finished, RequestHandle

Kind = Literal["completion", "chat"]
_json = msgspec.json.Encoder()


def _prfaas_info(handle: RequestHandle, finished: Finished | None) -> PrfaasInfo:
    p = handle.placement
    cached = finished.cached_tokens if finished else p.cached_tokens
    return PrfaasInfo(request_id=p.request_id, cluster=p.cluster, cached_tokens=cached,
                      prefill_worker=p.prefill_worker, decode_worker=p.decode_worker)


def _usage(finished: Finished) -> Usage:
    return Usage.of(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)


class Responder:
    """Builds the bodies of one generation (completion or chat), whole or as chunks."""

    def __init__(self, kind: Kind, handle: RequestHandle, model: str) -> None:
        self.kind, self.handle, self.model = kind, handle, model
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.id = f"{prefix}-{handle.placement.request_id}"
        self.created = now_s()

    def whole(self, text: str, finished: Finished) -> Completion | ChatCompletion:
        info, usage = _prfaas_info(self.handle, finished), _usage(finished)
        if self.kind == "completion":
            return Completion(id=self.id, object="text_completion", created=self.created,
                              model=self.model, usage=usage, prfaas=info, choices=[
                                  CompletionChoice(text=text,
                                                   finish_reason=finished.finish_reason)])
        message = ChatResponseMessage("assistant", text)
        return ChatCompletion(id=self.id, object="chat.completion", created=self.created,
                              model=self.model, usage=usage, prfaas=info, choices=[
                                  ChatChoice(message=message,
                                             finish_reason=finished.finish_reason)])

    def chunk(self, text: str | None, finish: Finished | None = None, *,
              role: bool = False) -> bytes:
        info = _prfaas_info(self.handle, finish) if finish else None
        reason = finish.finish_reason if finish else None
        body: Completion | ChatCompletion
        if self.kind == "completion":
            body = Completion(id=self.id, object="text_completion", created=self.created,
                              model=self.model, prfaas=info, choices=[
                                  CompletionChoice(text=text or "", finish_reason=reason)])
        else:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            body = ChatCompletion(id=self.id, object="chat.completion.chunk",
                                  created=self.created, model=self.model, prfaas=info,
                                  choices=[ChatChunkChoice(delta=delta, finish_reason=reason)])
        return sse(body)

    def usage_chunk(self, finished: Finished) -> bytes:
        kind = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        body = Completion(id=self.id, object=kind, created=self.created, model=self.model,
                          choices=[], usage=_usage(finished))
        return sse(body)


def sse(body: object) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


async def stream_events(responder: Responder,
                        generation: GenerationRequest) -> AsyncIterator[bytes]:
    """The server-sent events of one streamed generation; cancels it if the client leaves."""
    handle = responder.handle
    try:
        if responder.kind == "chat":
            yield responder.chunk("", role=True)
        if generation.echo_text:
            yield responder.chunk(generation.echo_text)
        async for text in handle:
            yield responder.chunk(text)
        assert handle.result is not None
        yield responder.chunk(None if responder.kind == "chat" else "", handle.result)
        if generation.include_usage:
            yield responder.usage_chunk(handle.result)
        yield b"data: [DONE]\n\n"
    except RouterError as exc:
        yield sse(exc.body())
    finally:
        handle.release()
