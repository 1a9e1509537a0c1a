"""The paper's throughput model (Eqs. 1-8) and its search for the threshold t and N_p / N_d.

Paper: arXiv 2604.15039 v2, section 3.4 (notation of Table 4), case study in section 4.
  Eq. 3  Theta_prfaas = min(N_prfaas / T_prefill(l_long), B_out / S_kv(l_long))
  Eq. 4  Theta_pd-p   = N_p / T_prefill(l_short)
  Eq. 5  Theta_pd-d   = N_d * BS_max / (T_decode * L_out)
  Eq. 6  Lambda_max   = min(Theta_prfaas / p, Theta_pd-p / (1 - p), Theta_pd-d)
  Eq. 7  optimal t:   Theta_prfaas / p = Theta_pd-p / (1 - p)
  Eq. 8  optimal N_p: Theta_prfaas + Theta_pd-p = Theta_pd-d (approximately: integers)
with p = P(L > t), l_long = E[L | L > t], l_short = E[L | L <= t]. As in the paper, all
offloaded requests are represented by l_long (T_prefill(l_long), not E[T_prefill(L)]).

`solve_threshold` finds t by bisection on the Eq. 7 balance (one side falls and the other
rises with t, section 3.4.2); `grid_threshold` is its slow exhaustive reference. Both run on
the analytic log-normal and on an empirical sample of recent incremental lengths, which is
how the dynamic policy re-solves t. `plan_main` is the `prfaas plan` command.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec

from services.paper.case_study import DEPLOYMENTS, HOMOGENEOUS, NAIVE, PRFAAS_PD
from services.paper.hardware import CostModel
from services.paper.workload import (
    PAPER_MAX_TOKENS,
    PAPER_MIN_TOKENS,
    PAPER_MU,
    PAPER_SIGMA,
    LengthDistribution,
    TruncatedLogNormal,
)


@dataclass(frozen=True)
class ClusterShape:
    """Instance counts: PrfaaS prefill, PD prefill (N_p) and PD decode (N_d).

    `prfaas_split`: the PrfaaS instances per PrfaaS cluster when several feed the PD cluster
    (summing to n_prfaas; empty: one cluster)."""

    n_prfaas: int
    n_p: int
    n_d: int
    prfaas_split: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("n_prfaas", "n_p", "n_d"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.prfaas_split and (sum(self.prfaas_split) != self.n_prfaas
                                  or min(self.prfaas_split) < 0):
            raise ValueError(f"prfaas_split must be counts >= 0 summing to n_prfaas="
                             f"{self.n_prfaas}, got {self.prfaas_split!r}")

    @property
    def sites(self) -> tuple[int, ...]:
        """PrfaaS instances per PrfaaS cluster."""
        return self.prfaas_split or (self.n_prfaas,)


class OperatingPoint(msgspec.Struct, frozen=True):
    """One evaluation of Eqs. 3-6; rates in req/s, egress in bit/s, t None: no routing."""

    lambda_max: float
    t: float | None
    n_prfaas: int
    n_p: int
    n_d: int
    theta_prfaas: float
    theta_pd_p: float
    theta_pd_d: float
    p: float
    l_short: float
    l_long: float
    egress_bps: float
    bound: str
    prfaas_limit: str
    egress_split_bps: tuple[float, ...] = ()  # Eq. 2 per PrfaaS cluster (several clusters)


@dataclass(frozen=True)
class ThroughputModel:
    """Eqs. 3-6 for PrfaaS clusters (None: none) feeding one PD cluster.

    Several PrfaaS clusters (a shape's `prfaas_split`) each have their own link to the PD
    cluster, of `links_bps[i]` (empty: `bandwidth_bps` each); Theta_prfaas is the sum of
    each cluster's Eq. 3 under its own link, and Eq. 2 gives each cluster's egress."""

    prfaas: CostModel | None
    pd: CostModel
    bandwidth_bps: float
    output_len: int = 1024
    links_bps: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0):
            raise ValueError(f"bandwidth_bps must be a finite number > 0, got "
                             f"{self.bandwidth_bps!r}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len!r}")

    def prfaas_limits(self, l_long: float, n_prfaas: int) -> tuple[float, float]:
        """(compute, bandwidth) ceilings of Eq. 3 in req/s."""
        if self.prfaas is None or n_prfaas == 0:
            return 0.0, 0.0
        compute = n_prfaas / self.prfaas.prefill_time_full(l_long)
        return compute, self.bandwidth_bps / (8.0 * self.prfaas.kv_bytes(l_long))

    def theta_prfaas(self, l_long: float, n_prfaas: int) -> float:
        return min(self.prfaas_limits(l_long, n_prfaas))

    def site_links(self, shape: ClusterShape) -> list[tuple[int, float]]:
        """(instances, link bandwidth) per PrfaaS cluster of `shape`."""
        sites = shape.sites
        links = self.links_bps or (self.bandwidth_bps,) * len(sites)
        if len(links) != len(sites):
            raise ValueError(f"links_bps names {len(links)} links for {len(sites)} PrfaaS "
                             "clusters")
        return list(zip(sites, links, strict=True))

    def site_thetas(self, l_long: float, shape: ClusterShape) -> list[float]:
        """Eq. 3 per PrfaaS cluster, each under its own link."""
        return [replace(self, bandwidth_bps=bw).theta_prfaas(l_long, n) if bw > 0 else 0.0
                for n, bw in self.site_links(shape)]

    def theta_prfaas_shape(self, l_long: float, shape: ClusterShape) -> float:
        if not shape.prfaas_split and not self.links_bps:
            return self.theta_prfaas(l_long, shape.n_prfaas)
        return sum(self.site_thetas(l_long, shape))

    def theta_pd_p(self, l_short: float, n_p: int) -> float:
        return n_p / self.pd.prefill_time_full(l_short) if n_p else 0.0

    def theta_pd_d(self, n_d: int) -> float:
        bs_max, step_s = self.pd.decode_slo()
        return n_d * bs_max / (step_s * self.output_len)

    def stage_demands(self, lengths: LengthDistribution, t: float,
                      shape: ClusterShape) -> tuple[float, float, float]:
        """The three terms of Eq. 6: the arrival rate each stage alone could sustain."""
        p = lengths.survival(t)
        l_short, l_long = lengths.conditional_means(t)
        prfaas = self.theta_prfaas_shape(l_long, shape) / p if p > 0 else math.inf
        pd_p = self.theta_pd_p(l_short, shape.n_p) / (1 - p) if p < 1 else math.inf
        return prfaas, pd_p, self.theta_pd_d(shape.n_d)

    def evaluate(self, lengths: LengthDistribution, t: float,
                 shape: ClusterShape) -> OperatingPoint:
        p = lengths.survival(t)
        l_short, l_long = lengths.conditional_means(t)
        demands = self.stage_demands(lengths, t, shape)
        lam = min(demands)
        compute, bandwidth = self.prfaas_limits(l_long, shape.n_prfaas)
        theta = self.theta_prfaas_shape(l_long, shape)
        if shape.prfaas_split or self.links_bps:
            bandwidth = compute if theta >= compute else theta
        egress = lam * p * 8.0 * self.prfaas.kv_bytes(l_long) if self.prfaas and p else 0.0
        thetas = self.site_thetas(l_long, shape) if shape.prfaas_split else []
        # Eq. 2 per cluster: its share of the offloaded requests times their KV
        split = tuple(egress * th / theta if theta else 0.0 for th in thetas)
        return OperatingPoint(
            lambda_max=lam, t=t if math.isfinite(t) else None,
            n_prfaas=shape.n_prfaas, n_p=shape.n_p, n_d=shape.n_d, egress_split_bps=split,
            theta_prfaas=theta, theta_pd_p=self.theta_pd_p(l_short, shape.n_p),
            theta_pd_d=demands[2], p=p, l_short=l_short, l_long=l_long, egress_bps=egress,
            bound=("prfaas", "pd_p", "pd_d")[demands.index(lam)],
            prfaas_limit=("" if not p or not shape.n_prfaas
                          else "compute" if compute <= bandwidth else "bandwidth"),
        )


def prefill_capacity(model: ThroughputModel, lengths: LengthDistribution, t: float,
                     shape: ClusterShape) -> float:
    """min(Theta_prfaas / p, Theta_pd-p / (1 - p)): what t trades off (Eq. 7)."""
    prfaas, pd_p, _ = model.stage_demands(lengths, t, shape)
    return min(prfaas, pd_p)


def _balance(model: ThroughputModel, lengths: LengthDistribution, t: float,
             shape: ClusterShape) -> float:
    prfaas, pd_p, _ = model.stage_demands(lengths, t, shape)
    if math.isinf(prfaas) or math.isinf(pd_p):
        return 1.0 if math.isinf(prfaas) else -1.0
    return prfaas - pd_p


def _edge_threshold(model: ThroughputModel, lengths: LengthDistribution,
                    shape: ClusterShape) -> float | None:
    """t when one prefill side does not exist: +inf offloads nothing, -inf everything."""
    if model.prfaas is None or shape.n_prfaas == 0:
        return math.inf
    if shape.n_p == 0:
        return -math.inf
    return None


def solve_threshold(model: ThroughputModel, lengths: LengthDistribution, shape: ClusterShape,
                    *, bandwidth_bps: float | None = None, tolerance: float = 1.0) -> float:
    """The t of Eq. 7 (maximising prefill capacity), by bisection to `tolerance` tokens.

    Works on any `LengthDistribution`; for an empirical one the answer is a sample value.
    `bandwidth_bps` overrides the model's B_out (the short-term loop measures it). Without
    PrfaaS instances t is +inf (offload nothing); without PD prefill, -inf (offload all).
    """
    if bandwidth_bps is not None:
        model = replace(model, bandwidth_bps=bandwidth_bps)
    edge = _edge_threshold(model, lengths, shape)
    if edge is not None:
        return edge
    low, high = lengths.lo - 1.0, lengths.hi
    while high - low > tolerance:
        mid = 0.5 * (low + high)
        if _balance(model, lengths, mid, shape) < 0:
            low = mid
        else:
            high = mid
    return max((high, low), key=lambda t: prefill_capacity(model, lengths, t, shape))


def grid_threshold(model: ThroughputModel, lengths: LengthDistribution, shape: ClusterShape,
                   candidates: Sequence[float] | None = None, step: float = 100.0) -> float:
    """Reference for `solve_threshold`: the best of every candidate t (default: a step grid)."""
    edge = _edge_threshold(model, lengths, shape)
    if edge is not None:
        return edge
    if candidates is None:
        count = math.ceil((lengths.hi - lengths.lo) / step)
        candidates = [lengths.lo + i * step for i in range(count)] + [lengths.hi]
    return max(candidates, key=lambda t: prefill_capacity(model, lengths, t, shape))


def _better(a: OperatingPoint, b: OperatingPoint) -> bool:
    """Higher Lambda_max wins; on a tie, the more prefill headroom."""
    return (a.lambda_max, min(a.theta_prfaas + a.theta_pd_p, a.theta_pd_d)) > (
        b.lambda_max, min(b.theta_prfaas + b.theta_pd_p, b.theta_pd_d))


def plan(model: ThroughputModel, lengths: LengthDistribution, n_prfaas: int, n_pd: int,
         exhaustive: bool = False) -> OperatingPoint:
    """Best (t, N_p, N_d) with N_p + N_d = n_pd: Eqs. 7 and 8 by search (paper Fig. 5)."""
    if n_pd < 2:
        raise ValueError(f"n_pd must be >= 2 (a prefill and a decode instance), got {n_pd!r}")
    best: OperatingPoint | None = None
    for n_p in range(1, n_pd):
        shape = ClusterShape(n_prfaas, n_p, n_pd - n_p)
        solver = grid_threshold if exhaustive else solve_threshold
        point = model.evaluate(lengths, solver(model, lengths, shape), shape)
        if best is None or _better(point, best):
            best = point
    assert best is not None
    return best


def plan_homogeneous(model: ThroughputModel, lengths: LengthDistribution,
                     n_pd: int) -> OperatingPoint:
    """One PD cluster alone (p = 0), best N_p / N_d."""
    return plan(replace(model, prfaas=None), lengths, 0, n_pd)


def plan_naive(model: ThroughputModel, lengths: LengthDistribution, n_prfaas: int,
               n_d: int) -> OperatingPoint:
    """Every prefill on the PrfaaS cluster (p = 1), every PD instance decodes."""
    return model.evaluate(lengths, -math.inf, ClusterShape(n_prfaas, 0, n_d))


class ModeledCase(msgspec.Struct, frozen=True, kw_only=True):
    """What the throughput model is evaluated for: the two clusters' hardware profiles, the
    model, the PrfaaS egress bandwidth, the output length and the input length distribution
    (a truncated log-normal). The defaults are the paper's case study (section 4.1); the
    planner's `Scenario` and the dynamic policy's config each add their cluster sizes."""

    prfaas_profile: str = "h200"
    pd_profile: str = "h20"
    model: str = "hybrid_1t"
    bandwidth_gbps: float = 100.0  # B_out
    output_len: int = 1024
    mu: float = PAPER_MU
    sigma: float = PAPER_SIGMA
    min_len: float = PAPER_MIN_TOKENS
    max_len: float = PAPER_MAX_TOKENS

    def distribution(self) -> TruncatedLogNormal:
        return TruncatedLogNormal(self.mu, self.sigma, self.min_len, self.max_len)

    def throughput_model(self) -> ThroughputModel:
        return ThroughputModel(CostModel.load(self.prfaas_profile, self.model),
                               CostModel.load(self.pd_profile, self.model),
                               self.bandwidth_gbps * 1e9, self.output_len)


class Scenario(ModeledCase, frozen=True, kw_only=True):
    """A deployment to plan: the case and the instances of each deployment of Table 6."""

    n_prfaas: int = 4
    n_pd: int = 8
    n_homogeneous: int = 12


class PlanResult(msgspec.Struct, frozen=True,
                 rename={"prfaas": PRFAAS_PD, "homogeneous": HOMOGENEOUS, "naive": NAIVE}):
    """Table 6's three operating points. The keys of `prfaas plan --json` are the deployments'
    names (services/paper/case_study.py), as `point` reads them."""

    prfaas: OperatingPoint
    homogeneous: OperatingPoint
    naive: OperatingPoint

    def point(self, deployment: str) -> OperatingPoint:
        """The operating point of the deployment named `deployment`."""
        points = {PRFAAS_PD: self.prfaas, HOMOGENEOUS: self.homogeneous, NAIVE: self.naive}
        if deployment not in points:
            raise ValueError(f"deployment must be one of {DEPLOYMENTS}, got {deployment!r}")
        return points[deployment]


def solve_scenario(scenario: Scenario,
                   lengths: LengthDistribution | None = None) -> PlanResult:
    """Table 6's three rows for `scenario` (lengths default: its log-normal)."""
    dist = scenario.distribution() if lengths is None else lengths
    model = scenario.throughput_model()
    return PlanResult(
        prfaas=plan(model, dist, scenario.n_prfaas, scenario.n_pd),
        homogeneous=plan_homogeneous(model, dist, scenario.n_homogeneous),
        naive=plan_naive(model, dist, scenario.n_prfaas, scenario.n_pd),
    )
