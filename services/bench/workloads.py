"""Bench workloads: the paper's log-normal lengths, Mooncake trace replay, multi-turn sessions.

Every workload is a list of `Session`s; a plain request is a session of one turn. Turn k's
prompt is turn k-1's prompt, its answer and the turn's new text (`next_prompt`), so the
prefix cache sees agent-style incremental prefills.

Lengths are paper-scale tokens mapped by `scale` (the small model has a short context):
scaled = ceil(tokens * scale), capped by `max_context`. Text is synthesised: a span of
consecutive words from the corpus, its start drawn from a `random.Random` seeded by a key, so
equal keys give equal text on every run and machine. Trace prompts key each 512-token block
by its hash id: equal hash ids give equal text, so requests share exactly the prefixes the
trace says they share (data/traces/README.md). Words per token: `TOKENS_PER_WORD`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import msgspec

from services.bench.errors import BenchError
from services.data import corpus_path
from services.paper.workload import (
    PAPER_MAX_TOKENS,
    TRACE_BLOCK_TOKENS,
    TraceRecord,
    TruncatedLogNormal,
)

# Measured: the packaged BPE (services/model/assets/tokenizer.json) gives 1.589 tokens per
# word over 200 random 100-word spans of the corpus (punctuation rides on the words).
TOKENS_PER_WORD = 1.6
DEFAULT_CORPUS = corpus_path()
# Used when the corpus is absent (an installed package without the data/ folder).
FALLBACK_TEXT = (
    "the of and to in a is that for it as was with be by on not he i this are or his from "
    "at which but have an they you were her she there one all we their been has when who "
    "will more no if out so said what up its about into than them can only other new some "
    "time could these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take"
)


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    text: str  # the new text of this turn
    planned_tokens: int  # its scaled length in tokens (the text has about as many)
    max_tokens: int
    think_s: float = 0.0  # pause after the previous turn's answer before sending this one


class Session(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    arrival_s: float  # offset from the start of the run
    turns: tuple[Turn, ...]


class Scaling(msgspec.Struct, frozen=True, kw_only=True):
    """Paper tokens -> the served model's tokens."""

    scale: float = 1.0
    max_context: int = int(PAPER_MAX_TOKENS)
    tokens_per_word: float = TOKENS_PER_WORD

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise BenchError(f"scale must be a finite number > 0, got {self.scale!r}")
        if self.max_context < 2:
            raise BenchError(f"max_context must be >= 2, got {self.max_context!r}")
        if not (math.isfinite(self.tokens_per_word) and self.tokens_per_word > 0):
            raise BenchError(f"tokens_per_word must be > 0, got {self.tokens_per_word!r}")

    def tokens(self, paper_tokens: float) -> int:
        return max(1, math.ceil(paper_tokens * self.scale)) if paper_tokens > 0 else 0

    def words(self, tokens: int) -> int:
        return max(1, round(tokens / self.tokens_per_word)) if tokens > 0 else 0

    def output(self, paper_tokens: float) -> int:
        return min(max(1, self.tokens(paper_tokens)), self.max_context - 1)


class WordSource:
    """Deterministic spans of words from a corpus."""

    def __init__(self, words: Sequence[str]) -> None:
        if not words:
            raise BenchError("words must hold at least one word, got none")
        self._words = tuple(words)

    @classmethod
    def from_file(cls, path: str | Path) -> WordSource:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise BenchError(f"corpus {str(path)!r} is unreadable: {exc.strerror}") from exc
        return cls(text.split())

    @classmethod
    def default(cls) -> WordSource:
        """The training corpus when present, else a built-in word list."""
        if DEFAULT_CORPUS.is_file():
            return cls.from_file(DEFAULT_CORPUS)
        return cls(FALLBACK_TEXT.split())

    def span(self, key: int, n_words: int) -> str:
        """`n_words` consecutive words (wrapping) from a start chosen by `key`."""
        if n_words <= 0:
            return ""
        start = random.Random(key).randrange(len(self._words))
        count = len(self._words)
        return " ".join(self._words[(start + i) % count] for i in range(n_words))


def next_prompt(previous_prompt: str, answer: str, text: str) -> str:
    """Turn k's prompt: turn k-1's prompt + its answer + the new text (a strict extension)."""
    if not previous_prompt:
        return text
    return f"{previous_prompt}{answer}\n{text}"


def _key(seed: int, item: int) -> int:
    """One integer per (seed, item): distinct seeds never share text keys."""
    return (seed << 64) | (item & ((1 << 64) - 1))


