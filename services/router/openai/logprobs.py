"""Token logprobs as the OpenAI API returns them, from the decode worker's `TokenLogprob`s.

The workers send ids and numbers only (services/contract/messages.py); the router, which holds
the tokenizer, names the tokens here. Chat returns `choices[i].logprobs.content`, a list of
`ChatTokenLogprob`; completions return one `CompletionLogprobs` of parallel lists. A token
that is part of a multi-byte character shows U+FFFD in `token`; `bytes` has its exact bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

from services.contract.sampling import TokenLogprob
from services.model.tokenizer import TokenizerLike


@runtime_checkable
class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, frozen=True):
    """One output token in the chat format (choices[i].logprobs.content[j])."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, frozen=True):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct, frozen=True):
    """The completions format: parallel lists, one entry per output token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TokenRecord(msgspec.Struct, frozen=True):
    """One output token's logprobs, and where its text begins in the generated text."""

    entry: ChatTokenLogprob
    offset: int


def _named(tokenizer: TokenizerLike, token_id: int) -> tuple[str, list[int]]:
    raw = (tokenizer.token_bytes(token_id) if isinstance(tokenizer, TokenBytes)
           else tokenizer.decode([token_id]).encode("utf-8"))
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_entry(tokenizer: TokenizerLike, token_id: int,
               logprob: TokenLogprob) -> ChatTokenLogprob:
    token, raw = _named(tokenizer, token_id)
    top = [TopLogprob(*_with_value(_named(tokenizer, alt), value))
           for alt, value in zip(logprob.top_ids, logprob.top_logprobs, strict=True)]
    return ChatTokenLogprob(token, logprob.logprob, raw, top)


def _with_value(named: tuple[str, list[int]], value: float) -> tuple[str, float, list[int]]:
    return named[0], value, named[1]


def text_offsets(tokenizer: TokenizerLike, ids: Sequence[int], base: int, end: int) -> list[int]:
    """Where each of `ids` begins in the text, their text spanning [base, end): the decoded
    length before it, an incomplete character's U+FFFD not counted."""
    return [min(base + len(tokenizer.decode(list(ids[:j])).rstrip("\ufffd")), end)
            for j in range(len(ids))]


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
