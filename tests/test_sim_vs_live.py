"""The simulation against the live mesh: a small, fast `make validate-sim`
(services/cli/validation.py).

The live side is real: `prfaas serve` processes in live mode (the shipped model, one torch thread,
no pacing) for the cache directory, the link, one PrfaaS prefill and one PD decode worker, and the
router's scheduler in this process. The engine is profiled just before (`prfaas profile`, a short
grid), so the simulation reads times taken on this machine under its present load. One light
load of a few requests; the simulation must land near the live TTFT and TPOT, and a profile
made 2.5x slower must not (the check can fail).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from services.cli.validate.compare import METRICS, compare, completed_rps, service_rate
from services.cli.validate.config import Job, Outcome, ValidationConfig
from services.cli.validate.evaluate import Validation, against_sim, evaluate
from services.cli.validate.jobs import jobs
from services.cli.validate.live import LiveRun, run_live
from services.cli.validate.profiles import derive_profiles, profile_for
from services.cli.validate.report import bench_line

SMALL = ValidationConfig(requests=8, loads=(("light", 1.0),), capacity_rps=1.0,
                         prompt_tokens=(128, 256), output_tokens=(8, 20), chunk_tokens=64,
                         warmup_requests=2, probe_repeats=1, load_probe_repeats=1)
# Looser than the full run's 15%: eight requests, and two cores shared with whatever else runs.
BOUND = 0.35
SLOWER = 2.5


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[ValidationConfig, LiveRun]:
    tmp = tmp_path_factory.mktemp("validate")
    config = profile_for(SMALL, tmp / "profile.toml", quick=True)
    return config, run_live(config, tmp, say=lambda line: None)


def slower(profile: Path, factor: float, out: Path) -> Path:
    """The profile with every measured time (prefill and decode) multiplied by `factor`."""
    lines = []
    for line in profile.read_text().splitlines():
        if line.startswith("seconds = ["):
            values = json.loads(line.split("=", 1)[1])
            line = f"seconds = {json.dumps([v * factor for v in values])}"
        lines.append(line)
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_sim_lands_near_the_live_mesh(measured: tuple[ValidationConfig, LiveRun],
                                          tmp_path: Path) -> None:
    config, live = measured
    row = evaluate(config, live, tmp_path).rows[0]
    # The load's own requests are compared; its probes rode in it (flagged on both sides).
    from services.paper.hardware import read_profile_spec
    spec = read_profile_spec(config.profile)  # one probe per profiled length
    assert spec.prefill is not None
    assert sum(o.probe for o in live.outcomes["light"]) == len(spec.prefill.lengths) >= 3
    assert row.requests == SMALL.requests
    assert row.live["completed"] == row.sim["completed"] == SMALL.requests
    # The decode worker timed its own steps over the probes and over the load.
    for phase in ("in-situ", "light"):
        window = live.decode_steps[phase]
        assert window.steps > 0 and window.seconds > 0 and window.sequences >= window.steps
    for key in ("ttft_p50", "tpot_p50"):
        assert abs(row.errors[key]) <= BOUND, (key, row.live, row.sim)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_wrong_profile_is_caught(measured: tuple[ValidationConfig, LiveRun],
                                   tmp_path: Path) -> None:
    config, live = measured
    profiles = derive_profiles(config, live, tmp_path)
    assert set(profiles.calibrated) == {"light"}  # the load's own fit, from its probes
    wrong = slower(Path(profiles.in_situ), SLOWER, tmp_path / "slower.toml")
    row = against_sim(config, live, {"light": str(wrong)})[0][0]
    assert row.errors["ttft_p50"] > BOUND and row.errors["tpot_p50"] > BOUND, row.errors


def outcome(at: float, e2e: float, ttft: float = 0.1, tpot: float = 0.01,
            ok: bool = True) -> Outcome:
    return Outcome(at, 100, 10, ttft, tpot, e2e, ok)


def test_both_sides_get_the_same_requests() -> None:
    load = jobs(SMALL, 2.0, 30, seed=3)
    assert load == jobs(SMALL, 2.0, 30, seed=3)
    for job in load:
        assert len(job.prompt) == job.arrival.length == len(job.arrival.prompt())
        assert SMALL.prompt_tokens[0] <= job.arrival.length <= SMALL.prompt_tokens[1]
        assert min(job.prompt) > 0 and max(job.prompt) < 4096
    # Nothing shared: every request's blocks are its own, within a load and across loads
    # (seed 0 is the first load's; a scheme of seed times index once made neighbours overlap).
    blocks = [b for s in (0, 1, 3) for job in jobs(SMALL, 2.0, 30, seed=s)
              for b in job.arrival.blocks]
    assert len(blocks) == len(set(blocks))


def test_service_rate_reads_the_middle_of_a_burst() -> None:
    # 40 finishes 0.5 s apart after a slow start: the rate is 2/s, whatever the edges do.
    burst = [outcome(0.0, 5.0 + 0.5 * i) for i in range(40)]
    burst[0] = outcome(0.0, 0.1)
    assert service_rate(burst) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="burst"):
        service_rate(burst[:2])


def test_completed_rps_spans_first_arrival_to_last_finish() -> None:
    done = [outcome(1.0, 1.0), outcome(2.0, 2.0), outcome(3.0, 1.0, ok=False)]
    assert completed_rps(done) == pytest.approx(2 / 3.0)


def test_errors_are_signed_sim_over_live() -> None:
    rng = random.Random(0)
    live = [outcome(i, 1.0 + i / 10, ttft=0.2 + rng.random() / 100, tpot=0.02)
            for i in range(20)]
    sim = [msgspec.structs.replace(o, ttft_s=o.ttft_s * 1.1, tpot_s=o.tpot_s * 0.9,
                                   e2e_s=o.e2e_s * 1.2) for o in live]
    row = compare("light", 1.0, live, sim)
    for p in ("p50", "p90", "p99"):
        assert row.errors[f"ttft_{p}"] == pytest.approx(0.1)
        assert row.errors[f"tpot_{p}"] == pytest.approx(-0.1)
        assert row.errors[f"e2e_{p}"] == pytest.approx(0.2)
    assert row.live["ttft_p99"] > row.live["ttft_p90"] > row.live["ttft_p50"]
    # Every request finishes 1.2x later: completions per second over the longer span.
    def span(outs: list[Outcome]) -> float:
        return max(o.at + o.e2e_s for o in outs) - min(o.at for o in outs)
    assert row.errors["completed_rps"] == pytest.approx(span(live) / span(sim) - 1.0)
    assert set(row.errors) == set(METRICS) and row.live_spread == {}
    line = json.loads(bench_line([row], replay=[compare("light", 1.0, live, live)]))
    assert line["bench"] == "validate-sim"
    got = line["rows"][0]
    assert {"ttft_p50_err", "ttft_p90_err", "ttft_p99_err", "tpot_p50_err", "tpot_p90_err",
            "e2e_p50_err", "completed_rps_err", "live_spread", "replay"} <= set(got)
    assert got["deployment"] and got["load"] == "light" and got["live_spread"] is None
    assert got["ttft_p99_err"] == pytest.approx(0.1, abs=1e-4)
    assert got["replay"]["ttft_p50_err"] == 0.0 and set(got["replay"]) == {
        f"{k}_err" for k in METRICS}


def test_the_live_spread_is_the_range_of_its_runs_over_their_median() -> None:
    from services.cli.validate.compare import live_figures, live_spread

    base = [outcome(i, 1.0, ttft=0.2 + i / 100) for i in range(20)]
    runs = [[msgspec.structs.replace(o, ttft_s=o.ttft_s * f) for o in base]
            for f in (1.0, 1.1, 0.95)]
    spread = live_spread(runs)
    assert spread["ttft_p50"] == pytest.approx(0.15) and spread["ttft_p99"] == pytest.approx(0.15)
    assert spread["tpot_p50"] == 0.0 and set(spread) == set(METRICS)
    assert live_spread(runs[:1]) == {}
    # The live side compared is the runs' median: 1.0x here, so a sim equal to run 1 is exact.
    assert live_figures(runs)["ttft_p50"] == pytest.approx(
        live_figures(runs[:1])["ttft_p50"])
    row = compare("light", 1.0, runs[0], runs[0], runs[1:])
    assert row.errors["ttft_p50"] == pytest.approx(0.0, abs=1e-12)
    assert row.live_spread == spread


def test_a_rerun_is_the_same_load_with_nothing_to_reuse() -> None:
    from services.cli.validate.jobs import rerun_jobs, rerun_name, reruns_of

    load = jobs(SMALL, 2.0, 12, seed=1)
    again = rerun_jobs(SMALL, load, 1)
    assert rerun_jobs(SMALL, load, 0) == load
    assert [(j.arrival.at, j.arrival.length, j.arrival.output_len, j.probe) for j in again] == [
        (j.arrival.at, j.arrival.length, j.arrival.output_len, j.probe) for j in load]
    assert all(len(a.prompt) == len(b.prompt) and a.prompt != b.prompt
               for a, b in zip(load, again, strict=True))
    blocks = [b for run in (load, again, rerun_jobs(SMALL, load, 2)) for j in run
              for b in j.arrival.blocks]
    assert len(blocks) == len(set(blocks))
    outcomes: dict[str, list[Outcome]] = {"light": [], "light run 2": [], "light run 3": []}
    assert rerun_name("light", 0) == "light"
    assert reruns_of("light", outcomes) == ["light run 2", "light run 3"]
    assert reruns_of("60%", outcomes) == []


def test_the_report_holds_the_table_the_plots_and_every_request(tmp_path: Path) -> None:
    from services.cli.validate.report import write_report

    live = [outcome(i, 1.0, ttft=0.2 + i / 100) for i in range(10)]
    sim = [msgspec.structs.replace(o, ttft_s=o.ttft_s * 0.95) for o in live]
    row = compare("light", 1.0, live, sim)
    calibrated = compare("light", 1.0, live, live)
    result = Validation(SMALL, 3.0, 3.1, [row], {"light": {k: 0.1 for k in (
        "ttft", "queue", "compute", "profile", "rest")}}, {"light": {"live": live, "sim": sim}},
        12.0, {"light": "0.50"}, {"light": 1.2}, [calibrated])
    text = write_report(tmp_path, result, "a test machine")
    assert "| light | 1.00 | 10 | ttft_p50 |" in text and "light pass" in text
    # The calibrated rows are a labelled diagnostic after the predicted ones, never the headline.
    predicted, diagnostic = text.split("Diagnostic, calibrated on the load itself")
    assert "Predicted:" in predicted and "-5.0%" in predicted and "+0.0%" in diagnostic
    assert "(light 1.200)" in diagnostic
    assert "light 0.50" in text and "a test machine" in text
    assert (tmp_path / "cdf_light.png").stat().st_size > 0
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 20
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rows"][0]["errors"]["ttft_p50"] == pytest.approx(-0.05)
    assert summary["decode_drift"] == {"light": 1.2}


def test_the_in_situ_profile_takes_the_workers_compute_and_keeps_the_decode_steps(
        tmp_path: Path) -> None:
    from services.cli.validate.jobs import probe_jobs
    from services.cli.validate.profiles import in_situ_profile
    from services.cli.validate.simulated import simulate
    from services.paper.hardware import CostModel, read_profile_spec

    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", probe_repeats=2)
    engine = read_profile_spec(config.profile)
    assert engine.prefill is not None and engine.decode is not None
    probes = probe_jobs(config, rate=2.0)
    lengths = [round(x) for x in engine.prefill.lengths]
    assert sorted(j.arrival.length for j in probes) == sorted(lengths * 2)
    # A Poisson load of their own at the rate asked: arrivals spread at about 2 a second, and
    # no arrival, prompt or block of a load's.
    times = [j.arrival.at for j in probes]
    assert times == sorted(times) and len(probes) / times[-1] == pytest.approx(2.0, rel=0.5)
    assert {j.arrival.at for j in probe_jobs(config)} == {0.0}  # rate 0: one at a time
    load = jobs(config, 2.0, len(probes), config.seed)
    assert not {b for j in probes for b in j.arrival.blocks} & {
        b for j in load for b in j.arrival.blocks}
    cost = CostModel.load(config.profile, config.model)
    # The worker reports 1.2x the engine's own time for a length's first probe and 1.4x for
    # its second; each live step is 2 ms slower (the decode steps stay the engine's).
    seen: set[int] = set()
    live = []
    for j in probes:
        factor = 1.4 if j.arrival.length in seen else 1.2
        seen.add(j.arrival.length)
        live.append(Outcome(0.0, j.arrival.length, j.arrival.output_len, 0.5,
                            cost.decode_step_time(1, j.arrival.length) + 0.002, 1.0, True,
                            compute_s=cost.prefill_time(j.arrival.length) * factor))
    written = read_profile_spec(in_situ_profile(config, live, tmp_path / "situ.toml"))
    assert written.prefill is not None and written.decode is not None
    assert written.prefill.chunk_tokens == engine.prefill.chunk_tokens
    for length, seconds in zip(written.prefill.lengths, written.prefill.seconds, strict=True):
        assert seconds == pytest.approx(1.3 * cost.prefill_time(round(length)), rel=1e-4)
    # Probes one at a time (no rate): the decode steps stay the engine's.
    assert written.decode.seconds == pytest.approx(engine.decode.seconds, abs=1e-6)
    assert "one at a time" in written.description
    # Probes under a load of their own: the steps are scaled by the probes' TPOT p50, live over
    # simulated with those steps. Live 1.25x the simulation's TPOT gives steps 1.25x the engine's.
    sim = simulate(msgspec.structs.replace(config, profile=str(tmp_path / "situ.toml")), probes)
    slow = [msgspec.structs.replace(o, output_tokens=s.output_tokens, tpot_s=1.25 * s.tpot_s)
            for o, s in zip(live, sim, strict=True)]
    scaled = read_profile_spec(in_situ_profile(config, slow, tmp_path / "scaled.toml", 2.0))
    assert scaled.decode is not None and scaled.prefill is not None
    assert scaled.decode.seconds == pytest.approx(
        [1.25 * x for x in engine.decode.seconds], rel=2e-3)
    assert scaled.prefill.seconds == pytest.approx(written.prefill.seconds, rel=1e-6)
    assert "Poisson at 2.00 req/s" in scaled.description and "x 1.250" in scaled.description
    # Too few completed probes to fit: a clear error, not a profile.
    with pytest.raises(ValueError, match="probes completed"):
        in_situ_profile(config, [msgspec.structs.replace(o, ok=False) for o in live],
                        tmp_path / "none.toml")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs Linux and two CPUs or more")
def test_the_prefill_worker_gets_a_core_of_its_own() -> None:
    from services.cli.validate.live_mesh import pin_cores

    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)
    children = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
                for name in ("prfaas-prefill-0", "pd-decode-0")}
    try:
        pin_cores({name: child.pid for name, child in children.items()}, cpus)
        assert os.sched_getaffinity(children["prfaas-prefill-0"].pid) == {cpus[0]}
        assert os.sched_getaffinity(children["pd-decode-0"].pid) == set(cpus[1:])
        assert os.sched_getaffinity(0) == set(cpus[1:])  # the driver, with the rest
    finally:
        os.sched_setaffinity(0, mine)
        for child in children.values():
            child.kill()
            child.wait()


def test_probes_ride_in_each_load_in_seeded_places() -> None:
    from services.cli.validate.jobs import load_jobs
    from services.paper.hardware import read_profile_spec

    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=30,
                                     load_probe_repeats=2)
    engine = read_profile_spec(config.profile)
    assert engine.prefill is not None
    lengths = [round(x) for x in engine.prefill.lengths]
    load = load_jobs(config, 1, 3.0)
    probes = [j for j in load if j.probe]
    assert sorted(j.arrival.length for j in probes) == sorted(lengths * 2)
    assert len(load) - len(probes) == config.requests
    # One Poisson list at the load's rate, probes and requests alike, mixed through it.
    times = [j.arrival.at for j in load]
    assert times == sorted(times) and len(load) / times[-1] == pytest.approx(3.0, rel=0.4)
    places = [i for i, j in enumerate(load) if j.probe]
    assert places[0] < len(load) // 2 < places[-1]
    assert load == load_jobs(config, 1, 3.0) and load != load_jobs(config, 2, 3.0)
    blocks = [b for j in load for b in j.arrival.blocks]
    assert len(blocks) == len(set(blocks))
    # Without probes a load is the plain seeded list it always was.
    plain = msgspec.structs.replace(config, load_probe_repeats=0)
    assert load_jobs(plain, 1, 3.0) == jobs(plain, 3.0, config.requests, config.seed + 1)


def test_a_load_is_simulated_with_its_own_probes_fit(tmp_path: Path) -> None:
    from services.cli.validate.jobs import load_jobs
    from services.cli.validate.profiles import in_situ_profile, load_profile
    from services.cli.validate.simulated import simulate
    from services.paper.hardware import CostModel, read_profile_spec

    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=12,
                                     load_probe_repeats=1, capacity_rps=2.0)
    cost = CostModel.load(config.profile, config.model)
    situ_probes = [Outcome(0.0, n, 10, 0.5, 0.01, 1.0, True, compute_s=cost.prefill_time(n))
                   for n in (64, 128, 256, 384, 512)]
    situ = in_situ_profile(config, situ_probes, tmp_path / "profile-in-situ.toml")
    load = load_jobs(config, 0, 1.0)
    # The worker ran 1.2x the in-situ fit while this load's probes rode in it; its own
    # requests report 10x, which must not reach the fit (they are what is checked).
    outcomes = [Outcome(0.0, j.arrival.length, j.arrival.output_len, 0.5, 0.01, 1.0, True,
                        compute_s=cost.prefill_time(j.arrival.length) * (1.2 if j.probe
                                                                          else 10.0),
                        probe=j.probe) for j in load]
    own = read_profile_spec(str(load_profile(situ, outcomes, tmp_path / "p.toml", "light")))
    base = read_profile_spec(str(situ))
    assert own.prefill is not None and own.decode is not None and base.decode is not None
    for length, seconds in zip(own.prefill.lengths, own.prefill.seconds, strict=True):
        assert seconds == pytest.approx(1.2 * cost.prefill_time(round(length)), rel=1e-4)
    assert own.decode.seconds == base.decode.seconds
    assert "rode in load light" in own.description
    # against_sim reads the profile it is given: a live run that is that simulation agrees
    # exactly on the load's own requests, and the in-situ block's profile does not.
    config = msgspec.structs.replace(config, loads=(("light", 0.5),))
    sim = simulate(msgspec.structs.replace(config, profile=str(tmp_path / "p.toml")), load)
    live = LiveRun(2.0, {"light": sim}, 1.0)
    row = against_sim(config, live, {"light": str(tmp_path / "p.toml")})[0][0]
    assert row.requests == config.requests
    assert all(abs(row.errors[k]) < 1e-9 for k in ("ttft_p50", "ttft_p90", "tpot_p50")), row
    blind = against_sim(config, live, {"light": str(situ)})[0][0]
    assert blind.errors["ttft_p50"] < -0.05, blind.errors


def fake_live(config: ValidationConfig, slow: float = 1.0, steps: float = 1.0) -> LiveRun:
    """A live run made of simulations with the engine's profile, the prefill worker's compute
    reported as the profile's: the in-situ probes at 1.1x, the load's requests and probes at
    `slow` x (their TTFT and TPOT too), the decode steps during the load `steps` x."""
    from services.cli.validate.jobs import load_jobs, probe_jobs
    from services.cli.validate.live import DecodeSteps
    from services.cli.validate.simulated import simulate
    from services.paper.hardware import CostModel

    cost = CostModel.load(config.profile, config.model)

    def reported(outcomes: list[Outcome], factor: float) -> list[Outcome]:
        return [msgspec.structs.replace(
            o, ttft_s=o.ttft_s * factor, tpot_s=o.tpot_s * factor,
            compute_s=cost.prefill_time(o.prompt_tokens) * factor) for o in outcomes]

    situ = reported(simulate(config, probe_jobs(config, config.probe_load * 2.0)), 1.1)
    rate = config.loads[0][1] * 2.0
    load = reported(simulate(config, load_jobs(config, 0, rate)), slow)
    window = DecodeSteps(0.5, 40, 80, 24000)
    return LiveRun(2.0, {"in-situ": situ, "light": load}, 1.0, decode_steps={
        "in-situ": window, "light": msgspec.structs.replace(window, seconds=0.5 * steps)})


def test_the_ttft_the_sim_leaves_out_is_measured_on_the_probes_and_added(
        tmp_path: Path) -> None:
    from services.cli.validate.jobs import probe_jobs
    from services.cli.validate.profiles import unmodelled_s, with_unmodelled
    from services.cli.validate.simulated import simulate
    from services.paper.hardware import CostModel

    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=10,
                                     loads=(("light", 0.5),), probe_repeats=2,
                                     load_probe_repeats=1, probe_load=0.5)
    cost = CostModel.load(config.profile, config.model)
    live = fake_live(config)
    # Probes that are the simulation plus 12 ms past the compute (dispatch, import, the way
    # back), whose worker reports the profile's compute: 12 ms is what the sim leaves out.
    sim = simulate(config, probe_jobs(config, config.probe_load * live.capacity_rps))
    probes = [msgspec.structs.replace(o, ttft_s=o.ttft_s + 0.012,
                                      compute_s=cost.prefill_time(o.prompt_tokens))
              for o in sim]
    assert unmodelled_s(cost, probes, sim) == pytest.approx(0.012, abs=1e-9)
    # A queue is not left out: the live side's wait is its own, the sim's its own.
    queued = [msgspec.structs.replace(o, ttft_s=o.ttft_s + 0.5, queue_s=o.queue_s + 0.5)
              for o in probes]
    assert unmodelled_s(cost, queued, sim) == pytest.approx(0.012, abs=1e-9)
    with pytest.raises(ValueError, match="unmodelled"):
        unmodelled_s(cost, [msgspec.structs.replace(o, ok=False) for o in probes], sim)
    result = evaluate(config, msgspec.structs.replace(
        live, outcomes={**live.outcomes, "in-situ": probes}), tmp_path)
    assert result.unmodelled_s == pytest.approx(0.012, abs=2e-3)
    # Added to every simulated request's TTFT and end to end, nothing else.
    done = sim[0]
    moved = with_unmodelled([done, msgspec.structs.replace(done, ok=False)], {"": 0.012})
    assert moved[0].ttft_s == pytest.approx(done.ttft_s + 0.012)
    assert moved[0].e2e_s == pytest.approx(done.e2e_s + 0.012)
    assert moved[0].tpot_s == done.tpot_s and moved[1].ttft_s == done.ttft_s
    assert "12." in write_report_text(tmp_path, result)


def test_the_unmodelled_ttft_is_measured_and_added_per_route() -> None:
    from services.cli.validate.jobs import probe_jobs
    from services.cli.validate.profiles import unmodelled_by_route, with_unmodelled
    from services.cli.validate.simulated import simulate
    from services.paper.hardware import CostModel

    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=10,
                                     loads=(("light", 0.5),), probe_repeats=2,
                                     load_probe_repeats=1, probe_load=0.5)
    cost = CostModel.load(config.profile, config.model)
    # Every other probe local (on both sides alike): the offloaded ones leave 30 ms out (the
    # KV through the link proxy and its import), the local ones 5 ms.
    sim = [msgspec.structs.replace(o, cluster="pd" if i % 2 else "prfaas")
           for i, o in enumerate(simulate(config, probe_jobs(config, 1.0)))]
    live = [msgspec.structs.replace(o, ttft_s=o.ttft_s + (0.005 if o.cluster == "pd" else 0.03),
                                    compute_s=cost.prefill_time(o.prompt_tokens)) for o in sim]
    left_out = unmodelled_by_route(cost, live, sim)
    assert left_out["prfaas"] == pytest.approx(0.03, abs=1e-9)
    assert left_out["pd"] == pytest.approx(0.005, abs=1e-9)
    assert 0.005 <= left_out[""] <= 0.03
    local, offloaded = sim[1], sim[0]
    moved = with_unmodelled([local, offloaded, msgspec.structs.replace(local, cluster="")],
                            left_out)
    assert moved[0].ttft_s == pytest.approx(local.ttft_s + 0.005)
    assert moved[1].ttft_s == pytest.approx(offloaded.ttft_s + 0.03)
    assert moved[2].ttft_s == pytest.approx(local.ttft_s + left_out[""])
    # A route none of whose probes completed on one side takes the overall figure.
    failed = [msgspec.structs.replace(o, ok=False) if o.cluster == "pd" else o for o in live]
    assert set(unmodelled_by_route(cost, failed, sim)) == {"", "prfaas"}


def write_report_text(out: Path, result: Validation) -> str:
    from services.cli.validate.report import write_report
    return write_report(out / "report", result, "a test machine")


def test_the_replay_feeds_the_loads_own_compute_to_the_simulation(tmp_path: Path) -> None:
    from services.cli.validate.simulated import simulate
    from services.paper.hardware import CostModel, read_profile_spec

    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=16,
                                     loads=(("light", 0.5),), probe_repeats=1,
                                     load_probe_repeats=0, probe_load=0.5)
    cost = CostModel.load(config.profile, config.model)
    # The load's requests report 1.3x the engine's compute: the replay's prefill is that.
    result = evaluate(config, fake_live(config, slow=1.3), tmp_path)
    spec = read_profile_spec(tmp_path / "profile-light-replay.toml")
    assert spec.prefill is not None and "requests in load light" in spec.description
    for length, seconds in zip(spec.prefill.lengths, spec.prefill.seconds, strict=True):
        assert seconds == pytest.approx(1.3 * cost.prefill_time(round(length)), rel=1e-3)
    assert not result.calibrated  # no probes rode in the load: no calibrated rows
    replayed = simulate(msgspec.structs.replace(
        config, profile=str(tmp_path / "profile-light-replay.toml")),
        load_jobs_of(config, 1.0))
    assert result.replay[0].sim["ttft_p50"] == pytest.approx(
        compare("light", 1.0, replayed, replayed).sim["ttft_p50"] + result.unmodelled_s)
    assert json.loads(bench_line(result.rows, result.replay))["rows"][0]["replay"] == {
        f"{k}_err": round(v, 4) for k, v in result.replay[0].errors.items()}


def load_jobs_of(config: ValidationConfig, rate: float) -> list[Job]:
    from services.cli.validate.jobs import load_jobs
    return load_jobs(config, 0, rate)


def test_nothing_measured_during_a_load_reaches_its_prediction(tmp_path: Path) -> None:
    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=10,
                                     loads=(("light", 0.5),), probe_repeats=1,
                                     load_probe_repeats=1, probe_load=0.5)
    before = evaluate(config, fake_live(config), tmp_path / "a")
    # The same live run, its load's timings (compute, TTFT, TPOT, the decode worker's own
    # steps) changed after the fact: the prediction must not move.
    after = evaluate(config, fake_live(config, slow=1.5, steps=1.5), tmp_path / "b")
    assert after.records["light"]["sim"] == before.records["light"]["sim"]
    assert after.rows[0].sim == before.rows[0].sim
    assert after.rows[0].live != before.rows[0].live  # the live side did change
    # The perturbation reaches the calibrated diagnostic, which reads the load.
    assert after.calibrated[0].sim["ttft_p50"] > 1.2 * before.calibrated[0].sim["ttft_p50"]
    assert after.decode_drift["light"] == pytest.approx(1.5)
    # And the replay, which is the load's own compute fed back, a figure apart.
    assert after.replay[0].sim["ttft_p50"] > 1.2 * before.replay[0].sim["ttft_p50"]
    # What was measured before the loads does reach it.
    situ = fake_live(config)
    slower_probes = [msgspec.structs.replace(o, compute_s=o.compute_s * 1.5,
                                             ttft_s=o.ttft_s + o.compute_s * 0.5)
                     for o in situ.outcomes["in-situ"]]
    moved = evaluate(config, msgspec.structs.replace(
        situ, outcomes={**situ.outcomes, "in-situ": slower_probes}), tmp_path / "c")
    assert moved.rows[0].sim["ttft_p50"] > 1.2 * before.rows[0].sim["ttft_p50"]


def test_the_decode_drift_is_the_workers_own_step_speed_this_load_over_the_probes(
        tmp_path: Path) -> None:
    from services.cli.validate.jobs import load_jobs
    from services.cli.validate.live import DecodeSteps, parse_decode_steps
    from services.cli.validate.profiles import decode_drift, in_situ_profile, load_profile
    from services.paper.hardware import CostModel, LinearDecode, read_profile_spec

    text = "\n".join([
        "# HELP prfaas_decode_steps_total steps", 'prfaas_decode_steps_total{service="d"} 10.0',
        'prfaas_decode_step_seconds_total{service="d"} 0.25',
        'prfaas_decode_step_sequences_total{service="d"} 30.0',
        'prfaas_decode_step_context_tokens_total{service="d"} 9000.0',
        'prfaas_decode_tokens_total{service="d"} 31.0'])
    assert parse_decode_steps(text) == DecodeSteps(0.25, 10, 30, 9000)
    with pytest.raises(ValueError, match="step_seconds"):
        parse_decode_steps(text.replace("step_seconds", "other"))
    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=12,
                                     load_probe_repeats=1)
    fit = CostModel.load(config.profile, config.model).profile.decode_fit
    assert isinstance(fit, LinearDecode)

    def steps(speed: float, count: int, batch: int, context: int) -> DecodeSteps:
        # `count` steps of `batch` sequences holding `context` tokens, `speed` x the fit.
        return DecodeSteps(speed * count * fit(batch, context), count, count * batch,
                           count * context)

    # The probes' steps ran at 1.1x the fit at batch 2, the load's at 1.32x at batch 5: 1.2.
    windows = {"in-situ": steps(1.1, 40, 2, 600), "light": steps(1.32, 90, 5, 1500)}
    assert decode_drift(config, windows, "light") == pytest.approx(1.2)
    assert decode_drift(config, {"light": windows["light"]}, "light") == 1.0  # no baseline
    assert decode_drift(config, {**windows, "light": DecodeSteps()}, "light") == 1.0
    cost = CostModel.load(config.profile, config.model)
    situ = in_situ_profile(config, [
        Outcome(0.0, n, 10, 0.5, 0.01, 1.0, True, compute_s=cost.prefill_time(n))
        for n in (64, 128, 256, 384, 512)], tmp_path / "situ.toml")
    outcomes = [Outcome(0.0, j.arrival.length, 10, 0.5, 0.01, 1.0, True,
                        compute_s=cost.prefill_time(j.arrival.length), probe=j.probe)
                for j in load_jobs(config, 0, 1.0)]
    own = read_profile_spec(str(load_profile(situ, outcomes, tmp_path / "p.toml", "light",
                                             1.2)))
    base = read_profile_spec(str(situ))
    assert own.decode is not None and base.decode is not None
    assert own.decode.seconds == pytest.approx([1.2 * s for s in base.decode.seconds],
                                               rel=1e-4)
    assert "x 1.200" in own.description


def test_the_routed_deployment_is_simulated_as_it_runs_live(tmp_path: Path) -> None:
    from mesh.errors import ConfigError
    from mesh.topology import load_topology
    from services.cli.validate.config import (
        DEPLOYMENTS,
        ROUTED,
        ROUTED_BANDWIDTH_BPS,
        deployment_name,
        routed,
    )
    from services.cli.validate.live import LiveRouter
    from services.cli.validate.live_mesh import mesh_services, topology_text
    from services.cli.validate.simulated import deployment, simulate

    config = msgspec.structs.replace(SMALL, profile="vm-xeon-spr-1t", requests=24)
    remote = deployment(config)
    assert (remote.n_prfaas, remote.n_pd_prefill, remote.n_decode) == (1, 0, 1)
    assert remote.policy_options["threshold"] == 0 and deployment_name(config) == "remote-1p1d"
    shaped = DEPLOYMENTS[ROUTED](config)
    assert shaped == routed(config) and deployment_name(shaped) == ROUTED == "routed-1+1p1d"
    d = deployment(shaped)
    # One PrfaaS prefill, one PD prefill, one decode; t in the middle of the prompt lengths.
    assert (d.n_prfaas, d.n_pd_prefill, d.n_decode) == (1, 1, 1)
    assert d.policy == "prfaas" and d.policy_options == {"threshold": 192, "prefix_rule": "scarce"}
    assert d.bandwidth_bps == ROUTED_BANDWIDTH_BPS < config.bandwidth_bps
    assert d.prfaas_profile == d.pd_profile == config.profile
    # The live side: the same workers, link rate and policy.
    assert mesh_services(shaped) == ("cachedir", "link-0", "prfaas-prefill-0", "pd-prefill-0",
                                     "pd-decode-0")
    assert "pd-prefill-0" not in mesh_services(config)
    path = tmp_path / "topology.toml"
    path.write_text(topology_text(shaped))
    topology = load_topology(path, "")
    assert topology.service("pd-prefill-0").cluster == "pd"
    assert topology.service("pd-prefill-0").kind == "prefill"
    assert topology.links[0].bandwidth_bps == ROUTED_BANDWIDTH_BPS
    policy = LiveRouter(topology, shaped).scheduler.policy
    assert policy.name == "prfaas" and policy.threshold == 192
    # Simulated, short requests stay local and long ones are offloaded; both routes occur.
    load = jobs(shaped, 2.0, 24, seed=1)
    outcomes = simulate(shaped, load)
    assert all(o.ok for o in outcomes)
    assert [o.cluster for o in outcomes] == [
        "prfaas" if j.arrival.length > 192 else "pd" for j in load]
    assert {o.cluster for o in outcomes} == {"prfaas", "pd"}
    assert {o.cluster for o in simulate(config, load)} == {"prfaas"}
    with pytest.raises(ConfigError, match="pd_prefill"):
        ValidationConfig(pd_prefill=2)


def test_each_route_is_compared_on_its_own_requests(tmp_path: Path) -> None:
    from services.cli.validate.config import by_route, routed
    from services.cli.validate.evaluate import route_rows
    from services.cli.validate.simulated import simulate

    config = msgspec.structs.replace(routed(SMALL), profile="vm-xeon-spr-1t", requests=24,
                                     loads=(("light", 0.5),))
    sim = simulate(config, jobs(config, 1.0, 24, seed=2))
    split = by_route(sim)
    assert set(split) == {"local", "offloaded"}
    assert all(o.cluster == "pd" for o in split["local"])
    assert all(o.cluster == "prfaas" for o in split["offloaded"])
    assert len(split["local"]) + len(split["offloaded"]) == len(sim)
    # The live side: the local requests as simulated, the offloaded ones 1.25x slower to
    # their first token; a second run the same. Only the offloaded route's TTFT errs.
    live = [msgspec.structs.replace(o, ttft_s=o.ttft_s * 1.25) if o.cluster == "prfaas"
            else o for o in sim]
    run = LiveRun(2.0, {"light": live, "light run 2": live}, 1.0)
    rows = route_rows(config, run, {"light": sim})
    assert [r.route for r in rows] == ["local", "offloaded"]
    local, offloaded = rows
    assert local.requests == len(split["local"]) and offloaded.requests == len(
        split["offloaded"])
    assert all(abs(v) < 1e-9 for k, v in local.errors.items() if k.startswith("ttft")), local
    assert offloaded.errors["ttft_p50"] == pytest.approx(1 / 1.25 - 1)
    assert offloaded.live_spread["ttft_p50"] == 0.0  # the rerun was split as well
    # The JSON line: each route's errors and count beside the load's overall row.
    overall = compare("light", 1.0, live, sim)
    got = json.loads(bench_line([overall], routes=rows, deployment="routed-1+1p1d"))["rows"][0]
    assert got["deployment"] == "routed-1+1p1d"
    assert set(got["routes"]) == {"local", "offloaded"}
    assert got["routes"]["offloaded"]["ttft_p50_err"] == pytest.approx(-0.2, abs=1e-4)
    assert got["routes"]["local"]["requests"] == len(split["local"])
    # A route one side never took gets no row (the remote deployment has no local one).
    only = route_rows(config, LiveRun(2.0, {"light": split["offloaded"]}, 1.0), {"light": sim})
    assert [r.route for r in only] == ["offloaded"]


def test_each_worker_gets_a_cpu_of_its_own_while_one_is_left_for_the_rest() -> None:
    from services.cli.validate.live_mesh import core_plan

    remote = ["cachedir", "link-0", "prfaas-prefill-0", "pd-decode-0"]
    routed_mesh = ["cachedir", "link-0", "prfaas-prefill-0", "pd-prefill-0", "pd-decode-0"]
    # Two CPUs: the PrfaaS prefill worker alone on the first, everything else on the second.
    for names in (remote, routed_mesh):
        plan = core_plan(names, [0, 1])
        assert plan["prfaas-prefill-0"] == {0}
        assert all(plan[n] == {1} for n in [*names, ""] if n != "prfaas-prefill-0")
    # Four: each worker its own, the cache directory, the link and the driver on the fourth.
    plan = core_plan(routed_mesh, [4, 5, 6, 7])
    assert (plan["prfaas-prefill-0"], plan["pd-prefill-0"], plan["pd-decode-0"]) == (
        {4}, {5}, {6})
    assert plan["cachedir"] == plan["link-0"] == plan[""] == {7}
    # Three for the remote mesh: both workers their own, the rest on the third.
    plan = core_plan(remote, [0, 1, 2])
    assert (plan["prfaas-prefill-0"], plan["pd-decode-0"], plan[""]) == ({0}, {1}, {2})
    # One: nothing to give, everything shares it.
    assert set(map(frozenset, core_plan(routed_mesh, [3]).values())) == {frozenset({3})}
