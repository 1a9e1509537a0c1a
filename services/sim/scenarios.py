"""The simulation's scenarios: each one command, each a folder of results.

- `paper`: the three deployments of the paper's Table 6 (PrfaaS-PD 4/3/5 at the planner's t,
  homogeneous PD 9P/3D, naive heterogeneous 4/-/8) on 100 Gbps: each one's saturation and SLO
  capacity over seeds (services/sim/capacity.py), TTFT at a common rate below every capacity
  and at 90% of its own, offload share and egress, beside the planner's Lambda_max and the
  paper's numbers.
- `bandwidth-bound`: the planner's PrfaaS-PD deployment on a link narrow enough (8 Gbps) that
  Theta_prfaas is set by bandwidth (Eq. 3's second term): its measured capacity against the
  planner's bandwidth-bound Lambda_max.
- `bandwidth-dip`: static `prfaas` against `prfaas-dynamic` while the link drops from 100 to
  5 Gbps for 10 minutes and comes back.
- `trace`: the Mooncake conversation trace on PrfaaS-PD under every registered policy, with
  cache hits and the bytes that crossed the link against a run without prefix caching.
- `burst`: gamma arrivals (CV 4) under `prfaas-dynamic`: the long-term loop converts roles.

Capacity (what the reports state): the saturation, from overloaded runs, and the SLO
capacity, the largest rate at which the P99 queueing delay before prefill (5 s) and the P99
TPOT (the paper's decode SLO) both hold, by bisection below the saturation, per seed; both as a mean
and a 95% interval over the seeds (services/sim/capacity.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import msgspec

from netem.params import LinkParams
from services.data import trace_path
from services.paper.case_study import DEPLOYMENTS, HOMOGENEOUS, NAIVE, PRFAAS_PD
from services.paper.planner import OperatingPoint, PlanResult, Scenario, solve_scenario
from services.paper.workload import PAPER_MAX_TOKENS, PAPER_MIN_TOKENS, TruncatedLogNormal
from services.router.policies import REGISTERED
from services.sim.capacity import Capacity, CapacityConfig, RunMap, measure_capacity
from services.sim.run import LinkChange, Record, SimResult, run_virtual
from services.sim.workload import Arrival, Workload, lognormal, trace
from services.sim.world import CHUNK_PAPER_TOKENS, COARSE_SCALE, DEFAULT_SCALE, Deployment

Progress = Callable[[str, float, float], None]  # (what, virtual s done, virtual s total)


def paper_deployments(plan: PlanResult, bandwidth_bps: float = 100e9,
                      scale: float = COARSE_SCALE) -> dict[str, Deployment]:
    """Table 6's three deployments, t from the planner (in paper tokens, served at `scale`:
    the coarse one unless prefixes must match the traces' blocks)."""
    p = plan.prfaas
    assert p.t is not None
    chunk = round(CHUNK_PAPER_TOKENS * scale)
    return {
        PRFAAS_PD: Deployment(name=PRFAAS_PD, n_prfaas=p.n_prfaas, n_pd_prefill=p.n_p,
                                n_decode=p.n_d, policy="prfaas", bandwidth_bps=bandwidth_bps,
                                policy_options={"threshold": p.t * scale,
                                                "prefix_rule": "scarce"},
                                scale=scale, chunk_tokens=chunk),
        HOMOGENEOUS: Deployment(name=HOMOGENEOUS, n_prfaas=0,
                                  n_pd_prefill=plan.homogeneous.n_p,
                                  n_decode=plan.homogeneous.n_d, policy="homogeneous",
                                  scale=scale, chunk_tokens=chunk),
        NAIVE: Deployment(name=NAIVE, n_prfaas=plan.naive.n_prfaas, n_pd_prefill=0,
                            n_decode=plan.naive.n_d, policy="naive-hetero",
                            bandwidth_bps=bandwidth_bps, scale=scale,
                            chunk_tokens=chunk),
    }


def _simulate(progress: Progress | None, d: Deployment, workload: Workload, rate: float,
              seed: int, drain_s: float) -> SimResult:
    """`capacity.simulate_rate`, showing its progress."""
    what = f"{d.name} @ {rate:.3f} req/s, seed {seed}"
    return _run(d, workload.arrivals(rate, d.scale, seed), what, workload.window_s, progress,
                drain_s=drain_s)


