"""The capacity search (services/sim/capacity.py) on deployments whose answer is known."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import pytest

from services.paper.planner import Scenario, solve_scenario
from services.sim.capacity import (
    Capacity,
    CapacityConfig,
    SeedCapacity,
    Slo,
    completion_rate,
    mean_interval,
    measure_capacity,
    quantile,
    saturation_of,
    saturation_point,
    simulate_rate,
)
from services.sim.report import paper_report, write_summary
from services.sim.scenarios import PaperOutcome, deployment_summary, paper_deployments
from services.sim.workload import Workload
from services.sim.world import Deployment
from tests.constant_profile import constant_profile

pytestmark = pytest.mark.slow

# The one prefill instance takes SERVICE_S for any prompt of one chunk (constant_profile):
# the deployment saturates at 1 / SERVICE_S requests per second.
SERVICE_S = 2.0


@pytest.fixture
def one_stage(tmp_path: Path) -> Deployment:
    profile = tmp_path / "constant.toml"
    profile.write_text(constant_profile(SERVICE_S))
    return Deployment(name="closed", n_prfaas=0, n_pd_prefill=1, n_decode=1,
                      policy="homogeneous", pd_profile=str(profile))


def test_the_search_lands_within_its_resolution_below_a_known_saturation(
        one_stage: Deployment) -> None:
    """Deterministic service, evenly spaced arrivals, one stage: saturation is exactly
    1 / SERVICE_S, and up to it nothing ever queues, so the SLO capacity is the saturation
    itself; the bisection must find it from below, never above."""
    saturation = 1.0 / SERVICE_S
    workload = Workload(window_s=160.0, output_len=2, paper_len=1000)
    config = CapacityConfig(seeds=(0, 1), resolution_rps=0.02)
    mapped: list[int] = []

    def run_map(job: Callable[[int], SeedCapacity], seeds: Iterable[int],
                ) -> list[SeedCapacity]:
        mapped.extend(seeds)
        return [job(seed) for seed in reversed(mapped)]

    found = measure_capacity(one_stage, workload, guess_rps=saturation, config=config,
                             run_map=run_map)
    assert mapped == [0, 1] and found.seeds == [0, 1]
    assert found.saturation_rps == pytest.approx(saturation, rel=1e-3)
    assert saturation - config.resolution_rps <= found.capacity_rps <= saturation
    for seed in found.per_seed:
        assert seed.capacity_rps <= seed.saturation_rps
        overloaded = seed.points[0]
        assert overloaded.rate == pytest.approx(1.3 * saturation)
        assert not overloaded.holds and overloaded.rho["pd_p"] == pytest.approx(1.0)
    assert found.rho["pd_p"] == pytest.approx(found.capacity_rps * SERVICE_S, rel=0.03)


def test_a_ttft_bound_that_binds_first_lowers_the_capacity(one_stage: Deployment) -> None:
    """The same deployment, workload and seeds, searched twice: with the queueing and TPOT
    bounds only, then with a P90 TTFT bound under the P90 TTFT it had at that capacity (the
    paper's lengths at Poisson arrivals on the 2 s-per-chunk stage: TTFT grows with the rate
    while the P99 queueing delay still holds). The TTFT bound binds first: a lower capacity,
    every accepted run within it, and a run refused by it alone."""
    workload = Workload(window_s=200.0, output_len=2)
    queue_only = CapacityConfig(seeds=(0, 1), resolution_rps=0.02)
    free = measure_capacity(one_stage, workload, 0.5, queue_only)
    bound = 3.5
    assert free.capacity_rps > 0 and free.ttft_p90_s > bound
    assert free.slo.ttft_p90_s is None and free.slo.holds(0.0, 0.0, math.inf)
    slo = Slo(ttft_p90_s=bound)
    capped = measure_capacity(one_stage, workload, 0.5,
                              msgspec.structs.replace(queue_only, slo=slo))
    assert capped.capacity_rps < free.capacity_rps
    runs = [p for s in capped.per_seed for p in s.points[1:]]
    assert all(p.ttft_p90_s <= bound for p in runs if p.holds)
    assert any(not p.holds and p.queue_s <= slo.queue_s and p.tpot_s <= slo.tpot_s
               for p in runs)
    assert capped.ttft_p90_s <= bound and "P90 TTFT <= 3.5 s" in slo.text()
    with pytest.raises(ValueError, match="ttft_p90_s"):
        Slo(ttft_p90_s=0.0)


def test_mean_interval_is_students_t() -> None:
    mean, (low, high) = mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    # sd = sqrt(2.5), t(0.975, 4) = 2.776
    assert mean == 3.0
    assert high - mean == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5))
    assert mean - low == pytest.approx(high - mean)


def test_quantile_and_completion_rate() -> None:
    assert quantile([3.0, 1.0, 2.0, math.inf], 0.99) == math.inf
    assert quantile(list(map(float, range(1, 101))), 0.99) == 99.0
    # Whole gaps only: 5 completions 2 s apart are 0.5 per second, wherever a window cuts.
    assert completion_rate([10.0, 12.0, 14.0, 16.0, 18.0]) == 0.5
    assert completion_rate([3.0]) == 0.0


def test_on_a_narrow_link_the_prfaas_side_follows_the_bandwidth_bound() -> None:
    """One PrfaaS instance on 2 Gbps: Eq. 3's bandwidth ceiling (0.18 req/s of long requests)
    is below its compute ceiling (0.27), and the planner's Lambda_max (0.90 req/s at its t)
    rests on it. Measured: the link's ceiling is the planner's B / S_kv(l_long) over p, and
    the PrfaaS side is held to it, far below its compute ceiling, and close to it: the
    instance computes its next prompt while the last one's KV drains (5% under with one
    instance; 15% when it held its compute slot until the KV was accepted,
    docs/simulation.md)."""
    scenario = Scenario(n_prfaas=1, n_pd=4, n_homogeneous=3, bandwidth_gbps=2.0)
    solved = solve_scenario(scenario)
    plan = solved.prfaas
    compute, bandwidth = scenario.throughput_model().prfaas_limits(plan.l_long, plan.n_prfaas)
    assert plan.prfaas_limit == "bandwidth" and bandwidth < 0.75 * compute
    d = paper_deployments(solved, bandwidth_bps=2e9)["prfaas-pd"]
    # The whole window overloaded: one PrfaaS instance completes a request every 6-7 s.
    point = saturation_point(d, Workload(window_s=500.0), plan.lambda_max, seed=0,
                             config=CapacityConfig(saturation_window=1.0))
    assert point.stage_rps["link"] == pytest.approx(bandwidth / plan.p, rel=0.10)
    prfaas_side = min(point.stage_rps["prfaas"], point.stage_rps["link"])
    assert prfaas_side < 0.75 * compute / plan.p
    assert prfaas_side == pytest.approx(bandwidth / plan.p, rel=0.10)
    assert 0.9 * plan.lambda_max < saturation_of(point) <= plan.lambda_max


def test_the_paper_report_keeps_its_keys_and_adds_the_capacities(tmp_path: Path) -> None:
    """summary.json keeps the old keys and adds, per deployment, saturation_rps,
    capacity_rps (the SLO capacity's mean), capacity_rps_ci, seeds and rho; table.md shows
    both capacities with intervals and both ratios over homogeneous beside the paper's."""
    solved = solve_scenario(Scenario())
    deployments = paper_deployments(solved)
    points = {"prfaas-pd": solved.prfaas, "homogeneous": solved.homogeneous,
              "naive": solved.naive}
    run = simulate_rate(deployments["naive"], Workload(window_s=30.0), 1.0, 0, 60.0)
    caps, summaries = {}, {}
    for factor, name in enumerate(deployments, start=1):
        per_seed = [SeedCapacity(seed, 2.0 * factor + seed / 10, 1.5 * factor + seed / 10, [])
                    for seed in (0, 1, 2)]
        caps[name] = Capacity(saturation_rps=2.0 * factor + 0.1, saturation_rps_ci=(1.9, 2.3),
                              capacity_rps=1.5 * factor + 0.1, capacity_rps_ci=(1.4, 1.8),
                              seeds=[0, 1, 2], rho={"pd_d": 0.5}, resolution_rps=0.05,
                              slo=Slo(), per_seed=per_seed)
        summaries[name] = deployment_summary(deployments[name], points[name], caps[name], run, run)
    outcome = PaperOutcome(summaries, caps, 1.0, dict.fromkeys(deployments, run))
    write_summary(tmp_path, paper_report(tmp_path, outcome, 60.0, 1.0))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {"scenario", "deployments", "common_rate_rps", "paper_table6", "virtual_s",
            "wall_s", "ratio_over_homogeneous"} <= set(summary)
    for name, entry in summary["deployments"].items():
        assert {"saturation_rps", "capacity_rps", "capacity_rps_ci", "seeds", "rho",
                "planner_lambda_rps", "ttft_mean_s", "offload_share", "sweep"} <= set(entry)
        assert entry["capacity_rps"] == caps[name].capacity_rps
        assert entry["capacity_rps_ci"] == [1.4, 1.8] and entry["seeds"] == [0, 1, 2]
    ratio = summary["ratio_over_homogeneous"]["naive"]
    assert ratio["mean"] == pytest.approx(statistics.fmean([4.5 / 3.0, 4.6 / 3.1, 4.7 / 3.2]),
                                          abs=1e-4)
    assert ratio["ci"][0] < ratio["mean"] < ratio["ci"][1]
    table = (tmp_path / "table.md").read_text()
    assert "SLO capacity (req/s) [95%]" in table and "4.6 [1.4, 1.8]" in table
    assert "| 1.54 |" in table
