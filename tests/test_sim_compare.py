"""Deployments side by side (services/sim/compare.py): one load, the same arrivals to each,
and at a rate between their capacities homogeneous's queue grows while PrfaaS-PD's holds."""

from __future__ import annotations

import math
import statistics

import anyio
import pytest
import trio

from mesh.errors import ConfigError
from services.contract.errors import ControlError
from services.contract.events import AnyEvent, RoutingDecision
from services.sim.capacity import Slo
from services.sim.clock import JumpClock
from services.sim.compare import (
    COMPARE_DEFAULT_RATE,
    CompareSample,
    CompareSim,
    Served,
    Tally,
    compare_deployments,
)
from services.sim.controls import CompareControls
from services.sim.live import LiveConfig

# Virtual seconds of the run below: homogeneous's prefill backlog is well past its noise by
# then (it gains about 0.4 requests a second), and the run takes seconds of wall time.
VIRTUAL_S = 300.0


def test_compare_deployments_are_the_paper_scenarios() -> None:
    both = compare_deployments(["prfaas-pd", "homogeneous"], seed=3)
    assert list(both) == ["prfaas-pd", "homogeneous"]
    pd, homogeneous = both["prfaas-pd"], both["homogeneous"]
    assert (pd.n_prfaas, pd.n_pd_prefill, pd.n_decode) == (4, 3, 5)
    assert (homogeneous.n_prfaas, homogeneous.n_pd_prefill, homogeneous.n_decode) == (0, 9, 3)
    assert pd.scale == homogeneous.scale and pd.seed == homogeneous.seed == 3
    assert set(compare_deployments(["naive", "prfaas-pd", "homogeneous"])) == {
        "naive", "prfaas-pd", "homogeneous"}
    for names in (["prfaas-pd"], ["prfaas-pd", "prfaas-pd"], ["prfaas-pd", "bogus"],
                  ["prfaas-pd", "homogeneous", "naive", "homogeneous"]):
        with pytest.raises(ConfigError, match="--compare"):
            compare_deployments(names)


def test_tally_windows_and_slo() -> None:
    tally = Tally(keep_s=60.0, slo=Slo())
    for at in (1.0, 2.0, 50.0):
        tally.arrive(at)
    tally.finish(Served(10.0, True, ttft_s=1.0, tpot_s=0.025, queue_s=0.5))
    tally.finish(Served(55.0, True, ttft_s=9.0, tpot_s=0.025, queue_s=6.0))  # queued too long
    tally.finish(Served(56.0, False))
    assert (tally.in_flight, tally.completed, tally.failed) == (0, 2, 1)
    assert tally.completed_since(20.0) == 1
    tally.forget(75.0)  # keeps (15, 75]
    assert list(tally.arrivals) == [50.0] and [s.done_at for s in tally.done] == [55.0]
    assert [tally.within_slo(s) for s in tally.done] == [False]


def run_compare(rate: float) -> tuple[CompareSim, dict[str, list[tuple[float, int]]], dict]:
    """Both deployments for VIRTUAL_S at `rate`; what each router decided (virtual time and
    prompt length of every request) and the summary at the end."""
    sim = CompareSim(compare_deployments(["prfaas-pd", "homogeneous"]),
                     config=LiveConfig(rate=rate, wall_clock=False, output_len=1024))
    seen: dict[str, list[tuple[float, int]]] = {c.name: [] for c in sim.columns}

    def publisher(name: str):  # type: ignore[no-untyped-def]
        def publish(event: AnyEvent) -> None:
            if isinstance(event, RoutingDecision):
                seen[name].append((event.ts, event.total_len))
        return publish

    async def main() -> dict:  # type: ignore[type-arg]
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sim.run_columns, {name: publisher(name) for name in seen})
            await anyio.sleep(VIRTUAL_S + 0.5)
            summary = sim.summary()
            controls = await CompareControls(sim).state()
            assert controls["workload"]["rate"] == rate
            tasks.cancel_scope.cancel()
        return summary

    summary = trio.run(main, clock=JumpClock())
    return sim, seen, summary


def test_the_same_arrivals_reach_every_deployment_and_only_homogeneous_queues() -> None:
    sim, seen, summary = run_compare(COMPARE_DEFAULT_RATE)
    pd, homogeneous = seen["prfaas-pd"], seen["homogeneous"]
    # Identical arrival lists, as each router saw them: the same instants, the same lengths.
    assert len(pd) > 0.8 * COMPARE_DEFAULT_RATE * VIRTUAL_S
    assert [length for _, length in pd] == [length for _, length in homogeneous]
    assert all(math.isclose(a, b, abs_tol=1e-6) for (a, _), (b, _) in zip(pd, homogeneous,
                                                                             strict=True))
    samples = {c.name: list(c.samples) for c in sim.columns}
    assert all(len(s) >= VIRTUAL_S - 2 for s in samples.values())
    offered = [s.offered_rps for s in samples["prfaas-pd"]]
    assert offered == [s.offered_rps for s in samples["homogeneous"]]

    def queued(name: str, low: float, high: float) -> list[int]:
        return [s.queued for s in samples[name] if low <= s.at < high]

    # 2.5 req/s is past homogeneous's capacity and below PrfaaS-PD's: one backlog grows
    # minute after minute (its least in the last minute above its most in the second), the
    # other comes and goes with the bursts (each minute's mean a few requests).
    early, late = queued("homogeneous", 60, 120), queued("homogeneous", 240, 300)
    assert min(late) > max(early) + 20, (early, late)
    means = [statistics.fmean(queued("prfaas-pd", low, low + 60)) for low in (60, 120, 180, 240)]
    assert max(means) < 25, means
    assert summary["baseline"] == "homogeneous"
    assert summary["ratios"]["prfaas-pd"] > 1.05
    last = samples["prfaas-pd"][-1]
    # Half the requests cross the link: several Gbps of KV (13 Gbps at the paper's 3.24 req/s).
    assert isinstance(last, CompareSample) and 2 < last.egress_gbps < 30, last
    assert samples["homogeneous"][-1].egress_gbps == 0
    assert last.slo_attained is not None and samples["homogeneous"][-1].slo_attained is not None
    assert last.slo_attained > samples["homogeneous"][-1].slo_attained


def test_compare_controls_refuse_what_belongs_to_one_deployment() -> None:
    sim = CompareSim(compare_deployments(["prfaas-pd", "homogeneous"]),
                     config=LiveConfig(rate=0.0, wall_clock=False))
    controls = CompareControls(sim)

    async def main() -> None:
        state = await controls.state()
        assert state["sim"] is None and "not running" in state["errors"]["sim"]
        with pytest.raises(ControlError) as refused:
            await controls.set_policy(type("P", (), {"policy": "homogeneous"})())
        assert refused.value.status == 409
        with pytest.raises(ControlError) as unpaced:
            await controls.set_speed(type("S", (), {"speed": 10.0})())
        assert unpaced.value.status == 409

    trio.run(main)
