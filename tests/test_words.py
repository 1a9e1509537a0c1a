"""Tests for services.model.words: the word-cache fast path equals the Hugging Face encoding."""

from __future__ import annotations

import random
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from services.model import words
from services.model.tokenizer import DEFAULT_TOKENIZER_PATH, EOT_TOKEN, Tokenizer, load_default
from services.model.words import Words

# The characters where an ASCII split could part from GPT-2's Unicode one: each kind of space
# (\x1c-\x1f are spaces to Python's \s, not to Unicode's), contractions, digits, runs of
# punctuation, control characters.
TRICKY = "aZ 09'stlrevmd\t\n\x0b\x0c\r\x1c\x1f\x00\x7f.,!?-_'S  \n\n"


@cache
def packaged() -> Tokenizer:
    return load_default()


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return packaged()


def fast(tokenizer: Tokenizer, text: str) -> list[int]:
    """The fast path's answer, asserting it took it."""
    assert tokenizer._words is not None
    ids = tokenizer._words.encode(text)
    assert ids is not None, f"{text!r} left the fast path"
    return ids


def test_the_whole_corpus_encodes_as_the_reference(bpe: Tokenizer) -> None:
    from services.data import corpus_path

    text = corpus_path().read_text(encoding="utf-8")
    assert fast(bpe, text) == bpe.encode_reference(text)
    rng = random.Random(0)
    for _ in range(300):
        start = rng.randrange(len(text))
        piece = text[start:start + rng.randrange(1, 2000)]
        assert fast(bpe, piece) == bpe.encode_reference(piece)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=TRICKY, max_size=40))
def test_tricky_ascii_encodes_as_the_reference(text: str) -> None:
    tokenizer = packaged()
    assert fast(tokenizer, text) == tokenizer.encode_reference(text)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=60))
def test_any_ascii_encodes_as_the_reference(text: str) -> None:
    tokenizer = packaged()
    if EOT_TOKEN not in text:
        assert fast(tokenizer, text) == tokenizer.encode_reference(text)


def test_other_text_goes_to_the_reference(bpe: Tokenizer) -> None:
    assert bpe._words is not None
    for text in ("café au lait", f"end{EOT_TOKEN}start", "naïve 😀"):
        assert bpe._words.encode(text) is None
        assert bpe.encode(text) == bpe.encode_reference(text)
    assert bpe.encode(f"a{EOT_TOKEN}b").count(0) == 1


def test_a_full_table_starts_again(bpe: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    table = Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)
    monkeypatch.setattr(words, "MAX_WORDS", 3)
    text = "one two three four five six"
    assert table.encode(text) == bpe.encode_reference(text)
    assert table._words is not None and 1 <= table._words.cached <= 3
    # Long words are answered, not kept.
    long_word = "x" * (words.MAX_WORD_CHARS + 1)
    before = table._words.cached
    assert table.encode(long_word) == bpe.encode_reference(long_word)
    assert table._words.cached == before


def test_a_tokenizer_it_does_not_match_gets_no_fast_path() -> None:
    backend = HFTokenizer.from_file(str(DEFAULT_TOKENIZER_PATH))
    backend.normalizer = normalizers.Lowercase()
    tokenizer = Tokenizer(backend, "lowercased")
    assert tokenizer._words is None
    assert tokenizer.encode("ROMEO") == tokenizer.encode_reference("ROMEO")
    assert Words.for_backend(HFTokenizer.from_file(str(DEFAULT_TOKENIZER_PATH)), {}) is not None
