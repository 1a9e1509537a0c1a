"""The profiles `prfaas validate-sim` simulates with, derived from a live run: the engine's, the
in-situ one measured before the loads, each load's calibrated and replay diagnostics, and the
TTFT the simulation does not time.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec

from services.bench.host import load_average, machine_line
from services.cli.profile import profile_toml, write_profile
from services.cli.validate.config import Job, Outcome, ValidationConfig, slug
from services.cli.validate.jobs import probe_jobs
from services.cli.validate.live import DecodeSteps, LiveRun
from services.cli.validate.simulated import simulate
from services.paper.hardware import (
    CostModel,
    LinearDecode,
    ProfileError,
    ProfileSpec,
    read_profile_spec,
)
from services.sim.workload import BLOCK
from services.worker.profiler import DecodePoint, PrefillPoint


class Profiles(msgspec.Struct, frozen=True):
    """The profiles derived from a live run (`derive_profiles`). `in_situ`: the profile
    measured before the loads (the engine's, its prefill re-measured by the in-situ probes), the
    only one a prediction reads; `calibrated`: each load's diagnostic profile (its own probes'
    prefill fit, its decode steps times `decode_drift`), read from the load it is compared with."""

    in_situ: str
    calibrated: dict[str, str] = {}
    decode_drift: dict[str, float] = {}
    # Each load's replay profile: the prefill fit of all its requests' reported compute, its
    # decode steps times its drift (`load_profile` with replay).
    replay: dict[str, str] = {}
    # What the simulation leaves out of every request's TTFT (`unmodelled_s`), measured on the
    # in-situ probes: the router's dispatch, the KV's import and the first token's way back;
    # over all probes (key "") and per route (`unmodelled_by_route`).
    unmodelled: dict[str, float] = {}


def derive_profiles(config: ValidationConfig, live: LiveRun, out: Path) -> Profiles:
    """The profiles of `live`, written to `out`: the in-situ one from the probes sent before
    the loads (`in_situ_profile`), and each load's calibrated one from the probes that rode in
    it and its decode drift (`load_profile`), a diagnostic only."""
    out.mkdir(parents=True, exist_ok=True)
    situ = in_situ_profile(config, live.outcomes["in-situ"], out / "profile-in-situ.toml",
                           config.probe_load * live.capacity_rps)
    names = [name for name, _ in config.loads if name in live.outcomes]
    drift = {name: decode_drift(config, live.decode_steps, name) for name in names}
    calibrated = {name: str(load_profile(situ, live.outcomes[name],
                                         out / f"profile-{slug(name)}-calibrated.toml", name,
                                         drift[name]))
                  for name in names if config.load_probe_repeats > 0}
    replay = {name: str(load_profile(situ, live.outcomes[name],
                                     out / f"profile-{slug(name)}-replay.toml", name,
                                     drift[name], replay=True)) for name in names}
    rate = config.probe_load * live.capacity_rps
    probes = simulate(msgspec.structs.replace(config, profile=str(situ)),
                      probe_jobs(config, rate))
    left_out = unmodelled_by_route(CostModel.load(situ, config.model),
                                   live.outcomes["in-situ"], probes)
    return Profiles(str(situ), calibrated, drift, replay, left_out)


def unmodelled_s(cost: CostModel, live: Sequence[Outcome], sim: Sequence[Outcome]) -> float:
    """The part of a request's TTFT that the simulation does not time, from the probes sent
    before the loads: the median of the live TTFT past the prefill worker's queue and compute
    (the router's dispatch, the KV's trip and import, the first token's way back), less the
    median of the same past the simulation's queue and the profile's compute (the link's
    trip, modelled). A constant on the way in and out of one prefill worker: it moves no queue.
    """

    def rest(outcomes: Sequence[Outcome], compute: Callable[[Outcome], float]) -> float:
        parts = [o.ttft_s - o.queue_s - compute(o) for o in outcomes
                 if o.ok and not math.isnan(o.queue_s)]
        if not parts:
            raise ValueError("no completed probe to measure the unmodelled TTFT on")
        return statistics.median(parts)

    return (rest(live, lambda o: o.compute_s)
            - rest(sim, lambda o: cost.prefill_time(o.prompt_tokens)))


def unmodelled_by_route(cost: CostModel, live: Sequence[Outcome],
                        sim: Sequence[Outcome]) -> dict[str, float]:
    """`unmodelled_s` over all the probes (key ""), and over each route's alone (the cluster
    that prefilled them: "prfaas" offloaded, "pd" local) where both sides completed some of
    that route's: only the offloaded ones cross the link proxy and import KV from it."""
    out = {"": unmodelled_s(cost, live, sim)}
    for route in sorted({o.cluster for o in live if o.cluster}):
        try:
            out[route] = unmodelled_s(cost, [o for o in live if o.cluster == route],
                                      [o for o in sim if o.cluster == route])
        except ValueError:  # no completed probe of that route on one side: the overall one
            continue
    return out


