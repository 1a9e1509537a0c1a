"""The routing policies: what the router asks a policy, every policy, and the one list of them.

Read top to bottom: the interface (what a policy reads and answers), the shared bookkeeping
(`PolicyBase`), then the policies in the order the paper meets them: `homogeneous` and
`naive-hetero` (its baselines), `prfaas` (its threshold rule), `dynamo` (a baseline from
another system), `prfaas-dynamic` (the rule with the paper's dual-timescale scheduler), and
last `REGISTERED`, the one list the CLI, the router, the dashboard and the simulation read.

The router (services/router/scheduler.py) owns the I/O; a policy is pure state on an injected
clock (`now` is passed in), so the same policy runs live and on virtual time. Per request:

    inputs = RouteInputs(request_id=..., total_len=..., cached_prfaas=..., cached_pd=...,
                         link_utilisation=..., queue_prfaas=..., queue_pd=..., now=...)
    decision = policy.decide(inputs)                    # which cluster prefills, and why
    ...choose workers (placement, services/router/scheduler.py), run the request...
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
control loops here and placement in the scheduler both read.

Cached lengths are *resumable* prefixes in tokens (services/cachedir/service.py:
blocks_resumable times the block size) of the best worker per cluster. Lengths are whatever
unit the router counts in; policies that use the paper's cost model take a `token_scale` to
convert.

To add a policy: write a class here that implements `Policy` (subclassing
`PolicyBase[YourConfig]` gives the bookkeeping and `from_options`), name its frozen
`config_type`, then add the class to `REGISTERED`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import ClassVar, Generic, Literal, Protocol, TypeVar

import msgspec

from services.contract.events import RoleChanged, RoutingDecision, ThresholdChanged
from services.contract.messages import DEFAULT_LANES
from services.contract.types import Cluster, WorkerRole
from services.paper.case_study import T_STAR_TOKENS
from services.paper.hardware import CostModel
from services.paper.planner import (
    ClusterShape,
    OperatingPoint,
    ThroughputModel,
    solve_threshold,
)
from services.paper.workload import (
    PAPER_MAX_TOKENS,
    PAPER_MIN_TOKENS,
    PAPER_MU,
    PAPER_SIGMA,
    EmpiricalLengths,
    LengthDistribution,
    TruncatedLogNormal,
)
from services.router.link_meter import LinkEstimate

BandwidthMode = Literal["auto", "scarce", "abundant"]
_Config = TypeVar("_Config", bound=msgspec.Struct)


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
    link_stalls: int = 0
    available: bool = True  # it has a serving prefill worker and its link is up


def site_key(site: PrfaasSite, sent: int) -> tuple[int, float, int, int, str]:
    """How PrfaaS clusters are ranked for a request: the longest cached prefix first, then
    the most link headroom (utilisation in steps of 0.1, so noise does not decide), the
    shortest queue, and the fewest requests sent so far (spreads equal clusters)."""
    return (-site.cached, round(site.link_utilisation, 1), site.queue, sent, site.name)


class RouteInputs(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a policy may look at for one request (tokens, 0..1, queue lengths, s).

    The PrfaaS fields describe one PrfaaS cluster, `prfaas_cluster`; with several
    (`prfaas_sites`), `Policy.narrow` fills them from the one the request would use.
    """

    request_id: str
    total_len: int
    cached_prfaas: int = 0  # resumable prefix of the best PrfaaS prefill worker
    cached_pd: int = 0  # ... of the best PD prefill worker
    link_utilisation: float = 0.0  # egress of the PrfaaS cluster's link (may exceed 1 briefly)
    link_stalls: int = 0  # transfer stalls seen recently (the router's window)
    queue_prfaas: int = 0  # queued prefill jobs in the PrfaaS cluster
    queue_pd: int = 0  # ... in the PD cluster
    prfaas_available: bool = True  # False: no PrfaaS worker, or the link is down
    now: float = 0.0
    prfaas_cluster: str = "prfaas"  # the PrfaaS cluster the fields above describe
    pd_cluster: str = "pd"  # the PD cluster of the request's decode worker
    prfaas_sites: tuple[PrfaasSite, ...] = ()  # every PrfaaS cluster (empty: just the one)

    def __post_init__(self) -> None:
        for name in ("total_len", "cached_prfaas", "cached_pd", "link_stalls",
                     "queue_prfaas", "queue_pd"):
            _check_count(name, getattr(self, name))
        for name in ("cached_prfaas", "cached_pd"):
            if getattr(self, name) > self.total_len:
                raise PolicyError(f"{name} must be <= total_len={self.total_len}, got "
                                  f"{getattr(self, name)!r}")
        _check_finite("link_utilisation", self.link_utilisation)
        if not math.isfinite(self.now):
            raise PolicyError(f"now must be finite, got {self.now!r}")


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

    The scheduler's worker table (services/router/scheduler.py) takes one per worker from the
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
    threshold: float | None
    override: float | None
    last_reason: str


