"""Tokenizers for the small model: the packaged byte-level BPE and a byte tokenizer for tests.

The BPE is trained with Hugging Face `tokenizers` on the Tiny Shakespeare corpus and stored as a
standard `tokenizer.json` in `services/model/assets/`, so any HF-compatible tool can load it
offline. It is byte-level (GPT-2 style pre-tokenizer over the 256 byte symbols), so every string
encodes. In both tokenizers the end-of-text token is id 0. `Tokenizer.encode` takes ASCII text
through a word cache (services.model.words) and everything else through the
Hugging Face encoder, which stays the reference (`encode_reference`).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from services.data import corpus_path
from services.model.config import ModelError
from services.model.words import Words

EOT_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"


class TokenizerError(ModelError, ValueError):
    """A tokenizer file or argument is unusable."""


class TokenizerLike(Protocol):
    """What the model code and the services need from a tokenizer."""

    @property
    def eot_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def repo_root() -> Path:
    """The project root: this file lives at <root>/services/model/tokenizer.py."""
    return Path(__file__).resolve().parents[2]


def default_corpus_path() -> Path:
    """The training text: data/corpus/ in the repository (services.data; never downloaded)."""
    return corpus_path()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer with the end-of-text token at id 0."""

    def __init__(self, backend: HFTokenizer, content_hash: str) -> None:
        eot = backend.token_to_id(EOT_TOKEN)
        if eot != 0:
            raise TokenizerError(f"{EOT_TOKEN!r} must be id 0, got id={eot!r}")
        self._backend = backend
        self._hash = content_hash
        self._alphabet = _byte_level_alphabet()
        # The fast path for ASCII text (services.model.words); None where it does not apply.
        self._words = Words.for_backend(
            backend, {byte: char for char, byte in self._alphabet.items()})

    @classmethod
    def from_file(cls, path: Path) -> Tokenizer:
        if not path.is_file():
            raise TokenizerError(f"tokenizer path={str(path)!r} is not a file")
        return cls(HFTokenizer.from_file(str(path)), file_sha256(path))

    @property
    def eot_id(self) -> int:
        return 0

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def content_hash(self) -> str:
        """sha256 of the tokenizer.json it was loaded from; checkpoints record it."""
        return self._hash

    def encode(self, text: str) -> list[int]:
        if self._words is not None:
            fast = self._words.encode(text)
            if fast is not None:
                return fast
        return self.encode_reference(text)

    def encode_reference(self, text: str) -> list[int]:
        """The Hugging Face tokenizer's own encoding, which `encode` equals (the tests check)."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [list(enc.ids) for enc in encodings]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        text: str = self._backend.decode(ids, skip_special_tokens=skip_special)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (the end-of-text token: its name)."""
        if token_id == self.eot_id:
            return EOT_TOKEN.encode("utf-8")
        entry = self._backend.id_to_token(token_id)
        if entry is None:
            raise TokenizerError(f"token id={token_id} outside [0, {self.vocab_size})")
        return bytes(self._alphabet[char] for char in entry)

    def token_text(self, token_id: int) -> str | None:
        """The raw vocabulary entry (byte-level alphabet), for debugging and display."""
        token: str | None = self._backend.id_to_token(token_id)
        return token


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted:
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def load_default() -> Tokenizer:
    """The packaged BPE tokenizer (services/model/assets/tokenizer.json)."""
    return Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)


class ByteTokenizer:
    """UTF-8 bytes as tokens: id 0 is end-of-text, byte b is id b + 1 (vocab 257).

    Keeping end-of-text at id 0 matches the BPE, so code that pads or stops on eot behaves the
    same with either tokenizer.
    """

    @property
    def eot_id(self) -> int:
        return 0

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def content_hash(self) -> str:
        return "byte-tokenizer-v1"

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def token_bytes(self, token_id: int) -> bytes:
        """The byte one token stands for (the end-of-text token: its name)."""
        if not 0 <= token_id < 257:
            raise TokenizerError(f"byte token id={token_id} outside [0, 257)")
        return EOT_TOKEN.encode("utf-8") if token_id == 0 else bytes([token_id - 1])

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        out = bytearray()
        for token_id in ids:
            if not 0 <= token_id < 257:
                raise TokenizerError(f"byte token id={token_id} outside [0, 257)")
            if token_id == 0:
                if not skip_special:
                    out += EOT_TOKEN.encode("utf-8")
                continue
            out.append(token_id - 1)
        return out.decode("utf-8", errors="replace")


def build_bpe(corpus: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> HFTokenizer:
    """Train a byte-level BPE on one text file; end-of-text is registered first so it is id 0."""
    if vocab_size < 257 + 1:
        raise TokenizerError(f"vocab_size={vocab_size} must exceed 256 bytes + end-of-text")
    if not corpus.is_file():
        raise TokenizerError(f"corpus path={str(corpus)!r} is not a file")
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train([str(corpus)], trainer)
    return backend


def train_tokenizer_main(argv: list[str] | None = None) -> int:
    """`prfaas train-tokenizer`: retrain the BPE from a local text file, save tokenizer.json."""
    parser = argparse.ArgumentParser(
        prog="prfaas train-tokenizer",
        description="Train the byte-level BPE tokenizer on a local text file (never downloads).",
    )
    parser.add_argument("--corpus", type=Path, default=default_corpus_path(), help="training text")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_PATH, help="tokenizer.json")
    args = parser.parse_args(argv)
    backend = build_bpe(args.corpus, args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(args.out))
    tokenizer = Tokenizer.from_file(args.out)
    text = args.corpus.read_text(encoding="utf-8")
    n_tokens = len(tokenizer.encode(text))
    print(
        f"saved {args.out} vocab={tokenizer.vocab_size} "
        f"chars/token={len(text) / n_tokens:.3f} sha256={tokenizer.content_hash[:16]}"
    )
    return 0
