"""The search: every configuration's SLO capacity, then what is worth buying.

`run_search` expands a space (space.py), runs each configuration's capacity search
(services/sim/capacity.py: a saturation run, then a bisection below it, per seed) with one
job per (configuration, seed) on a pool (pool.py: Ray tasks or this process), seeded with the
planner's Lambda_max so the overloaded run pushes about 1.3x past it. A configuration's result
is written to DIR/configurations/KEY.msgpack as soon as its last seed is in, so a search started
again over the same folder skips what it already holds (a result whose deployment, workload or
capacity settings differ is computed afresh).

The summary holds every configuration's capacity (mean and 95% interval over seeds), its cost
per hour and capacity per dollar beside the planner's Lambda_max; the Pareto frontier of cost
against capacity (no other configuration is at most as dear and more capable); the best
deployment per budget; and, where the space names two families for it, the equal-cost gain:
the first family's best capacity over the second's at the dearest cost both reach, minus 1,
with its interval from the seed-by-seed ratios.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import msgspec

from services.sim.capacity import (
    Capacity,
    SeedCapacity,
    measure_capacity,
    ratio_interval,
    seed_capacity,
    simulate_rate,
)
from services.sim.search.space import Configuration, SearchSpace, configurations

Progress = Callable[[int, int, int], None]  # configurations done, running, left
# The paper's claim the equal-cost gain stands beside (arXiv 2604.15039 v2, section 4).
PAPER_EQUAL_COST_GAIN = 0.15


class Pool(Protocol):
    address: str
    cpus: int

    def unordered(self, jobs: Sequence[Callable[[], SeedCapacity]],
                  started: Callable[[int], None]) -> Any: ...


class Stored(msgspec.Struct, frozen=True):
    """One configuration's result on disk."""

    fingerprint: str
    configuration: Configuration
    capacity: Capacity


class Entry(msgspec.Struct, frozen=True):
    """One configuration in the summary."""

    key: str
    family: str
    instances: str  # PrfaaS prefill / PD prefill / PD decode
    policy: str
    t: float | str | None
    bandwidth_gbps: float
    capacity_rps: float
    capacity_rps_ci: tuple[float, float]
    saturation_rps: float
    cost_per_hour: float
    capacity_per_dollar: float  # requests per second per dollar-hour
    planner_lambda_rps: float
    planner_t: float | None
    planner_bound: str
    deployment: Any  # services.sim.world.Deployment, as JSON
    ttft_p90_s: float = math.nan  # the P90 TTFT at each seed's capacity, averaged


class Budget(msgspec.Struct, frozen=True):
    budget_per_hour: float
    key: str
    capacity_rps: float
    cost_per_hour: float


class EqualCost(msgspec.Struct, frozen=True):
    cost_per_hour: float
    numerator: str  # the configuration keys compared
    denominator: str
    paper_gain: float = PAPER_EQUAL_COST_GAIN


class Summary(msgspec.Struct, frozen=True, omit_defaults=True):
    search: str
    description: str
    configurations: list[Entry]
    frontier: list[str]  # keys, cheapest first
    best_per_budget: list[Budget]
    best_per_dollar: str
    wall_s: float
    ray: dict[str, Any]  # {"address": ..., "cpus": ...}
    computed: int  # configurations this run computed (the rest were in the folder)
    seeds: list[int]
    slo: Any
    workload: Any
    equal_cost_gain: float | None = None
    equal_cost_gain_ci: tuple[float, float] | None = None
    equal_cost: EqualCost | None = None
    # `prfaas search --against-serial`: both wall times, the load, whether both found the same
    against_serial: dict[str, Any] | None = None