class Policy(Protocol):
    """The small interface every routing policy implements (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def threshold(self) -> float | None: ...

    def narrow(self, inputs: RouteInputs) -> RouteInputs: ...

    def decide(self, inputs: RouteInputs) -> Decision: ...

    def observe(self, feedback: Feedback) -> None: ...

    def tick(self, now: float, state: ClusterState) -> list[Action]: ...

    def set_threshold_override(self, t: float | None) -> None: ...

    def statistics(self) -> PolicyStatistics: ...

    def check_integrity(self) -> None: ...


class PolicyBase(Generic[_Config]):
    """Counting, overrides and no-op loops shared by the policies; subclasses write `_decide`.

    Each policy names its frozen config type (`config_type`); it is built from plain options
    (CLI, TOML, the admin API) here, once for all policies (`from_options`).
    `_own_threshold` returns the policy's t (None: it has none, and overrides are refused).
    """

    name = "base"
    config_type: ClassVar[type[msgspec.Struct]]

    def __init__(self, config: _Config | None = None) -> None:
        self.config: _Config = config if config is not None else self._default_config()
        self._override: float | None = None
        self._decisions = self._to_prfaas = self._transfers = self._finished = 0
        self._last_reason = ""
        self._sent: dict[str, int] = {}  # requests sent to each PrfaaS cluster

    def narrow(self, inputs: RouteInputs) -> RouteInputs:
        """`inputs` with the PrfaaS fields of the PrfaaS cluster a request would go to
        (`site_key`); unavailable when none is. Unchanged without `prfaas_sites`."""
        sites = [s for s in inputs.prfaas_sites if s.available]
        if not inputs.prfaas_sites:
            return inputs
        if not sites:
            return msgspec.structs.replace(inputs, prfaas_available=False)
        best = min(sites, key=lambda s: site_key(s, self._sent.get(s.name, 0)))
        return msgspec.structs.replace(
            inputs, cached_prfaas=best.cached, queue_prfaas=best.queue,
            link_utilisation=best.link_utilisation, link_stalls=best.link_stalls,
            prfaas_available=True, prfaas_cluster=best.name)

    def _default_config(self) -> _Config:
        return self.config_type()  # type: ignore[return-value]

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Policy:
        return cls(build_config(cls.name, cls.config_type, options))  # type: ignore[arg-type]

    def _decide(self, inputs: RouteInputs) -> Decision:
        raise NotImplementedError

    def _own_threshold(self) -> float | None:
        return None

    @property
    def threshold(self) -> float | None:
        return self._override if self._override is not None else self._own_threshold()

    def decide(self, inputs: RouteInputs) -> Decision:
        decision = self._decide(inputs)
        self._decisions += 1
        self._to_prfaas += decision.cluster == "prfaas"
        if decision.cluster == "prfaas":
            self._sent[inputs.prfaas_cluster] = self._sent.get(inputs.prfaas_cluster, 0) + 1
        self._transfers += decision.cross_cluster_cache_transfer
        self._last_reason = decision.reason
        return decision

    def observe(self, feedback: Feedback) -> None:
        if isinstance(feedback, RequestFinished):
            self._finished += 1

    def tick(self, now: float, state: ClusterState) -> list[Action]:
        return []

    def set_threshold_override(self, t: float | None) -> None:
        """Pin t (None: back to the policy's own); refused by policies without a threshold."""
        if self._own_threshold() is None:
            raise PolicyError(f"policy {self.name!r} has no threshold to override (t={t!r})")
        if t is not None and (math.isnan(t) or t < 0):
            raise PolicyError(f"t must be a number >= 0 or None, got {t!r}")
        self._override = t

    def check_integrity(self) -> None:
        """Raise PolicyError if the bookkeeping contradicts itself (tests call this)."""
        problems = []
        if not 0 <= self._to_prfaas <= self._decisions:
            problems.append(f"to_prfaas={self._to_prfaas} outside 0..{self._decisions}")
        if not 0 <= self._transfers <= self._decisions:
            problems.append(f"transfers={self._transfers} outside 0..{self._decisions}")
        problems += self._integrity_problems()
        if problems:
            raise PolicyError(f"policy {self.name!r} integrity: " + "; ".join(problems))

    def _integrity_problems(self) -> list[str]:
        t = self.threshold
        return [f"threshold is NaN ({t!r})"] if t is not None and math.isnan(t) else []

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(
            name=self.name, decisions=self._decisions, to_prfaas=self._to_prfaas,
            to_pd=self._decisions - self._to_prfaas,
            offload_fraction=self._to_prfaas / self._decisions if self._decisions else 0.0,
            cross_cluster_transfers=self._transfers, finished=self._finished,
            threshold=self.threshold, override=self._override, last_reason=self._last_reason)


def json_threshold(t: float | None) -> float | None:
    """t as events carry it: JSON has no infinity, so a non-finite t becomes None."""
    return t if t is not None and math.isfinite(t) else None


def decision_event(inputs: RouteInputs, decision: Decision, *, policy: str,
                   prefill_worker: str, decode_worker: str, ts: float,
                   source: str = "router") -> RoutingDecision:
    """The telemetry event of one decision, with every input (docs/architecture.md section 4)."""
    return RoutingDecision(
        ts=ts, source=source, request_id=inputs.request_id, policy=policy,
        total_len=inputs.total_len, cached_prfaas=inputs.cached_prfaas,
        cached_pd=inputs.cached_pd, incremental_len=decision.incremental_len,
        threshold=json_threshold(decision.threshold),
        link_utilisation=inputs.link_utilisation, queue_prfaas=inputs.queue_prfaas,
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


def format_tokens(value: float | None) -> str:
    """A length or threshold for reason lines: 2,048; inf; none."""
    if value is None:
        return "none"
    return f"{value:,.0f}" if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def is_bandwidth_scarce(inputs: RouteInputs, abundant_below: float,
                        mode: BandwidthMode = "auto") -> bool:
    """Which prefix rule of paper section 3.3 applies (section 2.4 step 3 of docs/paper-notes.md).

    The paper names the two cases but gives no test. Ours: bandwidth is abundant while the
    link's egress utilisation is below `abundant_below` and no transfer stalled recently,
    i.e. there is room left for a cross-cluster cache transfer; otherwise it is scarce.
    `mode` pins either case (for experiments and tests).
    """
    if mode != "auto":
        return mode == "scarce"
    return inputs.link_utilisation >= abundant_below or inputs.link_stalls > 0


def link_note(inputs: RouteInputs, abundant_below: float, mode: BandwidthMode = "auto") -> str:
    """What `is_bandwidth_scarce` decided from, for the reason line: the link's utilisation
    against the watermark and its recent stalls ("link calm (util 3% < 50%)"), or the pin."""
    if mode != "auto":
        return f"bandwidth pinned {mode}"
    util = f"util {inputs.link_utilisation:.0%}"
    if inputs.link_stalls > 0:
        return f"link busy ({inputs.link_stalls} recent stalls, {util})"
    if inputs.link_utilisation >= abundant_below:
        return f"link busy ({util} >= {abundant_below:.0%})"
    return f"link calm ({util} < {abundant_below:.0%})"


def build_config(policy: str, kind: type[_Config], options: Mapping[str, object]) -> _Config:
    """A policy's frozen config from plain options (CLI, TOML); errors name the bad key."""
    try:
        return msgspec.convert(dict(options), kind)
    except msgspec.ValidationError as exc:
        raise PolicyError(f"policy {policy!r}: bad option: {exc}") from exc


class HomogeneousConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field


class HomogeneousPolicy(PolicyBase[HomogeneousConfig]):
    """`homogeneous`, the paper's homogeneous PD baseline: every request prefills in the PD
    cluster, resuming from the PD cluster's own cache.
    """

    name = "homogeneous"
    config_type = HomogeneousConfig

    def _decide(self, inputs: RouteInputs) -> Decision:
        incremental = inputs.total_len - inputs.cached_pd
        return Decision(
            cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
            resume_prefix=inputs.cached_pd, threshold=None,
            bandwidth_scarce=is_bandwidth_scarce(inputs, self.config.abundant_below),
            cross_cluster_cache_transfer=False,
            reason=f"homogeneous: l = {format_tokens(incremental)} prefills in the PD cluster")


class NaiveHeteroConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field


class NaiveHeteroPolicy(PolicyBase[NaiveHeteroConfig]):
    """`naive-hetero`, the paper's naive heterogeneous baseline: every request prefills on
    PrfaaS, resuming from the PrfaaS cluster's own cache.

    Paper section 4.3.3: all prefill on the compute-dense cluster, all decode on the PD cluster,
    "without length-based routing or load balancing". Only when PrfaaS is unavailable (no worker,
    or its link down) does a request fall back to the PD cluster, so the system keeps serving.
    """

    name = "naive-hetero"
    config_type = NaiveHeteroConfig

    def _decide(self, inputs: RouteInputs) -> Decision:
        scarce = is_bandwidth_scarce(inputs, self.config.abundant_below)
        if not inputs.prfaas_available:
            incremental = inputs.total_len - inputs.cached_pd
            return Decision(
                cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
                resume_prefix=inputs.cached_pd, threshold=None, bandwidth_scarce=scarce,
                cross_cluster_cache_transfer=False,
                reason=f"naive-hetero: PrfaaS unavailable, l = {format_tokens(incremental)} "
                       "falls back to the PD cluster")
        incremental = inputs.total_len - inputs.cached_prfaas
        return Decision(
            cluster="prfaas", counted_prefix=inputs.cached_prfaas, incremental_len=incremental,
            resume_prefix=inputs.cached_prfaas, threshold=None, bandwidth_scarce=scarce,
            cross_cluster_cache_transfer=False,
            reason=f"naive-hetero: every prefill on PrfaaS, l = {format_tokens(incremental)}")


def check_watermark(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise PolicyError(f"{name} must be a finite number >= 0, got {value!r}")


class PrfaasConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    threshold: float = T_STAR_TOKENS  # t in the router's tokens; the paper's case-study optimum
    abundant_below: float = 0.5  # link utilisation under which bandwidth counts as abundant
    bandwidth: BandwidthMode = "auto"  # or pin "scarce" / "abundant"

    def __post_init__(self) -> None:
        if math.isnan(self.threshold) or self.threshold < 0:
            raise PolicyError(f"threshold must be a number >= 0, got {self.threshold!r}")
        check_watermark("abundant_below", self.abundant_below)


def _unavailable(inputs: RouteInputs, t: float, scarce: bool, who: str) -> Decision:
    incremental = inputs.total_len - inputs.cached_pd
    return Decision(
        cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
        resume_prefix=inputs.cached_pd, threshold=t, bandwidth_scarce=scarce,
        cross_cluster_cache_transfer=False,
        reason=f"{who}: PrfaaS unavailable, l = {format_tokens(incremental)} prefills locally")


def _counted_prefix(inputs: RouteInputs, scarce: bool) -> int:
    return inputs.cached_pd if scarce else max(inputs.cached_prfaas, inputs.cached_pd)


def _own_cache(inputs: RouteInputs, cluster: Cluster) -> int:
    return inputs.cached_prfaas if cluster == "prfaas" else inputs.cached_pd


def threshold_rule(inputs: RouteInputs, t: float, scarce: bool, who: str = "prfaas",
                   link: str = "") -> Decision:
    """The paper's rule at threshold t under the scarce or abundant prefix rule; `link` says
    in the reason why that rule applies (`link_note`), else the rule alone is named."""
    if not inputs.prfaas_available:
        return _unavailable(inputs, t, scarce, who)
    counted = _counted_prefix(inputs, scarce)
    incremental = inputs.total_len - counted
    cluster: Cluster = "prfaas" if incremental > t else "pd"
    own = _own_cache(inputs, cluster)
    resume = own if scarce else counted
    transfer = resume > own
    where = "PrfaaS" if cluster == "prfaas" else "PD prefill"
    rule = "PD cache counts" if scarce else "best cache anywhere counts"
    why = link or ("bandwidth scarce" if scarce else "bandwidth abundant")
    reason = (f"{who}: l = {format_tokens(inputs.total_len)} - {format_tokens(counted)} = "
              f"{format_tokens(incremental)} {'>' if cluster == 'prfaas' else '<='} "
              f"t = {format_tokens(t)} -> {where} ({why}: {rule})")
    if transfer:
        other = "pd" if cluster == "prfaas" else "prfaas"
        reason += f"; pull {format_tokens(resume - own)} cached tokens from {other}"
    return Decision(
        cluster=cluster, counted_prefix=counted, incremental_len=incremental,
        resume_prefix=resume, threshold=t, bandwidth_scarce=scarce,
        cross_cluster_cache_transfer=transfer, reason=reason)


class PrfaasPolicy(PolicyBase[PrfaasConfig]):
    """`prfaas`: the paper's length-threshold rule with a fixed t (arXiv 2604.15039 v2, 3.3, 3.4.3).

    Rule: l = l_total - l_prefix; l > t prefills on PrfaaS, l <= t on a PD prefill worker.
    Which prefix counts depends on the link (docs/paper-notes.md, section 2.4 step 3):
    - bandwidth scarce: each cluster's cache is judged on its own; the local decision counts the
      PD cluster's prefix (l = l_total - l_pd), and a request sent to PrfaaS resumes from the
      PrfaaS cluster's own cache. Nothing but the new KV crosses the link.
    - bandwidth abundant: the best cache anywhere counts (l_prefix = max(l_prfaas, l_pd)); "when
      the cluster with the longer cache differs from the compute cluster, a cross-cluster cache
      transfer is performed", so the compute cluster resumes from that longer prefix.
    The t is its config's (or an override set live); `threshold_rule` is shared with
    `prfaas-dynamic`, which moves t instead of fixing it.
    """

    name = "prfaas"
    config_type = PrfaasConfig

    def _own_threshold(self) -> float:
        return self.config.threshold

    def _decide(self, inputs: RouteInputs) -> Decision:
        below, mode = self.config.abundant_below, self.config.bandwidth
        scarce = is_bandwidth_scarce(inputs, below, mode)
        t = self.threshold
        assert t is not None
        return threshold_rule(inputs, t, scarce, self.name, link_note(inputs, below, mode))


class DynamoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 8
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field

    def __post_init__(self) -> None:
        for name in ("max_local_prefill_length", "max_prefill_queue_size"):
            if getattr(self, name) < 0:
                raise PolicyError(f"{name} must be >= 0, got {getattr(self, name)!r}")


class DynamoPolicy(PolicyBase[DynamoConfig]):
    """`dynamo`: NVIDIA Dynamo's conditional-disaggregation rule, a baseline from another
    system.

    Dynamo v0.x ("conditional disaggregation", docs/architecture/disagg_serving.md in
    github.com/ai-dynamo/dynamo; archived at docs.nvidia.com/dynamo/archive/0.2.0/architecture/
    disagg_serving.html) prefills a request remotely only if both hold:
    1. the prefill length without prefix-cache hit, prefill_len - prefix_hit_len, exceeds
       `max_local_prefill_length` (default 1000 in its Rust `DisaggRouterConf`), and
    2. the remote prefill queue holds fewer than `max_prefill_queue_size` requests.
    Otherwise it prefills locally. Facts from docs/prior-work.md section 2.3.

    Our mapping, a simplification: Dynamo's "remote" is its prefill-worker pool in the same
    datacenter and "local" is chunked prefill on the decode worker; here remote is the PrfaaS
    cluster and local a PD prefill worker. The prefix hit is the PD cluster's (Dynamo counts the
    decode worker's). A remote prefill in Dynamo reads the prefix-hit blocks from the decode
    worker, so a longer PD cache is moved to PrfaaS (`cross_cluster_cache_transfer`). The queue
    limit's default (8) is ours: the source gives none we could verify. The rule knows nothing of
    link bandwidth; that blindness is what it is here to show.
    """

    name = "dynamo"
    config_type = DynamoConfig

    def _own_threshold(self) -> float:
        return float(self.config.max_local_prefill_length)

    def _why_local(self, inputs: RouteInputs, incremental: int, limit: float) -> str | None:
        """None when the request goes remote, else the reason it stays local."""
        if not inputs.prfaas_available:
            return "PrfaaS unavailable"
        if incremental <= limit:
            return f"l = {format_tokens(incremental)} <= local limit {format_tokens(limit)}"
        if inputs.queue_prfaas >= self.config.max_prefill_queue_size:
            return (f"remote queue {inputs.queue_prfaas} >= "
                    f"{self.config.max_prefill_queue_size}")
        return None

    def _decide(self, inputs: RouteInputs) -> Decision:
        limit = self.threshold
        assert limit is not None
        incremental = inputs.total_len - inputs.cached_pd
        scarce = is_bandwidth_scarce(inputs, self.config.abundant_below)
        local = self._why_local(inputs, incremental, limit)
        if local is not None:
            return Decision(
                cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
                resume_prefix=inputs.cached_pd, threshold=limit, bandwidth_scarce=scarce,
                cross_cluster_cache_transfer=False, reason=f"dynamo: {local} -> PD prefill")
        resume = max(inputs.cached_prfaas, inputs.cached_pd)
        return Decision(
            cluster="prfaas", counted_prefix=inputs.cached_pd, incremental_len=incremental,
            resume_prefix=resume, threshold=limit, bandwidth_scarce=scarce,
            cross_cluster_cache_transfer=resume > inputs.cached_prfaas,
            reason=(f"dynamo: l = {format_tokens(incremental)} > local limit "
                    f"{format_tokens(limit)} and remote queue {inputs.queue_prfaas} < "
                    f"{self.config.max_prefill_queue_size} -> PrfaaS"))


class Ewma:
    """Exponential average over a time constant `tau_s` on the caller's clock; it starts at
    its first sample, and a `tau_s` of 0 follows the raw samples."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.value = 0.0
        self._at: float | None = None

    def update(self, now: float, sample: float) -> float:
        if self._at is None or self.tau_s == 0.0:
            self.value = sample
        else:
            weight = 1.0 - math.exp(-max(now - self._at, 0.0) / self.tau_s)
            self.value += weight * (sample - self.value)
        self._at = now
        return self.value


# The model's (Theta_prfaas, Theta_pd-p, Theta_pd-d) in requests/s for a shape
Rates = tuple[float, float, float]
Estimator = Callable[[ClusterShape], Rates]
# Each stage's load (its arrivals over its rate) for a shape at the arrival rate measured now;
# None without traffic
Loads = Callable[[ClusterShape], Rates | None]


class RoleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    period_s: float = 60.0
    imbalance: float = 2.0
    min_backlog: float = 2.0  # mean queued requests per worker before a stage counts as backed up
    min_role_workers: int = 1  # never convert the last worker(s) of a role
    margin: float = 0.3  # Eq. 8 may be off by this fraction before a conversion
    # Eq. 8 converts only while the busiest stage runs at least this loaded at the measured
    # arrival rate: below it the shape limits nothing, and a conversion would only cost its
    # drain and reload and spend the headroom of the role it takes from (a burst needs it).
    min_load: float = 0.6
    # No conversion undoes the last one within this long (a conversion drains a worker and
    # reloads it: one that the next period reverses costs twice and gains nothing).
    cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("period_s", "imbalance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PolicyError(f"roles.{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.min_backlog) and self.min_backlog >= 0):
            raise PolicyError(f"roles.min_backlog must be >= 0, got {self.min_backlog!r}")
        for name in ("margin", "cooldown_s", "min_load"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PolicyError(f"roles.{name} must be >= 0, got {value!r}")
        if self.min_role_workers < 1:
            raise PolicyError(f"roles.min_role_workers must be >= 1, got "
                              f"{self.min_role_workers!r}")


def shape_of(state: ClusterState) -> ClusterShape:
    """Serving instances per stage; draining workers count for neither role."""
    return ClusterShape(len(state.select("prfaas", "prefill")),
                        len(state.select("pd", "prefill")), len(state.select("pd", "decode")))


def _mean_queue(workers: list[WorkerSnapshot]) -> float:
    return sum(w.backlog for w in workers) / len(workers) if workers else 0.0


def _least_loaded(workers: list[WorkerSnapshot]) -> WorkerSnapshot:
    return min(workers, key=lambda w: (w.backlog + w.running, w.name))


def eq8_gap(rates: Rates) -> float:
    """How far Eq. 8 is off: log((Theta_prfaas + Theta_pd-p) / Theta_pd-d); 0 balanced."""
    prefill, decode = rates[0] + rates[1], rates[2]
    if prefill <= 0 or decode <= 0:
        return math.inf if decode <= 0 < prefill else -math.inf if prefill <= 0 < decode else 0.0
    return math.log(prefill / decode)


class RoleBalancer:
    """The long-term loop of `prfaas-dynamic`: convert PD workers between prefill and decode.

    Paper section 3.4.3: "When Theta_prfaas + Theta_pd-p << Theta_pd-d, prefill is the system
    bottleneck, and when ... >> Theta_pd-d, decode is"; the scheduler "monitors queue depth and
    utilization at each stage", "periodically re-evaluates load balance and converts nodes between
    prefill and decode roles within the PD cluster" (Eq. 8). At the end of each period:

    1. Re-estimate the three rates for the current shape: the throughput model (Eqs. 3-5: the
       hardware profiles, the recent incremental lengths, the current t), except that a stage
       whose queue stayed backed up the whole period (mean queue per worker >= `min_backlog`)
       delivered exactly its capacity, so its measured completions per second replace the model.
    2. Queue evidence first: the stage whose mean queue per worker is `imbalance` times the
       other's (and >= `min_backlog`) is the bottleneck.
    3. Else Eq. 8, while the busiest stage is at least `min_load` loaded at the measured
       arrival rate: prefill (Theta_prfaas + Theta_pd-p) below Theta_pd-d / (1 + margin) makes
       prefill the bottleneck, above Theta_pd-d * (1 + margin) decode; such a conversion is made
       only if it brings Eq. 8 closer to balance (one worker's rate moves from one side to the
       other), and never away from a stage that is backed up. Under a light load the shape
       limits nothing: the deployed split is kept, with its headroom for a burst.
    4. The bottleneck gains the least loaded worker of the other role (the router drains it
       first); the policy then re-solves t for the new shape.
    5. Only when the period before wanted the same (one period's evidence may be a burst or
       the warm-up), and unless it would undo the last conversion within `cooldown_s`
       (flapping), or the shape
       it leaves would not carry the load measured now (both PD stages within `max_load`: the
       role given away must still take its share; without traffic, nothing is converted: the
       loop settles).

    It accumulates stage queues and completions over a period; at its end, at most one
    `ConvertWorker`, the second period in a row that wants it. `estimate` gives the model's
    rates for a shape.
    """

    def __init__(self, config: RoleConfig, estimate: Estimator | None = None,
                 loads: Loads | None = None, max_load: float = 1.0) -> None:
        """`estimate`: the model's stage rates for a shape; `loads`: each stage's load for a
        shape at the arrival rate measured now (None without traffic: no conversion);
        `max_load`: the most a PD stage may be loaded in the shape a conversion leaves."""
        self.config = config
        self._estimate = estimate
        self._loads = loads
        self._max_load = max_load
        self._last: tuple[float, str] | None = None  # (when, to_role) of the last conversion
        self._wanted: str | None = None  # the role the last period wanted a worker moved to
        self._period_start: float | None = None
        self._prefill_sum = self._decode_sum = self._prfaas_sum = 0.0
        self._samples = 0
        self._done = [0, 0, 0]  # completions this period: PrfaaS prefill, PD prefill, decode
        self._pending: ConvertWorker | None = None
        self.conversions = 0
        self.last_rates: Rates | None = None  # the estimate of the last period's end

    def finished(self, cluster: str) -> None:
        """A request finished: its prefill stage and the decode stage each served one."""
        self._done[0 if cluster == "prfaas" else 1] += 1
        self._done[2] += 1

    def tick(self, now: float, state: ClusterState) -> ConvertWorker | None:
        if not self.config.enabled:
            return None
        if self._period_start is None:
            self._period_start = now
        prefill, decode = state.select("pd", "prefill"), state.select("pd", "decode")
        self._prefill_sum += _mean_queue(prefill)
        self._decode_sum += _mean_queue(decode)
        self._prfaas_sum += _mean_queue(state.select("prfaas", "prefill"))
        self._samples += 1
        elapsed = now - self._period_start
        if elapsed < self.config.period_s:
            return None
        n = self._samples
        means = (self._prfaas_sum / n, self._prefill_sum / n, self._decode_sum / n)
        rates = self._rates(shape_of(state), means, [d / elapsed for d in self._done])
        self._period_start, self._samples, self._done = now, 0, [0, 0, 0]
        self._prefill_sum = self._decode_sum = self._prfaas_sum = 0.0
        if state.select("pd", "draining"):
            return None
        action = self._rebalance(means[1], means[2], prefill, decode, rates,
                                 self._busy(shape_of(state)))
        wanted, self._wanted = self._wanted, action.to_role if action else None
        if action is None or wanted != action.to_role or not self._allowed(now, state, action):
            return None
        self._wanted = None
        return self._issue(now, action)

    def _allowed(self, now: float, state: ClusterState, action: ConvertWorker) -> bool:
        """Step 5 of the class docstring: not undoing the last conversion within
        `cooldown_s`, and only to a shape that carries the load measured now."""
        last = self._last
        if last is not None and last[1] != action.to_role and \
                now - last[0] < self.config.cooldown_s:
            return False
        if self._loads is None:
            return True
        loads = self._loads(self.shape_after(shape_of(state), action))
        return loads is not None and max(loads[1], loads[2]) <= self._max_load

    def _busy(self, shape: ClusterShape) -> bool:
        """Whether the busiest stage is at least `min_load` loaded (step 3's gate)."""
        loads = self._loads(shape) if self._loads is not None else (1.0, 1.0, 1.0)
        return loads is not None and max(loads) >= self.config.min_load

    def _rates(self, shape: ClusterShape, queues: tuple[float, float, float],
               measured: list[float]) -> Rates | None:
        """Step 1 of the class docstring: the model's rates, measured where backed up."""
        if self._estimate is None:
            return None
        model = self._estimate(shape)
        rates = tuple(measured[i] if queues[i] >= self.config.min_backlog and measured[i] > 0
                      else model[i] for i in range(3))
        self.last_rates = (rates[0], rates[1], rates[2])
        return self.last_rates

    def _rebalance(self, pre: float, dec: float, prefill: list[WorkerSnapshot],
                   decode: list[WorkerSnapshot], rates: Rates | None,
                   busy: bool) -> ConvertWorker | None:
        cfg = self.config
        stats = (f"mean queue per worker over {cfg.period_s:g} s: decode {dec:.1f}, "
                 f"PD prefill {pre:.1f}")
        backed = (pre >= cfg.min_backlog, dec >= cfg.min_backlog)
        to_decode = backed[1] and dec >= cfg.imbalance * pre
        to_prefill = backed[0] and pre >= cfg.imbalance * dec
        if rates is not None and busy and not (to_decode or to_prefill):
            to_decode, to_prefill, stats = self._eq8(rates, len(prefill), len(decode), backed)
        if to_decode and len(prefill) > cfg.min_role_workers:
            return ConvertWorker(
                worker=_least_loaded(prefill).name, from_role="prefill", to_role="decode",
                reason=f"long-term: decode is the bottleneck ({stats})")
        if to_prefill and len(decode) > cfg.min_role_workers:
            return ConvertWorker(
                worker=_least_loaded(decode).name, from_role="decode", to_role="prefill",
                reason=f"long-term: prefill is the bottleneck ({stats})")
        return None

    def _eq8(self, rates: Rates, n_p: int, n_d: int,
             backed: tuple[bool, bool]) -> tuple[bool, bool, str]:
        """Step 3: (to decode, to prefill, why) from Eq. 8 with one worker moved."""
        gap, limit = eq8_gap(rates), math.log1p(self.config.margin)
        per_p = rates[1] / n_p if n_p else 0.0
        per_d = rates[2] / n_d if n_d else 0.0
        stats = (f"Eq. 8: Theta_prfaas + Theta_pd-p = {rates[0]:.3g} + {rates[1]:.3g} vs "
                 f"Theta_pd-d = {rates[2]:.3g} req/s")
        to_decode = gap > limit and not backed[0] and abs(eq8_gap(
            (rates[0], rates[1] - per_p, rates[2] + per_d))) < abs(gap)
        to_prefill = gap < -limit and not backed[1] and abs(eq8_gap(
            (rates[0], rates[1] + per_p, rates[2] - per_d))) < abs(gap)
        return to_decode, to_prefill, stats

    def _issue(self, now: float, action: ConvertWorker) -> ConvertWorker:
        self.conversions += 1
        self._pending = action
        self._last = (now, action.to_role)
        return action

    def expected_shape(self, state: ClusterState) -> ClusterShape:
        """The shape once the last conversion is done, while the router still carries it out
        (the worker shows its old role, then "draining"); t is solved for this shape."""
        shape = shape_of(state)
        pending = self._pending
        role = next((w.role for w in state.workers if pending and w.name == pending.worker), None)
        if pending is None or role is None or role == pending.to_role:
            self._pending = None
            return shape
        if role == pending.from_role:
            return self.shape_after(shape, pending)
        grow = 1 if pending.to_role == "prefill" else 0
        return ClusterShape(shape.n_prfaas, shape.n_p + grow, shape.n_d + 1 - grow)

    @staticmethod
    def shape_after(shape: ClusterShape, action: ConvertWorker) -> ClusterShape:
        """The shape once `action` is done (what t is re-solved for)."""
        delta = 1 if action.to_role == "prefill" else -1
        return ClusterShape(shape.n_prfaas, shape.n_p + delta, shape.n_d - delta)


class DynamicConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The modeled deployment (defaults: the paper's case study) and the loops' constants.

    The paper gives no constant of either loop (docs/paper-notes.md section 3.4, "What is
    missing"); ours, each an option, and why (docs/policies.md, "The dynamic threshold"):
    - `headroom` 0.2: Eq. 7 is solved on 80 % of the measured bandwidth, room for bursts and
      cache transfers;
    - `tilt` 2: the queues move t at most a factor 2 either side of Eq. 7's, enough to drain a
      backlog in a few minutes, not enough to undo what the link's measurement says;
    - `wait_floor_s` 5: waits well under the TTFT SLO (10 s) are noise, not imbalance;
    - `pd_load_max` 0.75: PD prefill is never planned above 75 % busy at the arrival rate
      measured over `rate_window_s` (60 s): Eq. 4 takes every request at the mean length of
      its side, which underrates a side's load (prefill time grows faster than length), and
      a queue left from a dip needs room to drain (docs/policies.md: 0.75 against 0.85);
    - `dwell_s` 5 and `min_rel_change` 0.1: t moves at most once per one long prefill's time,
      and only by more than 10 %, half way in log space toward where it is wanted, so one move
      shows its effect on the queues before the next.
    60 s for roles, since conversions drain and react to "gradual and often periodic" change.
    """

    prfaas_profile: str = "h200"
    pd_profile: str = "h20"
    model: str = "hybrid_1t"
    bandwidth_gbps: float = 100.0  # the modeled B_out at the provisioned rate
    n_prfaas: int = 4
    n_p: int = 3
    n_d: int = 5
    output_len: int = 1024
    mu: float = PAPER_MU
    sigma: float = PAPER_SIGMA
    min_len: float = PAPER_MIN_TOKENS
    max_len: float = PAPER_MAX_TOKENS
    token_scale: float = 1.0  # router tokens per modeled token (as `prfaas bench --scale`)
    abundant_below: float = 0.5
    bandwidth: BandwidthMode = "auto"
    headroom: float = 0.2
    tilt: float = 2.0
    wait_floor_s: float = 5.0
    pd_load_max: float = 0.75
    rate_window_s: float = 60.0
    min_rel_change: float = 0.1
    dwell_s: float = 5.0
    window: int = 1000
    min_samples: int = 50
    queue_smoothing_s: float = 10.0  # time constant of the queue depth averages (0: raw)
    roles: RoleConfig = RoleConfig()

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbps", "token_scale", "window", "tilt", "pd_load_max",
                     "rate_window_s"):
            if not getattr(self, name) > 0:
                raise PolicyError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("abundant_below", "headroom", "wait_floor_s",
                     "min_rel_change", "dwell_s", "queue_smoothing_s"):
            check_watermark(name, getattr(self, name))
        if not 0.0 <= self.headroom < 1.0:
            raise PolicyError(f"headroom must lie in [0, 1), got {self.headroom!r}")
        if self.tilt < 1.0:
            raise PolicyError(f"tilt must be >= 1, got {self.tilt!r}")

    def throughput_model(self) -> ThroughputModel:
        return ThroughputModel(CostModel.load(self.prfaas_profile, self.model),
                               CostModel.load(self.pd_profile, self.model),
                               self.bandwidth_gbps * 1e9, self.output_len)

    def initial_lengths(self) -> TruncatedLogNormal:
        return TruncatedLogNormal(self.mu, self.sigma, self.min_len, self.max_len)


class DynamicStatistics(PolicyStatistics, frozen=True):
    solves: int  # times the threshold search ran
    window: int  # recent incremental lengths held
    conversions: int  # ConvertWorker actions issued
    n_prfaas: int  # the shape t is solved for
    n_p: int
    n_d: int
    bandwidth_bps: float  # the modeled B_out t is solved on (from the link's estimate)
    measured_bps: float  # the link's estimate as its senders see it (0: none yet)
    queue_prfaas: float  # the short-term loop's averages (PrfaasDynamicPolicy)
    queue_pd: float
    wait_prfaas_s: float  # predicted wait of a request sent now to each side
    wait_pd_s: float
    arrival_rps: float  # measured over rate_window_s
    model_t: float | None  # Eq. 7's t at the measured bandwidth
    wanted_t: float | None  # where the queues and the PD bound want t


class Outlook(msgspec.Struct, frozen=True):
    """What the short-term loop sees at one tick, and where it wants t (class docstring)."""

    model_t: float  # Eq. 7 at the measured bandwidth
    wait_prfaas_s: float
    wait_pd_s: float
    pd_cap: float  # largest t that keeps PD prefill within pd_load_max (inf: no bound)
    wanted: float
    arrival_rps: float  # what the PD bound was computed at


class PrfaasDynamicPolicy(PolicyBase[DynamicConfig]):
    """`prfaas-dynamic`: the threshold rule with the paper's dual-timescale scheduler (paper
    section 3.4.3), measuring the link as its own senders see it.

    t starts where the planner puts it: `solve_threshold` (Eq. 7) on the configured hardware
    profiles, cluster shape and an initial length distribution (default: the paper's workload).

    Short-term loop (every `tick`), four steps:
    1. The steady state: Eq. 7 (`solve_threshold`) on the recent incremental lengths (a window
       of what `decide` saw) at the bandwidth the link carries now, B_eff = B_out * (measured /
       provisioned) * (1 - headroom), B_out being the modeled link at the provisioned rate
       (the line's bought rate if the router was told it, else the highest measured). The
       measurement is the router's own (`LinkEstimate`, services/router/link_meter.py): no
       rate the line is configured to is ever read.
    2. The transient: the predicted wait of a request sent now to each side, its cluster's
       queued prefills (averaged over `queue_smoothing_s`) over the stage's rate at the current
       t (Eqs. 3 and 4: the PrfaaS side's rate includes its link, so a congested link shows as
       a longer PrfaaS wait). The side that waits longer gets less: t is wanted at
       model t * tilt ** (-x), x = (W_pd - W_prfaas) / (W_pd + W_prfaas + wait_floor_s).
    3. The PD-side bound: at the arrival rate measured over `rate_window_s`, t is never
       wanted above the largest t that keeps PD prefill within `pd_load_max` of its rate
       (Eq. 4): a narrow link pushes long requests to PD prefill only as far as PD prefill can
       take. When nothing fits (the link cannot carry what PD prefill cannot), the PD cluster
       is kept serving: the requests it keeps meet their SLO, where raising t would have PD
       prefill miss it for all of them.
    4. The move: at most once per `dwell_s`, only if the wanted t differs by more than
       `min_rel_change`, half way there in log space (all the way when that is close).
    While the link is down t holds still.

    Long-term loop (every `roles.period_s`; `RoleBalancer`): re-estimate Theta_prfaas,
    Theta_pd-p and Theta_pd-d (the throughput model on the recent lengths and the current t,
    measured completions for a stage that stayed backed up), and convert the least loaded
    worker of the other role when a stage's queue is `imbalance` times the other's, or when
    Eq. 8 is off by more than `roles.margin` and one conversion brings it closer (the router
    drains the worker first); then re-solve t for the new N_p / N_d (Eq. 7). Nothing is
    converted while a worker is still draining; t is solved for the shape the pending
    conversion will leave.
    """

    name = "prfaas-dynamic"
    config_type = DynamicConfig

    def __init__(self, config: DynamicConfig | None = None, *,
                 model: ThroughputModel | None = None,
                 initial: LengthDistribution | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self._model = model or cfg.throughput_model()
        for side, cost in (("prfaas_profile", self._model.prfaas), ("pd_profile", self._model.pd)):
            if cost is None or not cost.profile.paced or cost.profile.prefill is None:
                raise PolicyError(f"{side} must model prefill time (a paced profile such as "
                                  f"h200 or h20), got {cost.profile.name if cost else None!r}")
        self._initial = initial or cfg.initial_lengths()
        self._shape = ClusterShape(cfg.n_prfaas, cfg.n_p, cfg.n_d)
        self._window: deque[float] = deque(maxlen=cfg.window)
        self._arrivals: deque[float] = deque()
        self._last_rate = 0.0  # the arrival rate of the last tick
        self._link: LinkSample | None = None
        self._measured_bps = 0.0
        self._provisioned_bps = 0.0  # the line's bought rate, or the highest estimate so far
        self._queues = (Ewma(cfg.queue_smoothing_s), Ewma(cfg.queue_smoothing_s))
        self._last_change = -math.inf
        self._roles = RoleBalancer(cfg.roles, self.stage_rates, self._loads, cfg.pd_load_max)
        self._solves = 0
        self._outlook: Outlook | None = None
        self._t = self._solve()

    def _own_threshold(self) -> float:
        return self._t

    def _decide(self, inputs: RouteInputs) -> Decision:
        below, mode = self.config.abundant_below, self.config.bandwidth
        scarce = is_bandwidth_scarce(inputs, below, mode)
        t = self.threshold
        assert t is not None
        decision = threshold_rule(inputs, t, scarce, self.name, link_note(inputs, below, mode))
        self._window.append(decision.incremental_len / self.config.token_scale)
        self._arrivals.append(inputs.now)
        return decision

    def stage_rates(self, shape: ClusterShape) -> tuple[float, float, float]:
        """The model's Theta_prfaas, Theta_pd-p, Theta_pd-d (req/s) for `shape`, on the
        recent lengths at the current t (what the long-term loop compares, Eq. 8)."""
        point = self._point(self._t, shape)
        return point.theta_prfaas, point.theta_pd_p, point.theta_pd_d

    def _point(self, t: float, shape: ClusterShape) -> OperatingPoint:
        model = replace(self._model, bandwidth_bps=self.bandwidth_bps())
        return model.evaluate(self.lengths(), t / self.config.token_scale, shape)

    def observe(self, feedback: Feedback) -> None:
        super().observe(feedback)
        if isinstance(feedback, RequestFinished) and feedback.ok:
            self._roles.finished(feedback.cluster)
        elif isinstance(feedback, LinkSample):
            self._link = feedback
        elif isinstance(feedback, LinkEstimate) and feedback.available_bps > 0:
            self._measured_bps = feedback.available_bps
            self._provisioned_bps = feedback.provisioned_bps or max(self._provisioned_bps,
                                                                    feedback.available_bps)

    def lengths(self) -> LengthDistribution:
        """What t is solved on: the recent window (modeled tokens), or the initial guess."""
        if len(self._window) >= max(1, self.config.min_samples):
            return EmpiricalLengths.from_samples(self._window)
        return self._initial

    def bandwidth_bps(self) -> float:
        """B_eff of the class docstring, in modeled bits per second."""
        cfg = self.config
        fraction = 1.0
        if self._measured_bps > 0 and self._provisioned_bps > 0:
            fraction = min(1.0, self._measured_bps / self._provisioned_bps)
        return max(cfg.bandwidth_gbps * 1e9 * fraction * (1.0 - cfg.headroom), 1.0)

    def arrival_rate(self, now: float) -> float:
        """Requests decided per second over the last `rate_window_s` (a whole window even
        while the first is filling: the first seconds' few arrivals are no rate to bound t
        by)."""
        horizon = now - self.config.rate_window_s
        while self._arrivals and self._arrivals[0] < horizon:
            self._arrivals.popleft()
        return len(self._arrivals) / self.config.rate_window_s

    def _solve(self) -> float:
        """The model's t (Eq. 7) in router tokens for the current lengths, bandwidth, shape."""
        self._solves += 1
        t = solve_threshold(self._model, self.lengths(), self._shape,
                            bandwidth_bps=self.bandwidth_bps())
        return t * self.config.token_scale

    def tick(self, now: float, state: ClusterState) -> list[Action]:
        actions: list[Action] = []
        conversion = self._roles.tick(now, state)
        if state.workers:
            self._shape = self._roles.expected_shape(state)
        if conversion is not None:
            actions.append(conversion)
            # The PD bound holds for the new shape too.
            solved = min(self._solve(), self._pd_cap(self._last_rate))
            actions += self._move(now, solved, "long-term: re-solved for N_p / N_d "
                                  f"= {self._shape.n_p} / {self._shape.n_d}", force=True)
        actions += self._short_term(now, state)
        return actions

    def outlook(self, now: float, state: ClusterState) -> Outlook:
        """Steps 1-3 of the class docstring: Eq. 7's t, both waits, the PD bound, the wish."""
        cfg = self.config
        depths = [sum(w.backlog for w in state.select(c, "prefill")) for c in ("prfaas", "pd")]
        queue_prfaas, queue_pd = (self._queues[i].update(now, depths[i]) for i in (0, 1))
        model_t = self._solve()
        point = self._point(self._t, self._shape)
        wait_prfaas = queue_prfaas / point.theta_prfaas if point.theta_prfaas > 0 else math.inf
        wait_pd = queue_pd / point.theta_pd_p if point.theta_pd_p > 0 else math.inf
        wanted = model_t
        if math.isfinite(model_t) and model_t > 0 and math.isfinite(wait_prfaas + wait_pd):
            x = (wait_pd - wait_prfaas) / (wait_pd + wait_prfaas + cfg.wait_floor_s)
            wanted = model_t * cfg.tilt ** (-x)
        rate = self._last_rate = self.arrival_rate(now)
        cap = self._pd_cap(rate)
        return Outlook(model_t, wait_prfaas, wait_pd, cap, min(wanted, cap), rate)

    def _loads(self, shape: ClusterShape) -> Rates | None:
        """Each stage's load in `shape` at the arrival rate measured now and the current t:
        its arrivals over its rate (Eqs. 3-5); None at a rate of 0 (no traffic: no evidence
        to convert on)."""
        rate = self._last_rate
        if rate <= 0:
            return None
        point = self._point(self._t, shape)

        def load(arrivals: float, theta: float) -> float:
            return arrivals / theta if theta > 0 else (math.inf if arrivals > 0 else 0.0)
        return (load(rate * point.p, point.theta_prfaas),
                load(rate * (1.0 - point.p), point.theta_pd_p), load(rate, point.theta_pd_d))

    def _pd_cap(self, rate: float) -> float:
        """Step 3: the largest t (router tokens) at which PD prefill, fed the requests at or
        under t at `rate`, stays within `pd_load_max` of Eq. 4's rate; inf when any t does."""
        lengths, shape = self.lengths(), self._shape
        if rate <= 0 or shape.n_p == 0 or shape.n_prfaas == 0:
            return math.inf

        def load(t: float) -> float:
            p = lengths.survival(t)
            short, _ = lengths.conditional_means(t)
            theta = self._model.theta_pd_p(short, shape.n_p)
            return rate * (1.0 - p) / theta if theta > 0 else math.inf

        limit = self.config.pd_load_max
        low, high = lengths.lo - 1.0, lengths.hi
        if load(high) <= limit:
            return math.inf
        while high - low > 1.0:
            mid = 0.5 * (low + high)
            low, high = (mid, high) if load(mid) <= limit else (low, mid)
        return low * self.config.token_scale

    def _short_term(self, now: float, state: ClusterState) -> list[Action]:
        """Steps 1-4 of the class docstring."""
        cfg = self.config
        self._outlook = outlook = self.outlook(now, state)
        link_down = self._link is not None and not self._link.up
        if link_down or now - self._last_change < cfg.dwell_s:
            return []
        wanted, old = outlook.wanted, self._t
        if _close(old, wanted, cfg.min_rel_change):
            return []
        new = _halfway(old, wanted, cfg.min_rel_change)
        why = (f"short-term: wait PrfaaS {outlook.wait_prfaas_s:.3g} s / PD "
               f"{outlook.wait_pd_s:.3g} s, Eq. 7 t {format_tokens(outlook.model_t)}")
        if math.isfinite(outlook.pd_cap) and outlook.pd_cap <= wanted:
            why += f", PD prefill bound {format_tokens(outlook.pd_cap)}"
        return self._move(now, new, why)

    def _move(self, now: float, new: float, why: str, *, force: bool = False) -> list[Action]:
        """Apply t = new if it is far enough from t (or `force`); the announcing action."""
        old = self._t
        if self._override is not None or new == old:
            return []
        if not force and _close(old, new, self.config.min_rel_change):
            return []
        self._t, self._last_change = new, now
        bandwidth = self.bandwidth_bps() / 1e9
        return [SetThreshold(old=old, new=new, reason=(
            f"{why}; t {format_tokens(old)} -> {format_tokens(new)} "
            f"(B_eff {bandwidth:.3g} Gbps, {len(self._window)} recent lengths)"))]

    def set_threshold_override(self, t: float | None) -> None:
        super().set_threshold_override(t)
        self._last_change = -math.inf

    def _integrity_problems(self) -> list[str]:
        problems = super()._integrity_problems()
        if len(self._window) > self.config.window:
            problems.append(f"window holds {len(self._window)} > {self.config.window}")
        if any(not (math.isfinite(x) and x >= 0) for x in self._window):
            problems.append("window holds a length that is not finite and >= 0")
        for name, average in (("PrfaaS queue", self._queues[0]), ("PD queue", self._queues[1])):
            if not average.value >= 0.0:
                problems.append(f"smoothed {name} {average.value!r} is not >= 0")
        return problems

    def statistics(self) -> DynamicStatistics:
        base = msgspec.structs.asdict(super().statistics())
        outlook = self._outlook
        return DynamicStatistics(
            **base, solves=self._solves, window=len(self._window),
            conversions=self._roles.conversions, n_prfaas=self._shape.n_prfaas,
            n_p=self._shape.n_p, n_d=self._shape.n_d, bandwidth_bps=self.bandwidth_bps(),
            measured_bps=self._measured_bps, queue_prfaas=self._queues[0].value,
            queue_pd=self._queues[1].value,
            wait_prfaas_s=outlook.wait_prfaas_s if outlook else 0.0,
            wait_pd_s=outlook.wait_pd_s if outlook else 0.0,
            arrival_rps=outlook.arrival_rps if outlook else 0.0,
            model_t=json_threshold(outlook.model_t) if outlook else None,
            wanted_t=json_threshold(outlook.wanted) if outlook else None)


def _close(old: float, new: float, min_rel_change: float) -> bool:
    """Within `min_rel_change` of each other (infinite values only equal to themselves)."""
    if not (math.isfinite(old) and math.isfinite(new)):
        return old == new
    return abs(new - old) <= min_rel_change * max(abs(old), 1.0)


def _halfway(t: float, target: float, min_rel_change: float) -> float:
    """One move from t toward target: half way in log space, straight there when half way
    would stay within twice `min_rel_change` of it (t or target 0 or infinite: straight)."""
    if not (0 < t < math.inf and 0 < target < math.inf):
        return target
    middle = math.sqrt(t * target)
    return target if _close(middle, target, 2 * min_rel_change) else middle


# The one list of policies: the CLI, the router, the dashboard and the simulation read it.
REGISTERED = (
    HomogeneousPolicy, NaiveHeteroPolicy, PrfaasPolicy, PrfaasDynamicPolicy, DynamoPolicy,
)
PolicyFactory = Callable[[Mapping[str, object]], Policy]
POLICIES: dict[str, PolicyFactory] = {cls.name: cls.from_options for cls in REGISTERED}


def create_policy(name: str, options: Mapping[str, object] | None = None) -> Policy:
    """A fresh policy by name, configured from plain options (unknown keys are refused)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise PolicyError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return factory(options or {})
