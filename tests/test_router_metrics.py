"""/metrics as the router's collector reads it from the scheduler, policy and worker table, and
the request histograms the scheduler and runner observe (on virtual time: exact values)."""

from __future__ import annotations

import bisect

import msgspec
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from router_fakes import DONE, fake_mesh, fake_token, generation, placed_handle

from mesh.events import EventBus
from services.router.request_metrics import RequestMetrics
from services.router.runner import RequestRunner
from services.router.scheduler import SchedulerCollector


def registry_of(collector: Collector) -> CollectorRegistry:
    """A registry holding `collector` alone."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


@pytest.mark.trio
async def test_the_collector_reads_every_statistic_at_scrape_time(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh("prfaas", {"threshold": 100.0}) as mesh:
        registry = registry_of(SchedulerCollector(mesh.scheduler))
        await (await mesh.scheduler.submit(generation(range(1, 300), max_tokens=3))).collect()
        await (await mesh.scheduler.submit(generation(range(1, 20), max_tokens=2))).collect()
        text = generate_latest(registry).decode()
    for line in ('prfaas_router_requests_total{finish_reason="length",outcome="completed"} 2.0',
                 'prfaas_router_decisions_total{cluster="prfaas"} 1.0',
                 'prfaas_router_decisions_total{cluster="pd"} 1.0',
                 'prfaas_router_tokens_total{kind="completion"} 5.0',
                 "prfaas_router_inflight 0.0", "prfaas_router_offload_fraction 0.5",
                 "prfaas_router_threshold_tokens 100.0",
                 'prfaas_router_worker_up{role="prefill",worker="pd-prefill-0"} 1.0',
                 'prfaas_router_worker_queue{worker="prfaas-prefill-0"} 0.0'):
        assert line in text, line


@pytest.mark.trio
async def test_completed_requests_are_counted_by_finish_reason_and_the_rest_by_outcome_alone(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh("prfaas", {"threshold": 100.0}) as mesh:
        registry = registry_of(SchedulerCollector(mesh.scheduler))
        before = samples(registry)
        prompt = list(range(1, 30))
        stop = "".join(chr(fake_token(prompt, i) - 1) for i in range(4))[2:4]
        await (await mesh.scheduler.submit(generation(prompt, max_tokens=40,
                                                      stop=[stop]))).collect()
        await (await mesh.scheduler.submit(generation(prompt, max_tokens=2))).collect()
        got = samples(registry)
    requests = "prfaas_router_requests_total"
    # Both reasons exist from the first scrape, so a rate over either has a series.
    assert before[series(requests, outcome="completed", finish_reason="stop")] == 0
    assert got[series(requests, outcome="completed", finish_reason="stop")] == 1
    assert got[series(requests, outcome="completed", finish_reason="length")] == 1
    assert series(requests, outcome="completed") not in got
    assert got[series(requests, outcome="admitted")] == 2
    assert got[series(requests, outcome="failed")] == 0


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and sorted labels, as Prometheus would parse it."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def series(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


@pytest.mark.trio
async def test_a_streamed_request_fills_every_request_histogram_with_its_own_times(
        autojump_clock: trio.testing.MockClock) -> None:
    # The fake PD prefill takes 2 ms a token and the decode worker 10 ms a step, on virtual time.
    async with fake_mesh("prfaas", {"threshold": 100.0}) as mesh:
        registry = registry_of(mesh.scheduler.metrics)
        request = msgspec.structs.replace(generation(range(1, 40), max_tokens=5), stream=True)
        started = trio.current_time()
        await (await mesh.scheduler.submit(request)).collect()
        duration = trio.current_time() - started
        got = samples(registry)
    pd = {"cluster": "pd", "policy": "prfaas"}
    assert got[series("prfaas_time_to_first_token_seconds_count", **pd)] == 1
    ttft = got[series("prfaas_time_to_first_token_seconds_sum", **pd)]
    assert ttft == pytest.approx(39 * 0.002)
    # Four gaps of one 10 ms decode step each, all in the bucket (0.0075, 0.01].
    assert got[series("prfaas_inter_token_latency_seconds_count", **pd)] == 4
    assert got[series("prfaas_inter_token_latency_seconds_sum", **pd)] == pytest.approx(0.04)
    assert got[series("prfaas_inter_token_latency_seconds_bucket", le="0.0075", **pd)] == 0
    assert got[series("prfaas_inter_token_latency_seconds_bucket", le="0.01", **pd)] == 4
    assert got[series("prfaas_request_duration_seconds_sum", **pd)] == pytest.approx(duration)
    tpot = got[series("prfaas_request_time_per_output_token_seconds_sum", **pd)]
    assert tpot == pytest.approx((duration - ttft) / 4)
    # The old name, vLLM's for the gap between tokens, stays for a release with the same values.
    assert got[series("prfaas_time_per_output_token_seconds_sum", **pd)] == tpot
    assert got[series("prfaas_request_queue_seconds_count", **pd)] == 1
    # 39 prompt tokens: in the bucket (32, 64]; 5 completion tokens in (4, 8].
    assert got[series("prfaas_request_prompt_tokens_bucket", le="32.0", **pd)] == 0
    assert got[series("prfaas_request_prompt_tokens_bucket", le="64.0", **pd)] == 1
    assert got[series("prfaas_request_generation_tokens_sum", **pd)] == 5
    assert got[series("prfaas_request_generation_tokens_bucket", le="4.0", **pd)] == 0
    assert got[series("prfaas_prefix_cache_query_tokens_total", cluster="pd")] == 39
    assert got[series("prfaas_prefix_cache_hit_tokens_total", cluster="pd")] == 0


@pytest.mark.trio
async def test_histograms_are_labelled_by_the_cluster_that_prefilled_and_count_cache_hits(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh("prfaas", {"threshold": 100.0}) as mesh:
        registry = registry_of(mesh.scheduler.metrics)
        long = list(range(1, 250))
        # The second finds the first's 15 blocks (16 tokens each) in the PrfaaS worker's cache
        # and still has 208 tokens to compute, past t.
        for prompt in (long, long + list(range(1, 200))):
            await (await mesh.scheduler.submit(generation(prompt, max_tokens=2))).collect()
        await (await mesh.scheduler.submit(generation(range(1, 20), max_tokens=2))).collect()
        got = samples(registry)
    prfaas = {"cluster": "prfaas", "policy": "prfaas"}
    assert got[series("prfaas_time_to_first_token_seconds_count", **prfaas)] == 2
    assert got[series("prfaas_time_to_first_token_seconds_count", cluster="pd",
                      policy="prfaas")] == 1
    assert got[series("prfaas_prefix_cache_query_tokens_total", cluster="prfaas")] == 249 + 448
    assert got[series("prfaas_prefix_cache_hit_tokens_total", cluster="prfaas")] == 240
    assert got[series("prfaas_prefix_cache_query_tokens_total", cluster="pd")] == 19


@pytest.mark.trio
async def test_a_chunk_of_several_tokens_counts_its_gap_spread_over_them() -> None:
    # A whole answer: the first token at 1.0 s, the other 9 together at its end, 3.0 s.
    metrics = RequestMetrics()
    times = iter([1.0, 3.0])
    runner = RequestRunner(None, None, None, None, EventBus(), lambda: next(times))  # type: ignore[arg-type]
    handle = placed_handle()
    handle.series = metrics.series("pd", "prfaas")
    runner._token_times(handle, 1)
    runner._token_times(handle, 9)
    itl = handle.series.itl
    assert (itl.count, itl.sum) == (9, pytest.approx(2.0))
    assert itl.counts[bisect.bisect_left(itl.bounds, 2.0 / 9)] == 9
    assert handle.first_token_at == 1.0 and handle.last_token_at == 3.0


@pytest.mark.trio
async def test_a_failed_request_counts_its_first_token_but_no_duration() -> None:
    metrics = RequestMetrics()
    handle = placed_handle()
    handle.series = metrics.series("pd", "prfaas")
    handle.started, handle.first_token_at = 10.0, 10.5
    handle.observe_end(handle.ended(12.0))
    assert handle.series.ttft.count == 1 and handle.series.ttft.sum == 0.5
    assert handle.series.duration.count == 0 and handle.series.completion.count == 0
    handle.result = DONE
    handle.observe_end(handle.ended(12.0))
    assert handle.series.duration.sum == 2.0
    assert handle.series.tpot.sum == pytest.approx(1.5)  # (2.0 - 0.5) / (2 - 1)
