"""The router's scheduler: admits a request, has it placed (services/router/placement.py),
starts the task that runs it (services/router/runner.py), and records its end; beside the
path, it keeps the links' state current and moves requests off stalled links and silent
workers.

One request, in `submit` (before any byte goes to the client, so errors keep their status):
1. admission: at most `max_inflight` requests at once, and no more than the decode workers
   can hold (the sum of their reported `max_streams`), else `QueueFull` (429, Retry-After);
2. placement (`Placer.place`: the cache directory's lookup, the policy's decision, the
   workers), published as a `RoutingDecision` with every input and the reason;
3. a task owned by the scheduler runs it (`RequestRunner.serve`: migration included); at its
   end the request's one `RequestEnd` goes to the worker table, the counts, the histograms,
   the `RequestDone` event, the policy and the trace. Cancelling the handle (the client
   left) cancels the task.

A link whose queued bytes would take longer than the stall bound to cross (its link samples'
queued bytes at the router's estimate of its bandwidth), or that is down, is held from new
offload, and the requests still waiting for KV over it are moved on at once
(`_link_stalled`). A worker that hangs (alive, silent) breaks no connection: once it answers
no status poll, a request whose attempt made no progress on it for `silence_s` is moved on as
if it had died (`move_off_silent`).

`SchedulerCollector` is the router's /metrics view of the scheduler's, the policy's and the
workers' statistics, read at scrape time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh import native
from mesh.events import EventBus
from mesh.node import Node
from services.contract.events import MIGRATION_REASONS, Event, RequestDone
from services.contract.tracing import Tracer, failed, trace_id
from services.model.tokenizer import TokenizerLike
from services.router.config import SchedulerConfig
from services.router.errors import NoWorkerAvailable, QueueFull
from services.router.links import LinkBook
from services.router.placement import LINK_HOLD_STALLS, DirectoryReader, Placement, Placer
from services.router.policy import LinkSample, Policy, RequestFinished, decision_event
from services.router.request_metrics import RequestMetrics
from services.router.requests import (
    GenerationRequest,
    RequestEnd,
    RequestHandle,
    RequestIds,
    silence,
)
from services.router.runner import RequestRunner
from services.router.workers import WorkerTable

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

# The silent-worker watch looks this many times per silence bound (`_watch_silence`).
SILENCE_CHECKS = 5
# The finish reasons /metrics always shows for completed requests, at 0 until one is seen (the
# decode worker's "stop" and "length", services/model/batch.py), so a rate over them exists
# from the first scrape; any other reason a worker sends is shown once seen.
FINISH_REASONS = ("stop", "length")


@dataclass
class _Counts:
    admitted: int = 0
    rejected_full: int = 0  # at admission (placement counts its own)
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    to_prfaas: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)  # of the completed


class Scheduler:
    """Places and runs requests over `node`; run `run()` in a task group to serve."""

    def __init__(
        self,
        node: Node,
        policy: Policy,
        workers: WorkerTable,
        tokenizer: TokenizerLike,
        config: SchedulerConfig | None = None,
        *,
        bus: EventBus[Event] | None = None,
        clock: Callable[[], float] = native.now,
        directory: DirectoryReader | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.node = node
        # OpenTelemetry spans of each request (services/contract/tracing.py); None: tracing is off.
        self.tracer = tracer
        self.workers = workers
        self.config = config or SchedulerConfig()
        self.events: EventBus[Event] = bus or EventBus()
        self.clock = clock
        self.tokenizer = tokenizer
        self.links = LinkBook(self.config.links, self.config.stall_window_s,
                              self.config.link_estimator)
        self._active: dict[str, RequestHandle] = {}
        self._group: anyio.abc.TaskGroup | None = None
        self._ids = RequestIds(self.config.id_prefix)
        self._counts = _Counts()
        self._placing = 0
        self.placer = Placer(node, policy, workers, self.links, self.config, clock,
                             directory=directory, tracer=tracer)
        self._runner = RequestRunner(node, workers, tokenizer, self.config, self.events,
                                     clock, self.placer, tracer=tracer)
        self.metrics = RequestMetrics()

    @property
    def policy(self) -> Policy:
        """The policy placement asks (one object: the admin API swaps it here)."""
        return self.placer.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.placer.policy = policy

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Owns every request task until cancelled."""
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                if self.config.silence_s > 0:
                    group.start_soon(self._watch_silence)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._group = None

    def spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs `work` in the scheduler's task group (admin actions that outlive a call)."""
        self._running().start_soon(work)

    async def submit(self, request: GenerationRequest,
                     parent: Span | str | None = None) -> RequestHandle:
        """Places `request` and starts it; QueueFull / NoWorkerAvailable before it starts.
        With tracing on, its trace continues `parent` (a span, or a W3C traceparent)."""
        group = self._running()
        started = self.clock()
        trace = None if self.tracer is None else self.tracer.start(
            "request", parent, {"gen_ai.request.max_tokens": request.sampling.max_tokens,
                                "gen_ai.usage.input_tokens": len(request.prompt),
                                "prfaas.stream": request.stream})
        try:
            self._admit(trace)
            self._placing += 1
            try:
                placement = await self._place(request, trace)
            finally:
                self._placing -= 1
        except BaseException as exc:
            if trace is not None:
                failed(trace, exc)
                trace.end()
            raise
        handle = RequestHandle(placement, request, started=started, trace=trace,
                               series=self.metrics.series(
                                   self.workers.cluster_of(placement.prefill_worker),
                                   self.policy.name))
        self._active[handle.placement.request_id] = handle
        self.workers.dispatched(handle.placement.prefill_worker, handle.placement.decode_worker)
        self._counts.admitted += 1
        native.start_soon(group, self._serve, handle)
        return handle

    def admission_limit(self) -> int:
        """Requests admitted at once: `max_inflight`, or what the decode workers can hold."""
        capacity = self.workers.decode_capacity()
        limit = self.config.max_inflight
        return limit if capacity is None else min(limit, capacity)

    def _admit(self, trace: Span | None = None) -> None:
        # Requests still being placed count too: placing awaits the cache directory.
        limit, inflight = self.admission_limit(), len(self._active) + self._placing
        if trace is not None and self.tracer is not None:
            self.tracer.mark("admission", trace, {"prfaas.inflight": inflight,
                                                  "prfaas.admission_limit": limit},
                             ok=inflight < limit, why="queue_full")
        if inflight >= limit:
            self._reject_full(f"{inflight} requests in flight, the router's limit ({limit}: "
                              f"max_inflight={self.config.max_inflight}, decode capacity "
                              f"{self.workers.decode_capacity()})")

    def _reject_full(self, why: str) -> None:
        self._counts.rejected_full += 1
        raise QueueFull(f"{why}; retry later", code="queue_full")

    async def _place(self, request: GenerationRequest, trace: Span | None = None) -> Placement:
        request_id = self._ids.next()
        if trace is not None:
            trace.set_attribute("gen_ai.request.id", request_id)
        placement, inputs = await self.placer.place(request_id, request.prompt, trace=trace)
        decision = placement.decision
        self._counts.to_prfaas += decision.cluster == "prfaas"
        if self.events.subscribed:
            event = decision_event(
                inputs, decision, policy=self.policy.name,
                prefill_worker=placement.prefill_worker,
                decode_worker=placement.decode_worker, ts=self.clock())
            self.events.publish(event if trace is None else msgspec.structs.replace(
                event, trace_id=trace_id(trace)))
        self._runner.phase(request_id, "queued", placement.prefill_worker, decision.reason)
        return placement

    async def _serve(self, handle: RequestHandle) -> None:
        """Runs one request to its end, then records the end once and feeds it on."""
        try:
            await self._runner.serve(handle)
        finally:
            self._finish(handle, handle.ended(self.clock()))

    def _finish(self, handle: RequestHandle, end: RequestEnd) -> None:
        """The request's end, to the worker table, the counts, the histograms, the
        dashboard's event, the policy and the trace."""
        p = handle.placement
        del self._active[p.request_id]
        self.workers.released(p.decode_worker)
        self._count(end)
        handle.observe_end(end)
        self._publish_done(handle, end)
        self.policy.observe(RequestFinished(
            request_id=p.request_id, cluster=p.cluster, now=end.at,
            ok=end.result is not None, incremental_len=p.decision.incremental_len))
        if handle.trace is not None:
            _end_trace(handle.trace, p, end)

    def _count(self, end: RequestEnd) -> None:
        c, result = self._counts, end.result
        if end.cancelled:
            c.cancelled += 1
        elif result is None:
            c.failed += 1
        else:
            c.completed += 1
            c.finish_reasons[result.finish_reason] = c.finish_reasons.get(
                result.finish_reason, 0) + 1
            c.prompt_tokens += result.prompt_tokens
            c.completion_tokens += result.completion_tokens
            c.cached_tokens += result.cached_tokens

    def _publish_done(self, handle: RequestHandle, end: RequestEnd) -> None:
        if not self.events.subscribed:  # the dashboard's and the simulation's
            return
        p, result = handle.placement, end.result
        self._runner.phase(p.request_id, "finished" if result else "failed", p.decode_worker,
                           end.why)
        # The event's schema has no "missing": a timing the request never had is 0.0.
        self.events.publish(RequestDone(
            ts=end.at, source="router", request_id=p.request_id, cluster=p.cluster,
            ttft_s=end.ttft_s or 0.0, tpot_s=end.tpot_s or 0.0, e2e_s=end.e2e_s,
            prompt_tokens=p.prompt_tokens, output_tokens=result.completion_tokens if result
            else 0, cached_tokens=result.cached_tokens if result else 0, ok=result is not None,
            error=end.why, trace_id="" if handle.trace is None else trace_id(handle.trace)))

    def _running(self) -> anyio.abc.TaskGroup:
        if self._group is None:
            raise NoWorkerAvailable("the router's scheduler is not running")
        return self._group

    def measure_links(self) -> None:
        """Each link's bandwidth estimated from its PrfaaS side's send counters (as the
        last status poll left them); the policy gets every estimate."""
        now = self.clock()
        for ends in self.config.links:
            estimate = self.links.measure(ends.name, now, self.workers.send_readings(ends.a))
            self.policy.observe(estimate)

    def observe_link(self, sample: LinkSample) -> None:
        self.links.observe(sample)
        self.policy.observe(sample)
        stall = self.config.kv_stall_s
        backlog_s = self.links.wire_time(sample.link, sample.queued_bytes)
        if stall > 0 and (not sample.up or backlog_s > stall):
            self._link_stalled(sample.link, backlog_s if sample.up else math.inf)

    def _link_stalled(self, link: str, backlog_s: float) -> None:
        """KV entering `link` now would wait longer than the stall bound (or the link is
        down): it takes no new offload for a while, and requests still waiting for KV over
        it move on (migrated by their runners as kv_stalled, re-prefilled in the PD
        cluster)."""
        self.links.hold_link(link, self.clock() + LINK_HOLD_STALLS * self.config.kv_stall_s)
        waiting = [h for h in self._active.values() if h.awaiting_kv and self._crosses(
            h.placement, link)]
        if waiting:
            why = "down" if math.isinf(backlog_s) else f"{backlog_s:.1f} s of queued bytes"
            log.warning("link %s cannot carry KV within kv_stall_s=%g (%s): moving %d "
                        "requests that wait for KV over it", link or "(unnamed)",
                        self.config.kv_stall_s, why, len(waiting))
        for handle in waiting:
            handle.interrupt()

    async def _watch_silence(self) -> None:
        """Moves on, every fraction of `silence_s`, the requests stuck on a silent worker."""
        while True:
            await native.sleep(self.config.silence_s / SILENCE_CHECKS)
            self.move_off_silent()

    def move_off_silent(self) -> None:
        """A worker that answers no status poll (the control loop's `poll` marked it down)
        while a request's attempt on it made no progress for `silence_s` is hung, not slow:
        the attempt is interrupted as that worker lost (services/router/requests.py
        `silence`), so the runner migrates the request as for a crash, and the worker stays
        out of placement until it answers a poll again."""
        silent = self.workers.down()
        if not silent:
            return
        now, bound = self.clock(), self.config.silence_s
        for handle in list(self._active.values()):
            broken = silence(handle, silent, now, bound)
            if broken is not None:
                log.warning("request %s: %s", handle.placement.request_id, broken.message)
                handle.interrupt(broken)

    def _crosses(self, p: Placement, link: str) -> bool:
        between = self.links.between(self.workers.cluster_of(p.prefill_worker),
                                     self.workers.cluster_of(p.decode_worker))
        return p.cluster == "prfaas" and between in (link, "")

    def active(self) -> list[Placement]:
        return [h.placement for h in self._active.values()]

    def statistics(self) -> SchedulerStatistics:
        c, placed, runner = self._counts, self.placer.counts, self._runner.statistics()
        return SchedulerStatistics(
            admitted=c.admitted, rejected_full=c.rejected_full + placed.rejected_full,
            rejected_no_worker=placed.rejected_no_worker, completed=c.completed,
            failed=c.failed, cancelled=c.cancelled, inflight=len(self._active),
            to_prfaas=c.to_prfaas, to_pd=c.admitted - c.to_prfaas,
            lookup_failures=placed.lookup_failures,
            prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
            cached_tokens=c.cached_tokens, finish_reasons=dict(c.finish_reasons),
            admission_limit=self.admission_limit(),
            migrations=runner.migrations, migrations_gave_up=runner.gave_up,
            migrations_resumed=runner.resumed, migration_resume_s=runner.resume_s)

    def check_integrity(self) -> None:
        c = self._counts
        done = c.completed + c.failed + c.cancelled
        if c.admitted != done + len(self._active):
            raise AssertionError(f"admitted {c.admitted} != finished {done} + in flight "
                                 f"{len(self._active)}")
        self.workers.check_integrity([(p.prefill_worker, p.decode_worker)
                                      for p in self.active()])


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
    finish_reasons: dict[str, int] = {}  # completed requests by finish reason
    # What admission allows now: max_inflight, or less if the decode workers hold fewer.
    admission_limit: int = 0
    migrations: dict[str, int] = {}  # requests continued elsewhere, by reason
    migrations_gave_up: int = 0  # requests that broke past migration_limit
    migrations_resumed: int = 0  # continued attempts that streamed a token
    migration_resume_s: float = 0.0  # their summed time from the break to that token


