"""A search space, read from TOML, and the configurations it holds.

A space names its chips (a hardware profile and a price per instance-hour), its link
bandwidths (and a price per Gbps-hour), and families of deployments: PrfaaS-PD (`prfaas-pd`),
homogeneous PD (`homogeneous`) or every prefill remote (`naive`), each with ranges of
instance counts and, for PrfaaS-PD, threshold candidates: paper tokens, "planner" (the
planner's t for that shape and link) or "dynamic" (the `prfaas-dynamic` policy, which
re-solves t as it runs). `configurations` expands the space into `Configuration`s, each one
deployment with its cost per hour and the planner's prediction for it, the prediction that
seeds its capacity search.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import msgspec

from mesh.errors import ConfigError
from services.paper.case_study import (
    DEPLOYMENTS,
    HOMOGENEOUS,
    NAIVE,
    POLICY_DEPLOYMENTS,
    PRFAAS_PD,
)
from services.paper.hardware import CostModel
from services.paper.planner import ClusterShape, ThroughputModel, solve_threshold
from services.paper.workload import EmpiricalLengths, LengthDistribution, TruncatedLogNormal
from services.sim.capacity import CapacityConfig
from services.sim.workload import Workload
from services.sim.world import CHUNK_PAPER_TOKENS, COARSE_SCALE, Deployment

Threshold = float | str  # paper tokens, "planner" or "dynamic"
# The policy a baseline family runs (its deployment's, in the paper's comparison).
_POLICY = {deployment: policy for policy, deployment in POLICY_DEPLOYMENTS.items()}


class Chip(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An instance type: its hardware profile (a shipped name or a path) and its price."""

    profile: str
    price_per_hour: float

    def __post_init__(self) -> None:
        if not self.price_per_hour > 0:
            raise ConfigError(f"price_per_hour must be > 0, got {self.price_per_hour}")


