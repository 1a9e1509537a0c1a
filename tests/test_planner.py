"""The throughput model and its search against the paper's Table 6."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from services.cli.plan import format_table, plan_main
from services.paper.case_study import DEPLOYMENTS, TABLE6
from services.paper.planner import (
    ClusterShape,
    PlanResult,
    Scenario,
    ThroughputModel,
    grid_threshold,
    plan,
    prefill_capacity,
    solve_scenario,
    solve_threshold,
)
from services.paper.workload import EmpiricalLengths, TruncatedLogNormal

PAPER_SHAPE = ClusterShape(4, 3, 5)


@pytest.fixture(scope="module")
def model() -> ThroughputModel:
    return Scenario().throughput_model()


@pytest.fixture(scope="module")
def lengths() -> TruncatedLogNormal:
    return Scenario().distribution()


@pytest.fixture(scope="module")
def result() -> PlanResult:
    return solve_scenario(Scenario())


def test_plan_acceptance_matches_table6(result: PlanResult) -> None:
    assert result.prfaas.lambda_max == pytest.approx(3.24, rel=0.03)
    assert result.homogeneous.lambda_max == pytest.approx(2.11, rel=0.03)
    assert result.naive.lambda_max == pytest.approx(2.45, rel=0.03)
    assert result.prfaas.t == pytest.approx(19400, rel=0.05)
    points = (result.prfaas, result.homogeneous, result.naive)
    shapes = [(p.n_prfaas, p.n_p, p.n_d) for p in points]
    assert shapes == [(4, 3, 5), (0, 9, 3), (4, 0, 8)]


def test_what_is_fitted_comes_back_exactly_and_what_is_not_comes_back_close(
        result: PlanResult) -> None:
    """The H20 profile is fitted to Table 6 (services/paper/profiles/h20.toml): its anchors
    return to rounding; t*, p, Theta_prfaas and the naive row used no Table 6 number and
    are the independent checks (docs/simulation.md, "Where the numbers come from")."""
    # By construction: the anchors themselves.
    assert result.homogeneous.theta_pd_p == pytest.approx(2.11, rel=1e-3)
    assert result.homogeneous.lambda_max == pytest.approx(2.11, rel=1e-3)
    assert result.prfaas.theta_pd_d == pytest.approx(3.90625, rel=1e-6)
    # Independent: close, not exact.
    assert result.prfaas.t == pytest.approx(19400, rel=0.01)
    assert result.prfaas.p == pytest.approx(0.496, abs=0.002)
    assert result.prfaas.theta_prfaas == pytest.approx(1.61, rel=0.01)
    assert result.naive.lambda_max == pytest.approx(2.45, rel=0.01)


def test_stage_throughputs_offload_share_and_egress(result: PlanResult) -> None:
    for name in DEPLOYMENTS:
        point, paper = result.point(name), TABLE6[name]
        for key in ("theta_prfaas", "theta_pd_p", "theta_pd_d"):
            if getattr(paper, key) is not None:
                assert getattr(point, key) == pytest.approx(getattr(paper, key), rel=0.03)
    assert result.prfaas.p == pytest.approx(0.496, abs=0.005)
    assert result.prfaas.egress_bps / 1e9 == pytest.approx(13.0, rel=0.1)
    assert result.prfaas.prfaas_limit == "compute"
    assert (result.homogeneous.p, result.naive.p) == (0.0, 1.0)
    assert result.homogeneous.t is None and result.naive.t is None


def test_eq7_balance_holds_at_the_optimum(result: PlanResult) -> None:
    point = result.prfaas
    assert point.theta_prfaas / point.p == pytest.approx(point.theta_pd_p / (1 - point.p),
                                                         rel=1e-3)
    # Eq. 8 only roughly: integer instances leave decode some slack (paper 3.25 vs 3.91).
    assert point.theta_prfaas + point.theta_pd_p < point.theta_pd_d


def test_the_two_sides_of_eq7_are_monotone_in_t(model: ThroughputModel,
                                                lengths: TruncatedLogNormal) -> None:
    ts = [1000.0 + 500.0 * i for i in range(250)]
    demands = [model.stage_demands(lengths, t, PAPER_SHAPE) for t in ts]
    prfaas = [d[0] for d in demands]
    pd_p = [d[1] for d in demands]
    assert prfaas == sorted(prfaas)
    assert pd_p == sorted(pd_p, reverse=True)


def test_bisection_matches_grid_reference_on_the_lognormal(model: ThroughputModel,
                                                           lengths: TruncatedLogNormal) -> None:
    for shape in (PAPER_SHAPE, ClusterShape(4, 2, 6), ClusterShape(1, 6, 1)):
        fast = solve_threshold(model, lengths, shape)
        slow = grid_threshold(model, lengths, shape, step=50.0)
        assert fast == pytest.approx(slow, abs=50.0)
        assert prefill_capacity(model, lengths, fast, shape) >= prefill_capacity(
            model, lengths, slow, shape) * (1 - 1e-12)


def test_bisection_is_exact_on_empirical_samples(model: ThroughputModel,
                                                 lengths: TruncatedLogNormal) -> None:
    samples = lengths.samples(random.Random(11), 5001)
    empirical = EmpiricalLengths.from_samples(samples)
    fast = solve_threshold(model, empirical, PAPER_SHAPE)
    slow = grid_threshold(model, empirical, PAPER_SHAPE, candidates=sorted(set(samples)))
    assert prefill_capacity(model, empirical, fast, PAPER_SHAPE) == pytest.approx(
        prefill_capacity(model, empirical, slow, PAPER_SHAPE), rel=1e-12)
    assert fast == pytest.approx(solve_threshold(model, lengths, PAPER_SHAPE), rel=0.03)


def test_exhaustive_grid_plan_agrees_with_bisection_plan(model: ThroughputModel,
                                                         lengths: TruncatedLogNormal) -> None:
    fast = plan(model, lengths, 4, 8)
    slow = plan(model, lengths, 4, 8, exhaustive=True)
    assert (fast.n_p, fast.n_d) == (slow.n_p, slow.n_d) == (3, 5)
    assert fast.lambda_max == pytest.approx(slow.lambda_max, rel=1e-3)
    assert fast.lambda_max >= slow.lambda_max * (1 - 1e-12)


def test_scarce_bandwidth_raises_t(model: ThroughputModel, lengths: TruncatedLogNormal) -> None:
    wide = solve_threshold(model, lengths, PAPER_SHAPE)
    narrow = solve_threshold(model, lengths, PAPER_SHAPE, bandwidth_bps=5e9)
    assert narrow > wide
    point = replace(model, bandwidth_bps=5e9).evaluate(lengths, narrow, PAPER_SHAPE)
    assert point.prfaas_limit == "bandwidth"
    assert point.egress_bps <= 5e9 * (1 + 1e-9)


def test_missing_prefill_sides_give_infinite_thresholds(model: ThroughputModel,
                                                        lengths: TruncatedLogNormal) -> None:
    assert solve_threshold(model, lengths, ClusterShape(0, 3, 5)) == math.inf
    assert solve_threshold(model, lengths, ClusterShape(4, 0, 8)) == -math.inf
    point = model.evaluate(lengths, math.inf, ClusterShape(0, 3, 5))
    assert (point.t, point.p, point.bound) == (None, 0.0, "pd_p")


def test_invalid_inputs_name_the_parameter(model: ThroughputModel,
                                           lengths: TruncatedLogNormal) -> None:
    with pytest.raises(ValueError, match="n_d"):
        ClusterShape(1, 1, -1)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        replace(model, bandwidth_bps=0.0)
    with pytest.raises(ValueError, match="n_pd"):
        plan(model, lengths, 4, 1)


def test_plan_main_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"prfaas-pd", "homogeneous", "naive"}
    for row in data.values():
        assert {"lambda_max", "t", "n_prfaas", "n_p", "n_d"} <= set(row)
        assert all(isinstance(row[k], int) for k in ("n_prfaas", "n_p", "n_d"))
    assert data["prfaas-pd"]["lambda_max"] == pytest.approx(3.24, rel=0.03)
    assert data["prfaas-pd"]["t"] == pytest.approx(19400, rel=0.05)
    assert data["homogeneous"]["t"] is None


def test_plan_main_table_compares_with_the_paper(capsys: pytest.CaptureFixture[str],
                                                 result: PlanResult) -> None:
    assert plan_main([]) == 0
    out = capsys.readouterr().out
    assert out.strip() == format_table(result)
    assert "paper" in out and "rel. err" in out and "mean egress" in out
    assert "4 / 3 / 5" in out and "- / 9 / 3" in out


def test_plan_main_knobs_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--json", "--samples", "3000", "--seed", "5", "--n-pd", "6"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prfaas-pd"]["n_p"] + data["prfaas-pd"]["n_d"] == 6
    assert plan_main(["--n-pd", "1"]) == 2
    assert "n_pd" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--help"])
    assert exit_info.value.code == 0


def test_two_equal_prfaas_clusters_by_hand(model: ThroughputModel,
                                           lengths: TruncatedLogNormal) -> None:
    """Two PrfaaS clusters of 2 instances, each on its own 4 Gbps link (tight enough that
    bandwidth binds), feeding 3 + 5 PD instances: Eqs. 1-8 by hand."""
    two = replace(model, links_bps=(4e9, 4e9))
    shape = ClusterShape(4, 3, 5, prfaas_split=(2, 2))
    t = 19_400.0
    point = two.evaluate(lengths, t, shape)
    p = lengths.survival(t)
    l_short, l_long = lengths.conditional_means(t)
    assert model.prfaas is not None
    s_kv, t_long = model.prfaas.kv_bytes(l_long), model.prfaas.prefill_time_full(l_long)
    per_cluster = min(2 / t_long, 4e9 / (8 * s_kv))  # Eq. 3, one cluster under its link
    assert per_cluster == 4e9 / (8 * s_kv)  # 4 Gbps binds: each cluster egress-limited
    theta_prfaas = 2 * per_cluster
    theta_pd_p = 3 / model.pd.prefill_time_full(l_short)  # Eq. 4
    bs_max, step_s = model.pd.decode_slo()
    theta_pd_d = 5 * bs_max / (step_s * 1024)  # Eq. 5
    lam = min(theta_prfaas / p, theta_pd_p / (1 - p), theta_pd_d)  # Eq. 6
    assert point.theta_prfaas == pytest.approx(theta_prfaas)
    assert point.lambda_max == pytest.approx(lam)
    assert point.prfaas_limit == "bandwidth"
    # Eq. 2 per cluster: each carries half the offloaded KV, together lam * p * S_kv.
    egress = lam * p * 8 * s_kv
    assert point.egress_split_bps == pytest.approx((egress / 2, egress / 2))
    # One cluster of 4 on one 8 Gbps link has the same ceiling; on one 4 Gbps link, half.
    assert replace(model, bandwidth_bps=8e9).evaluate(
        lengths, t, ClusterShape(4, 3, 5)).theta_prfaas == pytest.approx(theta_prfaas)
    assert replace(model, bandwidth_bps=4e9).evaluate(
        lengths, t, ClusterShape(4, 3, 5)).theta_prfaas == pytest.approx(theta_prfaas / 2)


def test_split_must_sum_to_the_prfaas_instances() -> None:
    with pytest.raises(ValueError, match="prfaas_split"):
        ClusterShape(4, 3, 5, prfaas_split=(2, 1))