def _at_rate(d: Deployment, rate: float, window_s: float, seed: int,
             progress: Progress | None) -> SimResult:
    return _simulate(progress, d, Workload(window_s=window_s), rate, seed, 300.0)


def _run(d: Deployment, arrivals: Sequence[Arrival], what: str, total: float,
         progress: Progress | None, **options: object) -> SimResult:
    def tick(now: float) -> None:
        if progress is not None:
            progress(what, now, total)

    options.setdefault("drain_s", 300.0)
    result, _ = run_virtual(d, arrivals, progress=tick, **options)
    return result


def ttft(records: Sequence[Record]) -> tuple[float, float]:
    """(mean, P90) TTFT of the requests that completed."""
    values = sorted(r.ttft_s for r in records if r.ok)
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), values[min(len(values) - 1, int(0.9 * len(values)))]


def offload_share(records: Sequence[Record]) -> float:
    done = [r for r in records if r.ok]
    return sum(r.cluster == "prfaas" for r in done) / len(done) if done else 0.0


def egress_gbps(result: SimResult) -> tuple[float, float]:
    """(mean over the arrival window, peak of the samples) of link-0's egress, in Gbit/s:
    the drain after the last arrival is left out (the link idles while the last decode)."""
    rates = [s.egress_bps for s in result.samples]
    inside = [s for s in result.samples if s.at <= result.arrivals_end_s]
    mean = 8.0 * inside[-1].egress_bytes / inside[-1].at / 1e9 if inside and inside[-1].at \
        else 0.0
    return mean, max(rates, default=0.0) / 1e9


def ttst(records: Sequence[Record]) -> tuple[float, float]:
    """(mean, P90) time to the second token of the requests that completed."""
    values = sorted(r.ttst_s for r in records if r.ok and math.isfinite(r.ttst_s))
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), values[min(len(values) - 1, int(0.9 * len(values)))]


class DeploymentSummary(msgspec.Struct, frozen=True):
    instances: str
    policy: str
    saturation_rps: float  # mean over seeds (capacity.py, 1)
    saturation_rps_ci: tuple[float, float]
    capacity_rps: float  # the SLO capacity, mean over seeds (capacity.py, 2)
    capacity_rps_ci: tuple[float, float]
    seeds: list[int]
    saturation_per_seed: list[float]
    capacity_per_seed: list[float]
    rho: dict[str, float]  # stage -> busy fraction at each seed's SLO capacity, averaged
    planner_lambda_rps: float
    planner_t: float | None
    ttft_mean_s: float
    ttft_p90_s: float
    ttst_mean_s: float
    ttst_p90_s: float
    ttft_mean_at_90pct_s: float
    ttft_p90_at_90pct_s: float
    offload_share: float
    planner_offload_share: float
    egress_mean_gbps: float
    egress_peak_gbps: float
    tpot_mean_ms: float
    # every run of the search: seed, rate, SLO held, P99 queue (s), P99 TPOT (ms), rho
    sweep: list[tuple[int, float, bool, float, float, dict[str, float]]]
    virtual_s: float  # all of this deployment's runs


@dataclass
class PaperOutcome:
    summaries: dict[str, DeploymentSummary]
    capacities: dict[str, Capacity]
    common_rate: float
    runs: dict[str, SimResult]  # per deployment, the run at the common rate


def paper_capacity(window_s: float = 360.0, seeds: Sequence[int] = (0, 1, 2, 3, 4),
                   ) -> tuple[Workload, CapacityConfig]:
    """The `paper` scenario's workload and search: windows of `window_s` (a fifth of it warm-up),
    resolution 0.05 req/s, the bisection from 80% of the saturation up."""
    return Workload(window_s=window_s), CapacityConfig(seeds=tuple(seeds))


