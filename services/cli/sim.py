"""`prfaas sim`: the live services at the paper's scale on virtual time (services/sim).

    prfaas sim --scenario paper --out sim-paper            Table 6, measured
    prfaas sim --scenario bandwidth-bound --out sim-bw     PrfaaS-PD on 8 Gbps: Eq. 3's bound
    prfaas sim --scenario bandwidth-dip --out sim-dip      prfaas vs prfaas-dynamic, 100->5 Gbps
    prfaas sim --scenario trace --out sim-trace            the Mooncake conversation trace
    prfaas sim --scenario burst --out sim-burst            gamma arrivals, role conversions
    prfaas sim --policy prfaas --rate 3 --duration 600     one run of the paper deployment
    prfaas sim --policy prfaas --rate 1 --dashboard        the same, live on the dashboard

Each scenario writes DIR/summary.json and DIR/table.md (most also DIR/records.jsonl and PNG
plots), and shows its progress in virtual time on the terminal. The capacity scenarios
(paper, bandwidth-bound) search over --seeds seeds from --seed. `--quick` shortens every run
and searches over two seeds (a smoke check, not the numbers to quote). The same seed gives
the same summary, byte for byte.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no stubs

from mesh.errors import ConfigError
from services.paper.case_study import T_STAR_TOKENS
from services.router.policies import POLICIES
from services.sim import report, scenarios
from services.sim.run import run_virtual
from services.sim.search.pool import RayPool
from services.sim.workload import lognormal
from services.sim.world import DEFAULT_SCALE, Deployment

SCENARIOS = ("paper", "bandwidth-bound", "bandwidth-dip", "trace", "burst")


class ProgressBar:
    """One tqdm bar per run, advanced in virtual seconds."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._what = ""

    def __call__(self, what: str, done: float, total: float) -> None:
        if not self.enabled:
            return
        if what != self._what:
            self.close()
            self._what = what
            self._bar = tqdm(total=round(total), desc=what, unit="vs", leave=False,
                             file=sys.stderr)
        self._bar.update(max(0, min(round(done), round(total)) - self._bar.n))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas sim", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:8]))
    parser.add_argument("--scenario", choices=SCENARIOS, help="a whole scenario (else one run)")
    parser.add_argument("--out", type=Path, default=Path("sim-results"), help="report folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=5,
                        help="capacity scenarios: seeds to search over (>= 2; 5 for intervals "
                             "worth quoting)")
    parser.add_argument("--quick", action="store_true", help="short runs: a smoke check")
    parser.add_argument("--policy", default="prfaas", choices=sorted(POLICIES))
    parser.add_argument("--rate", type=float, default=3.0, help="one run: requests/s")
    parser.add_argument("--duration", type=float, default=600.0, help="one run: virtual s")
    parser.add_argument("--instances", default="4/3/5",
                        help="one run: PrfaaS prefill / PD prefill / PD decode instances")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--ray", action="store_true",
                        help="capacity scenarios: each seed's search a Ray task on a local Ray "
                             "instance with every core (or the cluster in RAY_ADDRESS); the "
                             "same numbers as without --ray (docs/search.md)")
    parser.add_argument("--dashboard", action="store_true",
                        help="serve the dashboard on the simulation instead of a report "
                             "(prfaas sim-dashboard with --policy and --rate)")
    parser.add_argument("--speed", type=float, default=10.0,
                        help="--dashboard: virtual seconds per wall second")
    parser.add_argument("--port", type=int, default=8080, help="--dashboard: its HTTP port")
    return parser.parse_args(argv)


