"""The router's bandwidth estimate from its senders' counters (services/router/link_meter.py):
against a fluid link here, and against the live shaper in the simulation."""

from __future__ import annotations

import msgspec
import pytest

from netem.params import LinkParams
from services.paper.planner import Scenario, solve_scenario
from services.router.link_meter import BandwidthEstimator, EstimatorConfig, LinkEstimate
from services.sim.run import LinkChange, run_virtual
from services.sim.scenarios import PRFAAS_PD, paper_deployments
from services.sim.workload import lognormal


class Senders:
    """Two senders offering `offered_bps` between them to a link of `rate_bps`, a second at a
    time: what is left over waits (the senders are held), what crossed is counted."""

    def __init__(self, rate_bps: float, offered_bps: float) -> None:
        self.rate_bps, self.offered_bps = rate_bps, offered_bps
        self.backlog = 0.0
        self.delivered = [0, 0]
        self.held = [0.0, 0.0]

    def second(self) -> dict[str, tuple[int, float]]:
        self.backlog += self.offered_bps
        sent = min(self.backlog, self.rate_bps)
        self.backlog -= sent
        for i in (0, 1):
            self.delivered[i] += round(sent / 16)  # half each, in bytes
            self.held[i] += 1.0 if self.backlog > 0 else 0.0
        return {f"x{i}": (self.delivered[i], self.held[i]) for i in (0, 1)}


def drive(estimator: BandwidthEstimator, senders: Senders, start: int,
          seconds: int) -> list[LinkEstimate]:
    return [estimator.observe(float(now), senders.second())
            for now in range(start, start + seconds)]


def within(value: float, truth: float, share: float = 0.15) -> bool:
    return abs(value - truth) <= share * truth


def test_a_saturated_link_is_measured_and_a_step_down_followed_within_30_s() -> None:
    estimator = BandwidthEstimator()  # no provisioned rate: all it knows is measured
    senders = Senders(100e9, 150e9)
    drive(estimator, senders, 0, 60)
    assert within(estimator.available_bps, 100e9)
    senders.rate_bps = 10e9
    after = drive(estimator, senders, 60, 60)
    first = next(i for i, e in enumerate(after) if within(e.available_bps, 10e9))
    assert first <= 30, [round(e.available_bps / 1e9, 1) for e in after]
    assert all(within(e.available_bps, 10e9) for e in after[first:])
    assert after[-1].saturated and after[-1].utilisation == pytest.approx(1.0, abs=0.15)
    estimator.check_integrity()


def test_idle_periods_change_nothing() -> None:
    # Provisioned far above what is measured: an idle link could be probed up to it, and is not.
    estimator = BandwidthEstimator(EstimatorConfig(provisioned_bps=100e9))
    senders = Senders(10e9, 20e9)
    drive(estimator, senders, 0, 60)
    measured = estimator.available_bps
    senders.offered_bps, senders.backlog = 0.0, 0.0
    idle = [e for e in drive(estimator, senders, 60, 300) if e.throughput_bps == 0]
    assert len(idle) >= 280  # every window past the last traffic's
    assert {e.available_bps for e in idle} == {idle[0].available_bps}
    assert idle[0].available_bps == pytest.approx(measured, rel=0.15)
    assert not any(e.saturated for e in idle)


def test_unsaturated_traffic_bounds_from_below_and_probes_back_to_the_provisioned_rate() -> None:
    estimator = BandwidthEstimator(EstimatorConfig(provisioned_bps=100e9))
    assert estimator.available_bps == 100e9  # the prior, before any measurement
    senders = Senders(5e9, 8e9)  # a dip: saturated at 5 Gbps
    drive(estimator, senders, 0, 60)
    assert within(estimator.available_bps, 5e9)
    senders.rate_bps, senders.offered_bps = 100e9, 3e9  # the line is back; traffic is light
    back = drive(estimator, senders, 60, 120)
    first = next(i for i, e in enumerate(back) if e.available_bps >= 99e9)
    assert first <= 60  # probed back up while nothing held the senders
    assert max(e.available_bps for e in back) <= 100e9  # never past the provisioned rate


def test_held_but_not_saturated_windows_do_not_probe() -> None:
    estimator = BandwidthEstimator(EstimatorConfig(provisioned_bps=100e9))
    senders = Senders(5e9, 8e9)
    drive(estimator, senders, 0, 60)
    measured = estimator.available_bps
    # Half the time held: the link is busy, neither saturated nor idle; nothing is learnt.
    for now in range(60, 180):
        senders.offered_bps = 8e9 if now % 2 else 1e9
        estimator.observe(float(now), senders.second())
    assert estimator.available_bps <= 1.5 * measured


def test_a_sender_that_restarts_counts_from_zero() -> None:
    estimator = BandwidthEstimator()
    estimator.observe(0.0, {"x0": (10**9, 5.0)})
    estimate = estimator.observe(10.0, {"x0": (125_000_000, 10.0)})  # restarted: 1 Gbit, held
    assert estimate.throughput_bps == pytest.approx(1e8)
    assert estimate.held == pytest.approx(1.0)


def test_config_errors_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"held_min must lie in \(0, 1\], got 1.5"):
        EstimatorConfig(held_min=1.5)
    with pytest.raises(ValueError, match=r"probe_step must be > 1, got 1.0"):
        EstimatorConfig(probe_step=1.0)
    with pytest.raises(ValueError, match=r"window_s must be a finite number > 0"):
        EstimatorConfig(window_s=0.0)


def test_the_router_measures_the_shaped_link_of_the_simulation() -> None:
    """Every prefill offloaded (naive-hetero) at a rate a 10 Gbps link cannot carry: the live
    shaper holds the senders, and the router's estimate (from their counters only) finds the
    link's new rate within 15 % within 30 s of the cut, with nothing told to the router."""
    base = paper_deployments(solve_scenario(Scenario()))[PRFAAS_PD]
    d = msgspec.structs.replace(base, policy="naive-hetero", policy_options={}, n_decode=8)
    cut = 120.0
    changes = [LinkChange(cut, LinkParams(bandwidth_bps=10e9, delay_s=base.delay_s))]
    arrivals = lognormal(3.0, 240.0, base.scale, 0)
    result, _ = run_virtual(d, arrivals, changes=changes, sample_s=5.0, drain_s=0.0)
    after = [s for s in result.samples if cut + 30 <= s.at <= 240]
    assert after and all(s.bandwidth_bps == 10e9 for s in after)
    assert all(within(s.estimate_bps, 10e9) for s in after), \
        [(s.at, round(s.estimate_bps / 1e9, 2)) for s in after]


def test_senders_held_a_whole_window_with_nothing_delivered_measure_a_dead_link() -> None:
    estimator = BandwidthEstimator(EstimatorConfig(provisioned_bps=1e9))
    estimates = [estimator.observe(float(now), {"x0": (0, float(now))}) for now in range(12)]
    assert estimates[4].available_bps == 1e9  # under a window: nothing known yet
    assert estimates[-1].saturated and estimates[-1].available_bps == 1.0  # known: nothing