class _Tally:
    """Which configurations are done, running (a seed started) or left."""

    def __init__(self, total: int, done: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = total, done, progress
        self.running: dict[str, int] = {}

    def started(self, key: str) -> None:
        self.running[key] = self.running.get(key, 0) + 1
        self.show()

    def finished(self, key: str, complete: bool) -> None:
        if complete:
            self.running.pop(key, None)
            self.done += 1
        self.show()

    def show(self) -> None:
        if self.progress is not None:
            running = len(self.running)
            self.progress(self.done, running, self.total - self.done - running)


def run_search(space: SearchSpace, out: Path, pool: Pool,
               progress: Progress | None = None) -> Summary:
    """The whole search into `out` (module docstring); returns and writes its summary."""
    began = time.perf_counter()
    store = out / "configurations"
    store.mkdir(parents=True, exist_ok=True)
    configs = configurations(space)
    results = {c.key: stored for c in configs
               if (stored := _load(store, c, space)) is not None}
    todo = [c for c in configs if c.key not in results]
    tally = _Tally(len(configs), len(results), progress)
    tally.show()
    for config, capacity in _compute(space, todo, pool, tally):
        results[config.key] = Stored(config.fingerprint(space.workload, space.capacity),
                                     config, capacity)
        # MessagePack: a run that never met the SLO holds infinities, which JSON cannot
        (store / f"{config.key}.msgpack").write_bytes(msgspec.msgpack.encode(results[config.key]))
    summary = summarise(space, [results[c.key] for c in configs],
                        wall_s=time.perf_counter() - began,
                        ray={"address": pool.address, "cpus": pool.cpus}, computed=len(todo))
    (out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    return summary


def _load(store: Path, config: Configuration, space: SearchSpace) -> Stored | None:
    path = store / f"{config.key}.msgpack"
    if not path.exists():
        return None
    stored = msgspec.msgpack.decode(path.read_bytes(), type=Stored)
    fresh = stored.fingerprint == config.fingerprint(space.workload, space.capacity)
    return stored if fresh else None


def _compute(space: SearchSpace, todo: Sequence[Configuration], pool: Pool, tally: _Tally,
             ) -> Any:
    """Yields (configuration, capacity) as each configuration's last seed comes in."""
    seeds = space.capacity.seeds
    jobs = [(c, seed) for c in todo for seed in seeds]
    calls = [partial(seed_capacity, c.deployment, space.workload, c.planner.lambda_rps,
                     space.capacity, simulate_rate, seed) for c, seed in jobs]
    got: dict[str, dict[int, SeedCapacity]] = {c.key: {} for c in todo}
    for index, result in pool.unordered(calls, lambda i: tally.started(jobs[i][0].key)):
        config, seed = jobs[index]
        got[config.key][seed] = result
        complete = len(got[config.key]) == len(seeds)
        tally.finished(config.key, complete)
        if complete:
            yield config, _capacity(space, config, got.pop(config.key))


def _capacity(space: SearchSpace, config: Configuration,
              per_seed: dict[int, SeedCapacity]) -> Capacity:
    """The capacity from the seeds' searches already run (capacity.py's own summary)."""
    def done(job: Callable[[int], SeedCapacity], seeds: Iterable[int]) -> list[SeedCapacity]:
        return [per_seed[s] for s in seeds]

    return measure_capacity(config.deployment, space.workload, config.planner.lambda_rps,
                            space.capacity, run_map=done)


def _entry(stored: Stored) -> Entry:
    c, cap = stored.configuration, stored.capacity
    d = c.deployment
    return Entry(key=c.key, family=c.family,
                 instances=f"{d.n_prfaas or '-'}/{d.n_pd_prefill or '-'}/{d.n_decode}",
                 policy=d.policy, t=c.t, bandwidth_gbps=c.bandwidth_gbps,
                 capacity_rps=cap.capacity_rps, capacity_rps_ci=cap.capacity_rps_ci,
                 saturation_rps=cap.saturation_rps, cost_per_hour=c.cost_per_hour,
                 capacity_per_dollar=cap.capacity_rps / c.cost_per_hour,
                 planner_lambda_rps=c.planner.lambda_rps, planner_t=c.planner.t,
                 planner_bound=c.planner.bound, deployment=msgspec.to_builtins(d),
                 ttft_p90_s=cap.ttft_p90_s)


def frontier(entries: Sequence[Entry]) -> list[str]:
    """The Pareto set of cost against capacity, cheapest first: each is more capable than
    every configuration at most as dear (ties in cost: the more capable)."""
    best = -math.inf
    keys = []
    for entry in sorted(entries, key=lambda e: (e.cost_per_hour, -e.capacity_rps)):
        if entry.capacity_rps > best:
            keys.append(entry.key)
            best = entry.capacity_rps
    return keys


def best_per_budget(entries: Sequence[Entry], budgets: Sequence[float]) -> list[Budget]:
    """For each budget, the most capable configuration at most that dear (the cheaper on a
    tie); budgets nothing fits are left out."""
    out = []
    for budget in sorted(set(budgets or [e.cost_per_hour for e in entries])):
        fits = [e for e in entries if e.cost_per_hour <= budget + 1e-9]
        if fits:
            top = max(fits, key=lambda e: (e.capacity_rps, -e.cost_per_hour))
            out.append(Budget(budget, top.key, top.capacity_rps, top.cost_per_hour))
    return out


def equal_cost_gain(space: SearchSpace, stored: Sequence[Stored],
                    ) -> tuple[float, tuple[float, float], EqualCost] | None:
    """The first `equal_cost` family's best over the second's at the dearest common cost."""
    if not space.equal_cost:
        return None
    first, second = ([s for s in stored if s.configuration.family == name]
                     for name in space.equal_cost)
    common = {round(s.configuration.cost_per_hour, 6) for s in first} & {
        round(s.configuration.cost_per_hour, 6) for s in second}
    if not common:
        return None
    cost = max(common)
    a, b = (max((s for s in group if round(s.configuration.cost_per_hour, 6) == cost),
                key=lambda s: s.capacity.capacity_rps) for group in (first, second))
    ratio, (low, high) = ratio_interval(a.capacity, b.capacity)
    return ratio - 1, (low - 1, high - 1), EqualCost(cost, a.configuration.key,
                                                     b.configuration.key)


def summarise(space: SearchSpace, stored: Sequence[Stored], *, wall_s: float,
              ray: dict[str, Any], computed: int) -> Summary:
    entries = [_entry(s) for s in stored]
    gain = equal_cost_gain(space, stored)
    top = max(entries, key=lambda e: (e.capacity_per_dollar, -e.cost_per_hour))
    return Summary(
        search=space.name, description=space.description, configurations=entries,
        frontier=frontier(entries), best_per_budget=best_per_budget(entries, space.budgets),
        best_per_dollar=top.key, wall_s=wall_s, ray=ray, computed=computed,
        seeds=list(space.capacity.seeds), slo=msgspec.to_builtins(space.capacity.slo),
        workload=msgspec.to_builtins(space.workload),
        equal_cost_gain=gain[0] if gain else None, equal_cost_gain_ci=gain[1] if gain else None,
        equal_cost=gain[2] if gain else None)