class Family(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One kind of deployment and the ranges its configurations take."""

    name: str
    kind: str  # a deployment of services/paper/case_study.py
    pd_chip: str
    n_d: list[int]
    prfaas_chip: str = ""
    n_prfaas: list[int] = msgspec.field(default_factory=lambda: [0])
    n_p: list[int] = msgspec.field(default_factory=lambda: [0])
    t: list[Threshold] = msgspec.field(default_factory=lambda: ["planner"])

    def __post_init__(self) -> None:
        if self.kind not in DEPLOYMENTS:
            raise ConfigError(f"family {self.name!r}: kind must be one of {DEPLOYMENTS}, got "
                              f"{self.kind!r}")
        if self.kind != HOMOGENEOUS and not self.prfaas_chip:
            raise ConfigError(f"family {self.name!r}: a {self.kind} family needs prfaas_chip")
        for t in self.t:
            if isinstance(t, str) and t not in ("planner", "dynamic"):
                raise ConfigError(f"family {self.name!r}: t must be paper tokens, 'planner' "
                                  f"or 'dynamic', got {t!r}")


class SearchSpace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What `prfaas search` explores (module docstring); TOML keys are these fields."""

    name: str
    chips: dict[str, Chip]
    families: list[Family]
    description: str = ""
    model: str = "hybrid_1t"
    bandwidth_gbps: list[float] = msgspec.field(default_factory=lambda: [100.0])
    link_price_per_gbps_hour: float = 0.0
    # Configurations that cost more per hour are left out of the search.
    budget_per_hour: float = math.inf
    # The budgets to name the best deployment for (empty: every cost the search holds).
    budgets: list[float] = []
    # Two family names: the first's capacity over the second's at equal cost, minus 1.
    equal_cost: list[str] = []
    scale: float = COARSE_SCALE
    workload: Workload = Workload()
    capacity: CapacityConfig = CapacityConfig()

    def __post_init__(self) -> None:
        for family in self.families:
            for chip in (family.pd_chip, family.prfaas_chip):
                if chip and chip not in self.chips:
                    raise ConfigError(f"family {family.name!r} names chip {chip!r}, not one "
                                      f"of {sorted(self.chips)}")
        names = [f.name for f in self.families]
        if len(set(names)) != len(names):
            raise ConfigError(f"family names must be distinct, got {names}")
        if self.equal_cost and (len(self.equal_cost) != 2
                                or not set(self.equal_cost) <= set(names)):
            raise ConfigError(f"equal_cost must name two families of {names}, got "
                              f"{self.equal_cost}")

    def quick(self) -> SearchSpace:
        """The same space on short runs over two seeds at a coarser resolution (a smoke
        check: its numbers are not the ones to quote)."""
        cap = self.capacity
        return replace_struct(self, workload=replace_struct(
            self.workload, window_s=self.workload.window_s / 2),
            capacity=replace_struct(cap, seeds=cap.seeds[:2],
                                    resolution_rps=2 * cap.resolution_rps))


S = TypeVar("S", bound=msgspec.Struct)


def replace_struct(struct: S, **changes: object) -> S:
    return msgspec.structs.replace(struct, **changes)


def load_space(path: Path) -> SearchSpace:
    """A search space from its TOML file; errors name the file."""
    try:
        return msgspec.toml.decode(path.read_bytes(), type=SearchSpace)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


class Prediction(msgspec.Struct, frozen=True):
    """The planner's view of one configuration (Eqs. 3-6)."""

    lambda_rps: float
    t: float | None  # paper tokens; None: nothing routed by length
    bound: str
    offload_share: float


class Configuration(msgspec.Struct, frozen=True):
    """One deployment of the space, what it costs, what the planner predicts for it."""

    key: str  # stable and readable: its results file in the search's folder
    family: str
    kind: str
    t: Threshold | None  # as the space gave it (None: the family routes no threshold)
    bandwidth_gbps: float
    cost_per_hour: float
    deployment: Deployment
    planner: Prediction

    def fingerprint(self, workload: Workload, capacity: CapacityConfig) -> str:
        """What its capacity depends on: a result stored under another is not reused."""
        data = msgspec.json.encode((self.deployment, workload, capacity))
        return hashlib.sha256(data).hexdigest()[:16]


def lengths_of(workload: Workload) -> LengthDistribution:
    """The planner's view of the workload's input lengths."""
    if workload.paper_len:
        return EmpiricalLengths.from_samples([workload.paper_len])
    return TruncatedLogNormal.paper()


def configurations(space: SearchSpace) -> list[Configuration]:
    """Every configuration of the space within its budget, in a stable order."""
    out = []
    for family in space.families:
        prfaas = family.kind != HOMOGENEOUS
        for n_prfaas, n_p, n_d, bw in itertools.product(
                family.n_prfaas if prfaas else [0], family.n_p if family.kind != NAIVE
                else [0], family.n_d, space.bandwidth_gbps if prfaas else [0.0]):
            for t in family.t if family.kind == PRFAAS_PD else [None]:
                config = _configuration(space, family, ClusterShape(n_prfaas, n_p, n_d), bw, t)
                if config.cost_per_hour <= space.budget_per_hour + 1e-9:
                    out.append(config)
    return out


def _configuration(space: SearchSpace, family: Family, shape: ClusterShape, bw: float,
                   t: Threshold | None) -> Configuration:
    prediction = _predict(space, family, shape, bw, t)
    policy, options = _policy(family, t, prediction.t, space.scale)
    key = f"{family.name}-{shape.n_prfaas}-{shape.n_p}-{shape.n_d}"
    key += f"-t{t if not isinstance(t, float) else round(t)}-{bw:g}g" if family.kind == \
        PRFAAS_PD else (f"-{bw:g}g" if family.kind == NAIVE else "")
    d = Deployment(name=key, n_prfaas=shape.n_prfaas, n_pd_prefill=shape.n_p,
                   n_decode=shape.n_d, prfaas_profile=_profile(space, family.prfaas_chip),
                   pd_profile=space.chips[family.pd_chip].profile, model=space.model,
                   bandwidth_bps=(bw or 100.0) * 1e9, policy=policy, policy_options=options,
                   scale=space.scale, chunk_tokens=round(CHUNK_PAPER_TOKENS * space.scale))
    return Configuration(key=key, family=family.name, kind=family.kind, t=t,
                         bandwidth_gbps=bw, cost_per_hour=_cost(space, family, shape, bw),
                         deployment=d, planner=prediction)


def _profile(space: SearchSpace, chip: str) -> str:
    return space.chips[chip].profile if chip else "h200"


def _cost(space: SearchSpace, family: Family, shape: ClusterShape, bw: float) -> float:
    pd = space.chips[family.pd_chip].price_per_hour * (shape.n_p + shape.n_d)
    remote = space.chips[family.prfaas_chip].price_per_hour * shape.n_prfaas if \
        family.prfaas_chip else 0.0
    link = space.link_price_per_gbps_hour * bw if shape.n_prfaas else 0.0
    return round(pd + remote + link, 6)


def _policy(family: Family, t: Threshold | None, planner_t: float | None,
            scale: float) -> tuple[str, dict[str, object]]:
    if family.kind != PRFAAS_PD:
        return _POLICY[family.kind], {}
    if t == "dynamic":
        return "prfaas-dynamic", {}
    threshold = planner_t if t == "planner" else t
    assert isinstance(threshold, float | int)
    return "prfaas", {"threshold": float(threshold) * scale, "prefix_rule": "scarce"}


def _predict(space: SearchSpace, family: Family, shape: ClusterShape, bw: float,
             t: Threshold | None) -> Prediction:
    """Eqs. 3-6 at the configuration (t "planner" and "dynamic": the planner's t)."""
    lengths = lengths_of(space.workload)
    pd = CostModel.load(space.chips[family.pd_chip].profile, space.model)
    remote = CostModel.load(space.chips[family.prfaas_chip].profile, space.model) if \
        family.prfaas_chip and shape.n_prfaas else None
    model = ThroughputModel(remote, pd, (bw or 100.0) * 1e9, space.workload.output_len)
    if family.kind == HOMOGENEOUS:
        model, tokens = replace(model, prfaas=None), math.inf
    elif family.kind == NAIVE:
        tokens = -math.inf
    elif isinstance(t, str):
        tokens = solve_threshold(model, lengths, shape)
    else:
        assert t is not None
        tokens = float(t)
    point = model.evaluate(lengths, tokens, shape)
    return Prediction(lambda_rps=point.lambda_max, t=point.t, bound=point.bound,
                      offload_share=point.p)
