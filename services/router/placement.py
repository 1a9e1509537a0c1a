"""Placement: where one request runs. The policy decides the cluster
(services/router/policy.py), and placement picks the prefill worker in it and the decode
worker in the PD cluster; a migrated request's next attempt is placed the same way, away from
the workers that failed it (`Migration`).

For a prompt (`Placer.place`): its prefix block hashes (services.contract.prefix), then the
cache directory's longest cached prefix per worker (a `PrefixQuery` to the `cachedir` service;
if it does not answer in time the request goes on as if nothing were cached, and that is
counted); then the decision and the workers. When no prefill worker of the chosen kind of
cluster serves, a request (new or migrated) prefills in the other kind instead, if its link is
up, rather than failing with 503. A link whose KV stalled is taken out of the policy's choices
for `LINK_HOLD_STALLS` stall bounds (`hold_link`).

Several PrfaaS and PD clusters: the decode worker is chosen first (its cluster is the
request's PD cluster); the inputs hold each PrfaaS cluster's cache, queue and own link
(`PrfaasSite`), and the policy picks the one (`Policy.pick_prfaas_site`). When the decision
resumes from a prefix the chosen prefill worker lacks (the abundant rule counted a cache in
another cluster, or placement chose a worker without it), the prefill request names the
worker that holds it (`PrefixPull`) and the prefill worker fetches it first
(services/worker/prefix_pull.py), so the prefix a decision counts is the one the worker
resumes from.

The choice of a worker inside a cluster: cache-affine first, then least loaded. The paper
leaves decode-node choice open (docs/paper-notes.md section 2.4, "Not specified") and picks
"the cache-affine node" for prefill (section 3.2). Rule, for either role:
1. candidates are the workers of that role (a draining worker takes nothing new); a worker at
   its `capacity` is skipped unless every one is;
2. affinity is allowed only among workers whose load (queue + running) is at most the least
   load plus `max_affinity_excess`: the load cap, so a hot prefix cannot pile every request
   onto one worker (SGLang's cache-aware router has the same guard: above a load imbalance it
   goes least loaded; docs/prior-work.md section 7);
3. among those, the longest cached prefix wins; ties go to the least loaded, then by name.
For decode the cached prefix is what the worker *holds* (any held KV block saves a transfer);
for prefill it is what it can *resume from* (services/cachedir/directory.py,
blocks_resumable). `choose_worker_reference` is the same rule as a plain sort, for the tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from mesh.errors import MeshError
from mesh.node import Node
from services.contract.events import MigrationReason, attempt_id
from services.contract.messages import PrefixMatch, PrefixPull, PrefixQuery, PrefixReply
from services.contract.prefix import block_hashes, reusable_blocks
from services.contract.tracing import Tracer, event_attributes
from services.contract.types import Cluster, WorkerRole
from services.router.config import SchedulerConfig
from services.router.errors import NoWorkerAvailable, QueueFull
from services.router.links import LinkBook
from services.router.policy import (
    Decision,
    Policy,
    PolicyError,
    PrfaasSite,
    RouteInputs,
    WorkerSnapshot,
    decision_event,
)
from services.router.workers import WorkerTable

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

# After KV stalled on a link, the link takes no new offload for this many stall bounds (a
# stalled link costs each request sent over it a bound's wait).
LINK_HOLD_STALLS = 3.0

class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where one request runs, decided before it starts."""

    request_id: str
    cluster: Cluster
    prefill_worker: str
    decode_worker: str
    prompt_tokens: int
    cached_tokens: int  # the prefix the prefill worker resumes from (the policy's view)
    decode_has_tokens: int  # the prefix whose KV the decode worker already holds
    decision: Decision
    pull: PrefixPull | None = None  # the cached prefix the prefill worker fetches first
    # Connections the prefill worker stripes the KV over: across clusters the scheduler's
    # `connections`, at most the worker's own lanes; within a cluster one.
    lanes: int = 1
    # 0 for the request as placed; n after its n-th migration (`RequestRunner`).
    attempt: int = 0
    # The hash chain of the prompt's blocks that a cache may supply (the lookup's), sent
    # with the prompt: the workers hash only what follows (PrefillRequest.hashes).
    hashes: list[int] = []

    @property
    def wire_id(self) -> str:
        """The id the workers know this attempt by (the router's own for attempt 0)."""
        return attempt_id(self.request_id, self.attempt)


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request whose data path broke is to continue (`RequestRunner`):
    the runner's ask, the scheduler's placement answers it."""

    reason: MigrationReason
    attempt: int  # this continuation's number, from 1
    prompt: list[int]  # the request's prompt and every output token streamed so far
    failed_worker: str
    worker_lost: bool  # its connection broke: it is down until it answers a status poll
    avoid: frozenset[str]  # the workers that failed this request so far
    cluster: Cluster | None  # the kind of cluster to prefill in; None: the policy decides




# The cache directory asked in this process, not called over the mesh: the simulation, whose
# directory runs in the router's event loop, answers each lookup from it (its
# `CacheDirService.lookup`) without a call, a reply and a handler per request.
DirectoryReader = Callable[[PrefixQuery], PrefixReply]

@dataclass
class PlacementCounts:
    """Requests placement turned away, and cache directory lookups that failed."""

    rejected_full: int = 0  # every decode worker full
    rejected_no_worker: int = 0
    lookup_failures: int = 0


class Placer:
    """Places prompts on the workers of `workers` (module docstring): a new request's
    (the scheduler's) or a migrated one's next attempt (the runner's)."""

    def __init__(self, node: Node, policy: Policy, workers: WorkerTable, links: LinkBook,
                 config: SchedulerConfig, clock: Callable[[], float], *,
                 directory: DirectoryReader | None = None,
                 tracer: Tracer | None = None) -> None:
        self.node, self.policy, self.workers, self.links = node, policy, workers, links
        self.config, self.clock, self.tracer = config, clock, tracer
        self._directory = directory
        self._directory_answers = True
        self.counts = PlacementCounts()

    def hold_link(self, stalled: Placement) -> None:
        """The link the stalled KV crossed takes no new offload for a while."""
        until = self.clock() + LINK_HOLD_STALLS * self.config.kv_stall_s
        self.links.hold(self.workers.cluster_of(stalled.prefill_worker),
                        self.workers.cluster_of(stalled.decode_worker), until)

    def _reject_full(self, why: str) -> None:
        self.counts.rejected_full += 1
        raise QueueFull(f"{why}; retry later", code="queue_full")

    async def place(self, request_id: str, prompt: list[int],
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
        inputs = self.policy.pick_prfaas_site(self._inputs(
            attempt_id(request_id, attempt), len(prompt), match, self.workers.cluster_of(decode)))
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
            self.counts.rejected_no_worker += 1
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
            if kind == "prfaas" and not inputs.site.available:
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
        self.counts.rejected_no_worker += 1
        raise NoWorkerAvailable(f"no worker can serve this request: {'; '.join(failures)}",
                                code="no_worker")

    def _cluster(self, kind: Cluster, inputs: RouteInputs) -> str | None:
        name = inputs.site.name if kind == "prfaas" else inputs.pd_cluster
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
            self.counts.lookup_failures += 1
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
        return RouteInputs(
            request_id=request_id, total_len=total,
            cached_pd=min(cap, self.workers.resumable_blocks("pd", match, pd) * bs),
            queue_pd=self.workers.prefill_queue("pd", pd), now=self.clock(), pd_cluster=pd,
            prfaas_sites=sites or (PrfaasSite(name="prfaas", available=False),))

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


def _other(kind: Cluster) -> Cluster:
    return "pd" if kind == "prfaas" else "prfaas"


def _placed_in(inputs: RouteInputs, kind: Cluster, why: str) -> Decision:
    """A decision that prefills in `kind` whatever the policy's rule says: a migration's, or
    a request whose decided kind of cluster has no prefill worker serving. Each cluster's own
    cache counts (no cache moves for it)."""
    cached = inputs.cached_pd if kind == "pd" else inputs.site.cached
    return Decision(cluster=kind, counted_prefix=cached, incremental_len=inputs.total_len - cached,
                    resume_prefix=cached, threshold=None, bandwidth_scarce=True,
                    cross_cluster_cache_transfer=False, reason=f"{why}: prefill in {kind}")


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
