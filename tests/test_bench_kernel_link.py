"""benchmarks/bench_kernel_link.py: the same KV transfers through the link emulator and over a
tbf-shaped veth between two namespaces it makes, at a low rate, arrive at the set rate, and
the router's estimator, fed the sender's own counters, reads about the delivered rate.

The namespace test skips, saying why, where this process may not make namespaces; not root,
the benchmark says so, exits 3 and makes nothing.
"""

from __future__ import annotations

import os

import pytest

from services.cli.multihost import EXIT_NO_NETNS
from services.model.config import family_config, kv_bytes
from services.router.link_meter import EstimatorConfig
from tests.benchmark_scripts import load_benchmark
from tests.netns_probe import NETNS_REFUSED, needs_netns, network_state

RATE_BPS = 200e6


bench = load_benchmark("bench_kernel_link")




def test_both_paths_get_the_same_kv_sized_transfers() -> None:
    sizes = bench.kv_transfer_sizes(50_000_000, size="tiny")
    assert sizes == bench.kv_transfer_sizes(50_000_000, size="tiny")
    assert sum(sizes) >= 50_000_000 > sum(sizes[:-1])
    tiny = family_config(bench.KV_FAMILY, "tiny")
    assert all(kv_bytes(tiny, 128) <= n <= kv_bytes(tiny, 131072) for n in sizes)


def test_not_root_is_told_and_makes_nothing(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    before = network_state() if not NETNS_REFUSED else None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["--rates", "1e8", "--seconds", "1"]) == EXIT_NO_NETNS
    captured = capsys.readouterr()
    assert "need root" in captured.err and captured.out == ""
    if before is not None:
        assert network_state() == before


@pytest.mark.slow
@needs_netns
def test_emulator_and_kernel_deliver_the_set_rate_and_the_estimate_follows() -> None:
    before = network_state()
    results = bench.measure_rate(RATE_BPS, 2.0, EstimatorConfig(window_s=1.0), size="tiny")
    kernel, emulator = results["kernel"], results["emulator"]
    # tbf counts the headers too (under 1% at a 9000-byte MTU).
    assert kernel.rate_ratio == pytest.approx(1.0, abs=0.05)
    assert emulator.rate_ratio == pytest.approx(1.0, abs=0.08)
    for result in (kernel, emulator):
        assert result.held > 0.95
        # The first windows start with nothing in flight and miss the transfer in flight at
        # their end: the estimate reads a little low.
        assert result.estimate_ratio == pytest.approx(0.95, abs=0.1)
        assert 0 < result.transfer_p50_s <= result.transfer_p90_s
    assert network_state() == before
