"""A deployment's capacity, measured in the simulation: its saturation and its SLO capacity.

Two numbers, as a researcher who trusts Vidur expects them (Vidur's capacity search: a binary
search on the rate with an SLO on the P99 scheduling delay, 5 s by default):

1. Saturation (the service capacity). The deployment is offered well above the planner's
   Lambda_max; over the steady part of the run each stage's completions per second X and its
   busy fraction rho give what the stage could serve, X / rho (services/sim/run.py measures
   rho), and dividing by the share of requests that cross it gives the arrival rate it could
   sustain. The saturation is the least of these: the measured counterpart of the planner's
   Eq. 6. For one stage fed by everything it is the completions per second at rho = 1; with two
   prefill branches (PrfaaS-PD) the completions of an overloaded run also hold the other
   branch's, which is why each stage is divided by its share instead.
2. The SLO capacity: per seed, the largest rate, found by bisection to `resolution_rps`, at
   which the P99 queueing delay before prefill, the P99 TPOT and, where the SLO sets one, the
   P90 TTFT (arrival to the first token, on the client's clock) all hold (`Slo`) over the
   steady part of a run; the bisection's upper end is the saturation, so it can never report
   more. Over the seeds: the mean and a 95% Student t interval.

`measure_capacity` is a plain function of a deployment, a workload and seeds; the runs of the
seeds are independent and go through the `run_map` it is given (the builtin `map` by
default), so another executor (Ray tasks, say) can run them without a change here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import msgspec

from services.paper.case_study import DECODE_STEP_S
from services.sim.run import STAGES, Sample, SimResult, run_virtual
from services.sim.workload import Workload
from services.sim.world import Deployment

# Two-sided 95% Student t quantiles by degrees of freedom (any statistics table).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
# A stage this idle says nothing of its ceiling (X / rho would be noise over noise).
_IDLE_RHO = 0.05
_MAX_STEPS_DOWN = 4
# The TTFT bound is on its P90 (issue 30's SLO: "TTFT P90 and TPOT bounds").
TTFT_QUANTILE = 0.9


class Slo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What must hold at a rate for it to count: P(quantile) of the queueing delay before
    prefill and of TPOT, and the P90 of TTFT where `ttft_p90_s` is set. Defaults: Vidur's
    P99 scheduling delay of 5 s; the paper's decode SLO (services/paper/case_study.py) with
    5% slack; no TTFT bound (the paper states none)."""

    queue_s: float = 5.0
    tpot_s: float = DECODE_STEP_S * 1.05
    quantile: float = 0.99
    ttft_p90_s: float | None = None

    def __post_init__(self) -> None:
        if self.ttft_p90_s is not None and not self.ttft_p90_s > 0:
            raise ValueError(f"ttft_p90_s must be > 0 seconds or absent, got {self.ttft_p90_s}")

    def holds(self, queue_s: float, tpot_s: float, ttft_p90_s: float) -> bool:
        """Whether measured quantiles meet every bound this SLO sets."""
        ttft_ok = self.ttft_p90_s is None or ttft_p90_s <= self.ttft_p90_s
        return queue_s <= self.queue_s and tpot_s <= self.tpot_s and ttft_ok

    def text(self) -> str:
        """The bounds in words, as the reports state them."""
        quantile = f"P{100 * self.quantile:g}"
        ttft = (f"P90 TTFT <= {self.ttft_p90_s:g} s" if self.ttft_p90_s is not None
                else "no TTFT bound")
        return (f"{quantile} queueing before prefill <= {self.queue_s:g} s, {quantile} TPOT "
                f"<= {1e3 * self.tpot_s:g} ms, {ttft}")


class CapacityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the search runs: seeds, resolution, where it starts, how far it overloads."""

    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    resolution_rps: float = 0.05
    overload: float = 1.3  # the saturation runs offer this times the guess
    # The saturation runs' arrival window, as a share of the workload's: past saturation a
    # run's queues grow and each request costs more, and with every stage busy the
    # completions' spacing settles fast.
    saturation_window: float = 0.5
    # The bisection's lower start, as a share of the saturation: at the paper's lengths the
    # 5 s P99 queueing SLO holds only to about 55-65% of it (heavy-tailed prefill times).
    low: float = 0.5
    warmup: float = 0.2  # the share of each run's arrival window left out as warm-up
    # After the last arrival, what an SLO run waits for its requests: a 128K prompt's prefill
    # on H20 (22 s), a 5 s queue and 1,024 tokens at 40/s fit twice.
    drain_s: float = 120.0
    slo: Slo = Slo()

    def __post_init__(self) -> None:
        if len(self.seeds) < 2 or not self.resolution_rps > 0 or not self.overload > 1:
            raise ValueError(f"need >= 2 seeds, resolution_rps > 0 and overload > 1, got "
                             f"{self.seeds}, {self.resolution_rps}, {self.overload}")
        if not (0 < self.low < 1 and 0 <= self.warmup < 1 and 0 < self.saturation_window <= 1):
            raise ValueError(f"low and saturation_window must be in (0, 1] and warmup in "
                             f"[0, 1), got {self.low}, {self.saturation_window}, {self.warmup}")


class RatePoint(msgspec.Struct, frozen=True):
    """One run at `rate`: what was measured over its steady window, and whether the SLO held."""

    seed: int
    rate: float
    holds: bool
    completed_rps: float
    queue_s: float  # at the SLO's quantile; inf when a request never started its prefill
    tpot_s: float  # at the SLO's quantile
    rho: dict[str, float]  # stage -> busy fraction over the steady window
    stage_rps: dict[str, float]  # stage -> arrival rate it alone could sustain (X / rho / q)
    offload_share: float  # of the arrivals routed in the window
    virtual_s: float  # the run's length, drain included
    ttft_p90_s: float = math.nan  # P90 TTFT (client's clock; inf counts), bounded or not


class SeedCapacity(msgspec.Struct, frozen=True):
    seed: int
    saturation_rps: float
    capacity_rps: float  # the largest rate that held (0.0: none tried held)
    points: list[RatePoint]  # the saturation run first, then the bisection's, in order


class Capacity(msgspec.Struct, frozen=True):
    """A deployment's measured capacity over seeds (module docstring)."""

    saturation_rps: float  # mean over seeds
    saturation_rps_ci: tuple[float, float]
    capacity_rps: float  # the SLO capacity, mean over seeds
    capacity_rps_ci: tuple[float, float]
    seeds: list[int]
    rho: dict[str, float]  # stage -> busy fraction at each seed's capacity, averaged
    resolution_rps: float
    slo: Slo
    per_seed: list[SeedCapacity]
    ttft_p90_s: float = math.nan  # P90 TTFT at each seed's capacity, averaged


Simulate = Callable[[Deployment, Workload, float, int, float], SimResult]
RunMap = Callable[[Callable[[int], SeedCapacity], Iterable[int]], Iterable[SeedCapacity]]


def simulate_rate(d: Deployment, workload: Workload, rate: float, seed: int,
                  drain_s: float) -> SimResult:
    """One run of `workload` at `rate` on the simulation (the default `Simulate`)."""
    result, _ = run_virtual(d, workload.arrivals(rate, d.scale, seed), drain_s=drain_s)
    return result


