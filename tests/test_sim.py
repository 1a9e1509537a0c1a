"""The simulation: the live services on virtual time (services/sim).

Small deployments and minutes of virtual time, so each test takes seconds of wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

import services.sim.world
from services.cli.sim import sim_main
from services.paper.hardware import CostModel
from services.sim.run import SimResult, run_virtual, simulate
from services.sim.scenarios import egress_gbps
from services.sim.workload import Arrival, lognormal
from services.sim.world import Deployment

pytestmark = pytest.mark.slow

SMALL = Deployment(name="small", n_prfaas=1, n_pd_prefill=1, n_decode=2,
                   policy_options={"threshold": 19400 / 8, "prefix_rule": "scarce"})


def _run(d: Deployment, arrivals: list[Arrival], **options: object) -> SimResult:
    result, _ = run_virtual(d, arrivals, **options)
    return result


def test_a_seed_gives_the_same_run_twice() -> None:
    arrivals = lognormal(0.5, 120, SMALL.scale, seed=3)
    first, second = (_run(SMALL, arrivals) for _ in range(2))
    assert len(first.records) == len(arrivals) > 20
    assert msgspec.json.encode(first.records) == msgspec.json.encode(second.records)
    assert msgspec.json.encode(first.samples) == msgspec.json.encode(second.samples)
    other = _run(SMALL, lognormal(0.5, 120, SMALL.scale, seed=4))
    assert msgspec.json.encode(other.records) != msgspec.json.encode(first.records)


# A run stopped at its last arrival (drain 0, as a capacity search's saturation runs are),
# under trio's scheduling coin seeded each way given; one line per seed: the result's digest.
_EVERY_ORDER = """
import hashlib, sys
import msgspec, trio
from services.sim.run import run_virtual
from services.sim.workload import lognormal
from services.sim.world import Deployment
d = Deployment(name="small", n_prfaas=1, n_pd_prefill=1, n_decode=2,
               policy_options={"threshold": 19400 / 8, "prefix_rule": "scarce"})
arrivals = lognormal(1.0, 60, d.scale, seed=3)
for k in sys.argv[1:]:
    # trio runs tasks woken together in an order drawn from this generator (private to
    # trio; seeded from the OS in every process otherwise).
    trio._core._run._r.seed(int(k))
    result, _ = run_virtual(d, arrivals, drain_s=0.0)
    print(hashlib.sha256(msgspec.json.encode(result)).hexdigest())
"""


def test_a_run_is_the_same_in_any_process_and_any_scheduling_order() -> None:
    """A run is a function of its deployment and arrivals only: two processes with different
    string-hash seeds, each under four orders of trio's same-instant wake-ups, give the same
    result to the byte, routes, samples and metrics included."""
    digests = []
    for hash_seed in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", _EVERY_ORDER, "0", "1", "2", "3"],
                              env={**os.environ, "PYTHONHASHSEED": hash_seed},
                              capture_output=True, text=True, timeout=100, check=True)
        digests += done.stdout.split()
    assert len(digests) == 8 and len(set(digests)) == 1


def test_the_jump_clock_runs_as_trios_mock_clock() -> None:
    """The sim's own clock (faster) fires the same timers at the same virtual times as trio's
    autojumping MockClock: the same records and samples, to the byte."""
    arrivals = lognormal(0.5, 60, SMALL.scale, seed=5)
    ours = _run(SMALL, arrivals)

    async def main() -> SimResult:
        return await simulate(SMALL, arrivals)

    mock = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(ours.records) == len(arrivals) > 10
    assert msgspec.json.encode(ours.records) == msgspec.json.encode(mock.records)
    assert msgspec.json.encode(ours.samples) == msgspec.json.encode(mock.samples)


def test_reading_worker_states_in_process_runs_as_polling_them_over_the_mesh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sim's router reads its workers' states in process each tick (the fast path);
    polling them with status calls over the in-memory mesh, as the live router does, gives
    the same records and samples, to the byte."""
    arrivals = lognormal(0.5, 60, SMALL.scale, seed=6)
    fast = _run(SMALL, arrivals)
    monkeypatch.setattr(services.sim.world, "_status_reader", lambda world: None)
    polled = _run(SMALL, arrivals)
    assert len(fast.records) == len(arrivals) > 10
    assert msgspec.json.encode(fast.records) == msgspec.json.encode(polled.records)
    assert msgspec.json.encode(fast.samples) == msgspec.json.encode(polled.samples)


