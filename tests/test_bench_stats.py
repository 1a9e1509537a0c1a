"""Bench metrics on hand-made timestamps: vLLM's TTFT, TPOT, ITL, goodput definitions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.bench.stats import (
    RequestResult,
    SLOs,
    distribution,
    meets_slos,
    percentile,
    percentile_reference,
    summarise,
    tpot_s,
)


def result(rid: str, *, ttft: float, gaps: list[float], tokens: int | None = None,
           cluster: str | None = None, ok: bool = True, start: float = 0.0,
           prompt: int = 100, cached: int | None = None) -> RequestResult:
    """A request whose first token came at `ttft` and the next ones `gaps` apart."""
    return RequestResult(
        request_id=rid, ok=ok, start_s=start, ttft_s=ttft if ok else None,
        latency_s=ttft + sum(gaps) if ok else None, itl_s=tuple(gaps),
        output_tokens=len(gaps) + 1 if tokens is None else tokens, prompt_tokens=prompt,
        cached_tokens=cached, cluster=cluster, error="" if ok else "HTTP 503")


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    # First token at 0.5 s, then 4 more 0.1 s apart: E2EL 0.9 s, TPOT = 0.4 / 4.
    r = result("a", ttft=0.5, gaps=[0.1, 0.1, 0.1, 0.1])
    assert tpot_s(r) == pytest.approx(0.1)
    # Usage says 9 tokens came in those 5 chunks: TPOT divides by 8, ITL stays per chunk.
    assert tpot_s(result("b", ttft=0.5, gaps=[0.1] * 4, tokens=9)) == pytest.approx(0.05)
    assert tpot_s(result("c", ttft=0.5, gaps=[])) is None
    assert tpot_s(result("d", ttft=0.5, gaps=[0.1], ok=False)) is None


def test_summary_metrics_on_hand_made_requests() -> None:
    results = [
        result("a", ttft=0.2, gaps=[0.05, 0.15], cluster="prfaas", cached=64),
        result("b", ttft=0.6, gaps=[0.1], cluster="pd", prompt=300),
        result("c", ttft=1.0, gaps=[], cluster="prfaas"),
        result("d", ttft=0.0, gaps=[], ok=False),
    ]
    s = summarise(results, duration_s=2.0)
    assert (s.completed, s.failed) == (3, 1)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx((3 + 2 + 1) / 2.0)
    assert s.input_throughput == pytest.approx((100 + 300 + 100) / 2.0)
    assert s.ttft is not None and s.ttft.count == 3
    assert s.ttft.mean == pytest.approx(600.0) and s.ttft.p50 == pytest.approx(600.0)
    assert s.ttft.p90 == pytest.approx(920.0)  # 600 + 0.8 * (1000 - 600)
    assert s.itl is not None and s.itl.count == 3  # pooled: 50, 150, 100 ms
    assert s.itl.mean == pytest.approx(100.0) and s.itl.max == pytest.approx(150.0)
    assert s.tpot is not None and s.tpot.count == 2  # a: 100 ms, b: 100 ms; c has one token
    assert s.tpot.mean == pytest.approx(100.0)
    assert s.e2el is not None and s.e2el.max == pytest.approx(1000.0)
    assert s.clusters == {"pd": 1, "prfaas": 2} and s.unreported == 0
    assert s.offload_fraction == pytest.approx(2 / 3)
    assert s.cached_tokens == 64
    assert s.goodput is None and s.good_requests is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    results = [
        result("fast", ttft=0.1, gaps=[0.02] * 10),  # TTFT 100 ms, TPOT 20 ms
        result("slow-start", ttft=0.9, gaps=[0.02] * 10),
        result("slow-decode", ttft=0.1, gaps=[0.08] * 10),
        result("one-token", ttft=0.2, gaps=[]),  # TPOT undefined: meets any TPOT SLO
        result("failed", ttft=0.1, gaps=[], ok=False),
    ]
    slos = SLOs(ttft_ms=500, tpot_ms=50)
    assert [meets_slos(r, slos) for r in results] == [True, False, False, True, False]
    s = summarise(results, duration_s=4.0, slos=slos)
    assert (s.good_requests, s.goodput) == (2, pytest.approx(0.5))
    only_e2el = summarise(results, 4.0, SLOs(e2el_ms=350))
    assert only_e2el.good_requests == 2  # fast (300 ms) and one-token (200 ms)


def test_offload_fraction_ignores_unreported_and_egress_rate() -> None:
    results = [result("a", ttft=0.1, gaps=[], cluster="prfaas"),
               result("b", ttft=0.1, gaps=[], cluster=None),
               result("c", ttft=0.1, gaps=[], cluster="prfaas-east"),
               result("d", ttft=0.1, gaps=[], cluster="pd")]
    s = summarise(results, 2.0, egress_bytes=250_000_000)
    assert (s.offload_fraction, s.unreported) == (pytest.approx(2 / 3), 1)
    assert s.egress_gbps == pytest.approx(1.0)
    none = summarise([result("c", ttft=0.1, gaps=[])], 1.0)
    assert none.offload_fraction is None and none.egress_gbps is None


def test_empty_run() -> None:
    s = summarise([], 0.0)
    assert (s.completed, s.request_throughput, s.ttft, s.itl) == (0, 0.0, None, None)
    assert distribution([]) is None


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=50),
       st.sampled_from([0, 1, 25, 50, 90, 99, 100]))
def test_percentile_equals_the_reference(values: list[float], q: int) -> None:
    assert percentile(values, q) == pytest.approx(percentile_reference(values, q), abs=1e-9)
