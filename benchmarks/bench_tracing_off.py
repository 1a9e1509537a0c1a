"""What tracing costs when it is off: the router of the merge that brought tracing against
the router of its parent, over several runs of bench_router.py, each figure beside an A/A
control (the parent against itself).

The headline counts work rather than time: each router's instructions per request under
valgrind's callgrind (`bench_router.py --count-instructions`), all its threads and C code
included, which the host's load does not move (the control's ratio says how far the count
moves by itself, timers firing at other moments). CPU time per request comes beside it.

Each run is two runs of `bench_router.py --against PARENT` (its routers take turns in every
round over the same backend and client): `--ours MERGE` (the change) and `--ours PARENT` (the
control: the same code on both sides, so its ratio says how far the host's noise alone moves
one), in alternating order. Every round gives each kind (plain, streamed) the ratio of the two
routers' CPU per request, measured back to back; the rounds of all runs are pooled per kind,
and the figure is the worse kind's median with a 95% bootstrap interval of that median
(seeded), beside the control's. On a small shared host each router process keeps what sets
it apart for the whole run, so the control's ratio can sit several per cent from 1: time
resolves several per cent here, the count a fraction of one. Then the counts: MERGE against
PARENT (instructions, and calls of the event loop's thread) and PARENT against itself.

    .venv/bin/python benchmarks/bench_tracing_off.py [--runs N] [--rounds N] [--requests N]
        [--merge REV] [--parent REV] [--count-calls N]

The last line is one JSON object: `tracing_off_instructions_ratio` (the worse kind's
instructions per request, MERGE over PARENT), `control_instructions_ratio`,
`tracing_off_calls_ratio`, `tracing_off_cpu_ratio` (pooled median, worse kind),
`tracing_off_cpu_interval`, `control_cpu_ratio` and `control_cpu_interval`, `rounds` (pooled
per kind), `instructions` and `calls` (each kind), `runs`, `merge`, `parent`, `cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_ROUTER = ROOT / "benchmarks" / "bench_router.py"
MERGE = "68d2110"  # Merge branch i44t: OpenTelemetry traces (issue 44)
PARENT = "868b00c"  # its first parent: main before tracing
KINDS = ("plain", "stream")
RESAMPLES = 2000


def bench_router(ours: str, against: str, rounds: int, requests: int,
                 count_calls: int = 0, count_instructions: int = 0) -> dict[str, Any]:
    """One bench_router.py run's JSON line (tracing off: no OTEL_ variables passed on)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    argv = [sys.executable, str(BENCH_ROUTER), "--ours", ours, "--against", against,
            "--rounds", str(rounds), "--requests", str(requests), "--long-senders", "0"]
    if count_calls:
        argv += ["--count-calls", str(count_calls)]
    if count_instructions:
        argv += ["--count-instructions", str(count_instructions)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench_router.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def median_interval(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The median of `values` and a 95% percentile-bootstrap interval of it."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(RESAMPLES))
    return (statistics.median(values), medians[int(0.025 * RESAMPLES)],
            medians[int(0.975 * RESAMPLES) - 1])


def pooled(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Every round's CPU ratio at the throughput concurrency, per kind, over all runs."""
    return {kind: [ratio for result in results
                   for ratio in result["against"]["kinds"][kind]["rounds_ratio"]]
            for kind in KINDS}


def summary(rounds: dict[str, list[float]]) -> dict[str, Any]:
    """Per kind the pooled median and its interval; the worse kind's as the headline."""
    kinds = {kind: dict(zip(("median", "low", "high"),
                            (round(x, 4) for x in median_interval(values)), strict=True))
             for kind, values in rounds.items()}
    worst = max(kinds.values(), key=lambda k: k["median"])
    return {"ratio": worst["median"], "interval": [worst["low"], worst["high"]], "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="pairs of runs (change, control)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each run")
    parser.add_argument("--requests", type=int, default=1000,
                        help="requests of each kind and router per run at concurrency 16")
    parser.add_argument("--merge", default=MERGE, help="the change's commit (its router)")
    parser.add_argument("--parent", default=PARENT, help="the commit before it")
    parser.add_argument("--count-calls", type=int, default=2000,
                        help="requests of each kind under the call counter (0: not)")
    parser.add_argument("--count-instructions", type=int, default=400,
                        help="requests of each kind under callgrind (0: not)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.rounds < 2:
        parser.error("--runs must be at least 1 and --rounds at least 2")
    change: list[dict[str, Any]] = []
    control: list[dict[str, Any]] = []
    for run in range(args.runs):
        order = [(change, args.merge), (control, args.parent)]
        for results, ours in order if run % 2 == 0 else reversed(order):
            results.append(bench_router(ours, args.parent, args.rounds, args.requests))
            kinds = results[-1]["against"]["kinds"]
            print(f"run {run + 1}/{args.runs}: {ours} against {args.parent}: " + ", ".join(
                f"{kind} {kinds[kind]['median_ratio']:.4f}" for kind in KINDS), flush=True)
    measured, noise = summary(pooled(change)), summary(pooled(control))
    out: dict[str, Any] = {
        "tracing_off_cpu_ratio": measured["ratio"],
        "tracing_off_cpu_interval": measured["interval"],
        "control_cpu_ratio": noise["ratio"], "control_cpu_interval": noise["interval"],
        "rounds": {"change": measured["kinds"], "control": noise["kinds"]},
        "runs": args.runs, "rounds_per_run": args.rounds, "merge": args.merge,
        "parent": args.parent, "cpu": change[0]["cpu"]}
    if args.count_calls or args.count_instructions:
        counted = bench_router(args.merge, args.parent, 2, 100, args.count_calls,
                               args.count_instructions)
        for unit in ("calls", "instructions"):
            if unit in counted:
                out[f"tracing_off_{unit}_ratio"] = counted[f"tracing_off_{unit}_ratio"]
                out[unit] = counted[unit]
    if args.count_instructions:
        alone = bench_router(args.parent, args.parent, 2, 100, 0, args.count_instructions)
        out["control_instructions_ratio"] = alone["tracing_off_instructions_ratio"]
        out["control_instructions"] = alone["instructions"]
    print(f"router CPU per request, {args.merge} over {args.parent} (tracing off) on "
          f"{out['cpu']}, {args.runs} runs of {args.rounds} rounds: median of rounds "
          f"{measured['ratio']:.4f} [{measured['interval'][0]:.4f}, "
          f"{measured['interval'][1]:.4f}]; the control ({args.parent} over itself) "
          f"{noise['ratio']:.4f} [{noise['interval'][0]:.4f}, {noise['interval'][1]:.4f}]")
    if "calls" in out:
        print(f"calls per request, {args.merge} over {args.parent}: "
              f"{out['tracing_off_calls_ratio']:.4f}")
    if "instructions" in out:
        print(f"instructions per request, {args.merge} over {args.parent}: " + ", ".join(
            f"{kind} {k['router_instructions_per_request']:,.0f} vs "
            f"{k['against_instructions_per_request']:,.0f} ({k['ratio']:.4f})"
            for kind, k in out["instructions"]["kinds"].items())
            + f"; the control ({args.parent} over itself) "
              f"{out['control_instructions_ratio']:.4f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
