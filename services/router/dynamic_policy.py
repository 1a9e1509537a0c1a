"""`prfaas-dynamic`: the threshold rule with the paper's dual-timescale scheduler, whose
short-term loop moves t with the link and both queues (its long-term loop is
services/router/role_balancer.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import msgspec

from services.paper.planner import (
    ClusterShape,
    ModeledCase,
    OperatingPoint,
    ThroughputModel,
    solve_threshold,
)
from services.paper.workload import (
    EmpiricalLengths,
    LengthDistribution,
)
from services.router.link_meter import LinkEstimate
from services.router.policy import (
    Action,
    ClusterState,
    Decision,
    Feedback,
    LinkSample,
    PolicyError,
    PolicyStatistics,
    RequestFinished,
    RouteInputs,
    SetThreshold,
    json_threshold,
)
from services.router.role_balancer import Rates, RoleBalancer, RoleConfig
from services.router.static_policies import (
    PolicyBase,
    PrefixRule,
    check_watermark,
    format_tokens,
    is_bandwidth_scarce,
    link_note,
    threshold_rule,
)


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



class DynamicConfig(ModeledCase, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The modeled deployment (the case, defaults the paper's, and the PrfaaS-PD split's
    instances) and the loops' constants.

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

    n_prfaas: int = 4
    n_p: int = 3
    n_d: int = 5
    token_scale: float = 1.0  # router tokens per modeled token (as `prfaas bench --scale`)
    abundant_below: float = 0.5
    prefix_rule: PrefixRule = "auto"
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
        self._initial = initial or cfg.distribution()
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
        self._threshold = self._solve()

    def _own_threshold(self) -> float:
        return self._threshold

    def _decide(self, inputs: RouteInputs) -> Decision:
        below, mode = self.config.abundant_below, self.config.prefix_rule
        scarce = is_bandwidth_scarce(inputs, below, mode)
        threshold = self.threshold
        assert threshold is not None
        decision = threshold_rule(inputs, threshold, scarce, self.name,
                                  link_note(inputs, below, mode))
        self._window.append(decision.incremental_len / self.config.token_scale)
        self._arrivals.append(inputs.now)
        return decision

    def stage_rates(self, shape: ClusterShape) -> tuple[float, float, float]:
        """The model's Theta_prfaas, Theta_pd-p, Theta_pd-d (req/s) for `shape`, on the
        recent lengths at the current t (what the long-term loop compares, Eq. 8)."""
        point = self._point(self._threshold, shape)
        return point.theta_prfaas, point.theta_pd_p, point.theta_pd_d

    def _point(self, threshold: float, shape: ClusterShape) -> OperatingPoint:
        model = replace(self._model, bandwidth_bps=self.bandwidth_bps())
        return model.evaluate(self.lengths(), threshold / self.config.token_scale, shape)

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
        threshold = solve_threshold(self._model, self.lengths(), self._shape,
                                    bandwidth_bps=self.bandwidth_bps())
        return threshold * self.config.token_scale

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
        point = self._point(self._threshold, self._shape)
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
        point = self._point(self._threshold, shape)

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

        def load(threshold: float) -> float:
            p = lengths.survival(threshold)
            short, _ = lengths.conditional_means(threshold)
            theta = self._model.theta_pd_p(short, shape.n_p)
            return rate * (1.0 - p) / theta if theta > 0 else math.inf

        load_max = self.config.pd_load_max
        low, high = lengths.lo - 1.0, lengths.hi
        if load(high) <= load_max:
            return math.inf
        while high - low > 1.0:
            mid = 0.5 * (low + high)
            low, high = (mid, high) if load(mid) <= load_max else (low, mid)
        return low * self.config.token_scale

    def _short_term(self, now: float, state: ClusterState) -> list[Action]:
        """Steps 1-4 of the class docstring."""
        cfg = self.config
        self._outlook = outlook = self.outlook(now, state)
        link_down = self._link is not None and not self._link.up
        if link_down or now - self._last_change < cfg.dwell_s:
            return []
        wanted, old = outlook.wanted, self._threshold
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
        old = self._threshold
        if self._threshold_override is not None or new == old:
            return []
        if not force and _close(old, new, self.config.min_rel_change):
            return []
        self._threshold, self._last_change = new, now
        bandwidth = self.bandwidth_bps() / 1e9
        return [SetThreshold(old=old, new=new, reason=(
            f"{why}; t {format_tokens(old)} -> {format_tokens(new)} "
            f"(B_eff {bandwidth:.3g} Gbps, {len(self._window)} recent lengths)"))]

    def set_threshold_override(self, threshold: float | None) -> None:
        super().set_threshold_override(threshold)
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


def _halfway(threshold: float, target: float, min_rel_change: float) -> float:
    """One move from t toward target: half way in log space, straight there when half way
    would stay within twice `min_rel_change` of it (t or target 0 or infinite: straight)."""
    if not (0 < threshold < math.inf and 0 < target < math.inf):
        return target
    middle = math.sqrt(threshold * target)
    return target if _close(middle, target, 2 * min_rel_change) else middle
