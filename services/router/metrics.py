"""The router's /metrics: the scheduler's, the policy's and the workers' statistics.

Read at scrape time from each component's `statistics()`, so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.router.scheduler import Scheduler


class SchedulerCollector(Collector):
    """/metrics: the scheduler's, the policy's and the workers' statistics, read at scrape."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
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
