"""`prfaas validate-sim`: the simulation against the live mesh under load, as Vidur validates.

    prfaas validate-sim                                   the full run (make validate-sim)
    prfaas validate-sim --requests 40 --out /tmp/v        a shorter one

The live side is the real system at its smallest: a cache directory, a link (the TCP proxy), one
prefill worker in the PrfaaS cluster and one decode worker in the PD cluster, each `prfaas serve`
process in live mode (real compute on the shipped model, one torch thread, no pacing), and the
router's scheduler in this process. Two deployments (`DEPLOYMENTS`), each a run of its own:
`remote-1p1d`, where every request goes remote (threshold 0), so its KV crosses the link; and
`routed-1+1p1d` (`routed`), a PD prefill worker beside the PrfaaS one and the prfaas policy at a
t in the middle of the prompt lengths, so short requests prefill locally and long ones are
offloaded over a link shaped slow enough to matter; its rows are also split by route
(`route_rows`). Each worker computes on a CPU of its own where the machine has enough
(`core_plan`). The simulation runs the same deployment on virtual time with the measured
profile (`prfaas profile`) for every worker and the model's KV sizes.

Steps: warm the workers up; measure the live mesh's capacity (a burst well above it,
completions per second over the middle half of the finishes); probe the prefill worker in situ
(each prompt length the engine's profile measured, a few times, sent as a Poisson load of their
own at half that capacity: the worker's own compute report becomes the profile's prefill points,
its decode steps stay the engine's; see `in_situ_profile` for why neither the engine alone nor
probes one at a time are enough); then for each load (a fraction of that capacity) send the same
seeded Poisson arrival list, prompt lengths and output lengths to both sides (`repeats` times
on the live side, fresh prompts each time: its own spread), and compare TTFT, TPOT and
end-to-end latency at P50, P90 and P99 and completed requests per second over the load's own
requests.
Probes ride in each load too (every profiled length a few times, in seeded places of the same
arrival list, so the load is offered at its rate with them); they are compared on neither side.

The headline is predicted: every load is simulated with the profile measured before the loads
(the engine's profile with its prefill points re-measured by the in-situ probes, its decode
steps scaled by the probes' TPOT), so no figure measured during a compared load feeds its
simulation (`evaluate`). Beside it, as a labelled diagnostic, each load simulated calibrated on
itself: the prefill fit of its own probes (`load_profile`) and its decode steps scaled by the
decode engine's own step speed during the load over during the probes (`decode_drift`); the
two apart is the host's drift, what the calibrated one leaves is modelling. The same live run
is also simulated with the engine-alone profile, and replayed: each load with its own requests'
reported compute (a separate figure). The predicted, calibrated and replayed simulations add
the TTFT the simulation does not time, measured on the in-situ probes per route
(`unmodelled_by_route`).
Errors are signed, sim over live minus 1.
Beside them, what the live TTFT is made of, measured from the prefill worker's own report:
queueing, compute, and the rest (the router's dispatch, the KV's trip through the link, its
import on the decode side and the first token's way back).

Writes, per deployment under DIR/<deployment>/: summary.json, table.md, records.jsonl (probes
flagged, each request's cluster), profile-in-situ.toml, profile-<load>-calibrated.toml and a
CDF plot per load (cdf_<load>.png); ends with one JSON line {"bench": "validate-sim", "rows":
[...]}, a row per deployment and load.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from matplotlib.figure import Figure

from services.bench.host import load_average, machine_line
from services.cli.validate.compare import METRICS, compare, service_rate, ttft_parts
from services.cli.validate.config import (
    DEPLOYMENT,
    DEPLOYMENTS,
    ROUTES,
    Outcome,
    Row,
    ValidationConfig,
    by_route,
    compared,
    deployment_name,
    slug,
)
from services.cli.validate.jobs import burst, load_jobs, reruns_of
from services.cli.validate.live import LiveRun, run_live
from services.cli.validate.profiles import derive_profiles, profile_for, with_unmodelled
from services.cli.validate.simulated import simulate
from services.sim.report import markdown_table

# `--quick`: the fewest probes and burst requests the fits and the capacity still work with.
QUICK = {"probe_repeats": 2, "load_probe_repeats": 1, "capacity_requests": 16,
         "warmup_requests": 2}


# Vidur's reported error against the real engine (its paper): the goal to state against.
VIDUR_GOAL = 0.09
ACCEPT = 0.15


def plot_cdfs(out: Path, row: Row, live: Sequence[Outcome], sim: Sequence[Outcome]) -> Path:
    """TTFT and TPOT CDFs of one load, live beside simulated."""
    fig = Figure(figsize=(9, 3.6))
    panels = (("TTFT (s)", "ttft_s", 1.0), ("TPOT (ms)", "tpot_s", 1e3))
    for ax, (label, field, scale) in zip(fig.subplots(1, 2), panels, strict=True):
        for name, outcomes in (("live", live), ("sim", sim)):
            values = sorted(getattr(o, field) * scale for o in outcomes if o.ok)
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set(xlabel=label, ylabel="share of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"load {row.load}: {row.rate:.2f} req/s, {row.requests} requests")
    fig.tight_layout()
    path = out / f"cdf_{slug(row.load)}.png"
    fig.savefig(path, dpi=110)
    return path


def table(rows: Sequence[Row]) -> str:
    header = ["load", "req/s", "requests", "metric", "live", "sim", "error", "live spread"]
    lines = []
    for row in rows:
        for key in METRICS:
            scale, unit = (1e3, " ms") if key.startswith("tpot") else (1.0, "")
            spread = f"{row.live_spread[key]:.1%}" if key in row.live_spread else "-"
            lines.append([f"{row.load} {row.route}".strip(), f"{row.rate:.2f}", row.requests,
                          key, f"{row.live[key] * scale:.3f}{unit}",
                          f"{row.sim[key] * scale:.3f}{unit}", f"{row.errors[key]:+.1%}",
                          spread])
    return markdown_table(header, lines)


def parts_table(parts: dict[str, dict[str, float]]) -> str:
    header = ["load", "live TTFT", "queue", "prefill compute", "profile's prefill",
              "in-situ block's", "engine alone", "rest (dispatch, link, import, first token)"]
    return markdown_table(header, [[load, *(f"{p.get(k, 0.0) * 1e3:.1f} ms" for k in (
        "ttft", "queue", "compute", "profile", "in-situ", "engine", "rest"))]
        for load, p in parts.items()])


def errors_line(row: Row) -> dict[str, float]:
    """A row's signed errors under the JSON line's keys (`ttft_p50_err`, ...)."""
    return {f"{k}_err": round(row.errors[k], 4) for k in METRICS}


def bench_rows(rows: Sequence[Row], replay: Sequence[Row] = (),
               deployment: str = DEPLOYMENT, routes: Sequence[Row] = ()) -> list[dict[str, Any]]:
    """The JSON line's rows of one deployment: per load, every signed error (predicted), the
    live side's own spread (null with one run per load), the replay's errors and each
    route's errors with its request count (`route_rows`; empty: none)."""
    replayed = {r.load: errors_line(r) for r in replay}
    return [{
        "deployment": deployment, "load": r.load, "requests": r.requests, **errors_line(r),
        "live_spread": ({k: round(v, 4) for k, v in r.live_spread.items()}
                        if r.live_spread else None),
        "replay": replayed.get(r.load),
        "routes": {x.route: {"requests": x.requests, **errors_line(x)}
                   for x in routes if x.load == r.load}} for r in rows]


