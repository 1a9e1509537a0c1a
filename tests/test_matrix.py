"""The schedulers' matrix and its oracle (services/sim/matrix.py)."""

from __future__ import annotations

import msgspec
import pytest

from services.sim import matrix
from services.sim.matrix import (
    ORACLE,
    PeriodResult,
    RunResult,
    jobs,
    period_result,
    summarise,
)


def _period(attainment: float) -> PeriodResult:
    return PeriodResult(arrived=100, met=round(100 * attainment), slo_attainment=attainment,
                        goodput_rps=attainment, ttft_p50_s=1.0, ttft_p90_s=2.0,
                        offload_share=0.5)


def _run(policy: str, seed: int, early: float, late: float) -> RunResult:
    return RunResult("toy", policy, seed, {"early": _period(early), "late": _period(late)},
                     [(0.0, 1000.0)], 100.0, 1.0)


def test_the_oracle_finds_the_planted_best_static_choice_of_each_period() -> None:
    """A toy scenario: a static t of 0.5x the planner's is best early, one PD worker moved
    from decode to prefill late (planted); the oracle picks each in its period, with its t
    and split, and a policy that matches neither is rated by its worst period against them."""
    planted = {"prfaas": (0.7, 0.6), "static x0.5": (0.95, 0.3), "static x0.7": (0.8, 0.5),
               "static x1.4": (0.6, 0.8), "static x1 p+1": (0.5, 0.9),
               "static x1 p-1": (0.4, 0.2)}
    runs = [_run(p, seed, early + 0.01 * seed, late + 0.01 * seed)
            for p, (early, late) in planted.items() for seed in range(3)]
    runs += [_run("prfaas-dynamic", seed, 0.9, 0.45) for seed in range(3)]
    cells = summarise(runs, lambda scenario: 1000.0)["toy"]
    oracle = cells[ORACLE]
    assert oracle.oracle_t == {"early": pytest.approx(500.0), "late": pytest.approx(1000.0)}
    assert oracle.oracle_split == {"early": (4, 3, 5), "late": (4, 4, 4)}
    assert oracle.attainment["early"][0] == pytest.approx(0.96)
    assert oracle.attainment["late"][0] == pytest.approx(0.91)
    assert cells["prfaas-dynamic"].oracle_ratio == pytest.approx(0.45 / 0.91)
    assert cells["prfaas"].oracle_ratio == pytest.approx(0.61 / 0.91)
    low, high = cells["prfaas"].attainment["early"][1]
    assert low < 0.71 < high  # an interval over the seeds


def test_the_comparison_with_the_static_t_is_paired_by_seed() -> None:
    """Seeds differ a lot (0.2 to 0.8) but the dynamic run is 0.02 below the static one at
    every seed: the paired interval excludes 0 where the unpaired ones overlap."""
    runs = [_run("prfaas", seed, 0.2 + 0.3 * seed, 0.5) for seed in range(3)]
    runs += [_run("prfaas-dynamic", seed, 0.18 + 0.3 * seed + 0.001 * seed, 0.5)
             for seed in range(3)]
    cells = summarise(runs, lambda scenario: 1000.0)["toy"]
    mean, (low, high) = cells["prfaas-dynamic"].vs_prfaas["early"]  # type: ignore[index]
    assert mean == pytest.approx(-0.019) and low < mean < high < 0
    assert cells["prfaas-dynamic"].vs_prfaas["late"][0] == 0.0  # type: ignore[index]
    static_low = cells["prfaas"].attainment["early"][1][0]
    assert static_low < cells["prfaas-dynamic"].attainment["early"][0]


def test_a_static_choice_reads_back_from_its_label_and_moves_one_worker() -> None:
    setup = matrix.SCENARIOS["dip-1.6"](0)
    for choice in matrix.oracle_choices():
        assert matrix.StaticChoice.parse(choice.label) == choice
    assert matrix.StaticChoice.parse("dynamo") is None
    moved = matrix.deployment_for(setup, "static x1 p-1")
    assert (moved.n_prfaas, moved.n_pd_prefill, moved.n_decode) == (4, 2, 6)
    assert moved.policy == "prfaas"
    assert moved.policy_options["threshold"] == setup.base.policy_options["threshold"]
    faster = matrix.deployment_for(setup, "static x1.4")
    assert faster.policy_options["threshold"] == pytest.approx(
        1.4 * setup.base.policy_options["threshold"])
    assert (faster.n_pd_prefill, faster.n_decode) == (3, 5)


def test_every_policy_and_every_static_choice_runs_at_every_seed() -> None:
    todo = jobs(["dip-1.6"], [0, 1])
    policies = {policy for _, policy, _ in todo}
    assert {"prfaas", "prfaas-dynamic", "dynamo", "naive-hetero"} <= policies
    assert {"static x0.5", "static x0.7", "static x1.4", "static x1 p-1",
            "static x1 p+1"} <= policies
    assert len(todo) == 2 * len(policies) == 2 * 9


def test_a_period_counts_what_arrived_in_it_unfinished_included() -> None:
    """Requests that never finished count against the period they arrived in; the cache hit
    share is over the completed requests' prompt tokens."""
    from services.sim.matrix import Period, Setup
    from services.sim.run import Record
    from services.sim.workload import Arrival
    from services.sim.world import Deployment

    arrivals = [Arrival(float(i), (i,), 10, 4, 10) for i in range(10)]
    setup = Setup(Deployment(), arrivals, [], [Period("p", 0.0, 10.0)])

    def record(i: int, ttft: float) -> Record:
        return Record(f"r{i}", float(i), 10, 10, "prfaas" if i % 2 else "pd", 10 - i, i, 1.0,
                      ttft, 0.01, 1.0, 4, True)

    class Result(msgspec.Struct):
        records: list[Record]

    done = [record(i, 1.0) for i in range(6)] + [record(6, 50.0)]  # 7 done, 1 too slow
    result = period_result(setup, Result(done), setup.periods[0])  # type: ignore[arg-type]
    assert (result.arrived, result.met) == (10, 6)
    assert result.slo_attainment == pytest.approx(0.6)
    # Cached over prompt tokens of the completed: (0 + 1 + ... + 6) / 70.
    assert result.cache_hit_share == pytest.approx(21 / 70)


def test_prfaas_dynamic_applies_the_same_prefix_rule_as_prfaas() -> None:
    """The two differ only in how t is chosen: the deployment's `prefix_rule` pin (which cache
    counts) reaches both, and dynamo keeps its own options."""
    setup = matrix.SCENARIOS["trace-100g"](0)
    static = matrix.deployment_for(setup, "prfaas").policy_options
    dynamic = matrix.deployment_for(setup, "prfaas-dynamic").policy_options
    assert static["prefix_rule"] == "scarce" and dynamic == {"prefix_rule": "scarce"}
    assert "prefix_rule" not in matrix.deployment_for(setup, "dynamo").policy_options