def with_unmodelled(outcomes: Sequence[Outcome], seconds: Mapping[str, float]) -> list[Outcome]:
    """The simulated outcomes with the unmodelled TTFT (`unmodelled_by_route`: their route's,
    else the overall "" one, else none) added to every completed request's TTFT and
    end-to-end latency."""

    def added(o: Outcome) -> float:
        return seconds.get(o.cluster, seconds.get("", 0.0))

    return [msgspec.structs.replace(o, ttft_s=o.ttft_s + added(o), e2e_s=o.e2e_s + added(o))
            if o.ok else o for o in outcomes]


def decode_drift(config: ValidationConfig, steps: dict[str, DecodeSteps], load: str) -> float:
    """How much slower the decode engine stepped during `load` than during the in-situ probes,
    as the decode worker timed its own steps against the engine profile's linear fit for the
    same steps (batch sizes and contexts): the decode side's drift, as the load's probes
    measure the prefill's. 1 when either window has no steps or the profile no linear fit."""
    fit = CostModel.load(config.profile, config.model).profile.decode_fit
    if not isinstance(fit, LinearDecode) or "in-situ" not in steps or load not in steps:
        return 1.0
    base, mine = steps["in-situ"].speed(fit), steps[load].speed(fit)
    return mine / base if base > 0 and mine > 0 else 1.0


def in_situ_profile(config: ValidationConfig, probes: Sequence[Outcome], out: Path,
                    rate: float = 0.0) -> Path:
    """The profile the simulation reads, written to `out`: the engine's profile
    (`config.profile`, `prfaas profile` on the engine alone) with its prefill points
    re-measured in situ, as the live prefill worker reports its own compute for the probes
    (sent Poisson at `rate`; 0: one at a time). Its decode steps are the engine's, scaled
    (when `rate` is given) by the probes' TPOT p50, live over simulated with those steps: the
    decode worker shares its core with the link, the router and the cache directory, which
    the engine alone does not see (its steps ran 6-19% under the live TPOT, more at higher
    load, in two runs on a 2-core VM), and one factor from the probes' own load keeps the
    calibration apart from the loads it is checked against. One at a time the probes' TPOT
    at batch 1 came out within a millisecond of the engine's step (+0.2 and -0.9 ms in two
    runs), so then the steps stay as they are.

    Why: the engine alone is not the engine in the worker. There its compute thread hands
    each KV piece to the event loop, which encodes and sends it while the next chunk runs,
    and on a small host the link and the decode worker share the cores. On a 2-core VM the
    worker's prefill took 15-30% longer than the same prompts on the engine alone, which the
    simulation then missed at every load.

    Why under a load of their own: probes sent one at a time still missed. With the prefill
    worker pinned to a core of its own, the compute it reported for the loads' requests (Poisson
    arrivals) ran 7.6-8.2% above the one-at-a-time probes' fit at every load (light, 60% and
    85% alike; with a decode running beside it or not), while the capacity burst's back-to-back
    computes matched it (1.00); re-simulated with that 7.6% the run's TTFT errors went from
    -10 / -19 / -33% (p90, light to 85%) to -5 / +4 / -1%. So the probes arrive as the loads
    do, Poisson at `probe_load` of the capacity, with their own seed: the calibration shares
    nothing with the arrivals it is then checked against. What the loads test is what the
    simulation adds: queueing, batching, the link."""
    spec = read_profile_spec(config.profile)
    if spec.prefill is None or spec.decode is None:
        raise ProfileError(f"profile {config.profile!r} needs prefill and decode points")
    ok = [o for o in probes if o.ok]
    chunk = spec.prefill.chunk_tokens
    points = _prefill_points(probes, chunk, "in-situ profile")
    dec = spec.decode

    def write(factor: float, decode_note: str) -> None:
        decode = [DecodePoint(b, c, s * factor, 0.0)
                  for b, c, s in zip(dec.batches, dec.contexts, dec.seconds, strict=True)]
        sent = f"Poisson at {rate:.2f} req/s" if rate > 0 else "one at a time"
        where = (f"in situ, the live prefill worker's compute over {len(ok)} probes, {sent}; "
                 f"decode: the steps of {Path(config.profile).stem}{decode_note}; "
                 f"{machine_line(1)}; load average {load_average():.2f}")
        write_profile(out, profile_toml(out.stem, where, points, decode, chunk), ProfileSpec)

    write(1.0, "")
    if rate > 0:
        factor = decode_factor(msgspec.structs.replace(config, profile=str(out)), ok,
                               probe_jobs(config, rate))
        write(factor, f" x {factor:.3f} (the probes' TPOT p50, live over simulated)")
    return out


