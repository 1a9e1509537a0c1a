"""The schedulers' scenario matrix: how close each routing policy comes to the best static
choice in hindsight.

A scenario is a workload and a link that change over time (a bandwidth dip, a slow ramp of the
link, a load burst, a slice of a real trace), cut into periods. Each scenario runs, over
seeds, under every policy compared (`POLICIES`: the planner's static t, prfaas-dynamic, Dynamo's
rule, naive heterogeneous) and under a sweep of static choices (`oracle_choices`): thresholds
around the planner's t (`ORACLE_FACTORS`) on the deployed split, and the PD splits one
conversion away (`ORACLE_SHIFTS`: a worker moved between PD prefill and decode, as
prfaas-dynamic's long-term loop may) at the planner's t. The oracle of a period is the best of
the sweep *in that period* (each period may pick another choice): what a static choice could
have done, known in hindsight. Per
period: SLO attainment (requests arriving in it that completed within the TTFT and TPOT
bounds, over all that arrived), goodput, TTFT P50 / P90, the offload share, and t over time;
`oracle_ratio` is a policy's attainment over the oracle's, in its worst period.

Every run is one job (`run_job`, a plain function of plain arguments), so the matrix runs
on Ray like the capacity search does (services/sim/search/pool.py), one job per core.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec

from netem.params import LinkParams
from services.data import trace_path
from services.paper.case_study import PRFAAS_PD
from services.paper.planner import Scenario, solve_scenario
from services.paper.workload import load_trace
from services.sim.capacity import mean_interval, quantile
from services.sim.report import SLO_TPOT_S, SLO_TTFT_S
from services.sim.run import LinkChange, SimResult, run_virtual
from services.sim.scenarios import paper_deployments
from services.sim.workload import Arrival, from_trace, lognormal
from services.sim.world import DEFAULT_SCALE, Deployment

# The policies compared; the static thresholds the oracle sweeps (times the planner's t) and
# the PD prefill workers it moves from decode (negative: to decode) at the planner's t.
POLICIES = ("prfaas", "prfaas-dynamic", "dynamo", "naive-hetero")
ORACLE_FACTORS = (0.5, 0.7, 1.0, 1.4)
ORACLE_SHIFTS = (-1, 1)
ORACLE = "oracle"
SAMPLE_S = 10.0
DRAIN_S = 300.0


class Period(msgspec.Struct, frozen=True):
    name: str
    start_s: float
    end_s: float


class Setup(msgspec.Struct, frozen=True):
    """One scenario at one seed: the deployment (its policy still to set), arrivals, changes."""

    base: Deployment
    arrivals: list[Arrival]
    changes: list[LinkChange]
    periods: list[Period]


class PeriodResult(msgspec.Struct, frozen=True):
    arrived: int
    met: int  # completed within the TTFT and TPOT bounds
    slo_attainment: float  # met / arrived
    goodput_rps: float  # met per second of the period
    ttft_p50_s: float
    ttft_p90_s: float
    offload_share: float  # of the period's completed requests, prefilled on PrfaaS
    cache_hit_share: float = 0.0  # of their prompt tokens, served from a cached prefix


class RunResult(msgspec.Struct, frozen=True):
    scenario: str
    policy: str  # a name of POLICIES, or a static choice's label (StaticChoice)
    seed: int
    periods: dict[str, PeriodResult]
    threshold: list[tuple[float, float]]  # (virtual s, t in paper tokens) every SAMPLE_S
    virtual_s: float
    wall_s: float


Builder = Callable[[int], Setup]


class StaticChoice(msgspec.Struct, frozen=True):
    """One point of the oracle's sweep: t at `factor` times the planner's, and `shift` PD
    workers moved from decode to PD prefill (negative: the other way)."""

    factor: float = 1.0
    shift: int = 0

    @property
    def label(self) -> str:
        """"prfaas" for the planner's own choice, else "static x<factor>[ p<+shift>]"."""
        if self == StaticChoice():
            return "prfaas"
        return f"static x{self.factor:g}" + (f" p{self.shift:+d}" if self.shift else "")

    @classmethod
    def parse(cls, policy: str) -> StaticChoice | None:
        """The choice a label names; None for a policy that is not a static choice."""
        if policy == "prfaas":
            return cls()
        if not policy.startswith("static x"):
            return None
        factor, _, shift = policy.removeprefix("static x").partition(" p")
        return cls(float(factor), int(shift) if shift else 0)

    def split(self, base: Deployment) -> tuple[int, int, int]:
        """(PrfaaS prefill, PD prefill, decode) instances of `base` under this choice."""
        return base.n_prfaas, base.n_pd_prefill + self.shift, base.n_decode - self.shift