def _one_run(args: argparse.Namespace, progress: ProgressBar) -> dict[str, Any]:
    try:
        n_prfaas, n_p, n_d = (int(x) for x in args.instances.split("/"))
    except ValueError as exc:
        raise ConfigError(f"--instances must be three counts like 4/3/5, got "
                          f"{args.instances!r}") from exc
    options = {"threshold": T_STAR_TOKENS * DEFAULT_SCALE} if args.policy == "prfaas" else {}
    d = Deployment(name=args.policy, n_prfaas=n_prfaas, n_pd_prefill=n_p, n_decode=n_d,
                   policy=args.policy, policy_options=options, seed=args.seed)
    arrivals = lognormal(args.rate, args.duration, d.scale, args.seed)
    result, wall = run_virtual(d, arrivals,
                               progress=lambda now: progress("run", now, args.duration))
    done = [r for r in result.records if r.ok]
    mean, p90 = scenarios.ttft(done)
    report.write_records(args.out, {args.policy: result})
    report.plot_ttft_cdf(args.out, {args.policy: result.records})
    report.plot_time_series(args.out, {args.policy: result})
    return {"scenario": "run", "policy": args.policy, "instances": args.instances,
            "rate_rps": args.rate, "requests": len(done), "unfinished": result.unfinished,
            "ttft_mean_s": mean, "ttft_p90_s": p90,
            "offload_share": scenarios.offload_share(done),
            "egress_mean_gbps": scenarios.egress_gbps(result)[0],
            "virtual_s": result.virtual_s, "wall_s": wall}


def _scenario(args: argparse.Namespace, progress: ProgressBar) -> dict[str, Any]:
    began = time.perf_counter()
    quick = args.quick
    if args.seeds < 2:
        raise ConfigError(f"--seeds must be >= 2 (an interval needs two), got {args.seeds}")
    seeds = tuple(range(args.seed, args.seed + (2 if quick else args.seeds)))
    pool = RayPool(os.environ.get("RAY_ADDRESS")) if args.ray and args.scenario in (
        "paper", "bandwidth-bound") else None
    # On Ray the runs report no progress: they run in Ray's processes.
    sweep: dict[str, Any] = {"run_map": pool.map, "progress": None} if pool else {
        "progress": progress}
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "paper": lambda: report.paper_report(args.out, outcome := scenarios.paper(
            window_s=300.0 if quick else 360.0, seeds=seeds, **sweep),
            sum(s.virtual_s for s in outcome.summaries.values()),
            time.perf_counter() - began),
        "bandwidth-bound": lambda: report.bandwidth_report(args.out, scenarios.bandwidth_bound(
            window_s=300.0 if quick else 360.0, seeds=seeds, **sweep),
            time.perf_counter() - began),
        "bandwidth-dip": lambda: report.dip_report(args.out, dip := scenarios.bandwidth_dip(
            before_s=120.0 if quick else 600.0, dip_s=120.0 if quick else 600.0,
            after_s=180.0 if quick else 600.0, seed=args.seed, progress=progress),
            _virtual(dip.runs), time.perf_counter() - began),
        "trace": lambda: report.trace_report(args.out, runs := scenarios.trace_policies(
            limit=800 if quick else None, seed=args.seed, progress=progress),
            _virtual(runs), time.perf_counter() - began),
        "burst": lambda: report.burst_report(args.out, burst := scenarios.burst(
            duration_s=600.0 if quick else 1800.0, seed=args.seed, progress=progress),
            burst.role_changes, burst.virtual_s, time.perf_counter() - began),
    }
    try:
        return runners[args.scenario]()
    finally:
        if pool is not None:
            pool.close()


def _virtual(runs: Any) -> float:
    return float(sum(r.virtual_s for r in runs.values()))


def sim_main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.dashboard:
        from services.cli.sim_dashboard import sim_dashboard_main

        return sim_dashboard_main(["--speed", str(args.speed), "--port", str(args.port),
                                   "--policy", args.policy, "--rate", str(args.rate),
                                   "--seed", str(args.seed)])
    args.out.mkdir(parents=True, exist_ok=True)
    progress = ProgressBar(not args.no_progress)
    try:
        summary = _scenario(args, progress) if args.scenario else _one_run(args, progress)
    except ConfigError as exc:
        print(f"prfaas sim: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    path = report.write_summary(args.out, summary)
    table = args.out / "table.md"
    if table.exists():
        print(table.read_text(encoding="utf-8"))
    print(f"report: {path.parent}/ (summary.json, records.jsonl, table.md, *.png)")
    return 0