class SchedulerCollector(Collector):
    """/metrics: the scheduler's, the policy's and the workers' statistics, read at scrape."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._migrations()
        yield from self._policy()
        yield from self._workers()

    def _requests(self) -> Iterator[Metric]:
        stats = self._scheduler.statistics()
        requests = CounterMetricFamily("prfaas_router_requests", "Requests by outcome, the "
                                       "completed by finish_reason too", labels=["outcome"])
        for outcome in ("admitted", "failed", "cancelled", "rejected_full",
                        "rejected_no_worker"):
            requests.add_metric([outcome], getattr(stats, outcome))
        # Only a completed request has a finish reason: its samples alone carry the label
        # (Prometheus reads an absent label as an empty one, so `sum by (outcome)` holds).
        for reason in dict.fromkeys([*FINISH_REASONS, *stats.finish_reasons]):
            requests.add_sample("prfaas_router_requests_total", {
                "outcome": "completed", "finish_reason": reason},
                stats.finish_reasons.get(reason, 0))
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
        """Requests continued elsewhere after their data path broke (RequestRunner)."""
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
            queue.add_metric([view.name], view.backlog)
        yield from (up, queue)



def _end_trace(span: Span, p: Placement, end: RequestEnd) -> None:
    """Ends a request's span with where it ran and how it ended (`end`: the same TTFT the
    router's histogram observed)."""
    result, error = end.result, end.error
    span.set_attributes({"prfaas.cluster": p.cluster, "prfaas.attempts": p.attempt + 1})
    if end.ttft_s is not None:
        span.set_attribute("gen_ai.latency.time_to_first_token", end.ttft_s)
    if result is not None:
        span.set_attributes({"gen_ai.usage.output_tokens": result.completion_tokens,
                             "gen_ai.response.finish_reasons": [result.finish_reason],
                             "prfaas.cached_tokens": result.cached_tokens})
    if error is not None:
        failed(span, error.message)
    span.end()