def bench_line(rows: Sequence[Row], replay: Sequence[Row] = (),
               deployment: str = DEPLOYMENT, routes: Sequence[Row] = ()) -> str:
    """The run's last line for one deployment (`bench_rows`)."""
    return lines_of(bench_rows(rows, replay, deployment, routes))


def lines_of(rows: Sequence[dict[str, Any]]) -> str:
    """The run's last line over the rows of every deployment run."""
    return json.dumps({"bench": "validate-sim", "rows": list(rows)})


def result_rows(result: Validation) -> list[dict[str, Any]]:
    """`bench_rows` of a whole run of one deployment."""
    return bench_rows(result.rows, result.replay, deployment_name(result.config),
                      result.routes)


def accepted(row: Row, bound: float = ACCEPT) -> bool:
    """The issue's acceptance for one load: TTFT p50 and p90 and TPOT p50 within `bound`."""
    return all(abs(row.errors[k]) <= bound for k in ("ttft_p50", "ttft_p90", "tpot_p50"))


class Validation(msgspec.Struct, frozen=True):
    """A whole run: the capacities, each load's row (predicted: the headline), its TTFT
    parts, each side's records, and the diagnostics beside (calibrated on the load; the
    engine's profile alone)."""

    config: ValidationConfig
    live_capacity_rps: float
    sim_capacity_rps: float
    rows: list[Row]
    parts: dict[str, dict[str, float]]
    records: dict[str, dict[str, list[Outcome]]]
    wall_s: float
    load_averages: dict[str, str] = {}
    # Each load's decode drift (decode_drift): its decode steps' scale in the calibrated rows.
    decode_drift: dict[str, float] = {}
    calibrated: list[Row] = []
    engine_alone: list[Row] = []
    unmodelled_s: float = 0.0  # Profiles.unmodelled[""]: over all the in-situ probes
    # Each load simulated with its own requests' measured compute (`Profiles.replay`): the
    # queueing, batching and transfer judged alone. A separate figure, never the prediction.
    replay: list[Row] = []
    # The predicted rows split by route (`route_rows`): local and offloaded requests apart.
    routes: list[Row] = []
    # The unmodelled TTFT added (Profiles.unmodelled): overall ("") and per route.
    unmodelled_routes: dict[str, float] = {}


