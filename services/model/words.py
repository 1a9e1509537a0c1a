"""Words: ASCII text split as a byte-level BPE splits it, each word's token ids remembered.

A byte-level BPE (GPT-2's scheme, which the packaged tokenizer uses) first cuts text into words
with one regular expression, then merges bytes within each word; no merge crosses a word's
edge, so a word's ids depend on the word alone. The Hugging Face tokenizer redoes both for
every call, and its Unicode regular expression is most of its cost. `Words` cuts ASCII text
with the same expression written for ASCII (Python's `re`, in C) and looks each word up in a
dict, asking the BPE model only for a word it has not seen (docs/engineering-notes.md 3d).

Only ASCII text without added tokens (`<|endoftext|>`) takes this path; everything else, and
any tokenizer whose configuration differs from the one this split assumes (`Words.for_backend`
returns None), goes to the Hugging Face tokenizer, which stays the reference: the tests compare
both on the whole corpus and on random text over the characters where the split could differ.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# GPT-2's pre-tokenizer pattern ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)
# restricted to ASCII: letters [A-Za-z], digits [0-9], and \s as Unicode's White_Space has it
# in ASCII (tab to carriage return, space; not \x1c-\x1f, which Python's own \s would take).
_SPACE = r"\t\n\x0b\x0c\r "
_ASCII_WORD = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_SPACE}A-Za-z0-9]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)
# Words remembered before the table starts again: Shakespeare's 15,000 take 3.6 MB; at most
# about 27 MB however hostile the text (random 32-character words).
MAX_WORDS = 50_000
# Longer words are rare in text and would only fill the table: they are encoded each time.
MAX_WORD_CHARS = 32


class Words:
    """Encodes ASCII text word by word through a cache; `encode` returns None where it cannot."""

    def __init__(self, backend: HFTokenizer, byte_symbols: dict[int, str],
                 added: tuple[str, ...]) -> None:
        self._model = backend.model
        self._symbols = byte_symbols
        self._added = added
        self._ids: dict[str, list[int]] = {}

    @classmethod
    def for_backend(cls, backend: HFTokenizer, byte_symbols: dict[int, str]) -> Words | None:
        """The word cache for `backend`, or None unless it is a plain byte-level BPE (no
        normalizer, GPT-2's split without a prefix space, no dropout) that this split matches."""
        config: dict[str, Any] = json.loads(backend.to_str())
        pre = config.get("pre_tokenizer") or {}
        model = config.get("model") or {}
        plain = (
            config.get("normalizer") is None
            and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)
            and model.get("type") == "BPE"
            and model.get("dropout") is None
            and not model.get("continuing_subword_prefix")
            and not model.get("end_of_word_suffix")
            and not model.get("byte_fallback", False)
        )
        if not plain:
            return None
        added = tuple(token["content"] for token in config.get("added_tokens") or [])
        return cls(backend, byte_symbols, added)

    @property
    def cached(self) -> int:
        """How many words the table holds."""
        return len(self._ids)

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text`, or None if it is not ASCII or holds an added token's text."""
        if not text.isascii() or any(token in text for token in self._added):
            return None
        ids: list[int] = []
        known = self._ids.get
        for word in _ASCII_WORD.findall(text):
            word_ids = known(word)
            if word_ids is None:
                word_ids = self._learn(word)
            ids += word_ids
        return ids

    def _learn(self, word: str) -> list[int]:
        symbols = self._symbols
        spelled = "".join(symbols[byte] for byte in word.encode("ascii"))
        word_ids = [token.id for token in self._model.tokenize(spelled)]
        if len(word) <= MAX_WORD_CHARS:
            if len(self._ids) >= MAX_WORDS:
                self._ids.clear()
            self._ids[word] = word_ids
        return word_ids
