"""Token ids to text, as the router streams it: `TextAssembler` turns streamed token ids into
text deltas, holding back an incomplete UTF-8 character and any tail that may still become a
stop string (re-decoding only the tokens since the last clean character boundary, as vLLM's
incremental detokenizer does); `assemble_reference` is the slow reference it is tested equal
to. The workers send token ids and numbers only (services/contract/messages.py); the router,
which holds the tokenizer, names each token's logprobs here (`chat_entry`: a token that is part
of a multi-byte character shows U+FFFD in `token`, and `bytes` has its exact bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec

from services.contract.sampling import TokenLogprob
from services.model.tokenizer import TokenizerLike

_REPLACEMENT = "\ufffd"


class TextAssembler:
    """Token ids in, text deltas out: UTF-8 completed, cut at the first stop string.

    Decoding follows vLLM's incremental detokenizer idea: re-decode only the tokens since the
    last clean character boundary and emit the new suffix.
    """

    def __init__(self, tokenizer: TokenizerLike, stop: Sequence[str] = (),
                 min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        # vLLM's min_tokens: stop strings are looked for once this many tokens are out.
        self._min_tokens = min_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already taken
        self._read = 0
        self._held = ""  # text that may still begin a stop string
        self.stopped = False
        self.tokens = 0
        self.chars = 0  # of the text returned so far

    def push(self, ids: Sequence[int]) -> str:
        """The text these ids add that is safe to send; "" once a stop string was found."""
        if self.stopped:
            return ""
        self.tokens += len(ids)
        self._ids.extend(ids)
        return self._count(self._cut(self._decode_new(final=False)))

    def skip(self, count: int) -> None:
        """Tokens that count but add no text (a stop token, which is not shown)."""
        self.tokens += count

    def finish(self) -> str:
        """Whatever is still held back (called when generation ends)."""
        if self.stopped:
            return ""
        text = self._cut(self._decode_new(final=True))
        if not self.stopped:
            text, self._held = text + self._held, ""
        return self._count(text)

    def _count(self, text: str) -> str:
        self.chars += len(text)
        return text

    def _decode_new(self, final: bool) -> str:
        seen = self._tokenizer.decode(self._ids[self._prefix:self._read])
        full = self._tokenizer.decode(self._ids[self._prefix:])
        if full.endswith(_REPLACEMENT) and not final:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(seen):]

    def _cut(self, new: str) -> str:
        text = self._held + new
        if self.tokens < self._min_tokens:
            self._held = ""
            return text
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)]
        keep = _stop_prefix_len(text, self._stop)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


def assemble_reference(tokenizer: TokenizerLike, ids: Sequence[int],
                       stop: Sequence[str] = ()) -> tuple[str, bool]:
    """Slow reference of TextAssembler: decode all ids, cut at the earliest stop string."""
    text = tokenizer.decode(list(ids))
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


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