def against_sim(config: ValidationConfig, live: LiveRun, profiles: dict[str, str],
                unmodelled: Mapping[str, float] | None = None
                ) -> tuple[list[Row], dict[str, list[Outcome]]]:
    """Each load of `live` simulated with its profile in `profiles` (by load name), the
    `unmodelled` seconds added (`with_unmodelled`), and compared with it: the rows and the
    simulated outcomes, by load. What a load is simulated from is its arrival list as sent
    (its probes' lengths are the engine profile's) and the profile named: nothing of the
    load's own measurements."""
    rows, sims = [], {}
    for index, (name, fraction) in enumerate(config.loads):
        if name not in profiles:
            continue
        rate = fraction * live.capacity_rps
        own = msgspec.structs.replace(config, profile=profiles[name])
        sims[name] = sim = with_unmodelled(simulate(own, load_jobs(config, index, rate)),
                                           unmodelled or {})
        reruns = [compared(live.outcomes[again]) for again in reruns_of(name, live.outcomes)]
        rows.append(compare(name, rate, compared(live.outcomes[name]), compared(sim), reruns))
    return rows, sims


def route_rows(config: ValidationConfig, live: LiveRun,
               sims: dict[str, list[Outcome]]) -> list[Row]:
    """Each simulated load of `sims` compared with `live` per route (`by_route`): the local
    requests on both sides, then the offloaded ones, each as a row of its own (`Row.route`).
    Each side's requests are split by where its own router placed them; a route one side
    never took gets no row."""
    rows = []
    for name, fraction in config.loads:
        if name not in sims:
            continue
        live_runs = [by_route(compared(live.outcomes[run]))
                     for run in (name, *reruns_of(name, live.outcomes))]
        sim = by_route(compared(sims[name]))
        for route in ROUTES.values():
            if route in sim and all(route in run for run in live_runs):
                row = compare(name, fraction * live.capacity_rps, live_runs[0][route],
                              sim[route], [run[route] for run in live_runs[1:]])
                rows.append(msgspec.structs.replace(row, route=route))
    return rows


