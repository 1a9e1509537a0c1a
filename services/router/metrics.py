"""The router's /metrics: the scheduler's, the policy's and the workers' statistics, and the
requests' latency and length histograms.

`SchedulerCollector` reads each component's `statistics()` at scrape time, so nothing is
counted twice. `RequestMetrics` is observed as requests run (the scheduler at a request's end,
the runner at each streamed token): per request, labelled by the cluster that prefilled and
the policy that placed it, the time to first token, every gap between streamed tokens, the
end-to-end time, the time queued at the prefill worker, the time per output token, prompt and
completion lengths; and by cluster, the prompt tokens looked up in the prefill worker's prefix
cache and those found there. The names, units and buckets are vLLM's and NVIDIA Dynamo's
habits (docs/observability.md); the buckets are services/service.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh.histogram import Histogram, HistogramSeries
from services.contract.events import MIGRATION_REASONS
from services.contract.messages import PrefillDone
from services.router.policy import Policy
from services.router.workers import WorkerTable
from services.service import SECONDS_BUCKETS, TOKENS_BUCKETS

REQUEST_LABELS = ("cluster", "policy")


class SchedulerStatistics(msgspec.Struct, frozen=True):
    admitted: int
    rejected_full: int
    rejected_no_worker: int
    completed: int
    failed: int
    cancelled: int
    inflight: int
    to_prfaas: int
    to_pd: int
    lookup_failures: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # What admission allows now: max_inflight, or less if the decode workers hold fewer.
    admission_limit: int = 0
    migrations: dict[str, int] = {}  # requests continued elsewhere, by reason
    migrations_gave_up: int = 0  # requests that broke past migration_limit
    migrations_resumed: int = 0  # continued attempts that streamed a token
    migration_resume_s: float = 0.0  # their summed time from the break to that token


class Observed(Protocol):
    """What the collector reads of the scheduler (services/router/scheduler.py)."""

    def statistics(self) -> SchedulerStatistics: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def workers(self) -> WorkerTable: ...


class SchedulerCollector(Collector):
    """/metrics: the scheduler's, the policy's and the workers' statistics, read at scrape."""

    def __init__(self, scheduler: Observed) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._migrations()
        yield from self._policy()
        yield from self._workers()

    def _requests(self) -> Iterator[Metric]:
        stats = self._scheduler.statistics()
        requests = CounterMetricFamily("prfaas_router_requests", "Requests by outcome",
                                       labels=["outcome"])
        for outcome in ("admitted", "completed", "failed", "cancelled", "rejected_full",
                        "rejected_no_worker"):
            requests.add_metric([outcome], getattr(stats, outcome))
        decisions = CounterMetricFamily("prfaas_router_decisions", "Prefills placed per "
                                        "cluster", labels=["cluster"])
        decisions.add_metric(["prfaas"], stats.to_prfaas)
        decisions.add_metric(["pd"], stats.to_pd)
        tokens = CounterMetricFamily("prfaas_router_tokens", "Tokens of finished requests",
                                     labels=["kind"])
        for kind in ("prompt", "completion", "cached"):
            tokens.add_metric([kind], getattr(stats, f"{kind}_tokens"))
        yield from (requests, decisions, tokens)
        yield CounterMetricFamily("prfaas_router_lookup_failures", "Cache directory lookups "
                                  "that failed", value=stats.lookup_failures)
        yield GaugeMetricFamily("prfaas_router_inflight", "Requests in flight",
                                value=stats.inflight)

    def _migrations(self) -> Iterator[Metric]:
        """Requests continued elsewhere after their data path broke (services/router/runner.py)."""
        stats = self._scheduler.statistics()
        migrations = CounterMetricFamily("prfaas_router_migrations", "Requests continued on "
                                         "other workers after their data path broke, by "
                                         "reason", labels=["reason"])
        for reason in MIGRATION_REASONS:
            migrations.add_metric([reason], stats.migrations.get(reason, 0))
        yield migrations
        yield CounterMetricFamily("prfaas_router_migrations_gave_up", "Requests that broke "
                                  "again past the migration limit", value=stats.migrations_gave_up)
        yield CounterMetricFamily("prfaas_router_migrations_resumed", "Continued attempts "
                                  "that streamed a token", value=stats.migrations_resumed)
        yield CounterMetricFamily("prfaas_router_migration_resume_seconds", "Summed time from "
                                  "a break to the continued attempt's first token",
                                  value=stats.migration_resume_s)

    def _policy(self) -> Iterator[Metric]:
        policy = self._scheduler.policy.statistics()
        yield GaugeMetricFamily("prfaas_router_offload_fraction", "Share of decisions sent "
                                "to PrfaaS by the current policy", value=policy.offload_fraction)
        if policy.threshold is not None:
            yield GaugeMetricFamily("prfaas_router_threshold_tokens", "The policy's t",
                                    value=policy.threshold)

    def _workers(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("prfaas_router_worker_up", "Worker answers status polls",
                               labels=["worker", "role"])
        queue = GaugeMetricFamily("prfaas_router_worker_queue", "Prefills sent and not done "
                                  "(prefill) or reported queue (decode)", labels=["worker"])
        for view in self._scheduler.workers.statistics().workers:
            up.add_metric([view.name, view.role], float(view.up))
            queue.add_metric([view.name], view.queue)
        yield from (up, queue)


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


class RequestSeries(NamedTuple):
    """One (cluster, policy)'s children of every request histogram, looked up once."""

    ttft: HistogramSeries
    itl: HistogramSeries
    duration: HistogramSeries
    queue: HistogramSeries
    tpot: HistogramSeries
    prompt: HistogramSeries
    completion: HistogramSeries
    cache: PrefixCacheTokens  # the prefill cluster's, shared by its policies' series


class Lengths(Protocol):
    """A completed request's token counts (services/router/requests.py Finished)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...


class EndedRequest(Protocol):
    """What `RequestMetrics.finished` reads of a request that has ended
    (services/router/requests.py RequestHandle)."""

    @property
    def series(self) -> RequestSeries | None: ...

    @property
    def result(self) -> Lengths | None: ...

    @property
    def started(self) -> float: ...

    @property
    def first_token_at(self) -> float: ...

    @property
    def prefill(self) -> PrefillDone | None: ...


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
            ("prfaas_time_per_output_token_seconds", "(duration - TTFT) / (completion tokens "
             "- 1), per completed request"),
        )
        tokens = (("prfaas_request_prompt_tokens", "Prompt length of completed requests"),
                  ("prfaas_request_generation_tokens", "Completion length of completed "
                   "requests"))
        self._histograms = [
            *(Histogram(name, doc, REQUEST_LABELS, SECONDS_BUCKETS) for name, doc in seconds),
            *(Histogram(name, doc, REQUEST_LABELS, TOKENS_BUCKETS) for name, doc in tokens)]
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

    def finished(self, handle: EndedRequest, now: float) -> None:
        """Observes a request that has ended: its first token and prefill whatever the
        outcome, its duration and lengths when it completed."""
        series, result = handle.series, handle.result
        if series is None:
            return
        ttft = handle.first_token_at - handle.started if handle.first_token_at else None
        if ttft is not None:
            series.ttft.observe(ttft)
        if handle.prefill is not None:
            series.queue.observe(handle.prefill.queue_s)
            series.cache.queried += handle.prefill.prompt_tokens
            series.cache.hit += handle.prefill.reused_tokens
        if result is None:
            return
        duration = now - handle.started
        series.duration.observe(duration)
        series.prompt.observe(result.prompt_tokens)
        series.completion.observe(result.completion_tokens)
        if ttft is not None and result.completion_tokens > 1:
            series.tpot.observe((duration - ttft) / (result.completion_tokens - 1))

    def histogram_exposition(self) -> str:
        """The histograms' text, as `collect` through a registry writes them but written
        directly: the router's /metrics appends it (scraped under load: bench_router.py
        --scrape-every); `cache` goes through the router's registry."""
        return "".join(histogram.exposition() for histogram in self._histograms)

    def collect(self) -> Iterator[Metric]:
        for histogram in self._histograms:
            yield from histogram.collect()
        yield from self.cache.collect()
