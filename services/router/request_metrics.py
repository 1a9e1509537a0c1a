"""The router's per-request metrics (`RequestMetrics`), observed as requests run (a request's
handle at its end, `RequestHandle.observe_end`; the runner at each streamed token): per
request, labelled by the cluster that prefilled and the policy that placed it, the time to
first token, every gap between streamed tokens, the end-to-end time, the time queued at the
prefill worker, the time per output token, prompt and completion lengths; and by cluster, the
prompt tokens looked up in the prefill worker's prefix cache and those found there. The names,
units and buckets are vLLM's and NVIDIA Dynamo's habits (docs/observability.md); the buckets
are services/service.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh.histogram import Histogram, HistogramSeries
from services.service import SECONDS_BUCKETS, TOKENS_BUCKETS

REQUEST_LABELS = ("cluster", "policy")


@dataclass
class PrefixCacheTokens:
    """Prompt tokens of one cluster's prefills: looked up in its prefix cache, found there."""

    queried: int = 0
    hit: int = 0


class PrefixCacheCounters(Collector):
    """prfaas_prefix_cache_{query,hit}_tokens_total by the cluster that prefilled."""

    def __init__(self) -> None:
        self._clusters: dict[str, PrefixCacheTokens] = {}

    def of(self, cluster: str) -> PrefixCacheTokens:
        return self._clusters.setdefault(cluster, PrefixCacheTokens())

    def collect(self) -> Iterator[Metric]:
        queried = CounterMetricFamily("prfaas_prefix_cache_query_tokens", "Prompt tokens "
                                      "looked up in the prefill worker's prefix cache",
                                      labels=["cluster"])
        hit = CounterMetricFamily("prfaas_prefix_cache_hit_tokens", "Prompt tokens found in "
                                  "the prefill worker's prefix cache (not computed)",
                                  labels=["cluster"])
        for cluster, tokens in self._clusters.items():
            queried.add_metric([cluster], tokens.queried)
            hit.add_metric([cluster], tokens.hit)
        yield from (queried, hit)


# The per-request TPOT's name until this release: vLLM gives the name to the gap between
# tokens (ours is prfaas_inter_token_latency_seconds), so a vLLM operator read it wrong. The
# histogram is exported under both names for one release (docs/observability.md).
TPOT_ALIAS = "prfaas_time_per_output_token_seconds"


class RequestSeries(NamedTuple):
    """One (cluster, policy)'s children of every request histogram, looked up once."""

    ttft: HistogramSeries
    itl: HistogramSeries
    duration: HistogramSeries
    queue: HistogramSeries
    tpot: HistogramSeries
    prompt: HistogramSeries
    completion: HistogramSeries
    tpot_alias: HistogramSeries  # the same values under TPOT_ALIAS, for one release
    cache: PrefixCacheTokens  # the prefill cluster's, shared by its policies' series


class RequestMetrics(Collector):
    """The router's per-request histograms and prefix-cache counters (module docstring)."""

    def __init__(self) -> None:
        seconds = (
            ("prfaas_time_to_first_token_seconds", "Request sent to its first token"),
            ("prfaas_inter_token_latency_seconds", "Gap before each output token after the "
             "first (a chunk's gap spread over its tokens)"),
            ("prfaas_request_duration_seconds", "Request sent to its last token (completed "
             "requests)"),
            ("prfaas_request_queue_seconds", "Time a request waited at its prefill worker "
             "before its prefill began"),
            ("prfaas_request_time_per_output_token_seconds", "(duration - TTFT) / (completion "
             "tokens - 1), per completed request"),
        )
        tokens = (("prfaas_request_prompt_tokens", "Prompt length of completed requests"),
                  ("prfaas_request_generation_tokens", "Completion length of completed "
                   "requests"))
        alias = Histogram(TPOT_ALIAS, "Deprecated: the same as prfaas_request_time_per_output_"
                          "token_seconds (per request, not between tokens); removed in the "
                          "next release", REQUEST_LABELS, SECONDS_BUCKETS)
        self._histograms = [
            *(Histogram(name, doc, REQUEST_LABELS, SECONDS_BUCKETS) for name, doc in seconds),
            *(Histogram(name, doc, REQUEST_LABELS, TOKENS_BUCKETS) for name, doc in tokens),
            alias]
        self.cache = PrefixCacheCounters()
        self._series: dict[tuple[str, str], RequestSeries] = {}

    def series(self, cluster: str, policy: str) -> RequestSeries:
        """The children for requests prefilled in `cluster` and placed by `policy`."""
        key = (cluster, policy)
        found = self._series.get(key)
        if found is None:
            found = RequestSeries._make([*(h.labels(cluster, policy) for h in self._histograms),
                                         self.cache.of(cluster)])
            self._series[key] = found
        return found

    def histogram_exposition(self) -> str:
        """The histograms' text, as `collect` through a registry writes them but written
        directly: the router's /metrics appends it (scraped under load: bench_router.py
        --scrape-every); `cache` goes through the router's registry."""
        return "".join(histogram.exposition() for histogram in self._histograms)

    def collect(self) -> Iterator[Metric]:
        for histogram in self._histograms:
            yield from histogram.collect()
        yield from self.cache.collect()
