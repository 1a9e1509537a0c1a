"""The router's scheduler: one scheduling step per request (lookup, policy decision,
placement), the worker table and the link state that step reads, and the task that runs the
request over the mesh to its last token.

One request, in `submit` (before any byte goes to the client, so errors keep their status):
1. admission: at most `max_inflight` requests at once, and no more than the decode workers
   can hold (the sum of their reported `max_streams`), else `QueueFull` (429, Retry-After);
2. prefix block hashes of the prompt (services.contract.prefix), then the cache directory's
   longest cached prefix per worker (a `PrefixQuery` to the `cachedir` service; if it does not
   answer in time the request goes on as if nothing were cached, and that is counted);
3. the policy decides the cluster (services/router/policies.py), placement picks the prefill
   worker in it and the decode worker in the PD cluster (`choose_worker`, below), and the
   decision is published as a `RoutingDecision` with every input and the reason.
Then a task owned by the scheduler runs it (`_serve`, with the `RequestRunner` of
services/router/requests.py): the decode worker's token stream beside the prefill call, the
tokens into the request's outbox. Cancelling the handle (the client left) cancels the task:
the decode stream is aborted at its worker (an Abort frame), and the prefill call is given up.

A request whose data path breaks is continued by the runner (migration, at most
`migration_limit` times); `_replace` places its next attempt: the policy decides again for
the prompt and the tokens already streamed, or the runner names the kind of cluster, away
from the workers that failed it. When no prefill worker of the chosen kind of cluster serves,
a request (new or migrated) prefills in the other kind instead, if its link is up, rather
than failing with 503. A link whose KV stalled is taken out of the policy's choices for
`LINK_HOLD_STALLS` stall bounds; so is a link whose queued bytes would take longer than the
stall bound to cross (its link samples' queued bytes at the router's estimate of its
bandwidth) or that is down, and the requests still
waiting for KV over it are moved on at once (`_link_stalled`). A worker that hangs (alive,
silent) breaks no connection: once it answers no status poll, a request whose attempt made
no progress on it for `silence_s` is moved on as if it had died (`move_off_silent`).

Several PrfaaS and PD clusters: the decode worker is chosen first (its cluster is the
request's PD cluster); the inputs hold each PrfaaS cluster's cache, queue and own link
(`PrfaasSite`), and the policy narrows them to one (`Policy.narrow`). When the decision
resumes from a prefix the chosen prefill worker lacks (the abundant rule counted a cache in
another cluster, or placement chose a worker without it), the prefill request names the
worker that holds it (`PrefixPull`) and the prefill worker fetches it first
(services/worker/prefix_pull.py), so the prefix a decision counts is the one the worker
resumes from.

The worker table (`WorkerTable`): per worker its cluster, its current role, whether it is
draining or converting, whether it answers, and the loads the router itself counts (it sees
every request): a prefill worker's queue is its requests not yet prefilled; a decode worker's
running count is its open token streams. Every reader (placement, the policy's control loops,
GET /admin/state) gets the same record of a worker, a `WorkerSnapshot`. The control loops
(services/router/control.py) keep the table current with `poll` and act on its entries. A
worker whose model has another KV block size than the router's is refused at its first
status poll (`ModelMismatch`): prefix hashes would never match and the cached lengths the
router sends (`decode_has_tokens`) would point mid-block.

Placement, the choice of a worker inside a cluster: cache-affine first, then least loaded.
The paper leaves decode-node choice open (docs/paper-notes.md section 2.4, "Not specified")
and picks "the cache-affine node" for prefill (section 3.2). Rule, for either role:
1. candidates are the workers of that role (a draining worker takes nothing new); a worker at
   its `capacity` is skipped unless every one is;
2. affinity is allowed only among workers whose load (queue + running) is at most the least
   load plus `max_affinity_excess`: the load cap, so a hot prefix cannot pile every request
   onto one worker (SGLang's cache-aware router has the same guard: above a load imbalance it
   goes least loaded; docs/prior-work.md section 7);
3. among those, the longest cached prefix wins; ties go to the least loaded, then by name.
For decode the cached prefix is what the worker *holds* (any held KV block saves a transfer);
for prefill it is what it can *resume from* (services/cachedir/service.py,
blocks_resumable). `choose_worker_reference` is the same rule as a plain sort, for the tests.

The links (`LinkBook`): once per tick the control loop (services/router/control.py) has the
scheduler estimate each link's bandwidth from what its senders saw of their own transfers
(services/router/link_meter.py; never the line's configured rate), and samples what the
transport tells of it (up, stalls, queued bytes); the scheduler keeps the latest of each per
link, so that each PrfaaS cluster is judged by its own link to the request's PD cluster.

`SchedulerCollector` is the router's /metrics view of the scheduler's, the policy's and the
workers' statistics, read at scrape time.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh import native
from mesh.errors import ConfigError, MeshError
from mesh.events import EventBus
from mesh.node import Node
from mesh.topology import Topology
from services.contract.events import MIGRATION_REASONS, Event, RequestDone, attempt_id
from services.contract.messages import (
    DEFAULT_LANES,
    PrefixMatch,
    PrefixPull,
    PrefixQuery,
    PrefixReply,
    StatusQuery,
    WorkerState,
)
from services.contract.prefix import block_hashes, reusable_blocks
from services.contract.tracing import Tracer, event_attributes, failed, trace_id
from services.contract.types import Cluster, Role, WorkerRole
from services.model.tokenizer import TokenizerLike
from services.router.config import LinkEnds, SchedulerConfig
from services.router.errors import (
    NotFound,
    NoWorkerAvailable,
    QueueFull,
)
from services.router.link_meter import (
    BandwidthEstimator,
    EstimatorConfig,
    LinkEstimate,
    readings_of,
)
from services.router.policies import (
    ClusterState,
    Decision,
    LinkSample,
    Policy,
    PolicyError,
    PrfaasSite,
    RequestFinished,
    RouteInputs,
    WorkerSnapshot,
    decision_event,
)
from services.router.requests import (
    GenerationRequest,
    Migration,
    Placement,
    RequestEnd,
    RequestHandle,
    RequestIds,
    RequestMetrics,
    RequestRunner,
    silence,
)
from services.service import WORKER_KINDS

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

# After KV stalled on a link, the link takes no new offload for this many stall bounds (a
# stalled link costs each request sent over it a bound's wait).
LINK_HOLD_STALLS = 3.0
# The silent-worker watch looks this many times per silence bound (`_watch_silence`).
SILENCE_CHECKS = 5
# The finish reasons /metrics always shows for completed requests, at 0 until one is seen (the
# decode worker's "stop" and "length", services/model/batch.py), so a rate over them exists
# from the first scrape; any other reason a worker sends is shown once seen.
FINISH_REASONS = ("stop", "length")


@dataclass
class _Counts:
    admitted: int = 0
    rejected_full: int = 0
    rejected_no_worker: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    to_prfaas: int = 0
    lookup_failures: int = 0
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
        self._directory = directory
        self.policy = policy
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
        self._directory_answers = True
        self._placing = 0
        self._runner = RequestRunner(node, workers.prefilled, tokenizer, self.config,
                                     self.events, clock, self._replace, tracer=tracer)
        self.metrics = RequestMetrics()

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
        placement, inputs = await self._placement(request_id, request.prompt, trace=trace)
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

    async def _replace(self, handle: RequestHandle, migration: Migration) -> Placement:
        """Places a migrated request's next attempt (`RequestRunner`) and moves the
        request's share of the worker table there; NoWorkerAvailable when nothing can take
        it (the request's placement is then unchanged)."""
        old = handle.placement
        if migration.worker_lost:
            self.workers.lost(migration.failed_worker)
        if migration.reason == "kv_stalled":
            self._hold_link(old)
        placed, _ = await self._placement(old.request_id, migration.prompt, migration,
                                          handle.migration_trace)
        self.workers.released(old.decode_worker)
        self.workers.dispatched(placed.prefill_worker, placed.decode_worker)
        handle.placement = placed
        self._runner.phase(old.request_id, "queued", placed.prefill_worker,
                           f"migrated ({migration.reason}): {placed.decision.reason}")
        return placed

    async def _placement(self, request_id: str, prompt: list[int],
                         migration: Migration | None = None, trace: Span | None = None
                         ) -> tuple[Placement, RouteInputs]:
        """Where `prompt` runs: the decision, the workers, and the inputs decided on. A
        migration names the workers to avoid and may name the kind of cluster. With
        `trace`, the lookup and the decision are its child spans."""
        attempt = migration.attempt if migration else 0
        avoid = migration.avoid if migration else frozenset()
        hashes = self._reusable_hashes(prompt)
        if trace is not None and self.tracer is not None:
            with self.tracer.span("cachedir.lookup", trace, {"prfaas.lookup.blocks": len(
                    hashes)}) as lookup:
                match = await self._lookup(hashes)
                lookup.set_attribute("prfaas.lookup.answered", match is not None or not hashes)
            with self.tracer.span("policy", trace) as decided:
                placement, inputs = self._decided(request_id, prompt, migration, attempt,
                                                  avoid, hashes, match)
                decided.set_attributes(event_attributes(decision_event(
                    inputs, placement.decision, policy=self.policy.name,
                    prefill_worker=placement.prefill_worker,
                    decode_worker=placement.decode_worker, ts=0.0), "prfaas.decision"))
            return placement, inputs
        match = await self._lookup(hashes)
        return self._decided(request_id, prompt, migration, attempt, avoid, hashes, match)

    def _decided(self, request_id: str, prompt: list[int], migration: Migration | None,
                 attempt: int, avoid: frozenset[str], hashes: list[int],
                 match: PrefixMatch | None) -> tuple[Placement, RouteInputs]:
        """The policy's decision and placement for `prompt`, given the lookup's `match`."""
        decode = self._choose_decode(match, avoid)
        inputs = self.policy.narrow(self._inputs(attempt_id(request_id, attempt), len(prompt),
                                                 match, self.workers.cluster_of(decode)))
        if migration is None or migration.cluster is None:
            decision = self.policy.decide(inputs)
        else:
            decision = _placed_in(inputs, migration.cluster, f"migrated ({migration.reason})")
        decision, prefill = self._choose_prefill(decision, inputs, match, avoid)
        return Placement(
            request_id=request_id, cluster=decision.cluster, prefill_worker=prefill,
            decode_worker=decode, prompt_tokens=len(prompt),
            cached_tokens=decision.resume_prefix, decision=decision,
            decode_has_tokens=self.workers.held_blocks(decode, match) * self.config.block_size,
            pull=self._pull(decision, prefill, match), attempt=attempt,
            lanes=self._lanes(decision.cluster, prefill), hashes=hashes), inputs

    def _lanes(self, kind: Cluster, prefill: str) -> int:
        """Connections for the prefill's KV stream: one within a cluster."""
        return min(self.config.connections, self.workers.lanes(prefill)) if kind == "prfaas" \
            else 1

    def _hold_link(self, stalled: Placement) -> None:
        """The link the stalled KV crossed takes no new offload for a while."""
        until = self.clock() + LINK_HOLD_STALLS * self.config.kv_stall_s
        self.links.hold(self.workers.cluster_of(stalled.prefill_worker),
                        self.workers.cluster_of(stalled.decode_worker), until)

    def _reusable_hashes(self, prompt: list[int]) -> list[int]:
        # Only blocks strictly below the last token are asked for: every cached length the
        # decision, placement and `decode_has_tokens` derive from the match stays below it.
        bs = self.config.block_size
        return block_hashes(prompt[: reusable_blocks(len(prompt), bs) * bs], bs)

    def _choose_decode(self, match: PrefixMatch | None, avoid: frozenset[str]) -> str:
        if self.workers.decode_full():
            self._reject_full("every decode worker holds as many streams as it can")
        try:
            return choose_decode_worker([
                c for c in self.workers.decode_candidates(match, self.config.block_size)
                if c.name not in avoid])
        except PlacementError as exc:
            self._counts.rejected_no_worker += 1
            raise NoWorkerAvailable(f"no worker can serve this request: {exc}",
                                    code="no_worker") from exc

    def _choose_prefill(self, decision: Decision, inputs: RouteInputs,
                        match: PrefixMatch | None,
                        avoid: frozenset[str]) -> tuple[Decision, str]:
        """The prefill worker in the decided kind of cluster, else in the other kind (the
        decision moved there, if that kind can take KV to the decode worker)."""
        kinds: tuple[Cluster, Cluster] = (decision.cluster, _other(decision.cluster))
        failures = []
        for kind in kinds:
            if kind == "prfaas" and not inputs.prfaas_available:
                failures.append("the PrfaaS cluster is unavailable")
                continue
            try:
                worker = choose_prefill_worker([
                    c for c in self.workers.prefill_candidates(
                        kind, match, self.config.block_size, self._cluster(kind, inputs))
                    if c.name not in avoid])
            except PlacementError as exc:
                failures.append(str(exc))
                continue
            if kind == decision.cluster:
                return decision, worker
            return _placed_in(inputs, kind, f"{decision.reason}; no {decision.cluster} "
                              f"prefill worker serves ({failures[0]})"), worker
        self._counts.rejected_no_worker += 1
        raise NoWorkerAvailable(f"no worker can serve this request: {'; '.join(failures)}",
                                code="no_worker")

    def _cluster(self, kind: Cluster, inputs: RouteInputs) -> str | None:
        name = inputs.prfaas_cluster if kind == "prfaas" else inputs.pd_cluster
        # Inputs built without cluster names (by hand, in tests) place in the kind at large.
        return name if name in self.workers.clusters(kind) else None

    def _pull(self, decision: Decision, prefill: str,
              match: PrefixMatch | None) -> PrefixPull | None:
        """Where `prefill` gets the prefix the decision resumes from, if it lacks it."""
        bs = self.config.block_size
        want = decision.resume_prefix // bs
        if want <= self.workers.resumable_of(prefill, match):
            return None
        holder = self.workers.holder(match, want, exclude=prefill)
        if holder is None:
            return None
        across = self.workers.cluster_of(holder) != self.workers.cluster_of(prefill)
        lanes = min(self.config.connections, self.workers.lanes(holder)) if across else 1
        return PrefixPull(holder=holder, tokens=want * bs, connections=lanes)

    async def _lookup(self, hashes: list[int]) -> PrefixMatch | None:
        if not hashes:
            return None
        try:
            reply = await self._ask_directory(PrefixQuery(hashes))
        except MeshError as exc:
            self._counts.lookup_failures += 1
            # Logged once per outage: every request fails the same way while it lasts.
            if self._directory_answers:
                log.warning("cache directory lookups fail, routing as uncached: %s", exc)
            self._directory_answers = False
            return None
        self._directory_answers = True
        return reply.match

    async def _ask_directory(self, query: PrefixQuery) -> PrefixReply:
        if self._directory is None:
            return await self.node.call(self.config.cachedir, query, PrefixReply,
                                        timeout=self.config.lookup_timeout_s)
        # In process (`DirectoryReader`): answered at once, with no checkpoint for a reply
        # (a scheduler pass per request); the records are those of the call (tests/test_sim.py).
        return self._directory(query)

    def _inputs(self, request_id: str, total: int, match: PrefixMatch | None,
                pd: str) -> RouteInputs:
        # A prefill computes at least one token: a cached prefix counts up to the last block
        # boundary before the prompt's end, as far as the worker can resume.
        bs = self.config.block_size
        cap = (total - 1) // bs * bs
        sites = tuple(self._site(name, pd, match, cap)
                      for name in self.workers.clusters("prfaas"))
        first = sites[0] if sites else PrfaasSite(name="prfaas", available=False)
        return RouteInputs(
            request_id=request_id, total_len=total, cached_prfaas=first.cached,
            cached_pd=min(cap, self.workers.resumable_blocks("pd", match, pd) * bs),
            link_utilisation=first.link_utilisation, link_stalls=first.link_stalls,
            queue_prfaas=first.queue, queue_pd=self.workers.prefill_queue("pd", pd),
            prfaas_available=first.available, now=self.clock(), prfaas_cluster=first.name,
            pd_cluster=pd, prfaas_sites=sites)

    def _site(self, name: str, pd: str, match: PrefixMatch | None, cap: int) -> PrfaasSite:
        """One PrfaaS cluster's cache, queue and link to the PD cluster `pd`."""
        link = self.links.sample(name, pd)
        return PrfaasSite(
            name=name,
            cached=min(cap, self.workers.resumable_blocks("prfaas", match, name)
                       * self.config.block_size),
            queue=self.workers.prefill_queue("prfaas", name),
            link_utilisation=self.links.utilisation(name, pd),
            link_stalls=self.links.recent_stalls(name, pd),
            available=self.workers.has_prefill("prfaas", name) and (link is None or link.up)
            and not self.links.held(name, pd, self.clock()))

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
        self.metrics.finished(handle, end)
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
        c, runner = self._counts, self._runner.statistics()
        return SchedulerStatistics(
            admitted=c.admitted, rejected_full=c.rejected_full,
            rejected_no_worker=c.rejected_no_worker, completed=c.completed, failed=c.failed,
            cancelled=c.cancelled, inflight=len(self._active), to_prfaas=c.to_prfaas,
            to_pd=c.admitted - c.to_prfaas, lookup_failures=c.lookup_failures,
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
        self.workers.check_integrity(self.active())


def _other(kind: Cluster) -> Cluster:
    return "pd" if kind == "prfaas" else "prfaas"


def _placed_in(inputs: RouteInputs, kind: Cluster, why: str) -> Decision:
    """A decision that prefills in `kind` whatever the policy's rule says: a migration's, or
    a request whose decided kind of cluster has no prefill worker serving. Each cluster's own
    cache counts (no cache moves for it)."""
    cached = inputs.cached_pd if kind == "pd" else inputs.cached_prfaas
    return Decision(cluster=kind, counted_prefix=cached, incremental_len=inputs.total_len - cached,
                    resume_prefix=cached, threshold=None, bandwidth_scarce=True,
                    cross_cluster_cache_transfer=False, reason=f"{why}: prefill in {kind}")


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



# A worker's state read in this process, not polled over the mesh: the simulation, whose
# workers all run in the router's event loop, reads each one's `WorkerService.state()` (what
# the status handler answers) at the same instant, without two messages and a task per
# worker each tick. Raises MeshError where the worker could not have answered.
StatusReader = Callable[[str], WorkerState]
# The cache directory asked in this process, not called over the mesh: the simulation, whose
# directory runs in the router's event loop, answers each lookup from it (its
# `CacheDirService.lookup`) without a call, a reply and a handler per request.
DirectoryReader = Callable[[PrefixQuery], PrefixReply]
class ModelMismatch(ConfigError):
    """A worker runs a model whose KV block size differs from the router's `block_size`."""


class WorkerTableStatistics(msgspec.Struct, frozen=True):
    workers: tuple[WorkerSnapshot, ...]

    @property
    def up(self) -> int:
        return sum(w.up for w in self.workers)


@dataclass
class WorkerEntry:
    """The table's bookkeeping of one worker: its snapshot as the topology gave it (`spec`),
    the role it serves, the flags the control loops set, the router's counts of its requests
    and its last status report; `snapshot` is what every reader gets."""

    spec: WorkerSnapshot
    role: Role
    draining: bool = False  # the router sends it nothing new
    converting: bool = False
    up: bool = True  # optimistic until a status poll fails
    prefills: int = 0
    decodes: int = 0
    polled: WorkerState | None = None

    @property
    def serving(self) -> bool:
        remote_draining = self.polled is not None and self.polled.draining
        return self.up and not (self.draining or self.converting or remote_draining)

    @property
    def shown_role(self) -> WorkerRole:
        return "draining" if self.draining or self.converting else self.role

    def snapshot(self, cached_prefix_tokens: int = 0) -> WorkerSnapshot:
        """The worker now; `cached_prefix_tokens`: its prefix of a request being placed."""
        s, role = self.spec, self.role
        prefill = role == "prefill"
        return WorkerSnapshot(
            name=s.name, kind=s.kind, cluster=s.cluster, up=self.up, lanes=s.lanes,
            role="draining" if self.draining or self.converting else role,
            queue=self.prefills if prefill else 0, running=0 if prefill else self.decodes,
            waiting=0 if prefill else _polled_queue(self), converting=self.converting,
            cached_prefix_tokens=cached_prefix_tokens)


class WorkerTable:
    """Every prefill and decode worker the router may use (module docstring)."""

    def __init__(self, specs: Sequence[WorkerSnapshot]) -> None:
        """`specs`: each worker as the topology gives it (name, cluster, kind, first role,
        lanes)."""
        self._workers: dict[str, WorkerEntry] = {}
        for spec in specs:
            if spec.name in self._workers:
                raise ConfigError(f"worker {spec.name!r} is listed twice")
            if spec.role == "decode" and spec.kind != "pd":
                raise ConfigError(f"decode worker {spec.name!r} must be in a PD cluster, "
                                 f"got kind {spec.kind!r}")
            if spec.role == "draining":
                raise ConfigError(f"worker {spec.name!r} must start as prefill or decode, "
                                  "got draining")
            self._workers[spec.name] = WorkerEntry(spec, spec.role)

    @classmethod
    def from_topology(cls, topology: Topology) -> WorkerTable:
        """Services of kind prefill/decode; a cluster's kind ("prfaas" or "pd") tells which."""
        specs = []
        for service in topology.services:
            if service.kind in WORKER_KINDS:
                kind = topology.cluster_kind(service)
                if kind not in ("prfaas", "pd"):
                    raise ConfigError(f"worker {service.name!r}: cluster {service.cluster!r} "
                                     f"must be of kind prfaas or pd, got {kind!r}")
                lanes = topology.options_of(service).get("connections", DEFAULT_LANES)
                specs.append(WorkerSnapshot(
                    name=service.name, cluster=service.cluster, kind=kind,  # type: ignore[arg-type]
                    role=service.kind, lanes=int(lanes)))  # type: ignore[arg-type]
        return cls(specs)

    @property
    def names(self) -> list[str]:
        return list(self._workers)

    def get(self, name: str) -> WorkerEntry:
        worker = self._workers.get(name)
        if worker is None:
            raise NotFound(f"no worker named {name!r}; known: {', '.join(self._workers)}",
                           param="name")
        return worker

    def _serving(self, kind: Cluster, role: Role, cluster: str | None = None
                 ) -> list[WorkerEntry]:
        return [w for w in self._workers.values()
                if w.spec.kind == kind and w.role == role and w.serving
                and cluster in (None, w.spec.cluster)]

    def clusters(self, kind: Cluster) -> list[str]:
        """The names of the clusters of `kind` that hold workers, in topology order."""
        return list(dict.fromkeys(w.spec.cluster for w in self._workers.values()
                                  if w.spec.kind == kind))

    def cluster_of(self, name: str) -> str:
        return self.get(name).spec.cluster

    @staticmethod
    def _blocks(match: PrefixMatch | None) -> dict[str, tuple[int, int]]:
        if match is None:
            return {}
        return {w.worker: (w.blocks_held, w.blocks_resumable) for w in match.workers}

    def prefill_candidates(self, kind: Cluster, match: PrefixMatch | None,
                           block_size: int, cluster: str | None = None
                           ) -> list[WorkerSnapshot]:
        """Serving prefill workers of `kind` (in `cluster`, if named); their cached prefix is
        what they can resume."""
        blocks = self._blocks(match)
        return [w.snapshot(blocks.get(w.spec.name, (0, 0))[1] * block_size)
                for w in self._serving(kind, "prefill", cluster)]

    def decode_candidates(self, match: PrefixMatch | None,
                          block_size: int) -> list[WorkerSnapshot]:
        """Serving decode workers with room for one more stream; their cached prefix is the
        KV they hold."""
        blocks = self._blocks(match)
        return [w.snapshot(blocks.get(w.spec.name, (0, 0))[0] * block_size)
                for w in self._serving("pd", "decode") if not _full(w)]

    def decode_full(self) -> bool:
        """Whether decode workers serve, and every one holds as many streams as it said it
        can (`WorkerState.max_streams`)."""
        serving = self._serving("pd", "decode")
        return bool(serving) and all(_full(w) for w in serving)

    def decode_capacity(self) -> int | None:
        """Streams the serving decode workers can hold together; None until one has said."""
        said = [w.polled.max_streams for w in self._serving("pd", "decode")
                if w.polled is not None and w.polled.max_streams > 0]
        return sum(said) if said else None

    def resumable_blocks(self, kind: Cluster, match: PrefixMatch | None,
                         cluster: str | None = None) -> int:
        """The longest prefix a serving prefill worker of `kind` (in `cluster`, if named) can
        resume from (blocks)."""
        blocks = self._blocks(match)
        return max((blocks.get(w.spec.name, (0, 0))[1]
                    for w in self._serving(kind, "prefill", cluster)), default=0)

    def resumable_of(self, name: str, match: PrefixMatch | None) -> int:
        """The prefix (blocks) worker `name` can resume from."""
        return self._blocks(match).get(name, (0, 0))[1]

    def holder(self, match: PrefixMatch | None, blocks: int, exclude: str) -> str | None:
        """A live worker other than `exclude` that can resume `blocks` blocks (to push them
        to another worker): prefill workers first, then the least busy."""
        have = self._blocks(match)
        holders = [w for w in self._workers.values() if w.up and w.spec.name != exclude
                   and have.get(w.spec.name, (0, 0))[1] >= blocks]
        best = min(holders, key=lambda w: (w.role != "prefill", w.prefills + w.decodes,
                                           w.spec.name), default=None)
        return best.spec.name if best else None

    def lanes(self, name: str) -> int:
        return self.get(name).spec.lanes

    def held_blocks(self, name: str, match: PrefixMatch | None) -> int:
        return self._blocks(match).get(name, (0, 0))[0]

    def send_readings(self, cluster: str) -> dict[str, tuple[int, float]]:
        """Each worker of `cluster`'s KV send counters, from its last status report."""
        return readings_of({w.spec.name: w.polled for w in self._workers.values()
                            if w.spec.cluster == cluster})

    def prefill_queue(self, kind: Cluster, cluster: str | None = None) -> int:
        return sum(w.prefills for w in self._workers.values()
                   if w.spec.kind == kind and w.role == "prefill"
                   and cluster in (None, w.spec.cluster))

    def ready(self) -> bool:
        """Whether any request can be served: a decode worker and, in each kind of cluster
        that has prefill workers, a prefill worker serve, each having answered a status poll
        (until the first poll, `up` is only a guess). A short prompt needs the PD cluster's
        prefill and a long one the PrfaaS cluster's: one of them alone is not ready."""
        answering = [w for w in self._workers.values() if w.serving and w.polled is not None]
        kinds = {w.spec.kind for w in self._workers.values() if w.spec.role == "prefill"}
        return any(w.role == "decode" for w in answering) and all(
            any(w.role == "prefill" and w.spec.kind == kind for w in answering)
            for kind in kinds)

    def has_prefill(self, kind: Cluster, cluster: str | None = None) -> bool:
        return bool(self._serving(kind, "prefill", cluster))

    def dispatched(self, prefill: str, decode: str) -> None:
        self._workers[prefill].prefills += 1
        self._workers[decode].decodes += 1

    def prefilled(self, prefill: str) -> None:
        self._workers[prefill].prefills -= 1

    def released(self, decode: str) -> None:
        self._workers[decode].decodes -= 1

    def down(self) -> set[str]:
        """The workers that answered no status poll or whose connection broke (not up)."""
        return {name for name, worker in self._workers.items() if not worker.up}

    def lost(self, name: str) -> None:
        """A request's connection to `name` broke: it is down (placed nothing new) until it
        answers a status poll again."""
        worker = self._workers[name]
        if worker.up:
            log.warning("worker %s is down: a request's connection to it broke", name)
        worker.up = False

    async def poll(self, node: Node, timeout: float, block_size: int,
                   vocab_size: int | None = None, *, read: StatusReader | None = None) -> None:
        """Asks every worker for its state at once; one that does not answer is down.
        With `read`, each state is read in this process instead (`StatusReader`).

        Raises ModelMismatch if a worker's model has a KV block size other than `block_size`
        (the router's), or more tokens than the router's tokenizer (`vocab_size`) can turn
        back into text: it is refused before any request is placed by its report.
        """
        if read is None:
            async with anyio.create_task_group() as group:
                for worker in self._workers.values():
                    group.start_soon(self._poll_one, node, worker, timeout)
        else:
            # Read at once: no checkpoint stands in for the replies (tests/test_sim.py: the
            # records are those of polling over the mesh).
            for worker in self._workers.values():
                self._read_one(worker, read)
        check_block_size(self._workers.values(), block_size)
        if vocab_size is not None:
            check_vocab_size(self._workers.values(), vocab_size)

    async def _poll_one(self, node: Node, worker: WorkerEntry, timeout: float) -> None:
        try:
            state = await node.call(worker.spec.name, StatusQuery(), WorkerState,
                                    timeout=timeout)
        except MeshError as exc:
            self._silent(worker, exc)
            return
        self._answered(worker, state)

    def _read_one(self, worker: WorkerEntry, read: StatusReader) -> None:
        try:
            state = read(worker.spec.name)
        except MeshError as exc:
            self._silent(worker, exc)
            return
        self._answered(worker, state)

    @staticmethod
    def _silent(worker: WorkerEntry, exc: MeshError) -> None:
        # A worker that never answered is still starting (every worker, at `make demo`).
        if worker.up and worker.polled is None:
            log.info("worker %s is not up yet: %s", worker.spec.name, exc)
        elif worker.up:
            log.warning("worker %s is down: %s", worker.spec.name, exc)
        worker.up = False

    @staticmethod
    def _answered(worker: WorkerEntry, state: WorkerState) -> None:
        if not worker.up:
            log.info("worker %s is %s", worker.spec.name, "back" if worker.polled else "up")
        worker.up, worker.polled = True, state
        if not worker.converting:
            worker.role = state.role

    def state(self) -> ClusterState:
        """The workers as the policy's control loops see them."""
        return ClusterState(workers=self.snapshots())

    def snapshots(self) -> tuple[WorkerSnapshot, ...]:
        return tuple(w.snapshot() for w in self._workers.values())

    def statistics(self) -> WorkerTableStatistics:
        return WorkerTableStatistics(workers=self.snapshots())

    def check_integrity(self, active: Sequence[Placement]) -> None:
        for worker in self._workers.values():
            name = worker.spec.name
            decodes = sum(p.decode_worker == name for p in active)
            if worker.prefills < 0 or worker.decodes != decodes:
                raise AssertionError(f"worker {name}: prefills {worker.prefills}, decodes "
                                     f"{worker.decodes} != {decodes} open streams")
            if worker.prefills > sum(p.prefill_worker == name for p in active):
                raise AssertionError(f"worker {name}: {worker.prefills} prefills in flight "
                                     "exceed its active requests")


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


def _full(worker: WorkerEntry) -> bool:
    limit = worker.polled.max_streams if worker.polled is not None else 0
    return 0 < limit <= worker.decodes


def _polled_queue(worker: WorkerEntry) -> int:
    return worker.polled.queue_depth if worker.polled else 0


def check_block_size(workers: Iterable[WorkerEntry], block_size: int) -> None:
    """ModelMismatch naming every polled worker whose model block size is not `block_size`."""
    wrong = [f"{w.spec.name} runs {w.polled.model.family}/{w.polled.model.size} with block_size "
             f"{w.polled.model.block_size}" for w in workers
             if w.polled is not None and w.polled.model.block_size != block_size]
    if wrong:
        raise ModelMismatch(f"the router's block_size is {block_size}, but worker "
                            f"{'; '.join(wrong)}: prefix hashes and cached lengths would not "
                            "match; set the router option block_size to the workers' model "
                            "block size")


def check_vocab_size(workers: Iterable[WorkerEntry], vocab_size: int) -> None:
    """ModelMismatch naming every polled worker whose model can emit token ids the router's
    tokenizer (of `vocab_size` tokens) cannot decode."""
    wrong = [f"{w.spec.name} runs {w.polled.model.family}/{w.polled.model.size} with vocab_size "
             f"{w.polled.model.vocab_size}" for w in workers
             if w.polled is not None and w.polled.model.vocab_size > vocab_size]
    if wrong:
        raise ModelMismatch(f"the router's tokenizer has {vocab_size} tokens, but worker "
                            f"{'; '.join(wrong)}: its output could not be decoded; set the "
                            "router option tokenizer to match the workers' model")


class PlacementError(PolicyError):
    """No worker of the required role to choose from."""


class PlacementConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # How much busier than the least loaded worker a cache-affine worker may be. 4 requests:
    # a decode batch of BS_max = 20 (paper-derived, services/paper/hardware.py) absorbs that much
    # skew, while a hot prefix spreads once one worker runs 4 ahead.
    max_affinity_excess: int = 4

    def __post_init__(self) -> None:
        if self.max_affinity_excess < 0:
            raise PolicyError(f"max_affinity_excess must be >= 0, got "
                              f"{self.max_affinity_excess!r}")


DEFAULT_PLACEMENT = PlacementConfig()


def _eligible(candidates: Sequence[WorkerSnapshot], role: WorkerRole) -> list[WorkerSnapshot]:
    workers = [w for w in candidates if w.role == role]
    if not workers:
        names = ", ".join(f"{w.name} ({w.role})" for w in candidates) or "none"
        raise PlacementError(f"no {role} worker among candidates: {names}")
    open_workers = [w for w in workers if not w.full]
    return open_workers or workers


def choose_worker(candidates: Sequence[WorkerSnapshot], role: WorkerRole,
                  config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """The chosen worker's name (rule in the module docstring), in one pass."""
    workers = _eligible(candidates, role)
    cap = min(w.load for w in workers) + config.max_affinity_excess
    best: WorkerSnapshot | None = None
    for w in workers:
        if w.load <= cap and (best is None or (-w.cached_prefix_tokens, w.load, w.name)
                              < (-best.cached_prefix_tokens, best.load, best.name)):
            best = w
    assert best is not None
    return best.name


def choose_worker_reference(candidates: Sequence[WorkerSnapshot], role: WorkerRole,
                            config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """Slow, obvious reference: filter step by step, then sort by the whole key."""
    of_role = [w for w in candidates if w.role == role]
    if not of_role:
        raise PlacementError(f"no {role} worker among candidates")
    not_full = [w for w in of_role if not w.full] or of_role
    least = sorted(w.load for w in not_full)[0]
    allowed = [w for w in not_full if w.load - least <= config.max_affinity_excess]
    ranked = sorted(allowed, key=lambda w: w.name)
    ranked = sorted(ranked, key=lambda w: w.load)
    ranked = sorted(ranked, key=lambda w: w.cached_prefix_tokens, reverse=True)
    return ranked[0].name


def choose_decode_worker(candidates: Sequence[WorkerSnapshot],
                         config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """The decode worker for a request (candidates: the PD cluster's workers)."""
    return choose_worker(candidates, "decode", config)


def choose_prefill_worker(candidates: Sequence[WorkerSnapshot],
                          config: PlacementConfig = DEFAULT_PLACEMENT) -> str:
    """The prefill worker in the chosen cluster (candidates: that cluster's workers)."""
    return choose_worker(candidates, "prefill", config)


class LinkBook:
    """The latest sample of each link, its recent stalls (over `stall_window_s`), and the
    links held back from new offload after KV stalled on them (`hold`)."""

    def __init__(self, links: Sequence[LinkEnds], stall_window_s: float,
                 estimator: EstimatorConfig | None = None) -> None:
        self._ends = {(e.a, e.b): e.name for e in links}
        self._ends.update({(e.b, e.a): e.name for e in links})
        self.stall_window_s = stall_window_s
        self._estimators = {e.name: BandwidthEstimator(estimator, e.name) for e in links}
        self._samples: dict[str, LinkSample] = {}
        self._stalls: dict[str, deque[tuple[float, int]]] = {}
        self._held: dict[str, float] = {}  # link -> until when it takes no new offload

    def observe(self, sample: LinkSample) -> None:
        self._samples[sample.link] = sample
        history = self._stalls.setdefault(sample.link, deque())
        history.append((sample.now, sample.stalls))
        while history and history[0][0] < sample.now - self.stall_window_s:
            history.popleft()

    def measure(self, name: str, now: float,
                readings: Mapping[str, tuple[int, float]]) -> LinkEstimate:
        """Link `name`'s estimate after its senders' counters at `now` (link_meter.py)."""
        return self._estimators[name].observe(now, readings)

    def estimate(self, name: str) -> LinkEstimate | None:
        estimator = self._estimators.get(name)
        return estimator.last if estimator is not None else None

    def estimates(self) -> dict[str, LinkEstimate]:
        """Every link's latest estimate, by name."""
        return {name: e.last for name, e in self._estimators.items()}

    def wire_time(self, name: str, nbytes: int) -> float:
        """Seconds `nbytes` take to cross link `name` at its estimated bandwidth (0 while it
        has no estimate, or for a link not in the topology)."""
        estimate = self.estimate(name)
        if estimate is None or estimate.available_bps <= 0:
            return 0.0
        return 8.0 * nbytes / estimate.available_bps

    def utilisation(self, a: str, b: str) -> float:
        """The link between a and b: its senders' throughput over its estimated bandwidth."""
        estimate = self.estimate(self.between(a, b))
        return estimate.utilisation if estimate is not None else 0.0

    def between(self, a: str, b: str) -> str:
        """The name of the link joining clusters a and b ("" when none is known)."""
        return self._ends.get((a, b), "")

    def sample(self, a: str, b: str) -> LinkSample | None:
        """The latest sample of the link between a and b; an unnamed sample stands for any."""
        name = self.between(a, b)
        return self._samples.get(name) or self._samples.get("")

    def hold(self, a: str, b: str, until: float) -> None:
        """KV stalled on the link between a and b: it takes no new offload until `until`."""
        self.hold_link(self.between(a, b), until)

    def hold_link(self, name: str, until: float) -> None:
        self._held[name] = max(until, self._held.get(name, until))

    def held(self, a: str, b: str, now: float) -> bool:
        return self._held.get(self.between(a, b), now) > now

    def recent_stalls(self, a: str, b: str) -> int:
        name = self.between(a, b)
        history = self._stalls.get(name) or self._stalls.get("")
        return history[-1][1] - history[0][1] if history else 0