def evaluate(config: ValidationConfig, live: LiveRun, out: Path) -> Validation:
    """The whole comparison of a live run, its profiles written to `out`. The headline rows
    are predicted: every load simulated with the in-situ profile, measured before the loads.
    Beside them, as diagnostics, each load simulated with its calibrated profile (read from
    the load itself: what is left between it and the live run is modelling, not drift) and
    with the engine's profile alone."""
    profiles = derive_profiles(config, live, out)
    names = [name for name, _ in config.loads if name in live.outcomes]
    rows, sims = against_sim(config, live, dict.fromkeys(names, profiles.in_situ),
                             profiles.unmodelled)
    calibrated, _ = against_sim(config, live, profiles.calibrated, profiles.unmodelled)
    engine_alone, _ = against_sim(config, live, dict.fromkeys(names, config.profile))
    replay, _ = against_sim(config, live, profiles.replay, profiles.unmodelled)
    predicted = msgspec.structs.replace(config, profile=profiles.in_situ)
    sim_capacity = service_rate(simulate(predicted, burst(config))) if (
        "capacity" in live.outcomes) else 0.0
    records: dict[str, dict[str, list[Outcome]]] = {
        name: {"live": live.outcomes[name]} for name in ("in-situ", "capacity")
        if name in live.outcomes}
    parts = {}
    for name in names:
        records[name] = {"live": live.outcomes[name], "sim": sims[name]}
        parts[name] = ttft_parts(predicted, compared(live.outcomes[name]), config.profile,
                                 profiles.in_situ)
    return Validation(config, live.capacity_rps, sim_capacity, rows, parts, records,
                      live.wall_s, live.load_averages, profiles.decode_drift, calibrated,
                      engine_alone, profiles.unmodelled.get("", 0.0), replay,
                      route_rows(config, live, sims), profiles.unmodelled)


def unmodelled_text(result: Validation) -> str:
    """The unmodelled TTFT added: overall, and each route's where it has its own."""
    routes = {ROUTES.get(k, k): v for k, v in result.unmodelled_routes.items() if k}
    return f"{result.unmodelled_s * 1e3:.1f} ms" + "".join(
        f", {name} {seconds * 1e3:.1f} ms" for name, seconds in routes.items())


def write_report(out: Path, result: Validation, machine: str) -> str:
    """DIR/summary.json, table.md, records.jsonl and the CDF plots; the table's text."""
    out.mkdir(parents=True, exist_ok=True)
    for row in result.rows:
        sides = result.records[row.load]
        plot_cdfs(out, row, compared(sides["live"]), compared(sides["sim"]))
    with (out / "records.jsonl").open("wb") as file:
        for load, sides in result.records.items():
            for side, outcomes in sides.items():
                for o in outcomes:
                    record = {"load": load, "side": side, **msgspec.to_builtins(o)}
                    file.write(msgspec.json.encode(record) + b"\n")
    config = result.config
    text = "\n".join([
        f"Deployment {deployment_name(config)}: one PrfaaS prefill, {config.pd_prefill} PD "
        f"prefill and one decode worker, prfaas policy at t = {config.threshold} tokens, "
        f"link {config.bandwidth_bps / 1e6:g} Mbit/s and {config.delay_s * 1e3:g} ms.", "",
        f"Live capacity {result.live_capacity_rps:.2f} req/s (simulated "
        f"{result.sim_capacity_rps:.2f}); {machine}; {result.wall_s:.0f} s in all; load "
        f"average as each phase began: " + ", ".join(
            f"{k} {v}" for k, v in result.load_averages.items()) + ".", "",
        "Predicted: every load simulated with the profile measured before the loads "
        "(profile-in-situ.toml), and the TTFT the simulation does not time (dispatch, KV "
        f"import, the first token's way back: {unmodelled_text(result)}, measured on "
        "the in-situ probes) added to each request; nothing measured during a load reaches "
        "its simulation.", "",
        table(result.rows),
        "What the live TTFT is made of (means, the load's own requests):", "",
        parts_table(result.parts),
        "Acceptance (|error| <= 15% on TTFT p50, p90 and TPOT p50, light and 60% load, "
        "predicted): " + ", ".join(
            f"{r.load} {'pass' if accepted(r) else 'FAIL'}" for r in result.rows) +
        f"; Vidur's goal: {VIDUR_GOAL:.0%}.", ""])
    if result.routes:
        text += ("\nPredicted, per route: each side's requests split by where its own router "
                 "prefilled them (local: the PD prefill worker; offloaded: the PrfaaS one, its "
                 f"KV over the link).\n\n{table(result.routes)}")
    if result.calibrated:
        text += ("\nDiagnostic, calibrated on the load itself (not a prediction): each load "
                 "simulated with the prefill fit of the probes that rode in it and its decode "
                 "steps times the decode worker's own step speed during the load over during "
                 "the in-situ probes (" + ", ".join(
                     f"{k} {v:.3f}" for k, v in result.decode_drift.items()) +
                 "). Predicted minus calibrated is the host's drift between the profile and "
                 f"the load; what calibrated leaves is modelling.\n\n{table(result.calibrated)}")
    if result.replay:
        text += ("\nReplay (a separate figure, not a prediction): each load simulated with "
                 "its own requests' measured compute, the prefill worker's reported compute "
                 "fitted per length and the decode steps scaled as the calibrated rows': the "
                 "simulation's queueing, batching and transfer judged alone.\n\n"
                 f"{table(result.replay)}")
    if result.engine_alone:
        text += (f"\nDiagnostic, the engine's profile alone ({result.config.profile}, no "
                 f"in-situ probes):\n\n{table(result.engine_alone)}")
    (out / "table.md").write_text(text)
    summary = _summary(result)
    summary["machine"] = machine
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return text


