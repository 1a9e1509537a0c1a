"""Open-loop arrival times: Poisson, gamma (burstiness), or a trace's timestamps sped up.

Gamma as in vLLM's `bench serve` (`--burstiness`): inter-arrival gaps are Gamma(shape=b,
scale=1 / (rate * b)), so the mean rate stays `rate` while b < 1 makes arrivals burstier and
b > 1 more regular; b = 1 is the Poisson process (exponential gaps).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from services.bench.errors import BenchError


def _check_count(n: int) -> None:
    if n < 0:
        raise BenchError(f"n must be >= 0, got {n!r}")


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """n arrival offsets (s, from 0) at mean `rate` req/s; rate inf sends all at once."""
    _check_count(n)
    if math.isnan(rate) or rate <= 0:
        raise BenchError(f"rate must be > 0 (inf: all at once), got {rate!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise BenchError(f"burstiness must be a finite number > 0, got {burstiness!r}")
    if math.isinf(rate):
        return [0.0] * n
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Exponential gaps: gamma with burstiness 1."""
    return gamma_arrivals(n, rate, 1.0, rng)


def trace_arrivals(timestamps_ms: Sequence[float], speedup: float = 1.0) -> list[float]:
    """Offsets (s) of a trace's millisecond timestamps, from the first, divided by `speedup`."""
    if not (math.isfinite(speedup) and speedup > 0):
        raise BenchError(f"speedup must be a finite number > 0, got {speedup!r}")
    if not timestamps_ms:
        return []
    first = timestamps_ms[0]
    return [max(0.0, (ts - first) / 1000.0 / speedup) for ts in timestamps_ms]