def oracle_choices() -> list[StaticChoice]:
    """The oracle's sweep: every factor on the deployed split, every shift at the planner's t."""
    return ([StaticChoice(f) for f in ORACLE_FACTORS]
            + [StaticChoice(1.0, shift) for shift in ORACLE_SHIFTS])


def _planner() -> tuple[Deployment, float]:
    """The paper's PrfaaS-PD deployment (4/3/5, 100 Gbps) and its t in served tokens."""
    base = paper_deployments(solve_scenario(Scenario()))[PRFAAS_PD]
    return base, float(base.policy_options["threshold"])


def _link(base: Deployment, at: float, bps: float) -> LinkChange:
    return LinkChange(at, LinkParams(bandwidth_bps=bps, delay_s=base.delay_s))


def dip(rate: float) -> Builder:
    """10 minutes at 100 Gbps, 10 at 5 Gbps, 10 at 100 again, at `rate` req/s."""
    def build(seed: int) -> Setup:
        base, _ = _planner()
        changes = [_link(base, 600.0, 5e9), _link(base, 1200.0, base.bandwidth_bps)]
        return Setup(base, lognormal(rate, 1800.0, base.scale, seed), changes,
                     [Period("before", 0, 600), Period("during", 600, 1200),
                      Period("after", 1200, 1800)])
    return build


def ramp(rate: float = 2.6, low_bps: float = 10e9, minutes: int = 30) -> Builder:
    """The link falls from 100 to 10 Gbps over 30 minutes, a step a minute, and comes back
    the same way."""
    def build(seed: int) -> Setup:
        base, _ = _planner()
        high = base.bandwidth_bps
        steps = [high * (low_bps / high) ** (i / minutes) for i in range(1, minutes + 1)]
        changes = [_link(base, 60.0 * i, bps) for i, bps in enumerate(steps, 1)]
        changes += [_link(base, 60.0 * (minutes + i), bps)
                    for i, bps in enumerate(reversed(steps[:-1]), 1)]
        changes.append(_link(base, 120.0 * minutes, high))
        end = 120.0 * minutes
        return Setup(base, lognormal(rate, end, base.scale, seed), changes,
                     [Period("falling", 0, end / 2), Period("rising", end / 2, end)])
    return build


def burst(rate: float = 1.0, link_bps: float = 100e9) -> Builder:
    """10 minutes at `rate`, 5 at three times it, 10 at `rate` again, on a link of `link_bps`."""
    def build(seed: int) -> Setup:
        base, _ = _planner()
        base = msgspec.structs.replace(base, bandwidth_bps=link_bps)
        arrivals = (lognormal(rate, 600.0, base.scale, seed)
                    + lognormal(3 * rate, 300.0, base.scale, seed + 1000, start_s=600.0)
                    + lognormal(rate, 600.0, base.scale, seed + 2000, start_s=900.0))
        return Setup(base, sorted(_within(arrivals, 1500.0), key=lambda a: a.at), [],
                     [Period("before", 0, 600), Period("burst", 600, 900),
                      Period("after", 900, 1500)])
    return build


def trace_slice(link_bps: float = 100e9, minutes: float = 10.0) -> Builder:
    """A `minutes` slice of the Mooncake conversation trace (seed k: the k-th slice), served at
    the scale that matches its 512-token blocks, its prefixes shared as recorded."""
    def build(seed: int) -> Setup:
        base, t = _planner()
        scale = DEFAULT_SCALE
        base = msgspec.structs.replace(
            base, bandwidth_bps=link_bps, scale=scale,
            chunk_tokens=round(base.chunk_tokens * scale / base.scale),
            policy_options={**base.policy_options, "threshold": t * scale / base.scale})
        start = 60.0 * minutes * seed
        records = [r for r in load_trace(trace_path())
                   if start * 1000 <= r.timestamp < (start + 60 * minutes) * 1000]
        arrivals = from_trace(records, scale)
        end = 60.0 * minutes
        return Setup(base, arrivals, [],
                     [Period("first half", 0, end / 2), Period("second half", end / 2, end)])
    return build


def _within(arrivals: Iterable[Arrival], end: float) -> list[Arrival]:
    return [a for a in arrivals if a.at < end]


