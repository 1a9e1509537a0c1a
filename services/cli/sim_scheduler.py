"""`prfaas sim-scheduler`: the schedulers' scenario matrix against the oracle (sim/matrix.py).

    prfaas sim-scheduler --out sim-results/scheduler          every scenario, 3 seeds, on Ray
    prfaas sim-scheduler --scenarios dip-2.6,ramp --seeds 1   a part of it
    prfaas sim-scheduler --docs docs/policies.md              also rewrite its matrix section

Each run is a Ray task on a local instance (every core); `--serial` runs them in this process.
Writes DIR/summary.json, DIR/table.md, DIR/runs.jsonl and a plot per scenario (t over time under
each policy against the oracle's t per period); with `--docs`, the section between the
markers `<!-- sim-scheduler:begin -->` and `<!-- sim-scheduler:end -->` of that file becomes the
tables, and the plots go beside it. The last line printed is one JSON line: per scenario and
policy, `slo_attainment` per period and `oracle_ratio` (the policy's attainment over the
oracle's in its worst period), `cache_hit_share` (the prompt tokens served from a cached
prefix), and the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from matplotlib.figure import Figure
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no stubs

from services.bench.host import cpu_name
from services.sim.matrix import (
    ORACLE,
    SCENARIOS,
    Cell,
    RunResult,
    jobs,
    planner_t_of,
    run_job,
    summarise,
)
from services.sim.report import SLO_TPOT_S, SLO_TTFT_S, markdown_table, rounded
from services.sim.search.pool import RayPool, SerialPool

BEGIN, END = "<!-- sim-scheduler:begin -->", "<!-- sim-scheduler:end -->"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas sim-scheduler",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:5]))
    parser.add_argument("--out", type=Path, default=Path("sim-results/scheduler"))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (>= 1)")
    parser.add_argument("--serial", action="store_true", help="no Ray: one run after another")
    parser.add_argument("--docs", type=Path, help="rewrite this file's matrix section")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios.split(",") if s not in SCENARIOS]
    if unknown or args.seeds < 1:
        parser.error(f"unknown scenarios {unknown}" if unknown else "--seeds must be >= 1")
    return args


def _call(job: tuple[str, str, int]) -> RunResult:
    return run_job(*job)


def run_all(todo: Sequence[tuple[str, str, int]], serial: bool,
            progress: Callable[[int], None]) -> list[RunResult]:
    pool = SerialPool() if serial else RayPool()
    results: list[RunResult | None] = [None] * len(todo)
    try:
        calls = [partial(_call, job) for job in todo]
        for done, (index, result) in enumerate(pool.unordered(calls), 1):
            results[index] = result
            progress(done)
    finally:
        pool.close()
    return [r for r in results if r is not None]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    scenarios = args.scenarios.split(",")
    todo = jobs(scenarios, list(range(args.seeds)))
    began = time.perf_counter()
    with tqdm(total=len(todo), desc="sim-scheduler", unit="run", file=sys.stderr) as bar:
        runs = run_all(todo, args.serial, lambda done: bar.update(done - bar.n))
    wall = time.perf_counter() - began
    cells = summarise(runs, planner_t_of)
    args.out.mkdir(parents=True, exist_ok=True)
    figures = args.docs.parent / "policies" if args.docs else args.out
    figures.mkdir(parents=True, exist_ok=True)
    plots = {s: plot_thresholds(figures / f"scheduler-{s}.png", s, runs, cells[s])
             for s in scenarios}
    tables = markdown_report(cells, plots, args.docs.parent if args.docs else args.out, wall,
                             len(runs), args.seeds)
    (args.out / "table.md").write_text(tables, encoding="utf-8")
    with (args.out / "runs.jsonl").open("wb") as f:
        for run in runs:
            f.write(msgspec.json.encode(run) + b"\n")
    line = figures_line(cells, wall, len(runs), args.seeds)
    (args.out / "summary.json").write_text(json.dumps(line, indent=2, sort_keys=True) + "\n",
                                           encoding="utf-8")
    if args.docs:
        replace_section(args.docs, tables)
    print(tables)
    print(json.dumps(line, sort_keys=True))
    return 0


def figures_line(cells: dict[str, dict[str, Cell]], wall: float, runs: int,
                 seeds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario, policies in cells.items():
        out[scenario] = {name: {"slo_attainment": {p: a[0] for p, a in c.attainment.items()},
                                "oracle_ratio": c.oracle_ratio,
                                "cache_hit_share": c.cache_hits,
                                **({"vs_prfaas": {p: [d[0], *d[1]]
                                                  for p, d in c.vs_prfaas.items()}}
                                   if c.vs_prfaas and name != "prfaas" else {})}
                         for name, c in policies.items()}
    line: dict[str, Any] = rounded({"bench": "sim-scheduler", "scenarios": out,
                                    "wall_s": wall, "runs": runs, "seeds": seeds,
                                    "cpu": cpu_name()}, 3)
    return line


def _paired_text(policies: dict[str, Cell]) -> str:
    """prfaas-dynamic's attainment minus prfaas's per period, paired by seed (a line)."""
    dynamic = policies.get("prfaas-dynamic")
    if dynamic is None or not dynamic.vs_prfaas:
        return ""
    return ("\nprfaas-dynamic minus prfaas, paired by seed (mean [95% interval]): " + ", ".join(
        f"{p} {_signed(d)}" for p, d in dynamic.vs_prfaas.items()) + ".\n")


def _signed(value: tuple[float, tuple[float, float]]) -> str:
    mean, (low, high) = value
    return f"{mean:+.3f}" if low != low else f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def _cell_text(value: tuple[float, tuple[float, float]]) -> str:
    mean, (low, high) = value
    if mean != mean:
        return "-"
    return f"{mean:.3f}" if low != low else f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def markdown_report(cells: dict[str, dict[str, Cell]], plots: dict[str, Path], base: Path,
                    wall: float, runs: int, seeds: int) -> str:
    parts = [f"SLO: TTFT <= {SLO_TTFT_S:g} s and TPOT <= {1e3 * SLO_TPOT_S:.1f} ms; "
             f"attainment over the requests arriving in each period, mean and 95% interval "
             f"over {seeds} seeds. {runs} runs in {wall:.0f} s of wall time on "
             f"{cpu_name()}.\n"]
    for scenario, policies in cells.items():
        periods = list(next(iter(policies.values())).attainment)
        rows = []
        for name, cell in policies.items():
            rows.append([name, *(_cell_text(cell.attainment[p]) for p in periods),
                         *(f"{cell.ttft_p90[p]:.2f}" for p in periods),
                         *(f"{cell.offload[p]:.2f}" for p in periods),
                         f"{cell.cache_hits:.3f}",
                         "-" if name == ORACLE else f"{cell.oracle_ratio:.2f}"])
        oracle_t = policies[ORACLE].oracle_t or {}
        header = ["policy", *(f"SLO {p}" for p in periods), *(f"P90 TTFT {p} (s)"
                  for p in periods), *(f"offload {p}" for p in periods), "cache hits",
                  "oracle ratio"]
        splits = policies[ORACLE].oracle_split or {}
        parts.append(f"### {scenario}\n\nThe oracle's t per period: " + ", ".join(
            f"{p} {t:,.0f}" for p, t in oracle_t.items()) + " (paper tokens); its split "
            "(PrfaaS prefill / PD prefill / decode): " + ", ".join(
            f"{p} {'/'.join(map(str, s))}" for p, s in splits.items()) + ".\n\n"
            + markdown_table(header, rows) + _paired_text(policies)
            + f"\n![t over time, {scenario}]({plots[scenario].relative_to(base)})\n")
    return "\n".join(parts)


def plot_thresholds(path: Path, scenario: str, runs: Sequence[RunResult],
                    cells: dict[str, Cell]) -> Path:
    """t over time under each policy (seed 0) against the oracle's t per period."""
    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot()
    for run in runs:
        if run.scenario == scenario and run.seed == 0 and not run.policy.startswith("static") \
                and run.threshold:
            ax.plot([at / 60 for at, _ in run.threshold], [t for _, t in run.threshold],
                    label=run.policy, linewidth=1.2)
    oracle = cells[ORACLE].oracle_t or {}
    periods = next((r.periods for r in runs if r.scenario == scenario), {})
    bounds = _period_bounds(scenario)
    for i, (name, t) in enumerate(oracle.items()):
        low, high = bounds[name]
        ax.hlines(t, low / 60, high / 60, colors="black", linestyles="dashed",
                  label="oracle (best static t per period)" if i == 0 else "_")
    ax.set(xlabel="virtual time (min)", ylabel="t (paper tokens)", yscale="log",
           title=f"{scenario}: t against the oracle's per period ({len(periods)} periods)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _period_bounds(scenario: str) -> dict[str, tuple[float, float]]:
    return {p.name: (p.start_s, p.end_s) for p in SCENARIOS[scenario](0).periods}


def replace_section(doc: Path, tables: str) -> None:
    """The text between the markers becomes `tables` (the markers are added at the end of
    the file the first time)."""
    text = doc.read_text(encoding="utf-8")
    block = f"{BEGIN}\n{tables}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text, encoding="utf-8")
