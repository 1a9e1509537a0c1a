"""`prfaas-dynamic`: the threshold rule with the paper's dual-timescale scheduler (section 3.4.3).

t starts where the planner puts it: `solve_threshold` (Eq. 7) on the configured hardware
profiles, cluster shape and an initial length distribution (default: the paper's workload).

Short-term loop (every `tick`). Signals, as the paper lists them: PrfaaS egress utilisation,
queue depths and transfer stalls. Utilisation is averaged over `smoothing_s` and both queue
depths over `queue_smoothing_s` (exponential averages on the caller's clock), so one long
transfer on a slow link, or a burst of arrivals, is not congestion; a sustained excess is.
The re-search of t ("model t") uses the *recent* incremental lengths (a window of what
`decide` saw) and the *current* effective bandwidth: B_eff = B_out * (link rate now /
nominal rate) * (1 - headroom), times `stall_derate` while stalls are recent. Three moves, at
most one per `dwell_s`, each only if t changes by more than `min_rel_change`:
- congested (utilisation >= high watermark, new stalls, or PrfaaS queue >= surge): t may only
  rise, to max(model t, step * t). The step makes t rise even when the model sees no reason
  (its profile or the traffic is off), because what the link measures wins over the model.
- PD prefill queue >= surge while the link is calm and the PrfaaS queue < surge / 2: t may
  only fall, to min(model t, t / step).
- the link calm for `calm_s` (utilisation <= low watermark, no stall for `calm_s`): t moves
  toward the model t, halfway in log space and at least one step (never past it). Only the
  link starts or resets this timer; the queues only veto a direction: t does not fall while
  the PrfaaS queue is >= surge / 2 (PrfaaS has no slack to take more), nor rise while the PD
  queue is (PD has none). This is how t comes back after a cut: react at once, recover once
  the link has been calm for a while, quickly but without overshooting the model.
Between the watermarks nothing moves, and a queue must fall to half the surge before it stops
vetoing: those gaps are the hysteresis.

Long-term loop (every `roles.period_s`; services/router/policies/roles.py): re-estimate
Theta_prfaas, Theta_pd-p and Theta_pd-d (the throughput model on the recent lengths and the
current t, measured completions for a stage that stayed backed up), and convert the least
loaded worker of the other role when a stage's queue is `imbalance` times the other's, or
when Eq. 8 is off by more than `roles.margin` and one conversion brings it closer (the router
drains the worker first); then re-solve t for the new N_p / N_d (Eq. 7). Nothing is
converted while a worker is still draining; t is solved for the shape the
pending conversion will leave.

The paper gives no watermark, step, average or period (docs/paper-notes.md section 3.4 "What is
missing"). Ours: 0.8 leaves 20 % of the link for bursts and cache transfers (the brief's
example), 0.5 leaves a 0.3 gap so one move of t cannot carry utilisation across both marks.
A step of 1.25 per 5 s reaches a 10x rise in about 50 s, yet each move waits for one long
prefill (1.8 s at 32K on H200, Table 5) to show its effect first. The averages' 10 s spans
several such prefills and a few Poisson arrivals at the paper's rates (about 3 req/s), so a
burst or one slow transfer moves an average by a fraction of its size. `calm_s` = 10 s, one
averaging time, asks the link to be calm for longer than any such burst before t recovers.
Halving the log distance per move recovers from 10x away to within 15 % in four moves
(10 -> 3.2 -> 1.8 -> 1.33 -> 1.07), the last three 5 s apart; with the ~7 s the utilisation
average needs to fall from 1 to 0.5 and the 10 s calm, t is back about 32 s after the link
(the tests ask for 40 s). One step at a time took ten moves and, as long as PD queue spikes
restarted the calm timer, over 100 s.
60 s for roles, since conversions drain and react to "gradual and often periodic" change. All
are options.
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

from services.paper.hardware import CostModel
from services.paper.planner import ClusterShape, ThroughputModel, solve_threshold
from services.paper.workload import EmpiricalLengths, LengthDistribution, TruncatedLogNormal
from services.router.policies.ewma import Ewma
from services.router.policies.prfaas import check_watermark, threshold_rule
from services.router.policies.roles import RoleBalancer, RoleConfig
from services.router.policy import (
    Action,
    BandwidthMode,
    ClusterState,
    Decision,
    Feedback,
    LinkSample,
    PolicyBase,
    PolicyError,
    PolicyStatistics,
    RequestFinished,
    RouteInputs,
    SetThreshold,
    format_tokens,
    is_bandwidth_scarce,
    link_note,
)


class DynamicConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The modeled deployment (defaults: the paper's case study) and the loops' constants."""

    prfaas_profile: str = "h200"
    pd_profile: str = "h20"
    model: str = "hybrid_1t"
    bandwidth_gbps: float = 100.0
    n_prfaas: int = 4
    n_p: int = 3
    n_d: int = 5
    output_len: int = 1024
    mu: float = 9.90
    sigma: float = 1.00
    min_len: float = 128.0
    max_len: float = 131072.0
    token_scale: float = 1.0  # router tokens per modeled token (as `prfaas bench --scale`)
    abundant_below: float = 0.5
    bandwidth: BandwidthMode = "auto"
    high_watermark: float = 0.8
    low_watermark: float = 0.5
    headroom: float = 0.2
    stall_derate: float = 0.5
    queue_surge: int = 8  # queued prefill jobs, summed over one cluster's prefill workers
    step: float = 1.25
    min_rel_change: float = 0.05
    dwell_s: float = 5.0
    calm_s: float = 10.0
    window: int = 1000
    min_samples: int = 50
    link_nominal_bps: float = 0.0  # 0: the highest link rate seen so far
    smoothing_s: float = 10.0  # time constant of the utilisation average (0: raw samples)
    queue_smoothing_s: float = 10.0  # ... of the queue depth averages (0: raw depths)
    roles: RoleConfig = RoleConfig()

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbps", "token_scale", "step", "window"):
            if not getattr(self, name) > 0:
                raise PolicyError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("abundant_below", "high_watermark", "low_watermark", "headroom",
                     "stall_derate", "min_rel_change", "dwell_s", "calm_s", "link_nominal_bps",
                     "smoothing_s", "queue_smoothing_s"):
            check_watermark(name, getattr(self, name))
        if self.low_watermark > self.high_watermark:
            raise PolicyError(f"low_watermark must be <= high_watermark={self.high_watermark}, "
                              f"got {self.low_watermark!r}")
        if not 0.0 <= self.headroom < 1.0:
            raise PolicyError(f"headroom must lie in [0, 1), got {self.headroom!r}")

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
    utilisation: float  # the short-term loop's averages (module docstring)
    queue_prfaas: float
    queue_pd: float
    calm_since: float | None  # when the link became calm; None while it is not


