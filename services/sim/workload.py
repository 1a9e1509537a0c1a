"""The simulation's requests: when each arrives, its prompt (token ids), its output length.

Lengths are in paper tokens and served at the deployment's scale (1/8: a 64-token block is a
512-token block of the Mooncake traces). Prompts are token ids made from block ids, so equal
blocks hash equal in the router's prefix chain: a trace's `hash_ids` give cache hits and
multi-turn reuse, the log-normal workload's prompts share nothing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import msgspec

from services.bench.arrivals import gamma_arrivals, poisson_arrivals, trace_arrivals
from services.paper.workload import TraceRecord, TruncatedLogNormal, load_trace

BLOCK = 64  # served tokens per block (the workers' block size)


class Arrival(msgspec.Struct, frozen=True):
    """One request: its arrival (virtual s from the start), its prompt's blocks and length
    (served tokens), its output length. The prompt is built when it is sent (`prompt`):
    an hour of paper-scale prompts held at once would take gigabytes."""

    at: float
    blocks: tuple[int, ...]
    length: int
    output_len: int
    paper_len: int  # the prompt's length in paper tokens

    def prompt(self) -> list[int]:
        return prompt_of(self.blocks, self.length)


def block_tokens(block_id: int) -> list[int]:
    """The served tokens of one block: distinct per id, never the end-of-text id 0."""
    base = _first_token(block_id)
    return list(range(base, base + BLOCK))


def _first_token(block_id: int) -> int:
    return (block_id % (1 << 22)) * BLOCK + 1


def prompt_of(block_ids: Sequence[int], length: int) -> list[int]:
    """`length` served tokens made of the given blocks in order (the last may be partial):
    `prompt_of_reference`, with each run of blocks whose tokens follow on (consecutive ids,
    as every log-normal prompt's are) made as one range rather than block by block."""
    tokens: list[int] = []
    needed = max(0, -(-length // BLOCK))
    # The run so far is range(start, end); no block starts at 0 (token ids start at 1).
    start = end = 0
    for block_id in block_ids[:needed]:
        first = _first_token(block_id)
        if first != end:
            tokens += range(start, end)
            start = first
        end = first + BLOCK
    tokens += range(start, min(end, start + length - len(tokens)))
    return tokens


def prompt_of_reference(block_ids: Sequence[int], length: int) -> list[int]:
    """`prompt_of` block by block (the slow, obvious reference)."""
    tokens: list[int] = []
    for block_id in block_ids:
        if len(tokens) >= length:
            break
        tokens.extend(block_tokens(block_id))
    return tokens[:length]


def served(paper_len: float, scale: float) -> int:
    return max(1, round(paper_len * scale))


def lognormal(rate: float, duration_s: float, scale: float, seed: int, *,
              burstiness: float = 1.0, output_len: int = 1024,
              lengths: TruncatedLogNormal | None = None, start_s: float = 0.0,
              ) -> list[Arrival]:
    """The paper's workload (services.paper.workload's truncated log-normal) at `rate` req/s for
    `duration_s`; burstiness 1 is Poisson, below 1 burstier (gamma shape; CV = 1/sqrt(k)).
    `lengths` replaces the paper's distribution; arrivals start at `start_s`."""
    rng = random.Random(seed)
    count = max(1, math.ceil(rate * duration_s * 1.2) + 10)
    times = (poisson_arrivals(count, rate, rng) if burstiness == 1.0
             else gamma_arrivals(count, rate, burstiness, rng))
    lengths = lengths or TruncatedLogNormal.paper()
    return [_fresh(index, seed, at, lengths.sample(rng), scale, output_len)
            for index, at in enumerate(start_s + t for t in times if t < duration_s)]


def _fresh(index: int, seed: int, at: float, paper_len: int, scale: float,
           output_len: int) -> Arrival:
    """A request whose blocks no other shares (the paper's case study caches nothing)."""
    first = (seed * 1_000_003 + index) * 512
    length = served(paper_len, scale)
    blocks = tuple(range(first, first + length // BLOCK + 1))
    return Arrival(at, blocks, length, output_len, paper_len)


def evenly(rate: float, duration_s: float, scale: float, seed: int, *, paper_len: int,
           output_len: int = 1024) -> list[Arrival]:
    """One request every 1/rate s, each `paper_len` paper tokens long: no randomness, so a
    deployment's saturation is known in closed form (tests of the capacity search)."""
    count = math.ceil(rate * duration_s)
    return [_fresh(index, seed, index / rate, paper_len, scale, output_len)
            for index in range(count) if index / rate < duration_s]


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a capacity search offers at any rate (services/sim/capacity.py): the paper's
    log-normal lengths with Poisson arrivals for `window_s`, or (`paper_len` > 0) evenly
    spaced requests of one length."""

    window_s: float = 600.0
    output_len: int = 1024
    paper_len: int = 0

    def __post_init__(self) -> None:
        if not self.window_s > 0 or self.output_len < 1 or self.paper_len < 0:
            raise ValueError(f"window_s must be > 0, output_len >= 1 and paper_len >= 0, got "
                             f"{self.window_s}, {self.output_len}, {self.paper_len}")

    def arrivals(self, rate: float, scale: float, seed: int) -> list[Arrival]:
        if self.paper_len:
            return evenly(rate, self.window_s, scale, seed, paper_len=self.paper_len,
                          output_len=self.output_len)
        return lognormal(rate, self.window_s, scale, seed, output_len=self.output_len)


def from_trace(records: Sequence[TraceRecord], scale: float, *, speedup: float = 1.0,
               duration_s: float | None = None, output_len: int | None = None,
               ) -> list[Arrival]:
    """A Mooncake trace replayed `speedup` times faster (its hash ids make the prompts)."""
    times = trace_arrivals([r.timestamp for r in records], speedup)
    out = []
    for at, record in zip(times, records, strict=True):
        if duration_s is not None and at >= duration_s:
            break
        length = served(record.input_length, scale)
        out.append(Arrival(at, record.hash_ids, length,
                           output_len or max(1, record.output_length), record.input_length))
    return out


def trace(path: Path, scale: float, *, speedup: float = 1.0, limit: int | None = None,
          duration_s: float | None = None, output_len: int | None = None) -> list[Arrival]:
    return from_trace(load_trace(path, limit), scale, speedup=speedup, duration_s=duration_s,
                      output_len=output_len)