SCENARIOS: dict[str, Builder] = {
    "dip-1.6": dip(1.6),
    "dip-2.2": dip(2.2),
    "dip-2.6": dip(2.6),
    "ramp": ramp(2.6),
    "burst-100g": burst(link_bps=100e9),
    "burst-10g": burst(link_bps=10e9),
    "trace-100g": trace_slice(100e9),
    "trace-10g": trace_slice(10e9),
}


def deployment_for(setup: Setup, policy: str) -> Deployment:
    """The scenario's deployment under `policy`, or under a static choice's label."""
    base = setup.base
    t = float(base.policy_options["threshold"])
    choice = StaticChoice.parse(policy)
    if choice is not None and policy != "prfaas":
        _, n_p, n_d = choice.split(base)
        if min(n_p, n_d) < 1:
            raise ValueError(f"{policy}: the split leaves {n_p} PD prefill and {n_d} decode")
        return msgspec.structs.replace(
            base, name=policy, policy="prfaas", n_pd_prefill=n_p, n_decode=n_d,
            policy_options={**base.policy_options, "threshold": t * choice.factor})
    # prfaas-dynamic applies the same prefix rule as prfaas (the deployment's `prefix_rule`
    # pin): the two differ only in how t is chosen.
    rule = {k: v for k, v in base.policy_options.items() if k != "threshold"}
    options: dict[str, object] = {
        "prfaas": dict(base.policy_options),
        "prfaas-dynamic": rule,
        "dynamo": {"max_local_prefill_length": round(t)},
    }.get(policy, {})
    return msgspec.structs.replace(base, name=policy, policy=policy, policy_options=options)


def period_result(setup: Setup, result: SimResult, period: Period) -> PeriodResult:
    arrived = sum(period.start_s <= a.at < period.end_s for a in setup.arrivals)
    records = [r for r in result.records if period.start_s <= r.arrival_s < period.end_s]
    done = [r for r in records if r.ok]
    met = sum(r.ttft_s <= SLO_TTFT_S and r.tpot_s <= SLO_TPOT_S for r in done)
    ttfts = [r.ttft_s for r in done]
    return PeriodResult(
        arrived=arrived, met=met, slo_attainment=met / arrived if arrived else math.nan,
        goodput_rps=met / (period.end_s - period.start_s),
        ttft_p50_s=quantile(ttfts, 0.5), ttft_p90_s=quantile(ttfts, 0.9),
        offload_share=sum(r.cluster == "prfaas" for r in done) / len(done) if done else 0.0,
        cache_hit_share=sum(r.cached_tokens for r in done) / max(
            1, sum(r.prompt_tokens for r in done)))


def run_job(scenario: str, policy: str, seed: int) -> RunResult:
    """One cell of the matrix at one seed (a Ray task: plain arguments, a plain result)."""
    setup = SCENARIOS[scenario](seed)
    d = deployment_for(setup, policy)
    result, wall = run_virtual(d, setup.arrivals, changes=setup.changes, sample_s=SAMPLE_S,
                               drain_s=DRAIN_S)
    to_paper = 1.0 / d.scale
    threshold = [(s.at, s.threshold * to_paper) for s in result.samples
                 if s.threshold is not None and math.isfinite(s.threshold)]
    return RunResult(scenario, policy, seed,
                     {p.name: period_result(setup, result, p) for p in setup.periods},
                     threshold, result.virtual_s, wall)


def jobs(scenarios: Sequence[str], seeds: Sequence[int]) -> list[tuple[str, str, int]]:
    """Every run of the matrix: each scenario, policy and oracle choice, at each seed."""
    policies = list(dict.fromkeys([*POLICIES, *(c.label for c in oracle_choices())]))
    return [(s, p, seed) for s in scenarios for p in policies for seed in seeds]


@dataclass
class Cell:
    """One policy in one scenario, over the seeds, per period."""

    attainment: dict[str, tuple[float, tuple[float, float]]]  # period -> mean, 95% interval
    goodput: dict[str, float]
    ttft_p50: dict[str, float]
    ttft_p90: dict[str, float]
    offload: dict[str, float]
    oracle_ratio: float  # worst period: this policy's mean attainment over the oracle's
    cache_hits: float = 0.0  # mean over periods and seeds of `cache_hit_share`
    oracle_t: dict[str, float] | None = None  # the oracle's: its best t per period
    oracle_split: dict[str, tuple[int, int, int]] | None = None  # and its split per period
    # Per period: this policy's attainment minus the planner's static t's, paired by seed
    # (both see the same arrivals), mean and 95% interval; None for the oracle.
    vs_prfaas: dict[str, tuple[float, tuple[float, float]]] | None = None