def _summary(result: Validation) -> dict[str, Any]:
    fields = msgspec.structs.asdict(result)
    del fields["records"]
    built: dict[str, Any] = msgspec.to_builtins(fields)
    return built


def _parse(argv: list[str]) -> argparse.Namespace:
    lines = (__doc__ or "").splitlines()
    parser = argparse.ArgumentParser(prog="prfaas validate-sim", description=lines[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(lines[2:]))
    defaults = ValidationConfig()
    parser.add_argument("--profile", default=defaults.profile,
                        help="the measured hardware profile (prfaas profile) the sim reads")
    parser.add_argument("--model", default=defaults.model, help="the model's KV-size profile")
    parser.add_argument("--reprofile", action="store_true",
                        help="measure a fresh profile first (DIR/profile.toml) and use it")
    parser.add_argument("--requests", type=int, default=defaults.requests,
                        help="requests per load")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--repeats", type=int, default=defaults.repeats,
                        help="runs of each load (the live side's own spread needs two or more)")
    parser.add_argument("--deployment", action="append", choices=list(DEPLOYMENTS),
                        help="a deployment to validate (repeatable; default: every one, "
                             "each reported in DIR/<deployment>/)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: fewer probes, a smaller capacity burst")
    parser.add_argument("--out", type=Path, default=Path("validation-results"))
    parser.add_argument("--log-dir", type=Path, help="the services' logs (default: a temp dir)")
    return parser.parse_args(argv)


def end_line() -> str:
    """The machine and how busy it was (1-minute load average) as the run ended."""
    return f"{machine_line(1)}; load average {load_average():.2f} at the end"


def validate_main(argv: list[str]) -> int:
    args = _parse(argv)
    config = ValidationConfig(profile=args.profile, model=args.model, requests=args.requests,
                              seed=args.seed, repeats=args.repeats)
    if args.quick:
        config = msgspec.structs.replace(config, **QUICK)
    args.out.mkdir(parents=True, exist_ok=True)
    say = partial(print, file=sys.stderr)
    if args.reprofile:
        say("profiling the engine (prfaas profile) ...")
        config = profile_for(config, args.out / "profile.toml")
    rows = []
    for name in args.deployment or list(DEPLOYMENTS):
        shaped = DEPLOYMENTS[name](config)
        out = args.out / name
        say(f"deployment {name}")
        with tempfile.TemporaryDirectory(prefix="validate-sim-") as temp:
            log_dir = (args.log_dir or Path(temp)) / name
            log_dir.mkdir(parents=True, exist_ok=True)
            live = run_live(shaped, log_dir, say)
        result = evaluate(shaped, live, out)
        print(write_report(out, result, end_line()))
        print(f"report: {out}/table.md, summary.json, records.jsonl, cdf_*.png")
        rows += result_rows(result)
    print(lines_of(rows))
    return 0