def lognormal_sessions(arrivals: Sequence[float], *, rng: random.Random, words: WordSource,
                       scaling: Scaling, output_len: int = 1024, seed: int = 0,
                       lengths: TruncatedLogNormal | None = None) -> list[Session]:
    """One single-turn request per arrival, input lengths from the paper's log-normal."""
    dist = lengths or TruncatedLogNormal.paper()
    max_tokens = scaling.output(output_len)
    budget = scaling.max_context - max_tokens
    sessions = []
    for index, arrival in enumerate(arrivals):
        tokens = min(scaling.tokens(dist.sample(rng)), budget)
        text = words.span(_key(seed, index), scaling.words(tokens))
        turn = Turn(text=text, planned_tokens=tokens, max_tokens=max_tokens)
        sessions.append(Session(session_id=f"ln-{index}", arrival_s=arrival, turns=(turn,)))
    return sessions


def trace_prompt(record: TraceRecord, *, words: WordSource, scaling: Scaling,
                 budget: int, seed: int = 0) -> tuple[str, int]:
    """The prompt of one trace record and its planned tokens: one span per hash-id block.

    Block i holds 512 trace tokens (the last one the remainder); scaled, capped so the whole
    prompt fits `budget`. A partial block is the start of the same id's full span.
    """
    full_words = scaling.words(scaling.tokens(TRACE_BLOCK_TOKENS))
    parts, planned = [], 0
    for index, block_id in enumerate(record.hash_ids):
        trace_tokens = min(TRACE_BLOCK_TOKENS, record.input_length - index * TRACE_BLOCK_TOKENS)
        tokens = min(scaling.tokens(trace_tokens), budget - planned)
        if tokens <= 0:
            break
        span = words.span(_key(seed, block_id), full_words).split(" ")
        parts.append(" ".join(span[: scaling.words(tokens)]))
        planned += tokens
    return " ".join(parts), planned


def trace_sessions(records: Sequence[TraceRecord], arrivals: Sequence[float], *,
                   words: WordSource, scaling: Scaling, output_len: int | None = None,
                   seed: int = 0) -> list[Session]:
    """Mooncake trace replay: one single-turn request per record, at the given arrivals."""
    if len(arrivals) != len(records):
        raise BenchError(f"arrivals must have one time per record ({len(records)}), got "
                         f"{len(arrivals)}")
    sessions = []
    for index, (record, arrival) in enumerate(zip(records, arrivals, strict=True)):
        max_tokens = scaling.output(record.output_length if output_len is None else output_len)
        text, planned = trace_prompt(record, words=words, scaling=scaling,
                                     budget=scaling.max_context - max_tokens, seed=seed)
        turn = Turn(text=text, planned_tokens=planned, max_tokens=max_tokens)
        sessions.append(Session(session_id=f"trace-{index}", arrival_s=arrival, turns=(turn,)))
    return sessions


class AgentShape(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-turn sessions: a long first prompt, then short new text each turn (paper tokens)."""

    turns: int = 4
    first_tokens: float = 8192.0  # mean; each drawn uniformly in [0.5, 1.5] x mean
    turn_tokens: float = 1024.0
    output_len: int = 256
    think_s: float = 1.0

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise BenchError(f"turns must be >= 1, got {self.turns!r}")
        for name in ("first_tokens", "turn_tokens", "think_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise BenchError(f"{name} must be a finite number >= 0, got {value!r}")


DEFAULT_AGENT = AgentShape()


def agent_sessions(arrivals: Sequence[float], *, rng: random.Random, words: WordSource,
                   scaling: Scaling, shape: AgentShape = DEFAULT_AGENT,
                   seed: int = 0) -> list[Session]:
    """One agent session per arrival; the client grows each prompt with the answers.

    Turns stop early where the grown prompt (earlier turns, their answers at most
    `max_tokens` each, the new text) and this turn's answer would exceed `max_context`.
    """
    max_tokens = scaling.output(shape.output_len)
    sessions = []
    for index, arrival in enumerate(arrivals):
        turns: list[Turn] = []
        context = 0
        for k in range(shape.turns):
            mean = shape.first_tokens if k == 0 else shape.turn_tokens
            tokens = scaling.tokens(mean * rng.uniform(0.5, 1.5))
            room = scaling.max_context - max_tokens - context - (max_tokens if k else 0)
            if k and tokens > room:
                break
            tokens = min(tokens, room)
            context += tokens + (max_tokens if k else 0)
            text = words.span(_key(seed, index * 1024 + k), scaling.words(tokens))
            turns.append(Turn(text=text, planned_tokens=tokens, max_tokens=max_tokens,
                              think_s=shape.think_s if k else 0.0))
        sessions.append(Session(session_id=f"agent-{index}", arrival_s=arrival,
                                turns=tuple(turns)))
    return sessions