def mean_interval(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """The mean and its two-sided 95% Student t interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, (math.nan, math.nan)
    df = len(values) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    half = t * statistics.stdev(values) / math.sqrt(len(values))
    return mean, (mean - half, mean + half)


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile (an observed value; inf counts as one)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _at(samples: Sequence[Sample], t: float) -> Sample:
    """The last sample at or before `t` (the first if none)."""
    best = samples[0]
    for sample in samples:
        if sample.at > t:
            break
        best = sample
    return best


def stage_rho(samples: Sequence[Sample], low: float, high: float) -> dict[str, float]:
    """Each stage's busy fraction between the samples at `low` and `high`."""
    a, b = _at(samples, low), _at(samples, high)
    rho = {}
    for stage in STAGES:
        units = b.units.get(stage, 0.0) - a.units.get(stage, 0.0)
        if units > 0:
            rho[stage] = (b.busy.get(stage, 0.0) - a.busy.get(stage, 0.0)) / units
    return rho


def _crosses(stage: str, cluster: str) -> bool:
    """Whether a request prefilled in `cluster` crosses `stage`."""
    if stage in ("prfaas", "link"):
        return cluster == "prfaas"
    return stage == "pd_d" or cluster == "pd"


def completion_rate(ends: Sequence[float]) -> float:
    """Completions per second from their times: (n - 1) / (last - first), which counts whole
    gaps only (a count over a fixed window is off by up to one completion)."""
    if len(ends) < 2 or max(ends) == min(ends):
        return 0.0
    return (len(ends) - 1) / (max(ends) - min(ends))


def measure(result: SimResult, workload: Workload, seed: int, rate: float, slo: Slo,
            warmup: float) -> RatePoint:
    """What one run says over its steady window [warmup * window, window] of arrivals."""
    low, high = warmup * workload.window_s, workload.window_s
    span = high - low
    done = [r for r in result.records if r.ok and low <= r.arrival_s + r.e2e_s < high]
    rho = stage_rho(result.samples, low, high)
    # Shares of the arrivals (routed in the window), not of the completions: past saturation
    # each branch completes at its own ceiling, whatever the router sent it.
    routed = [cluster for at, cluster in result.routes if low <= at < high]
    share = routed.count("prfaas") / len(routed) if routed else 0.0
    stage_rps = {}
    for stage, busy in rho.items():
        ends = [r.arrival_s + r.e2e_s for r in done if _crosses(stage, r.cluster)]
        part = sum(_crosses(stage, c) for c in routed) / len(routed) if routed else 0.0
        if busy >= _IDLE_RHO and part > 0:
            stage_rps[stage] = completion_rate(ends) / busy / part
    arrived = [r for r in result.records if low <= r.arrival_s < high]
    missing = _arrived(result, workload, rate, seed, low, high) - len(arrived)
    queue = [r.queue_s if r.ok and math.isfinite(r.queue_s) else math.inf for r in arrived]
    tpot = [r.tpot_s if r.ok else math.inf for r in arrived if r.output_tokens != 1]
    ttft = [r.ttft_s if r.ok and math.isfinite(r.ttft_s) else math.inf for r in arrived]
    queue_q = quantile(queue + [math.inf] * missing, slo.quantile)
    tpot_q = quantile(tpot + [math.inf] * missing, slo.quantile)
    ttft_q = quantile(ttft + [math.inf] * missing, TTFT_QUANTILE)
    return RatePoint(seed=seed, rate=rate, holds=slo.holds(queue_q, tpot_q, ttft_q),
                     completed_rps=len(done) / span, queue_s=queue_q, tpot_s=tpot_q, rho=rho,
                     stage_rps=stage_rps, offload_share=share, virtual_s=result.virtual_s,
                     ttft_p90_s=ttft_q)


def _arrived(result: SimResult, workload: Workload, rate: float, seed: int, low: float,
             high: float) -> int:
    """How many requests arrived in [low, high): the run's records hold only finished ones."""
    arrivals = workload.arrivals(rate, result.deployment.scale, seed)
    return sum(low <= a.at < high for a in arrivals)


def saturation_point(d: Deployment, workload: Workload, guess_rps: float, seed: int,
                     config: CapacityConfig, simulate: Simulate = simulate_rate) -> RatePoint:
    """One overloaded run (`config.overload` times the guess, nothing drained)."""
    rate = round(config.overload * guess_rps, 4)
    workload = msgspec.structs.replace(workload,
                                       window_s=config.saturation_window * workload.window_s)
    result = simulate(d, workload, rate, seed, 0.0)
    return measure(result, workload, seed, rate, config.slo, config.warmup)


def saturation_of(point: RatePoint) -> float:
    """The least stage's sustainable arrival rate (module docstring, 1)."""
    return min(point.stage_rps.values(), default=point.completed_rps)


def seed_capacity(d: Deployment, workload: Workload, guess_rps: float, config: CapacityConfig,
                  simulate: Simulate, seed: int) -> SeedCapacity:
    """One seed: its saturation, then the bisection below it (module docstring, 2)."""
    sat = saturation_point(d, workload, guess_rps, seed, config, simulate)
    saturation = saturation_of(sat)
    points = [sat]

    def run(rate: float) -> RatePoint:
        result = simulate(d, workload, rate, seed, config.drain_s)
        point = measure(result, workload, seed, rate, config.slo, config.warmup)
        points.append(point)
        return point

    high, low = saturation, round(config.low * saturation, 4)
    # Below the start, steps of half the start's distance to the saturation.
    step = (1 - config.low) * saturation / 2
    for _ in range(_MAX_STEPS_DOWN):
        if run(low).holds:
            break
        high, low = low, round(low - step, 4)
        if low <= 0:
            return SeedCapacity(seed, saturation, 0.0, points)
    else:
        return SeedCapacity(seed, saturation, 0.0, points)
    while high - low > config.resolution_rps:
        mid = round((low + high) / 2, 4)
        if run(mid).holds:
            low = mid
        else:
            high = mid
    return SeedCapacity(seed, saturation, low, points)


def measure_capacity(d: Deployment, workload: Workload, guess_rps: float,
                     config: CapacityConfig | None = None, *,
                     simulate: Simulate = simulate_rate, run_map: RunMap = map) -> Capacity:
    """Saturation and SLO capacity of `d` under `workload` over `config.seeds`; `guess_rps`
    (the planner's Lambda_max) sets how hard the saturation runs push."""
    config = config or CapacityConfig()
    job = partial(seed_capacity, d, workload, guess_rps, config, simulate)
    per_seed = sorted(run_map(job, config.seeds), key=lambda s: s.seed)
    saturation, saturation_ci = mean_interval([s.saturation_rps for s in per_seed])
    capacity, capacity_ci = mean_interval([s.capacity_rps for s in per_seed])
    return Capacity(saturation_rps=saturation, saturation_rps_ci=saturation_ci,
                    capacity_rps=capacity, capacity_rps_ci=capacity_ci,
                    seeds=[s.seed for s in per_seed], rho=_rho_at_capacity(per_seed),
                    resolution_rps=config.resolution_rps, slo=config.slo, per_seed=per_seed,
                    ttft_p90_s=_ttft_at_capacity(per_seed))


def accepted(seed: SeedCapacity) -> RatePoint | None:
    """The run at the seed's capacity (the last one that held at that rate)."""
    held = [p for p in seed.points[1:] if p.holds and p.rate == seed.capacity_rps]
    return held[-1] if held else None


def _rho_at_capacity(per_seed: Sequence[SeedCapacity]) -> dict[str, float]:
    points = [p for p in map(accepted, per_seed) if p is not None]
    stages = sorted({stage for p in points for stage in p.rho})
    return {stage: statistics.fmean(p.rho.get(stage, 0.0) for p in points)
            for stage in stages}


def _ttft_at_capacity(per_seed: Sequence[SeedCapacity]) -> float:
    points = [p for p in map(accepted, per_seed) if p is not None]
    return statistics.fmean(p.ttft_p90_s for p in points) if points else math.nan


def ratio_interval(numerator: Capacity, denominator: Capacity, *, saturation: bool = False,
                   ) -> tuple[float, tuple[float, float]]:
    """The SLO capacity ratio (or the saturation ratio), seed by seed (the same seeds), as a
    mean and a 95% interval."""
    def of(seed: SeedCapacity) -> float:
        return seed.saturation_rps if saturation else seed.capacity_rps

    mine = {s.seed: of(s) for s in numerator.per_seed}
    ratios = [mine[s.seed] / of(s) for s in denominator.per_seed
              if s.seed in mine and of(s) > 0]
    if not ratios:
        return math.nan, (math.nan, math.nan)
    return mean_interval(ratios)
