"""Bench metrics with vLLM's definitions (`vllm bench serve`; docs/architecture.md section 8).

Per request: TTFT = first non-empty streamed token - request sent; E2EL = last token - sent;
TPOT = (E2EL - TTFT) / (output tokens - 1) for requests with more than one output token;
ITL = every gap between consecutive non-empty chunks, pooled over requests. Goodput = requests
per second meeting *every* SLO given (a one-token request meets any TPOT SLO, as in vLLM).
Percentiles interpolate linearly between order statistics (numpy's default, vLLM's too);
`percentile_reference` is the plain-Python reference the tests compare with.
Offload fraction: the share of completed requests whose reported cluster is a PrfaaS one (its
name starts with "prfaas", so "prfaas-2" counts too), among those with a reported cluster.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

PRFAAS = "prfaas"


class RequestResult(msgspec.Struct, frozen=True, kw_only=True):
    """One streamed request; times in seconds, `start_s` from the start of the run."""

    request_id: str
    session_id: str = ""
    turn: int = 0
    ok: bool
    error: str = ""
    start_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0  # as the server's usage says, else the planned length
    cached_tokens: int | None = None
    cluster: str | None = None
    empty_chunks: int = 0  # token chunks without text (sse.ChunkInfo.empty)


class SLOs(msgspec.Struct, frozen=True, kw_only=True):
    """Goodput thresholds in milliseconds; None: not part of the SLO."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


class Distribution(msgspec.Struct, frozen=True):
    """Summary of one metric in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


class BenchSummary(msgspec.Struct, frozen=True, kw_only=True):
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed req/s
    input_throughput: float  # prompt tokens/s of completed requests
    output_throughput: float  # output tokens/s
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    slos: SLOs
    good_requests: int | None  # None when no SLO was given
    goodput: float | None  # good req/s
    clusters: dict[str, int]  # completed requests per reported cluster
    unreported: int  # completed requests without a cluster
    offload_fraction: float | None  # None when no cluster was reported
    cached_tokens: int  # sum of reported cached prompt tokens
    egress_bytes: int | None = None  # PrfaaS link egress during the run (GET /link)
    egress_gbps: float | None = None
    empty_chunks: int = 0  # streamed token chunks without text, over every request


NO_SLOS = SLOs()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; numpy does the work."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def percentile_reference(values: Sequence[float], q: float) -> float:
    """Slow reference: rank (n - 1) * q / 100 between the two order statistics around it."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(seconds: Sequence[float]) -> Distribution | None:
    if not seconds:
        return None
    ms = [s * 1000.0 for s in seconds]
    return Distribution(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90),
                        percentile(ms, 99), max(ms))


def tpot_s(result: RequestResult) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1); None for one-token or failed requests."""
    if not result.ok or result.ttft_s is None or result.latency_s is None:
        return None
    if result.output_tokens <= 1:
        return None
    return (result.latency_s - result.ttft_s) / (result.output_tokens - 1)


def meets_slos(result: RequestResult, slos: SLOs) -> bool:
    if not result.ok or result.ttft_s is None or result.latency_s is None:
        return False
    checks = ((slos.ttft_ms, result.ttft_s), (slos.tpot_ms, tpot_s(result) or 0.0),
              (slos.e2el_ms, result.latency_s))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def _clusters(done: Sequence[RequestResult]) -> tuple[dict[str, int], int, float | None]:
    counts: dict[str, int] = {}
    for r in done:
        if r.cluster is not None:
            counts[r.cluster] = counts.get(r.cluster, 0) + 1
    reported = sum(counts.values())
    offloaded = sum(n for name, n in counts.items() if name.startswith(PRFAAS))
    fraction = offloaded / reported if reported else None
    return dict(sorted(counts.items())), len(done) - reported, fraction


def _egress(egress_bytes: int | None, duration: float) -> float | None:
    if egress_bytes is None or duration <= 0:
        return None
    return egress_bytes * 8.0 / duration / 1e9


def summarise(results: Sequence[RequestResult], duration_s: float, slos: SLOs = NO_SLOS,
              egress_bytes: int | None = None) -> BenchSummary:
    """Every metric of the run; `duration_s` is the wall time from first send to last reply."""
    done = [r for r in results if r.ok and r.ttft_s is not None and r.latency_s is not None]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(meets_slos(r, slos) for r in done) if slos.given() else None
    clusters, unreported, offload = _clusters(done)
    return BenchSummary(
        completed=len(done), failed=len(results) - len(done), duration_s=duration_s,
        request_throughput=len(done) * per_s,
        input_throughput=sum(r.prompt_tokens for r in done) * per_s,
        output_throughput=sum(r.output_tokens for r in done) * per_s,
        ttft=distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=distribution([t for r in done if (t := tpot_s(r)) is not None]),
        itl=distribution([gap for r in done for gap in r.itl_s]),
        e2el=distribution([r.latency_s for r in done if r.latency_s is not None]),
        slos=slos, good_requests=good, goodput=None if good is None else good * per_s,
        clusters=clusters, unreported=unreported, offload_fraction=offload,
        cached_tokens=sum(r.cached_tokens or 0 for r in done),
        egress_bytes=egress_bytes, egress_gbps=_egress(egress_bytes, duration_s),
        empty_chunks=sum(r.empty_chunks for r in results))
