"""The OpenAI response bodies: what a chunk omits, what usage counts."""

from __future__ import annotations

import msgspec

from services.router.openai_responses import (
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    Completion,
    CompletionChoice,
    Usage,
)


def test_chunks_omit_what_they_do_not_carry() -> None:
    chunk = ChatCompletion(id="c", object="chat.completion.chunk", created=1, model="m",
                           choices=[ChatChunkChoice(delta=ChatDelta(content="x"))])
    body = msgspec.json.decode(msgspec.json.encode(chunk))
    assert "usage" not in body and "prfaas" not in body
    assert body["choices"] == [{"index": 0, "delta": {"content": "x"}, "logprobs": None,
                                "finish_reason": None}]


def test_usage_totals_and_cached_tokens() -> None:
    usage = Usage.of(prompt=30, completion=5, cached=16)
    assert (usage.total_tokens, usage.prompt_tokens_details.cached_tokens) == (35, 16)
    body = Completion(id="c", object="text_completion", created=1, model="m", usage=usage,
                      choices=[CompletionChoice(text="hi", finish_reason="length")])
    decoded = msgspec.json.decode(msgspec.json.encode(body))
    assert decoded["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert "prfaas" not in decoded