class _Signals(msgspec.Struct, frozen=True):
    utilisation: float  # averaged over smoothing_s
    new_stalls: bool
    queue_prfaas: float  # averaged over queue_smoothing_s
    queue_pd: float
    calm: bool  # the link: utilisation <= low watermark, no stall for calm_s


class PrfaasDynamicPolicy(PolicyBase[DynamicConfig]):
    """The threshold rule; `tick` runs both loops on the caller's clock."""

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
        self._link: LinkSample | None = None
        self._utilisation = Ewma(cfg.smoothing_s)
        self._queues = (Ewma(cfg.queue_smoothing_s), Ewma(cfg.queue_smoothing_s))
        self._nominal_bps = cfg.link_nominal_bps
        self._stalls_seen: int | None = None
        self._last_stall = self._last_change = -math.inf
        self._calm_since: float | None = None
        self._roles = RoleBalancer(cfg.roles, self.stage_rates)
        self._solves = 0
        self._t = self._solve(-math.inf)


    def _own_threshold(self) -> float:
        return self._t

    def _decide(self, inputs: RouteInputs) -> Decision:
        below, mode = self.config.abundant_below, self.config.bandwidth
        scarce = is_bandwidth_scarce(inputs, below, mode)
        t = self.threshold
        assert t is not None
        decision = threshold_rule(inputs, t, scarce, self.name, link_note(inputs, below, mode))
        self._window.append(decision.incremental_len / self.config.token_scale)
        return decision

    def stage_rates(self, shape: ClusterShape) -> tuple[float, float, float]:
        """The model's Theta_prfaas, Theta_pd-p, Theta_pd-d (req/s) for `shape`, on the
        recent lengths at the current t (what the long-term loop compares, Eq. 8)."""
        t = self._t / self.config.token_scale
        point = self._model.evaluate(self.lengths(), t, shape)
        return point.theta_prfaas, point.theta_pd_p, point.theta_pd_d

    def observe(self, feedback: Feedback) -> None:
        super().observe(feedback)
        if isinstance(feedback, RequestFinished) and feedback.ok:
            self._roles.finished(feedback.cluster)
        if isinstance(feedback, LinkSample):
            self._utilisation.update(feedback.now, feedback.utilisation)
            self._link = feedback
            if self.config.link_nominal_bps == 0.0:
                self._nominal_bps = max(self._nominal_bps, feedback.bandwidth_bps)

    def lengths(self) -> LengthDistribution:
        """What t is solved on: the recent window (modeled tokens), or the initial guess."""
        if len(self._window) >= max(1, self.config.min_samples):
            return EmpiricalLengths.from_samples(self._window)
        return self._initial

    def effective_bandwidth_bps(self, now: float) -> float:
        """B_eff of the module docstring, in modeled bits per second."""
        cfg = self.config
        fraction = 1.0
        link = self._link
        if link is not None and link.bandwidth_bps > 0 and self._nominal_bps > 0:
            fraction = min(1.0, link.bandwidth_bps / self._nominal_bps)
        if now - self._last_stall < cfg.calm_s:
            fraction *= cfg.stall_derate
        return max(cfg.bandwidth_gbps * 1e9 * fraction * (1.0 - cfg.headroom), 1.0)

    def _solve(self, now: float) -> float:
        """The model's t (Eq. 7) in router tokens for the current lengths, bandwidth, shape."""
        self._solves += 1
        t = solve_threshold(self._model, self.lengths(), self._shape,
                            bandwidth_bps=self.effective_bandwidth_bps(now))
        return t * self.config.token_scale

    def tick(self, now: float, state: ClusterState) -> list[Action]:
        actions: list[Action] = []
        conversion = self._roles.tick(now, state)
        if state.workers:
            self._shape = self._roles.expected_shape(state)
        if conversion is not None:
            actions.append(conversion)
            actions += self._move(now, self._solve(now), "long-term: re-solved for N_p / N_d "
                                  f"= {self._shape.n_p} / {self._shape.n_d}", force=True)
        actions += self._short_term(now, state)
        return actions

    def _signals(self, now: float, state: ClusterState) -> _Signals:
        cfg = self.config
        link = self._link
        new_stalls = False
        if link is not None:
            if self._stalls_seen is not None and link.stalls > self._stalls_seen:
                new_stalls = True
                self._last_stall = now
            self._stalls_seen = link.stalls
        depths = [sum(w.queue for w in state.select(c, "prefill")) for c in ("prfaas", "pd")]
        prfaas, pd = (self._queues[i].update(now, depths[i]) for i in (0, 1))
        utilisation = self._utilisation.value
        calm = utilisation <= cfg.low_watermark and now - self._last_stall >= cfg.calm_s
        return _Signals(utilisation, new_stalls, prfaas, pd, calm)

    def _update_calm(self, now: float, calm: bool) -> None:
        """The calm timer: only the link starts or resets it (module docstring)."""
        if not calm:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now

    def _congestion(self, s: _Signals) -> str | None:
        """Why the PrfaaS side is congested, or None."""
        cfg = self.config
        causes = []
        if s.utilisation >= cfg.high_watermark:
            causes.append(f"link utilisation {s.utilisation:.2f} >= {cfg.high_watermark:g}")
        if s.new_stalls:
            causes.append("transfer stalls")
        if s.queue_prfaas >= cfg.queue_surge:
            causes.append(f"PrfaaS queue {s.queue_prfaas:.3g} >= {cfg.queue_surge}")
        return "short-term: congested (" + ", ".join(causes) + ")" if causes else None

    def _short_term(self, now: float, state: ClusterState) -> list[Action]:
        """1. read the signals, 2. keep the calm timer, 3. hold still while the link is down
        or within `dwell_s` of the last move, 4. rise on congestion, 5. fall on a PD surge
        over a calm link, 6. else recover toward the model once calm for `calm_s`."""
        cfg = self.config
        s = self._signals(now, state)
        self._update_calm(now, s.calm)
        link_down = self._link is not None and not self._link.up
        if link_down or now - self._last_change < cfg.dwell_s:
            return []
        congestion = self._congestion(s)
        if congestion is not None:
            raised = max(self._solve(now), _scaled(self._t, cfg.step))
            return self._move(now, raised, congestion, rise=True)
        if s.queue_pd >= cfg.queue_surge and s.calm and s.queue_prfaas < cfg.queue_surge / 2:
            lowered = min(self._solve(now), _scaled(self._t, 1.0 / cfg.step))
            return self._move(now, lowered, f"short-term: PD prefill queue {s.queue_pd:.3g} >= "
                              f"{cfg.queue_surge}, link calm", fall=True)
        if self._calm_since is not None and now - self._calm_since >= cfg.calm_s:
            return self._recover(now, s)
        return []

    def _recover(self, now: float, s: _Signals) -> list[Action]:
        """One move toward the model's t, unless the side it would load has no slack."""
        model, half = self._solve(now), self.config.queue_surge / 2
        if (model < self._t and s.queue_prfaas >= half) or (model > self._t and s.queue_pd >= half):
            return []
        toward = _toward(self._t, model, self.config.step)
        return self._move(now, toward, f"short-term: link calm for {self.config.calm_s:g} s, "
                          "halfway toward the model's t")

    def _move(self, now: float, new: float, why: str, *, rise: bool = False,
              fall: bool = False, force: bool = False) -> list[Action]:
        """Apply t = new if it goes the allowed way and far enough; the announcing action."""
        old = self._t
        if self._override is not None or new == old:
            return []
        if (rise and new < old) or (fall and new > old):
            return []
        if not force and not _far_enough(old, new, self.config.min_rel_change):
            return []
        self._t, self._last_change = new, now
        bandwidth = self.effective_bandwidth_bps(now) / 1e9
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
        for name, average in (("utilisation", self._utilisation), ("PrfaaS queue",
                              self._queues[0]), ("PD queue", self._queues[1])):
            if not average.value >= 0.0:
                problems.append(f"smoothed {name} {average.value!r} is not >= 0")
        return problems

    def statistics(self) -> DynamicStatistics:
        base = msgspec.structs.asdict(super().statistics())
        return DynamicStatistics(
            **base, solves=self._solves, window=len(self._window),
            conversions=self._roles.conversions, n_prfaas=self._shape.n_prfaas,
            n_p=self._shape.n_p, n_d=self._shape.n_d, utilisation=self._utilisation.value,
            queue_prfaas=self._queues[0].value, queue_pd=self._queues[1].value,
            calm_since=self._calm_since)


def _scaled(t: float, factor: float) -> float:
    """t times factor; a t of 0 (or -inf: PrfaaS takes all) rises from 1 token."""
    return (t if t > 0 else 1.0) * factor if factor > 1 else t * factor


def _toward(t: float, target: float, step: float) -> float:
    """One recovery move from t to target: halfway in log space, at least a factor `step`,
    never past target (t or target 0 or infinite: one step, as `_scaled` takes it)."""
    if not (0 < t < math.inf and 0 < target < math.inf):
        return min(max(target, _scaled(t, 1.0 / step)), _scaled(t, step))
    if target < t:
        return max(target, min(math.sqrt(t * target), t / step))
    return min(target, max(math.sqrt(t * target), t * step))


def _far_enough(old: float, new: float, min_rel_change: float) -> bool:
    if not (math.isfinite(old) and math.isfinite(new)):
        return old != new
    return abs(new - old) > min_rel_change * max(abs(old), 1.0)