def test_asking_the_directory_in_process_runs_as_calling_it_over_the_mesh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sim's router looks prefixes up in the directory in its own event loop, without a
    checkpoint; calling the directory over the in-memory mesh, as the live router does,
    gives the same records and samples, to the byte."""
    arrivals = lognormal(0.5, 60, SMALL.scale, seed=7)
    fast = _run(SMALL, arrivals)
    build = services.sim.world._scheduler
    monkeypatch.setattr(services.sim.world, "_scheduler",
                        lambda d, topology, transport, directory: build(d, topology, transport,
                                                                        None))
    called = _run(SMALL, arrivals)
    assert len(fast.records) == len(arrivals) > 10
    assert msgspec.json.encode(fast.records) == msgspec.json.encode(called.records)
    assert msgspec.json.encode(fast.samples) == msgspec.json.encode(called.samples)


def test_link_bytes_are_the_s_kv_of_the_offloaded_requests() -> None:
    """Nothing is cached (fresh blocks), so each offloaded request sends S_kv of its whole
    modeled length; the link adds only frame headers and stream control on top."""
    result = _run(SMALL, lognormal(0.5, 180, SMALL.scale, seed=1))
    offloaded = [r for r in result.records if r.ok and r.cluster == "prfaas"]
    assert len(offloaded) >= 5 and any(r.cluster == "pd" for r in result.records)
    kv = CostModel.load("h20").model.kv
    expected = sum(kv.fixed_bytes + kv.bytes_per_token * r.prompt_tokens / SMALL.scale
                   for r in offloaded)
    overhead = result.link_bytes - expected
    assert 0 <= overhead < 2000 * len(offloaded)
    assert result.link_bytes == pytest.approx(expected, rel=1e-4)


def test_a_prefix_counted_in_the_other_cluster_is_pulled_across_and_reused() -> None:
    """Abundant rule: turn 1 (60 blocks, l > t) prefills on PrfaaS and is cached there; turn
    2 extends it by 4 blocks, so the PrfaaS cache counts (l = 256 <= t) and it prefills on
    PD, which first pulls that prefix over the link: it reuses all it counted, and the link
    carries S_kv of turn 1 and of the prefix (turn 2's KV stays in the PD cluster)."""
    d = msgspec.structs.replace(SMALL, n_decode=1, policy_options={
        "threshold": 19400 / 8, "prefix_rule": "abundant"})
    first = tuple(range(1, 61))
    turns = [Arrival(0.0, first, 60 * 64, 16, 60 * 64 * 8),
             Arrival(60.0, (*first, 61, 62, 63, 64), 64 * 64, 16, 64 * 64 * 8)]
    result = _run(d, turns)
    one, two = result.records
    assert one.ok and two.ok and (one.cluster, two.cluster) == ("prfaas", "pd")
    assert (two.prompt_tokens, two.incremental_len) == (4096, 256)
    assert two.cached_tokens == two.prompt_tokens - two.incremental_len == 3840
    kv = CostModel.load("h20").model.kv
    s_kv = kv.fixed_bytes + kv.bytes_per_token * 3840 / d.scale
    assert result.link_bytes == pytest.approx(2 * s_kv, rel=1e-4)


def test_offload_follows_the_threshold_and_the_decode_slo_holds() -> None:
    result = _run(SMALL, lognormal(0.4, 180, SMALL.scale, seed=2))
    t = 19400 / 8
    for record in result.records:
        assert record.ok, record.error
        assert (record.cluster == "prfaas") == (record.incremental_len > t)
        assert record.output_tokens == 1024
        # 40 tokens/s: the decode batch never exceeds BS_max, so a step stays at the SLO.
        assert record.tpot_s <= 0.0255
    assert result.unfinished == 0


def test_queues_grow_past_capacity_and_not_below() -> None:
    light = _run(SMALL, lognormal(0.2, 240, SMALL.scale, seed=5), drain_s=0.0)
    heavy = _run(SMALL, lognormal(2.0, 240, SMALL.scale, seed=5), drain_s=0.0)
    assert light.samples[-1].in_flight < 12
    assert heavy.samples[-1].in_flight > 3 * light.samples[-1].in_flight


def test_prfaas_sim_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = sim_main(["--policy", "prfaas", "--rate", "0.5", "--duration", "60",
                     "--instances", "1/1/1", "--out", str(out), "--no-progress"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] >= 15 and summary["unfinished"] == 0
    assert summary["virtual_s"] > 60
    lines = (out / "records.jsonl").read_text().splitlines()
    assert len(lines) == summary["requests"]
    assert (out / "ttft_cdf.png").stat().st_size > 1000
    assert (out / "timeline.png").stat().st_size > 1000


def test_the_second_token_waits_for_a_batch_slot_and_the_first_does_not() -> None:
    """One decode instance of BS_max 20 behind fast prefill: at 1.5 req/s of 1,024-token
    answers (about 26 s each) the batch is full, so requests wait for a slot after their first
    token. The client sees the first token once the KV is in; the second, after the wait."""
    d = msgspec.structs.replace(SMALL, n_decode=1)
    light = _run(d, lognormal(0.1, 120, d.scale, seed=6))
    full = _run(d, lognormal(1.5, 120, d.scale, seed=6))
    for result in (light, full):
        assert all(r.ttft_s < r.ttst_s < r.e2e_s for r in result.records)
        assert all(r.queue_s >= 0 for r in result.records)
    # Light: the second token is one decode step after the first.
    assert max(r.ttst_s - r.ttft_s for r in light.records) < 0.1
    assert max(r.ttst_s - r.ttft_s for r in full.records) > 10.0


def test_mean_egress_is_over_the_arrival_window_not_the_drain() -> None:
    result = _run(SMALL, lognormal(0.5, 120, SMALL.scale, seed=1), drain_s=600.0)
    assert result.virtual_s > result.arrivals_end_s + 20
    mean, _ = egress_gbps(result)
    inside = [s for s in result.samples if s.at <= result.arrivals_end_s][-1]
    assert mean == pytest.approx(8 * inside.egress_bytes / inside.at / 1e9)
    # Over the whole run (the drain included) it would read lower.
    assert mean > 8 * result.link_bytes / result.virtual_s / 1e9
