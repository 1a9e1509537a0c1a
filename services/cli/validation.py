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
import sys
import tempfile
from functools import partial
from pathlib import Path

import msgspec

from services.bench.host import load_average, machine_line
from services.cli.validate.config import DEPLOYMENTS, ValidationConfig
from services.cli.validate.evaluate import evaluate
from services.cli.validate.live import run_live
from services.cli.validate.profiles import profile_for
from services.cli.validate.report import lines_of, result_rows, write_report

# `--quick`: the fewest probes and burst requests the fits and the capacity still work with.
QUICK = {"probe_repeats": 2, "load_probe_repeats": 1, "capacity_requests": 16,
         "warmup_requests": 2}


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
