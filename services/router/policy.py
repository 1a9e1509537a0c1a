"""What the router asks a routing policy and what it answers (`Policy`, its inputs, decisions,
feedback and actions), and the bookkeeping every policy shares (`PolicyBase`).

The router (services/router/scheduler.py) owns the I/O; a policy is pure state on an injected
clock (`now` is passed in), so the same policy runs live and on virtual time. Per request:

    inputs = RouteInputs(request_id=..., total_len=..., cached_pd=..., queue_pd=..., now=...,
                         prfaas_sites=(PrfaasSite(name=..., cached=..., queue=...,
                                                  link_utilisation=...), ...))
    inputs = policy.pick_prfaas_site(inputs)            # inputs.site: the PrfaaS cluster it uses
    decision = policy.decide(inputs)                    # which cluster prefills, and why
    ...choose workers (services/router/placement.py), run the request...
    event = decision_event(inputs, decision, policy=policy.name, prefill_worker=...,
                           decode_worker=..., ts=..., source="router")
    policy.observe(RequestFinished(...))                 # feedback when it completes

and periodically, for the control loops (paper section 3.4.3):

    policy.observe(LinkSample(...))                      # the transport: up, stalls
    policy.observe(LinkEstimate(...))                    # the link as its senders measure it
    for action in policy.tick(now, ClusterState(workers=...)):
        SetThreshold: already applied by the policy; publish `action_event(action, ...)`.
        ConvertWorker: drain `worker`, then switch it to `to_role` (the router does both).

`ClusterState` holds a `WorkerSnapshot` per worker: the one record of a worker that the
control loops and placement both read.

Cached lengths are *resumable* prefixes in tokens (services/cachedir/directory.py:
blocks_resumable times the block size) of the best worker per cluster. Lengths are whatever
unit the router counts in; policies that use the paper's cost model take a `token_scale` to
convert.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import msgspec

from services.contract.events import RoleChanged, RoutingDecision, ThresholdChanged
from services.contract.messages import DEFAULT_LANES
from services.contract.types import Cluster, WorkerRole
from services.router.link_meter import LinkEstimate


class PolicyError(ValueError):
    """A policy name, option or input that is unusable; the message names it and its value."""


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise PolicyError(f"{name} must be >= 0, got {value!r}")


def _check_finite(name: str, value: float, low: float = 0.0) -> None:
    if not (math.isfinite(value) and value >= low):
        raise PolicyError(f"{name} must be a finite number >= {low}, got {value!r}")


class PrfaasSite(msgspec.Struct, frozen=True, kw_only=True):
    """One PrfaaS cluster as one request sees it (several may feed the PD cluster)."""

    name: str
    cached: int = 0  # resumable prefix of its best prefill worker (tokens)
    queue: int = 0  # its queued prefill jobs
    link_utilisation: float = 0.0  # egress of its link to the request's PD cluster
    link_stalls: int = 0  # transfer stalls seen recently on that link (the router's window)
    available: bool = True  # it has a serving prefill worker and its link is up

    def __post_init__(self) -> None:
        for name in ("cached", "queue", "link_stalls"):
            _check_count(f"PrfaaS site {self.name!r}: {name}", getattr(self, name))
        _check_finite(f"PrfaaS site {self.name!r}: link_utilisation", self.link_utilisation)


def site_key(site: PrfaasSite, sent: int) -> tuple[int, float, int, int, str]:
    """How PrfaaS clusters are ranked for a request: the longest cached prefix first, then
    the most link headroom (utilisation in steps of 0.1, so noise does not decide), the
    shortest queue, and the fewest requests sent so far (spreads equal clusters)."""
    return (-site.cached, round(site.link_utilisation, 1), site.queue, sent, site.name)


class RouteInputs(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a policy may look at for one request (tokens, 0..1, queue lengths, s).

    Each PrfaaS cluster is one `PrfaasSite` in `prfaas_sites` (an unavailable one stands in
    when the topology has none); `site` is the one the request would use, chosen by
    `Policy.pick_prfaas_site` (`site_index`).
    """

    request_id: str
    total_len: int
    cached_pd: int = 0  # resumable prefix of the best PD prefill worker
    queue_pd: int = 0  # queued prefill jobs in the PD cluster
    now: float = 0.0
    pd_cluster: str = "pd"  # the PD cluster of the request's decode worker
    prfaas_sites: tuple[PrfaasSite, ...] = (PrfaasSite(name="prfaas"),)  # every PrfaaS cluster
    site_index: int = 0  # of the site in `prfaas_sites` the request would use

    def __post_init__(self) -> None:
        for name in ("total_len", "cached_pd", "queue_pd"):
            _check_count(name, getattr(self, name))
        if self.cached_pd > self.total_len:
            raise PolicyError(f"cached_pd must be <= total_len={self.total_len}, got "
                              f"{self.cached_pd!r}")
        for site in self.prfaas_sites:
            if site.cached > self.total_len:
                raise PolicyError(f"PrfaaS site {site.name!r}: cached must be <= "
                                  f"total_len={self.total_len}, got {site.cached!r}")
        if not 0 <= self.site_index < len(self.prfaas_sites):
            raise PolicyError(f"site_index must index one of the {len(self.prfaas_sites)} "
                              f"prfaas_sites, got {self.site_index!r}")
        if not math.isfinite(self.now):
            raise PolicyError(f"now must be finite, got {self.now!r}")

    @property
    def site(self) -> PrfaasSite:
        """The PrfaaS cluster the request would use: its cache, queue, link and availability."""
        return self.prfaas_sites[self.site_index]


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """Where one request prefills and why; the router adds the workers and publishes it."""

    cluster: Cluster
    counted_prefix: int  # the cached prefix the rule counted (tokens)
    incremental_len: int  # total_len - counted_prefix: what was compared with the threshold
    resume_prefix: int  # the prefix the chosen prefill worker starts from (after any transfer)
    threshold: float | None  # t used; None: the policy has none; inf: offload nothing
    bandwidth_scarce: bool
    cross_cluster_cache_transfer: bool  # move the other cluster's longer cache to the compute
    reason: str  # one line a student can read


