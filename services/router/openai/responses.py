"""The router's OpenAI-compatible response bodies: completions and chat, whole or as chunks.

`omit_defaults` keeps a streamed chunk to what it carries (no `usage` or `prfaas` until the
last), as OpenAI's own chunks do. `prfaas` is this project's extension: where the request ran.
"""

from __future__ import annotations

import time

import msgspec

from services.router.openai.logprobs import ChatLogprobs, CompletionLogprobs


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
