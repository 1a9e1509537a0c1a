"""Tests for services.model.tokenizer: the packaged BPE, the byte tokenizer, BPE retraining."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from services.model.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    EOT_TOKEN,
    ByteTokenizer,
    Tokenizer,
    TokenizerError,
    build_bpe,
    default_corpus_path,
    load_default,
    repo_root,
    train_tokenizer_main,
)

SAMPLE = "ROMEO:\nBut soft! what light through yonder window breaks?\n\nJULIET:\nAy me.\n"


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return load_default()


def test_packaged_tokenizer_shape(bpe: Tokenizer) -> None:
    assert bpe.vocab_size == 4096
    assert bpe.eot_id == 0
    assert len(bpe.content_hash) == 64


def test_packaged_file_is_standard_hf_json() -> None:
    raw = json.loads(DEFAULT_TOKENIZER_PATH.read_text(encoding="utf-8"))
    assert raw["model"]["type"] == "BPE"
    assert raw["pre_tokenizer"]["type"] == "ByteLevel"
    plain = HFTokenizer.from_file(str(DEFAULT_TOKENIZER_PATH))
    assert plain.token_to_id(EOT_TOKEN) == 0
    assert plain.get_vocab_size() == 4096


def test_bpe_roundtrip_and_compression(bpe: Tokenizer) -> None:
    ids = bpe.encode(SAMPLE)
    assert bpe.decode(ids) == SAMPLE
    assert all(0 < i < 4096 for i in ids)
    # Merges learnt on Shakespeare must compress Shakespeare well beyond one byte per token.
    assert len(SAMPLE) / len(ids) > 2.5


def test_bpe_special_token_is_one_id(bpe: Tokenizer) -> None:
    ids = bpe.encode(f"a{EOT_TOKEN}b")
    assert ids.count(0) == 1
    assert bpe.decode(ids) == "ab"
    assert bpe.decode(ids, skip_special=False) == f"a{EOT_TOKEN}b"


def test_bpe_batch_matches_single(bpe: Tokenizer) -> None:
    texts = [SAMPLE, "", "é 😀 \x00"]
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_bpe_roundtrips_any_text(text: str) -> None:
    tok = load_default()
    ids = tok.encode(text)
    assert tok.decode(ids) == text.replace(EOT_TOKEN, "")


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_byte_tokenizer_roundtrips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(1 <= i <= 256 for i in ids)
    assert tok.decode(ids) == text


def test_byte_tokenizer_eot_and_bad_id() -> None:
    tok = ByteTokenizer()
    assert (tok.eot_id, tok.vocab_size) == (0, 257)
    assert tok.decode([0, *tok.encode("hi")], skip_special=False) == f"{EOT_TOKEN}hi"
    with pytest.raises(TokenizerError, match="257"):
        tok.decode([257])


def test_retrain_on_small_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(SAMPLE * 20, encoding="utf-8")
    out = tmp_path / "tok.json"
    argv = ["--corpus", str(corpus), "--vocab-size", "300", "--out", str(out)]
    assert train_tokenizer_main(argv) == 0
    tok = Tokenizer.from_file(out)
    assert tok.vocab_size == 300
    assert tok.eot_id == 0
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE


def test_retrain_is_deterministic(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(SAMPLE * 10, encoding="utf-8")
    first = build_bpe(corpus, 280).to_str()
    assert build_bpe(corpus, 280).to_str() == first


def test_bad_arguments_name_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="vocab_size=100"):
        build_bpe(tmp_path / "missing.txt", 100)
    with pytest.raises(TokenizerError, match="corpus path"):
        build_bpe(tmp_path / "missing.txt", 4096)
    with pytest.raises(TokenizerError, match="tokenizer path"):
        Tokenizer.from_file(tmp_path / "missing.json")


def test_default_corpus_is_found_inside_or_beside_the_repo() -> None:
    path = default_corpus_path()
    assert path.name == "tinyshakespeare.txt" and path.parent.name == "corpus"
    inside = repo_root() / "data" / "corpus" / path.name
    # data/corpus/ in the repo wins once the corpus has moved there; ../shared/ until then.
    assert path == inside if inside.is_file() else path.parent.parent.parent.name == "shared"