def _mean(values: Iterable[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def summarise(runs: Sequence[RunResult], planner_t: Callable[[str], float],
              ) -> dict[str, dict[str, Cell]]:
    """Per scenario, per policy (and the oracle): the matrix's cells."""
    out: dict[str, dict[str, Cell]] = {}
    for scenario in dict.fromkeys(r.scenario for r in runs):
        mine = [r for r in runs if r.scenario == scenario]
        periods = list(mine[0].periods)
        by_policy: dict[str, list[RunResult]] = {}
        for run in mine:
            by_policy.setdefault(run.policy, []).append(run)
        sweep = {p: rs for p, rs in by_policy.items() if StaticChoice.parse(p) is not None}
        oracle = _oracle(sweep, periods, planner_t(scenario), split_of(scenario))
        cells = {p: _cell(rs, periods, oracle) for p, rs in by_policy.items()
                 if not p.startswith("static")}
        for name, cell in cells.items():
            cell.vs_prfaas = paired_difference(by_policy[name], by_policy.get("prfaas", []),
                                               periods)
        cells[ORACLE] = oracle
        out[scenario] = cells
    return out


def _oracle(sweep: dict[str, list[RunResult]], periods: Sequence[str], t: float,
            split: Callable[[StaticChoice], tuple[int, int, int]]) -> Cell:
    """Per period, the static choice whose mean attainment over the seeds was the best."""
    best = {period: max(sweep, key=lambda p: _mean(
        r.periods[period].slo_attainment for r in sweep[p])) for period in periods}
    chosen = {id(r): r for period in periods for r in sweep[best[period]]}
    cell = _cell(list(chosen.values()), periods, None, only=best)
    choices = {period: StaticChoice.parse(best[period]) or StaticChoice() for period in periods}
    cell.oracle_t = {period: t * choices[period].factor for period in periods}
    cell.oracle_split = {period: split(choices[period]) for period in periods}
    return cell


def paired_difference(runs: Sequence[RunResult], reference: Sequence[RunResult],
                      periods: Sequence[str]) -> dict[str, tuple[float, tuple[float, float]]]:
    """Per period, the mean and 95% interval of `runs`' attainment minus `reference`'s at
    the same seed (seeds missing from either are left out; none in common: nan)."""
    theirs = {r.seed: r for r in reference}
    out = {}
    for period in periods:
        diffs = [r.periods[period].slo_attainment - theirs[r.seed].periods[period].slo_attainment
                 for r in runs if r.seed in theirs]
        finite = [d for d in diffs if math.isfinite(d)]
        out[period] = mean_interval(finite) if finite else (math.nan, (math.nan, math.nan))
    return out


def _cell(runs: Sequence[RunResult], periods: Sequence[str], oracle: Cell | None,
          only: dict[str, str] | None = None) -> Cell:
    def values(period: str, field: str) -> list[float]:
        chosen = [r for r in runs if only is None or r.policy == only[period]]
        return [getattr(r.periods[period], field) for r in chosen]

    attainment = {p: mean_interval([v for v in values(p, "slo_attainment")
                                    if math.isfinite(v)] or [math.nan]) for p in periods}
    ratio = min((attainment[p][0] / oracle.attainment[p][0]
                 if oracle and oracle.attainment[p][0] > 0 else 1.0) for p in periods)
    return Cell(attainment, {p: _mean(values(p, "goodput_rps")) for p in periods},
                {p: _mean(values(p, "ttft_p50_s")) for p in periods},
                {p: _mean(values(p, "ttft_p90_s")) for p in periods},
                {p: _mean(values(p, "offload_share")) for p in periods}, ratio,
                _mean(v for p in periods for v in values(p, "cache_hit_share")))


def split_of(scenario: str) -> Callable[[StaticChoice], tuple[int, int, int]]:
    """A static choice's split in `scenario` (a toy name: the paper's 4/3/5)."""
    builder = SCENARIOS.get(scenario)
    base = builder(0).base if builder else Deployment()
    return lambda choice: choice.split(base)


def planner_t_of(scenario: str) -> float:
    """The planner's t of a scenario, in paper tokens."""
    setup = SCENARIOS[scenario](0)
    return float(setup.base.policy_options["threshold"]) / setup.base.scale