class RequestFinished(msgspec.Struct, frozen=True, kw_only=True):
    """A request left the system (feedback for policies that learn)."""

    request_id: str
    cluster: Cluster
    incremental_len: int
    now: float
    ok: bool = True


class LinkSample(msgspec.Struct, frozen=True, kw_only=True):
    """What the transport tells of a PrfaaS egress link: whether it is up, its stalls and
    the bytes queued on it (what a sender's socket holds unsent). Never its rate: how much the
    link carries is measured from the router's own transfers (`LinkEstimate`,
    services/router/link_meter.py), and the queued bytes' wire time is reckoned at that."""

    now: float
    link: str = ""  # its name in the topology ("": the only link)
    stalls: int  # cumulative stall count of the link
    up: bool = True
    queued_bytes: int = 0  # egress bytes waiting on it now


Feedback = RequestFinished | LinkSample | LinkEstimate




class WorkerSnapshot(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One prefill or decode worker as the router knows it at one instant: the one record of a
    worker that the control loops (`ClusterState`), placement and GET /admin/state read.

    The router's worker table (services/router/workers.py) takes one per worker from the
    topology and its own counts; what a worker reports of itself is the wire message
    (services/contract/messages.py), which the table folds in. `queue` and `running` are the
    router's own counts, current to the request: a prefill worker's queue is its prefills sent
    and not done, a decode worker's running count its open token streams; `waiting` is what a
    decode worker last reported waiting to join its batch (those requests hold streams too, so
    placement's `load` leaves them out, and the control loops read them in `backlog`).
    Placement fills `cached_prefix_tokens` for the request it places.
    """

    name: str
    kind: Cluster  # the kind of its cluster
    role: WorkerRole  # what it serves; "draining": finishing its work, taking nothing new
    cluster: str = ""  # its cluster's name
    queue: int = 0  # requests sent to it and not done (prefill)
    running: int = 0  # open token streams (decode)
    waiting: int = 0  # of its streams, those it reported waiting to join its batch (decode)
    up: bool = True  # answers status polls (optimistic until one fails)
    converting: bool = False  # switching role (the router drains it first)
    lanes: int = DEFAULT_LANES  # connections it may stripe one KV stream over
    cached_prefix_tokens: int = 0  # of the request being placed, on this worker
    capacity: int | None = None  # most requests it should hold (decode: BS_max); None: no cap

    @property
    def load(self) -> int:
        """Requests the router has placed on it and not yet seen it finish."""
        return self.queue + self.running

    @property
    def backlog(self) -> int:
        """Requests waiting for it, counted by the router or reported by the worker."""
        return self.queue + self.waiting

    @property
    def full(self) -> bool:
        return self.capacity is not None and self.load >= self.capacity


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    """Every worker of every cluster, for the control loops."""

    workers: tuple[WorkerSnapshot, ...] = ()

    def select(self, kind: Cluster, role: WorkerRole) -> list[WorkerSnapshot]:
        return [w for w in self.workers if w.kind == kind and w.role == role]


class SetThreshold(msgspec.Struct, frozen=True, kw_only=True):
    """t moved (already applied by the policy; the router publishes ThresholdChanged)."""

    old: float | None
    new: float | None
    reason: str


class ConvertWorker(msgspec.Struct, frozen=True, kw_only=True):
    """Convert a PD worker's role; the router drains it first, then switches it."""

    worker: str
    from_role: Literal["prefill", "decode"]
    to_role: Literal["prefill", "decode"]
    reason: str


Action = SetThreshold | ConvertWorker


class PolicyStatistics(msgspec.Struct, frozen=True):
    name: str
    decisions: int
    to_prfaas: int
    to_pd: int
    offload_fraction: float  # to_prfaas / decisions (0 before the first)
    cross_cluster_transfers: int
    finished: int
    threshold: float | None  # None: the policy has none
    override: float | None  # the pinned threshold; None: none pinned
    last_reason: str


class Policy(Protocol):
    """The small interface every routing policy implements (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def threshold(self) -> float | None: ...

    def pick_prfaas_site(self, inputs: RouteInputs) -> RouteInputs: ...

    def decide(self, inputs: RouteInputs) -> Decision: ...

    def observe(self, feedback: Feedback) -> None: ...

    def tick(self, now: float, state: ClusterState) -> list[Action]: ...

    def set_threshold_override(self, threshold: float | None) -> None: ...

    def statistics(self) -> PolicyStatistics: ...

    def check_integrity(self) -> None: ...


def json_threshold(threshold: float | None) -> float | None:
    """t as events carry it: JSON has no infinity, so a non-finite t becomes None."""
    return threshold if threshold is not None and math.isfinite(threshold) else None


def decision_event(inputs: RouteInputs, decision: Decision, *, policy: str,
                   prefill_worker: str, decode_worker: str, ts: float,
                   source: str = "router") -> RoutingDecision:
    """The telemetry event of one decision, with every input (docs/architecture.md section 4)."""
    return RoutingDecision(
        ts=ts, source=source, request_id=inputs.request_id, policy=policy,
        total_len=inputs.total_len, cached_prfaas=inputs.site.cached,
        cached_pd=inputs.cached_pd, incremental_len=decision.incremental_len,
        threshold=json_threshold(decision.threshold),
        link_utilisation=inputs.site.link_utilisation, queue_prfaas=inputs.site.queue,
        queue_pd=inputs.queue_pd, cluster=decision.cluster, prefill_worker=prefill_worker,
        decode_worker=decode_worker, bandwidth_scarce=decision.bandwidth_scarce,
        reason=decision.reason)


def action_event(action: Action, *, policy: str, ts: float,
                 source: str = "router") -> ThresholdChanged | RoleChanged:
    """The telemetry event announcing a control-loop action."""
    if isinstance(action, SetThreshold):
        return ThresholdChanged(ts=ts, source=source, policy=policy,
                                old=json_threshold(action.old), new=json_threshold(action.new),
                                reason=action.reason)
    return RoleChanged(ts=ts, source=source, worker=action.worker, old=action.from_role,
                       new=action.to_role, reason=action.reason)
