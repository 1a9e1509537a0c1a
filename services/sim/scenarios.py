"""The simulation's scenarios: each one command, each a folder of results.

- `paper`: the three deployments of the paper's Table 6 (PrfaaS-PD 4/3/5 at the planner's t,
  homogeneous PD 9P/3D, naive heterogeneous 4/-/8) on 100 Gbps: each one's measured maximum
  sustainable rate (a rate sweep), TTFT at a common rate below every capacity and at 90% of
  its own, offload share and egress, beside the planner's Lambda_max and the paper's numbers.
- `bandwidth-dip`: static `prfaas` against `prfaas-dynamic` while the link drops from 100 to
  5 Gbps for 10 minutes and comes back.
- `trace`: the Mooncake conversation trace on PrfaaS-PD under every registered policy, with
  cache hits and the bytes that crossed the link against a run without prefix caching.
- `burst`: gamma arrivals (CV 4) under `prfaas-dynamic`: the long-term loop converts roles.

Sustainable rate (the criterion the reports state): over the second half of a run of
`window_s` arrivals, the requests in flight grow by less than 5% of the requests that
arrived meanwhile (queues do not grow), and the decode SLO (40 tokens/s per request) holds,
which the decode workers' batch cap (BS_max of the profile) guarantees and TPOT shows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from netem.params import LinkParams
from services.data import trace_path
from services.paper.planner import OperatingPoint, PlanResult, Scenario, solve_scenario
from services.paper.workload import TruncatedLogNormal
from services.router.policies import REGISTERED
from services.sim.run import LinkChange, Record, SimResult, run_virtual
from services.sim.workload import Arrival, lognormal, trace
from services.sim.world import CHUNK_PAPER_TOKENS, COARSE_SCALE, DEFAULT_SCALE, Deployment

# The paper's Table 6 (arXiv 2604.15039 v2): Lambda_max, mean and P90 TTFT, offload share.
PAPER_TABLE6 = {
    "prfaas_pd": {"lambda_rps": 3.24, "ttft_mean_s": 2.22, "ttft_p90_s": 3.51,
                  "offload_share": 0.496, "egress_gbps": 13.0},
    "homogeneous": {"lambda_rps": 2.11, "ttft_mean_s": 4.44, "ttft_p90_s": 9.73},
    "naive": {"lambda_rps": 2.45, "ttft_mean_s": 1.74, "ttft_p90_s": 3.51},
}
GROWTH_LIMIT = 0.05
Progress = Callable[[str, float, float], None]  # (what, virtual s done, virtual s total)


@dataclass(frozen=True)
class SweepPoint:
    rate: float
    sustainable: bool
    growth: float
    result: SimResult


def paper_deployments(plan: PlanResult, bandwidth_bps: float = 100e9,
                      scale: float = COARSE_SCALE) -> dict[str, Deployment]:
    """Table 6's three deployments, t from the planner (in paper tokens, served at `scale`:
    the coarse one unless prefixes must match the traces' blocks)."""
    p = plan.prfaas
    assert p.t is not None
    chunk = round(CHUNK_PAPER_TOKENS * scale)
    return {
        "prfaas_pd": Deployment(name="prfaas_pd", n_prfaas=p.n_prfaas, n_pd_prefill=p.n_p,
                                n_decode=p.n_d, policy="prfaas", bandwidth_bps=bandwidth_bps,
                                policy_options={"threshold": p.t * scale,
                                                "bandwidth": "scarce"},
                                scale=scale, chunk_tokens=chunk),
        "homogeneous": Deployment(name="homogeneous", n_prfaas=0,
                                  n_pd_prefill=plan.homogeneous.n_p,
                                  n_decode=plan.homogeneous.n_d, policy="homogeneous",
                                  scale=scale, chunk_tokens=chunk),
        "naive": Deployment(name="naive", n_prfaas=plan.naive_hetero.n_prfaas, n_pd_prefill=0,
                            n_decode=plan.naive_hetero.n_d, policy="naive-hetero",
                            bandwidth_bps=bandwidth_bps, scale=scale,
                            chunk_tokens=chunk),
    }


def growth(result: SimResult, rate: float, window_s: float) -> float:
    """In-flight growth over the window's second half, as a share of its arrivals."""
    def mean_in_flight(low: float, high: float) -> float:
        values = [s.in_flight for s in result.samples if low <= s.at < high]
        return statistics.fmean(values) if values else 0.0

    half = window_s / 2
    early = mean_in_flight(half - window_s / 8, half + window_s / 8)
    late = mean_in_flight(window_s - window_s / 4, window_s)
    return (late - early) / (rate * (window_s / 2 - window_s / 8))


def run_rate(d: Deployment, rate: float, window_s: float, seed: int,
             progress: Progress | None = None) -> SweepPoint:
    arrivals = lognormal(rate, window_s, d.scale, seed)
    result = _run(d, arrivals, f"{d.name} @ {rate:.2f} req/s", window_s, progress)
    g = growth(result, rate, window_s)
    failed = sum(not r.ok for r in result.records)
    return SweepPoint(rate, g < GROWTH_LIMIT and failed == 0 and result.unfinished == 0, g,
                      result)


def _run(d: Deployment, arrivals: Sequence[Arrival], what: str, total: float,
         progress: Progress | None, **options: object) -> SimResult:
    def tick(now: float) -> None:
        if progress is not None:
            progress(what, now, total)

    result, _ = run_virtual(d, arrivals, progress=tick, drain_s=300.0, **options)
    return result