def paper(window_s: float = 360.0, seeds: Sequence[int] = (0, 1, 2, 3, 4),
          progress: Progress | None = None, run_map: RunMap = map) -> PaperOutcome:
    """Every number of the `paper` scenario (module docstring)."""
    plan = solve_scenario(Scenario())
    deployments = paper_deployments(plan)
    points = {name: plan.point(name) for name in DEPLOYMENTS}
    workload, config = paper_capacity(window_s, seeds)
    simulate = partial(_simulate, progress)
    caps = {name: measure_capacity(d, workload, points[name].lambda_max, config,
                                   simulate=simulate, run_map=run_map)
            for name, d in deployments.items()}
    common = round(0.8 * min(cap.capacity_rps for cap in caps.values()), 2)
    seed = seeds[0]
    runs, summaries = {}, {}
    for name, d in deployments.items():
        runs[name] = _at_rate(d, common, window_s, seed + 1, progress)
        at90 = _at_rate(d, round(0.9 * caps[name].capacity_rps, 2), window_s, seed + 2,
                        progress)
        summaries[name] = deployment_summary(d, points[name], caps[name], runs[name], at90)
    return PaperOutcome(summaries, caps, common, runs)


def deployment_summary(d: Deployment, point: OperatingPoint, cap: Capacity, common: SimResult,
                       at90: SimResult) -> DeploymentSummary:
    mean, p90 = ttft(common.records)
    second_mean, second_p90 = ttst(common.records)
    mean90, p9090 = ttft(at90.records)
    egress_mean, egress_peak = egress_gbps(common)
    tpots = [r.tpot_s for r in common.records if r.ok and r.output_tokens > 1]
    searched = [p for seed in cap.per_seed for p in seed.points]
    return DeploymentSummary(
        instances=f"{d.n_prfaas or '-'}/{d.n_pd_prefill or '-'}/{d.n_decode}",
        policy=d.policy, saturation_rps=cap.saturation_rps,
        saturation_rps_ci=cap.saturation_rps_ci, capacity_rps=cap.capacity_rps,
        capacity_rps_ci=cap.capacity_rps_ci, seeds=cap.seeds,
        saturation_per_seed=[seed.saturation_rps for seed in cap.per_seed],
        capacity_per_seed=[seed.capacity_rps for seed in cap.per_seed], rho=cap.rho,
        planner_lambda_rps=point.lambda_max, planner_t=point.t, ttft_mean_s=mean,
        ttft_p90_s=p90, ttst_mean_s=second_mean, ttst_p90_s=second_p90,
        ttft_mean_at_90pct_s=mean90, ttft_p90_at_90pct_s=p9090,
        offload_share=offload_share(common.records), planner_offload_share=point.p,
        egress_mean_gbps=egress_mean, egress_peak_gbps=egress_peak,
        tpot_mean_ms=1e3 * statistics.fmean(tpots) if tpots else math.nan,
        sweep=[(p.seed, p.rate, p.holds, p.queue_s, 1e3 * p.tpot_s, p.rho) for p in searched],
        virtual_s=sum(p.virtual_s for p in searched) + common.virtual_s + at90.virtual_s)


# Narrow enough that the planner's Theta_prfaas is bandwidth-bound (Eq. 3) at its best t.
NARROW_BPS = 8e9


@dataclass
class BandwidthOutcome:
    plan: OperatingPoint
    compute_rps: float  # Eq. 3's compute ceiling at the planner's l_long
    bandwidth_rps: float  # Eq. 3's bandwidth ceiling
    capacity: Capacity
    deployment: Deployment


def bandwidth_bound(window_s: float = 360.0, seeds: Sequence[int] = (0, 1, 2, 3, 4),
                    bandwidth_bps: float = NARROW_BPS, progress: Progress | None = None,
                    run_map: RunMap = map, config: CapacityConfig | None = None,
                    ) -> BandwidthOutcome:
    """The planner's PrfaaS-PD deployment on a narrow link, measured (module docstring)."""
    scenario = Scenario(bandwidth_gbps=bandwidth_bps / 1e9)
    plan = solve_scenario(scenario).prfaas
    d = msgspec.structs.replace(paper_deployments(solve_scenario(scenario), bandwidth_bps)[
        PRFAAS_PD], name=f"{PRFAAS_PD}-narrow")
    compute, bandwidth = scenario.throughput_model().prfaas_limits(plan.l_long, plan.n_prfaas)
    workload, default = paper_capacity(window_s, seeds)
    cap = measure_capacity(d, workload, plan.lambda_max, config or default,
                           simulate=partial(_simulate, progress), run_map=run_map)
    return BandwidthOutcome(plan, compute, bandwidth, cap, d)


