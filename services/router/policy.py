"""The routing policy interface: what the router asks a policy, and what a policy answers.

The router (services/router/app.py) owns the I/O; a policy is pure state on an injected clock
(`now` is passed in), so the same policy runs live and on virtual time. Per request:

    inputs = RouteInputs(request_id=..., total_len=..., cached_prfaas=..., cached_pd=...,
                         link_utilisation=..., queue_prfaas=..., queue_pd=..., now=...)
    decision = policy.decide(inputs)                    # which cluster prefills, and why
    ...choose workers (services/router/workers.py), run the request...
    event = decision_event(inputs, decision, policy=policy.name, prefill_worker=...,
                           decode_worker=..., ts=..., source="router")
    policy.observe(RequestFinished(...))                 # feedback when it completes

and periodically, for the control loops (paper section 3.4.3):

    policy.observe(LinkSample(...))                      # from the link's LinkStats
    for action in policy.tick(now, ClusterState(workers=...)):
        SetThreshold: already applied by the policy; publish `action_event(action, ...)`.
        ConvertWorker: drain `worker`, then switch it to `to_role` (the router does both).

Cached lengths are *resumable* prefixes in tokens (services/cachedir/directory.py: blocks_resumable
times the block size) of the best worker per cluster. Lengths are whatever unit the router
counts in; policies that use the paper's cost model take a `token_scale` to convert.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Generic, Literal, Protocol, TypeVar

import msgspec

from services.contract.events import RoleChanged, RoutingDecision, ThresholdChanged
from services.contract.types import Cluster, WorkerRole

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
    """One sample of a PrfaaS egress link (telemetry.LinkStats carries the same fields)."""

    now: float
    link: str = ""  # its name in the topology ("": the only link)
    utilisation: float  # throughput / bandwidth
    bandwidth_bps: float  # the link's configured rate now; 0 = unshaped
    stalls: int  # cumulative stall count of the link
    up: bool = True
    backlog_s: float = 0.0  # wire time of the bytes queued on it now (egress)


Feedback = RequestFinished | LinkSample


class WorkerState(msgspec.Struct, frozen=True, kw_only=True):
    """One prefill or decode worker as the router sees it at a control tick."""

    name: str
    cluster: Cluster
    role: WorkerRole
    queue: int = 0  # requests waiting for this worker
    running: int = 0  # requests in prefill, or in the decode batch

    @property
    def load(self) -> int:
        return self.queue + self.running


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    """Every worker of every cluster, for the control loops."""

    workers: tuple[WorkerState, ...] = ()

    def select(self, cluster: Cluster, role: WorkerRole) -> list[WorkerState]:
        return [w for w in self.workers if w.cluster == cluster and w.role == role]


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
    """A length or threshold for reason lines: 19,400; inf; none."""
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