def capacity(d: Deployment, guess: float, window_s: float, seed: int, steps: int,
             progress: Progress | None = None) -> tuple[float, list[SweepPoint]]:
    """The largest sustainable rate, by bisection between a sustainable and an unsustainable
    rate found around `guess` (the planner's Lambda_max)."""
    points: list[SweepPoint] = []
    low, high = 0.0, math.inf
    rate = guess
    for _ in range(steps):
        point = run_rate(d, rate, window_s, seed, progress)
        points.append(point)
        if point.sustainable:
            low = rate
        else:
            high = rate
        if not math.isfinite(high):
            rate *= 1.15
        elif low == 0.0:
            rate = high * 0.85
        else:
            rate = (low + high) / 2
    return low, points


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
    """(mean over the run, peak of the samples) of link-0's egress, in Gbit/s."""
    rates = [s.egress_bps for s in result.samples]
    mean = 8.0 * result.link_bytes / result.virtual_s / 1e9 if result.virtual_s else 0.0
    return mean, max(rates, default=0.0) / 1e9


class DeploymentSummary(msgspec.Struct, frozen=True):
    instances: str
    policy: str
    capacity_rps: float
    planner_lambda_rps: float
    planner_t: float | None
    ttft_mean_s: float
    ttft_p90_s: float
    ttft_mean_at_90pct_s: float
    ttft_p90_at_90pct_s: float
    offload_share: float
    planner_offload_share: float
    egress_mean_gbps: float
    egress_peak_gbps: float
    tpot_mean_ms: float
    sweep: list[tuple[float, bool, float]]  # (rate, sustainable, growth)


@dataclass
class PaperOutcome:
    summaries: dict[str, DeploymentSummary]
    common_rate: float
    runs: dict[str, SimResult]  # per deployment, the run at the common rate


def paper(window_s: float = 900.0, steps: int = 5, seed: int = 0,
          progress: Progress | None = None) -> PaperOutcome:
    """Every number of the `paper` scenario (module docstring)."""
    plan = solve_scenario(Scenario())
    deployments = paper_deployments(plan)
    points = {"prfaas_pd": plan.prfaas, "homogeneous": plan.homogeneous,
              "naive": plan.naive_hetero}
    caps = {name: capacity(d, points[name].lambda_max, window_s, seed, steps, progress)
            for name, d in deployments.items()}
    common = round(0.8 * min(cap for cap, _ in caps.values()), 2)
    runs, summaries = {}, {}
    for name, d in deployments.items():
        runs[name] = run_rate(d, common, window_s, seed + 1, progress).result
        at90 = run_rate(d, round(0.9 * caps[name][0], 2), window_s, seed + 2, progress).result
        summaries[name] = _summary(d, points[name], caps[name], runs[name], at90)
    return PaperOutcome(summaries, common, runs)


def _summary(d: Deployment, point: OperatingPoint, cap: tuple[float, list[SweepPoint]],
             common: SimResult, at90: SimResult) -> DeploymentSummary:
    mean, p90 = ttft(common.records)
    mean90, p9090 = ttft(at90.records)
    egress_mean, egress_peak = egress_gbps(common)
    tpots = [r.tpot_s for r in common.records if r.ok and r.output_tokens > 1]
    return DeploymentSummary(
        instances=f"{d.n_prfaas or '-'}/{d.n_pd_prefill or '-'}/{d.n_decode}",
        policy=d.policy, capacity_rps=cap[0], planner_lambda_rps=point.lambda_max,
        planner_t=point.t, ttft_mean_s=mean, ttft_p90_s=p90, ttft_mean_at_90pct_s=mean90,
        ttft_p90_at_90pct_s=p9090, offload_share=offload_share(common.records),
        planner_offload_share=point.p, egress_mean_gbps=egress_mean,
        egress_peak_gbps=egress_peak, tpot_mean_ms=1e3 * statistics.fmean(tpots) if tpots
        else math.nan,
        sweep=[(p.rate, p.sustainable, round(p.growth, 4)) for p in cap[1]])


@dataclass
class DipOutcome:
    runs: dict[str, SimResult]
    dip: tuple[float, float]  # (start, end) of the dip, virtual s


def bandwidth_dip(rate: float = 1.6, before_s: float = 600.0, dip_s: float = 600.0,
                  after_s: float = 600.0, low_bps: float = 5e9, seed: int = 0,
                  progress: Progress | None = None) -> DipOutcome:
    """Static prfaas against prfaas-dynamic through a 10-minute dip of the link."""
    plan = solve_scenario(Scenario())
    base = paper_deployments(plan)["prfaas_pd"]
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
    base = paper_deployments(plan, scale=DEFAULT_SCALE)["prfaas_pd"]
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
    base = paper_deployments(plan)["prfaas_pd"]
    d = msgspec.structs.replace(base, name="burst", policy="prfaas-dynamic", policy_options={})
    third = duration_s / 3
    shape = 1.0 / cv ** 2
    short = TruncatedLogNormal(7.6, 1.0, 128.0, 131072.0)
    arrivals = (lognormal(rate, third, d.scale, seed, burstiness=shape)
                + lognormal(rate * 1.6, third, d.scale, seed + 1, burstiness=shape,
                            lengths=short, start_s=third)
                + lognormal(rate, third, d.scale, seed + 2, burstiness=shape,
                            start_s=2 * third))
    return _run(d, arrivals, "burst", duration_s, progress)
