"""The router's scheduler: places each request and runs it over the mesh to its last token.

One request, in `submit` (before any byte goes to the client, so errors keep their status):
1. admission: at most `max_inflight` requests at once, and no more than the decode workers
   can hold (the sum of their reported `max_streams`), else `QueueFull` (429, Retry-After);
2. prefix block hashes of the prompt (services.contract.prefix), then the cache directory's longest
   cached prefix per worker (a `PrefixQuery` to the `cachedir` service; if it does not answer
   in time the request goes on as if nothing were cached, and that is counted);
3. the policy decides the cluster (services.router.policy), placement picks the prefill worker in it
   and the decode worker in the PD cluster (services.router.workers), and the decision is
   published as a `RoutingDecision` with every input and the reason.
Then a task owned by the scheduler runs it (`_serve`, with services/router/runner.py): it
opens the decode worker's token stream (`DecodeRequest`) and calls the prefill worker
(`PrefillRequest`, which names the decode worker and the prefix it already holds, so only the
KV it lacks is sent), and feeds the tokens through a `TextAssembler` into the request's outbox
(services/router/requests.py). Cancelling the handle (the client left) cancels the task: the
decode stream is aborted at its worker (an Abort frame), and the prefill call is given up.

A request whose data path breaks is continued by the runner (migration, at most
`migration_limit` times); `_replace` places its next attempt: the policy decides again for
the prompt and the tokens already streamed, or the runner names the kind of cluster
(services/router/runner.py), away from the workers that failed it. When no prefill worker of
the chosen kind of cluster serves, a request (new or migrated) prefills in the other kind
instead, if its link is up, rather than failing with 503. A link whose KV stalled is taken
out of the policy's choices for `LINK_HOLD_STALLS` stall bounds; so is a link whose queued
bytes would take longer than the stall bound to cross (its link samples' `backlog_s`) or
that is down, and the requests still waiting for KV over it are moved on at once
(`_link_stalled`).

The control loops (services/router/control.py) feed it link samples (`observe_link`) and
keep its worker table (services/router/workers.py: roles, draining, liveness) current.

Several PrfaaS and PD clusters: the decode worker is chosen first (its cluster is the
request's PD cluster); the inputs hold each PrfaaS cluster's cache, queue and own link
(`PrfaasSite`), and the policy narrows them to one (`Policy.narrow`). When the decision
resumes from a prefix the chosen prefill worker lacks (the abundant rule counted a cache in
another cluster, or placement chose a worker without it), the prefill request names the
worker that holds it (`PrefixPull`) and the prefill worker fetches it first
(services/worker/prefix_pull.py), so the prefix a decision counts is the one the worker
resumes from.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from mesh.errors import MeshError
from mesh.events import EventBus
from mesh.node import Node
from services.contract.events import Event, RequestDone, attempt_id
from services.contract.messages import PrefixMatch, PrefixPull, PrefixQuery, PrefixReply
from services.contract.prefix import block_hashes, reusable_blocks
from services.contract.types import Cluster
from services.model.tokenizer import TokenizerLike
from services.router.config import SchedulerConfig
from services.router.errors import NoWorkerAvailable, QueueFull, RouterError, UpstreamFailed
from services.router.link import LinkBook
from services.router.metrics import RequestMetrics, SchedulerStatistics
from services.router.policy import (
    Decision,
    LinkSample,
    Policy,
    PrfaasSite,
    RequestFinished,
    RouteInputs,
    decision_event,
)
from services.router.requests import (
    Finished,
    GenerationRequest,
    Migration,
    Placement,
    RequestHandle,
    RequestIds,
)
from services.router.runner import RequestRunner
from services.router.workers import (
    PlacementError,
    WorkerTable,
    choose_decode_worker,
    choose_prefill_worker,
)

log = logging.getLogger(__name__)

# After KV stalled on a link, the link takes no new offload for this many stall bounds (a
# stalled link costs each request sent over it a bound's wait).
LINK_HOLD_STALLS = 3.0

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
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        self.node = node
        self.policy = policy
        self.workers = workers
        self.config = config or SchedulerConfig()
        self.events: EventBus[Event] = bus or EventBus()
        self.clock = clock
        self.tokenizer = tokenizer
        self.links = LinkBook(self.config.links, self.config.stall_window_s)
        self._active: dict[str, RequestHandle] = {}
        self._group: anyio.abc.TaskGroup | None = None
        self._ids = RequestIds(self.config.id_prefix)
        self._counts = _Counts()
        self._directory_answers = True
        self._placing = 0
        self._runner = RequestRunner(node, workers, tokenizer, self.config, self.events, clock,
                                     self._replace)
        self.metrics = RequestMetrics()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Owns every request task until cancelled."""
        async with anyio.create_task_group() as group:
            self._group = group
            try:
                task_status.started()
                await anyio.sleep_forever()
            finally:
                self._group = None

    def spawn(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Runs `work` in the scheduler's task group (admin actions that outlive a call)."""
        self._running().start_soon(work)

    async def submit(self, request: GenerationRequest) -> RequestHandle:
        """Places `request` and starts it; QueueFull / NoWorkerAvailable before it starts."""
        group = self._running()
        started = self.clock()
        self._admit()
        self._placing += 1
        try:
            handle = RequestHandle(await self._place(request), request)
        finally:
            self._placing -= 1
        handle.started = started
        handle.series = self.metrics.series(
            self.workers.cluster_of(handle.placement.prefill_worker), self.policy.name)
        self._active[handle.placement.request_id] = handle
        self.workers.dispatched(handle.placement.prefill_worker, handle.placement.decode_worker)
        self._counts.admitted += 1
        group.start_soon(self._serve, handle)
        return handle

    def admission_limit(self) -> int:
        """Requests admitted at once: `max_inflight`, or what the decode workers can hold."""
        capacity = self.workers.decode_capacity()
        limit = self.config.max_inflight
        return limit if capacity is None else min(limit, capacity)

    def _admit(self) -> None:
        # Requests still being placed count too: placing awaits the cache directory.
        limit, inflight = self.admission_limit(), len(self._active) + self._placing
        if inflight >= limit:
            self._reject_full(f"{inflight} requests in flight, the router's limit ({limit}: "
                              f"max_inflight={self.config.max_inflight}, decode capacity "
                              f"{self.workers.decode_capacity()})")

    def _reject_full(self, why: str) -> None:
        self._counts.rejected_full += 1
        raise QueueFull(f"{why}; retry later", code="queue_full")

    async def _place(self, request: GenerationRequest) -> Placement:
        request_id = self._ids.next()
        placement, inputs = await self._placement(request_id, request.prompt)
        decision = placement.decision
        self._counts.to_prfaas += decision.cluster == "prfaas"
        if self.events.subscribed:
            self.events.publish(decision_event(
                inputs, decision, policy=self.policy.name,
                prefill_worker=placement.prefill_worker,
                decode_worker=placement.decode_worker, ts=self.clock()))
        self._runner.phase(request_id, "queued", placement.prefill_worker, decision.reason)
        return placement

    async def _replace(self, handle: RequestHandle, migration: Migration) -> Placement:
        """Places a migrated request's next attempt (services/router/runner.py) and moves the
        request's share of the worker table there; NoWorkerAvailable when nothing can take
        it (the request's placement is then unchanged)."""
        old = handle.placement
        if migration.reason == "kv_stalled":
            self._hold_link(old)
        placed, _ = await self._placement(old.request_id, migration.prompt, migration)
        self.workers.released(old.decode_worker)
        self.workers.dispatched(placed.prefill_worker, placed.decode_worker)
        handle.placement = placed
        self._runner.phase(old.request_id, "queued", placed.prefill_worker,
                           f"migrated ({migration.reason}): {placed.decision.reason}")
        return placed

    async def _placement(self, request_id: str, prompt: list[int],
                         migration: Migration | None = None) -> tuple[Placement, RouteInputs]:
        """Where `prompt` runs: the decision, the workers, and the inputs decided on. A
        migration names the workers to avoid and may name the kind of cluster."""
        attempt = migration.attempt if migration else 0
        avoid = migration.avoid if migration else frozenset()
        match = await self._lookup(self._reusable_hashes(prompt))
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
            pull=self._pull(decision, prefill, match), attempt=attempt), inputs

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
            reply = await self.node.call(self.config.cachedir, PrefixQuery(hashes), PrefixReply,
                                         timeout=self.config.lookup_timeout_s)
        except MeshError as exc:
            self._counts.lookup_failures += 1
            # Logged once per outage: every request fails the same way while it lasts.
            if self._directory_answers:
                log.warning("cache directory lookups fail, routing as uncached: %s", exc)
            self._directory_answers = False
            return None
        self._directory_answers = True
        return reply.match

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
            link_utilisation=link.utilisation if link else 0.0,
            link_stalls=self.links.recent_stalls(name, pd),
            available=self.workers.has_prefill("prfaas", name) and (link is None or link.up)
            and not self.links.held(name, pd, self.clock()))

    async def _serve(self, handle: RequestHandle) -> None:
        """Runs one request to its end; its failure is the request's, never the router's."""
        try:
            with handle.scope:
                handle.result = await self._runner.run(handle)
        except RouterError as exc:
            handle.error = exc
        except MeshError as exc:
            handle.error = UpstreamFailed(f"request {handle.placement.request_id}: {exc}")
        except Exception as exc:
            log.exception("request %s failed in the router", handle.placement.request_id)
            handle.error = RouterError(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self._finish(handle)

    def _finish(self, handle: RequestHandle) -> None:
        p = handle.placement
        del self._active[p.request_id]
        self.workers.released(p.decode_worker)
        cancelled = handle.result is None and handle.error is None
        error = UpstreamFailed(f"request {p.request_id} was cancelled") if cancelled \
            else handle.error
        self._count(handle.result, cancelled)
        self.metrics.finished(handle, self.clock())
        handle.outbox.close(handle.result, error)
        self._publish_done(handle, cancelled)
        self.policy.observe(RequestFinished(
            request_id=p.request_id, cluster=p.cluster, now=self.clock(),
            ok=handle.result is not None, incremental_len=p.decision.incremental_len))

    def _count(self, result: Finished | None, cancelled: bool) -> None:
        c = self._counts
        if cancelled:
            c.cancelled += 1
        elif result is None:
            c.failed += 1
        else:
            c.completed += 1
            c.prompt_tokens += result.prompt_tokens
            c.completion_tokens += result.completion_tokens
            c.cached_tokens += result.cached_tokens

    def _publish_done(self, handle: RequestHandle, cancelled: bool) -> None:
        if not self.events.subscribed:  # the dashboard's and the simulation's
            return
        p, result, now = handle.placement, handle.result, self.clock()
        ttft = handle.first_token_at - handle.started if handle.first_token_at else 0.0
        e2e = now - handle.started
        out = result.completion_tokens if result else 0
        tpot = (e2e - ttft) / (out - 1) if out > 1 and ttft else 0.0
        error = "cancelled" if cancelled else (handle.error.message if handle.error else "")
        self._runner.phase(p.request_id, "finished" if result else "failed", p.decode_worker, error)
        self.events.publish(RequestDone(
            ts=now, source="router", request_id=p.request_id, cluster=p.cluster, ttft_s=ttft,
            tpot_s=tpot, e2e_s=e2e, prompt_tokens=p.prompt_tokens, output_tokens=out,
            cached_tokens=result.cached_tokens if result else 0, ok=result is not None,
            error=error))

    def _running(self) -> anyio.abc.TaskGroup:
        if self._group is None:
            raise NoWorkerAvailable("the router's scheduler is not running")
        return self._group

    def observe_link(self, sample: LinkSample) -> None:
        self.links.observe(sample)
        self.policy.observe(sample)
        stall = self.config.kv_stall_s
        if stall > 0 and (not sample.up or sample.backlog_s > stall):
            self._link_stalled(sample.link, sample.backlog_s if sample.up else math.inf)

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
            cached_tokens=c.cached_tokens, admission_limit=self.admission_limit(),
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