@dataclass
class DipOutcome:
    runs: dict[str, SimResult]
    dip: tuple[float, float]  # (start, end) of the dip, virtual s


def bandwidth_dip(rate: float = 1.6, before_s: float = 600.0, dip_s: float = 600.0,
                  after_s: float = 600.0, low_bps: float = 5e9, seed: int = 0,
                  progress: Progress | None = None) -> DipOutcome:
    """Static prfaas against prfaas-dynamic through a 10-minute dip of the link."""
    plan = solve_scenario(Scenario())
    base = paper_deployments(plan)[PRFAAS_PD]
    total = before_s + dip_s + after_s
    changes = [LinkChange(before_s, LinkParams(bandwidth_bps=low_bps, delay_s=base.delay_s)),
               LinkChange(before_s + dip_s, LinkParams(bandwidth_bps=base.bandwidth_bps,
                                                       delay_s=base.delay_s))]
    arrivals = lognormal(rate, total, base.scale, seed)
    runs = {}
    for policy in ("prfaas", "prfaas-dynamic"):
        options = base.policy_options if policy == "prfaas" else {}
        d = msgspec.structs.replace(base, name=policy, policy=policy, policy_options=options)
        runs[policy] = _run(d, arrivals, f"{policy}, dip", total, progress, changes=changes)
    return DipOutcome(runs, (before_s, before_s + dip_s))


def trace_policies(speedup: float = 1.0, limit: int | None = None, seed: int = 0,
                   progress: Progress | None = None) -> dict[str, SimResult]:
    """The conversation trace under every registered policy, and prfaas without a cache."""
    plan = solve_scenario(Scenario())
    base = paper_deployments(plan, scale=DEFAULT_SCALE)[PRFAAS_PD]
    arrivals = trace(trace_path(), base.scale, speedup=speedup, limit=limit)
    total = arrivals[-1].at if arrivals else 0.0
    runs = {}
    for cls in REGISTERED:
        options = base.policy_options if cls.name == "prfaas" else {}
        d = msgspec.structs.replace(base, name=cls.name, policy=cls.name,
                                    policy_options=options, seed=seed)
        runs[cls.name] = _run(d, arrivals, f"trace, {cls.name}", total, progress)
    fresh = [msgspec.structs.replace(a, blocks=_fresh_blocks(i, a)) for i, a in
             enumerate(arrivals)]
    runs["prfaas (no cache)"] = _run(msgspec.structs.replace(base, name="no-cache"), fresh,
                                     "trace, no cache", total, progress)
    return runs


def _fresh_blocks(index: int, arrival: Arrival) -> tuple[int, ...]:
    """Block ids no other request shares: the same lengths with prefix caching defeated."""
    first = (1 << 40) + index * 4096
    return tuple(range(first, first + len(arrival.blocks)))


def burst(rate: float = 2.2, duration_s: float = 1800.0, cv: float = 4.0, seed: int = 0,
          progress: Progress | None = None) -> SimResult:
    """Gamma arrivals (CV `cv`) under prfaas-dynamic; for the middle third of the run the
    bursts are short chats (mean about 2.7K tokens), which load decode far more than prefill:
    the long-term loop should move PD prefill instances to decode, and back after."""
    plan = solve_scenario(Scenario())
    base = paper_deployments(plan)[PRFAAS_PD]
    d = msgspec.structs.replace(base, name="burst", policy="prfaas-dynamic", policy_options={})
    third = duration_s / 3
    shape = 1.0 / cv ** 2
    short = TruncatedLogNormal(7.6, 1.0, PAPER_MIN_TOKENS, PAPER_MAX_TOKENS)
    arrivals = (lognormal(rate, third, d.scale, seed, burstiness=shape)
                + lognormal(rate * 1.6, third, d.scale, seed + 1, burstiness=shape,
                            lengths=short, start_s=third)
                + lognormal(rate, third, d.scale, seed + 2, burstiness=shape,
                            start_s=2 * third))
    return _run(d, arrivals, "burst", duration_s, progress)
