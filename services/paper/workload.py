"""Request-length workloads: the paper's truncated log-normal, empirical samples, Mooncake traces.

The planner (services/paper/planner.py) needs three numbers of the uncached input length L at a
threshold t: p = P(L > t), l_short = E[L | L <= t] and l_long = E[L | L > t] (paper Table 4).
`TruncatedLogNormal` gives them in closed form (partial expectations of the log-normal via
erf); `EmpiricalLengths` gives them from samples (sorted values plus prefix sums), which is
what the dynamic policy has at run time: the recent incremental lengths after prefix matching.
Both satisfy the `LengthDistribution` protocol, so the planner runs on either.

The paper's case-study workload (arXiv 2604.15039 v2, section 4.1): mu = 9.90, sigma = 1.00,
truncated to [128, 128K], mean about 27K tokens. We read 128K as 131072 (2**17): the mean is
then 27,486 and P(L > 19,400) = 0.4957, matching the paper's 49.6 % offload share; with
128000 they would be 27,313 and 0.4949. docs/paper-notes.md section 5.1 has these checks.

Mooncake FAST'25 traces (data/traces/README.md): JSONL with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (prefix block hashes, 512-token blocks).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Final, Protocol

import msgspec

TRACE_BLOCK_TOKENS = 512
# The case-study workload (section 4.1): ln(prompt tokens) ~ N(PAPER_MU, PAPER_SIGMA^2),
# truncated to [PAPER_MIN_TOKENS, PAPER_MAX_TOKENS] (128K read as 2**17, module docstring).
PAPER_MU: Final = 9.90
PAPER_SIGMA: Final = 1.00
PAPER_MIN_TOKENS: Final = 128.0
PAPER_MAX_TOKENS: Final = 131072.0
_SQRT2 = math.sqrt(2.0)
_STANDARD_NORMAL = NormalDist()


class TraceFormatError(ValueError):
    """A trace file line that does not decode as a Mooncake trace record."""


class LengthDistribution(Protocol):
    """What the planner needs of an uncached-input-length distribution."""

    @property
    def lo(self) -> float: ...

    @property
    def hi(self) -> float: ...

    def mean(self) -> float: ...

    def survival(self, t: float) -> float: ...

    def conditional_means(self, t: float) -> tuple[float, float]: ...


def _normal_mass(x: float, y: float) -> float:
    """P(x < Z <= y) for a standard normal Z, without cancellation in either tail."""
    if x >= 0.0:
        return 0.5 * (math.erfc(x / _SQRT2) - math.erfc(y / _SQRT2))
    if y <= 0.0:
        return 0.5 * (math.erfc(-y / _SQRT2) - math.erfc(-x / _SQRT2))
    return 0.5 * (math.erf(y / _SQRT2) - math.erf(x / _SQRT2))


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class TruncatedLogNormal:
    """L = exp(N(mu, sigma^2)) conditioned on lo <= L <= hi; all results in tokens."""

    mu: float
    sigma: float
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise ValueError(f"mu must be finite, got {self.mu!r}")
        _check_positive("sigma", self.sigma)
        _check_positive("lo", self.lo)
        if not (math.isfinite(self.hi) and self.hi > self.lo):
            raise ValueError(f"hi must be finite and > lo={self.lo!r}, got {self.hi!r}")
        if self._z_mass(self.lo, self.hi) <= 0.0:
            raise ValueError(f"[lo, hi] = [{self.lo}, {self.hi}] holds no probability mass")

    @classmethod
    def paper(cls) -> TruncatedLogNormal:
        """The case-study workload of the paper (section 4.1), 128K read as 131072."""
        return cls(mu=PAPER_MU, sigma=PAPER_SIGMA, lo=PAPER_MIN_TOKENS, hi=PAPER_MAX_TOKENS)

    def _z(self, x: float) -> float:
        return (math.log(x) - self.mu) / self.sigma

    def _clamp(self, x: float) -> float:
        return min(max(x, self.lo), self.hi)

    def _z_mass(self, a: float, b: float) -> float:
        return _normal_mass(self._z(a), self._z(b))

    def cdf(self, x: float) -> float:
        """P(L <= x)."""
        if x <= self.lo:
            return 0.0
        if x >= self.hi:
            return 1.0
        return self._z_mass(self.lo, x) / self._z_mass(self.lo, self.hi)

    def survival(self, t: float) -> float:
        """P(L > t): the share of requests offloaded at threshold t."""
        if t < self.lo:
            return 1.0
        if t >= self.hi:
            return 0.0
        return self._z_mass(t, self.hi) / self._z_mass(self.lo, self.hi)

    def partial_expectation(self, a: float, b: float) -> float:
        """E[L ; a < L <= b], the mean of L restricted to (a, b] times its probability.

        For the untruncated log-normal, E[L ; L <= x] = exp(mu + sigma^2/2) Phi(z(x) - sigma);
        truncation only renormalises by the mass of [lo, hi].
        """
        a, b = self._clamp(a), self._clamp(b)
        if b <= a:
            return 0.0
        scale = math.exp(self.mu + 0.5 * self.sigma**2)
        shifted = _normal_mass(self._z(a) - self.sigma, self._z(b) - self.sigma)
        return scale * shifted / self._z_mass(self.lo, self.hi)

    def mean(self) -> float:
        return self.partial_expectation(self.lo, self.hi)

    def conditional_means(self, t: float) -> tuple[float, float]:
        """(E[L | L <= t], E[L | L > t]); an empty side takes its limit value, t clamped."""
        p = self.survival(t)
        edge = self._clamp(t)
        short = self.partial_expectation(self.lo, t) / (1.0 - p) if p < 1.0 else edge
        long = self.partial_expectation(t, self.hi) / p if p > 0.0 else edge
        return short, long

    def quantile(self, q: float) -> float:
        """The length x with P(L <= x) = q, for 0 < q < 1."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"q must lie in (0, 1), got {q!r}")
        lo_cdf = _STANDARD_NORMAL.cdf(self._z(self.lo))
        hi_cdf = _STANDARD_NORMAL.cdf(self._z(self.hi))
        u = lo_cdf + q * (hi_cdf - lo_cdf)
        u = min(max(u, 1e-300), 1.0 - 1e-16)
        return self._clamp(math.exp(self.mu + self.sigma * _STANDARD_NORMAL.inv_cdf(u)))

    def sample(self, rng: random.Random) -> int:
        """One length in whole tokens, by inverting the CDF of a uniform draw."""
        q = min(max(rng.random(), 1e-12), 1.0 - 1e-12)
        whole = round(self.quantile(q))
        return min(max(whole, math.ceil(self.lo)), math.floor(self.hi))

    def samples(self, rng: random.Random, n: int) -> list[int]:
        return [self.sample(rng) for _ in range(n)]

    def discretise(self, n: int) -> EmpiricalLengths:
        """n equal-probability points (quantiles at bin midpoints): a deterministic sample."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        return EmpiricalLengths.from_samples(self.quantile((i + 0.5) / n) for i in range(n))


@dataclass(frozen=True)
class EmpiricalLengths:
    """The empirical distribution of observed lengths (each sample weighs 1/n)."""

    values: tuple[float, ...]
    prefix_sums: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("values must hold at least one length, got none")
        if len(self.prefix_sums) != len(self.values) + 1:
            raise ValueError(
                f"prefix_sums must have len(values) + 1 = {len(self.values) + 1} entries, "
                f"got {len(self.prefix_sums)}"
            )

    @classmethod
    def from_samples(cls, samples: Iterable[float]) -> EmpiricalLengths:
        values = tuple(sorted(float(x) for x in samples))
        for x in values:
            if not (math.isfinite(x) and x >= 0.0):
                raise ValueError(f"samples must be finite lengths >= 0, got {x!r}")
        return cls(values, (0.0, *itertools.accumulate(values)))

    @property
    def lo(self) -> float:
        return self.values[0]

    @property
    def hi(self) -> float:
        return self.values[-1]

    def __len__(self) -> int:
        return len(self.values)

    def mean(self) -> float:
        return self.prefix_sums[-1] / len(self.values)

    def cdf(self, x: float) -> float:
        return bisect.bisect_right(self.values, x) / len(self.values)

    def survival(self, t: float) -> float:
        return 1.0 - self.cdf(t)

    def conditional_means(self, t: float) -> tuple[float, float]:
        """(E[L | L <= t], E[L | L > t]) in O(log n); an empty side takes the value t, clamped."""
        k = bisect.bisect_right(self.values, t)
        n = len(self.values)
        edge = min(max(t, self.lo), self.hi)
        short = self.prefix_sums[k] / k if k > 0 else edge
        long = (self.prefix_sums[n] - self.prefix_sums[k]) / (n - k) if k < n else edge
        return short, long


class TraceRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request of a Mooncake trace; `timestamp` is the arrival time in milliseconds."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _decode_line(decoder: msgspec.json.Decoder[TraceRecord], path: Path, number: int,
                 line: bytes) -> TraceRecord:
    try:
        record = decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise TraceFormatError(f"{path}:{number}: not a trace record: {exc}") from exc
    if record.input_length < 0 or record.output_length < 0:
        raise TraceFormatError(
            f"{path}:{number}: lengths must be >= 0, got input_length={record.input_length}, "
            f"output_length={record.output_length}"
        )
    return record


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Read a Mooncake trace (JSONL); blank lines are skipped, `limit` keeps the first n."""
    path = Path(path)
    decoder = msgspec.json.Decoder(TraceRecord)
    records: list[TraceRecord] = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(_decode_line(decoder, path, number, line))
    return records


def incremental_lengths(
    records: Sequence[TraceRecord], block_tokens: int = TRACE_BLOCK_TOKENS
) -> list[int]:
    """Uncached prefill length of each request under one infinite global prefix cache.

    Requests are taken in the given (arrival) order. A request reuses its longest prefix of
    blocks already seen. A trace block id names its content together with all preceding
    blocks, so a seen partial last block counts as cached too; this reproduces the
    statistics of data/traces/README.md (conversation p50 2,470 tokens).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
    seen: set[int] = set()
    result: list[int] = []
    for record in records:
        hits = 0
        for block in record.hash_ids:
            if block not in seen:
                break
            hits += 1
        cached = min(hits * block_tokens, record.input_length)
        result.append(record.input_length - cached)
        seen.update(record.hash_ids)
    return result