def load_profile(in_situ: Path, outcomes: Sequence[Outcome], out: Path, load: str,
                 drift: float = 1.0, replay: bool = False) -> Path:
    """The profile a load is simulated with, written to `out`: the in-situ profile with its
    prefill points re-measured by the probes that rode in that load (`load_jobs`) and its
    decode steps times `drift`, the decode engine's own step speed during the load over its
    speed during the in-situ probes (`decode_drift`). Why: the workers' speed drifts on a
    shared host. In one of three runs on a 2-vCPU VM the loads computed 5.7-8.0% above the
    in-situ probes' fit, a minute earlier, against 0.4-3.7% in the other two, and the
    simulation's TTFT at 60% load went from within 9% to 17-24% low; what the probes beside
    the load's own requests measure is the speed the load met. The load's own requests are
    not used, nor any request's TPOT: they are what is checked. `replay`: the fit of every
    request of the load, its own and its probes (the replay's profile, `evaluate`)."""
    spec = read_profile_spec(str(in_situ))
    if spec.prefill is None or spec.decode is None:
        raise ProfileError(f"profile {str(in_situ)!r} needs prefill and decode points")
    probes = [o for o in outcomes if o.probe or replay]
    chunk = spec.prefill.chunk_tokens
    points = _prefill_points(probes, chunk, f"load {load}'s profile")
    dec = spec.decode
    decode = [DecodePoint(b, c, s * drift, 0.0)
              for b, c, s in zip(dec.batches, dec.contexts, dec.seconds, strict=True)]
    what = "requests" if replay else "probes that rode"
    where = (f"in situ, the live prefill worker's compute over the {len(probes)} {what} "
             f"in load {load}; decode: the steps of {in_situ.stem} x {drift:.3f} (the "
             f"decode worker's own step timing, this load over the in-situ probes); "
             f"{machine_line(1)}")
    write_profile(out, profile_toml(out.stem, where, points, decode, chunk), ProfileSpec)
    return out


def _prefill_points(probes: Sequence[Outcome], chunk: int, what: str) -> list[PrefillPoint]:
    """The median compute the prefill worker reported per probed length, with its spread."""
    ok = [o for o in probes if o.ok]
    by_length: dict[int, list[float]] = {}
    for o in ok:
        by_length.setdefault(o.prompt_tokens, []).append(o.compute_s)
    if len(by_length) < 3:
        raise ProfileError(f"{what}: {len(ok)} of {len(probes)} probes completed, "
                           f"over {len(by_length)} lengths; need 3 or more")
    return [PrefillPoint(length, chunk, statistics.median(times),
                         (max(times) - min(times)) / statistics.median(times))
            for length, times in sorted(by_length.items())]


def decode_factor(config: ValidationConfig, live: Sequence[Outcome],
                  probes: Sequence[Job]) -> float:
    """The probes' TPOT p50 live over the simulation's of the same probes with `config`'s
    profile: what its decode steps are scaled by (in_situ_profile)."""

    def tpot_p50(outcomes: Sequence[Outcome]) -> float:
        return statistics.median(o.tpot_s for o in outcomes if o.ok and o.output_tokens > 1)

    return tpot_p50(live) / tpot_p50(simulate(config, probes))


def profile_for(config: ValidationConfig, out: Path, quick: bool = False) -> ValidationConfig:
    """`prfaas profile` (a child process, one thread, as the workers) over the lengths,
    batches and contexts the loads reach, written to `out`; `config` reading it."""
    low, high = config.prompt_tokens
    top = high + config.output_tokens[1]
    # Whole chunks and half chunks: a prompt pays for its last chunk whole (the per-chunk term
    # of the prefill fit), which lengths that are all whole chunks cannot show.
    chunk = config.chunk_tokens or high
    ends = range(chunk, high + chunk, chunk)
    lengths = sorted({n for end in ends for n in (end - chunk // 2, end)
                      if BLOCK <= n <= high and n >= low // 2})
    batches = "1,2,4" if quick else "1,2,4,8,16"
    args = [sys.executable, "-m", "services.cli.main", "profile", "--out", str(out),
            "--name", out.stem, "--no-progress", "--lengths", ",".join(map(str, lengths)),
            "--chunk-tokens", str(config.chunk_tokens), "--batches", batches,
            "--contexts", f"{low},{(low + top) // 2},{top}",
            "--repeats", "2" if quick else "5", "--snapshot-every", str(config.snapshot_every),
            "--family", config.family, "--size", config.size,
            "--checkpoint", config.checkpoint]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    model = out.parent / f"{config.family}-{config.size}.toml"
    return msgspec.structs.replace(config, profile=str(out), model=str(model))
