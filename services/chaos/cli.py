"""`prfaas chaos`: the fault scenarios against the real default mesh; writes the report.

    prfaas chaos [--quick] [--only NAME ...] [--out docs/reliability.md]
                 [--max-inflight N] [--workdir DIR]

Starts the default mesh under `prfaas up` on free ports of 127.0.0.1 (services.chaos.harness),
runs each scenario (services.chaos.scenarios) in order, writes the Markdown report
(services.chaos.report) and prints one JSON line: scenarios run, passed, and seconds taken.
Exit status 0 when every scenario passed, 1 when one failed (the report is written either way),
2 when the mesh did not start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import anyio
import httpx
import msgspec

from mesh.http import CLIENT_KEEPALIVE_S
from services.chaos.faults import Faults
from services.chaos.harness import ChaosMeshError, MeshConfig, running_mesh
from services.chaos.load import LOAD_OCCUPANCY, Load, Result, sized_rate
from services.chaos.report import render, verdict
from services.chaos.scenarios import SCENARIOS, Run, ScenarioResult

HEADER = """# Reliability: what the mesh does when things break

Written by `make chaos` (`prfaas chaos`, services/chaos/). The default mesh's processes run
under the supervisor (`prfaas up`) on 127.0.0.1, the default model with one torch thread
per worker, a prefix cache budget of {cache_mib:g} MiB per worker, admission limit
{max_inflight}; each scenario breaks one thing under load.
Every request has a deadline of 30 s: *completed* is a whole answer, *explicit errors* are
HTTP errors or error events, *hung* is no answer by the deadline, *lost* is neither answer
nor error (connection refused or reset, a stream cut without an error). *Time to recover*
runs from the kill (or from the end of the fault) until the service is up again, the router
lists it up, and a probe request completes. RSS is read from /proc for each service.

Acceptance: 0 hung and 0 lost; in every fault scenario (kill-*, freeze-*, cachedir-restart,
link-down, link-trickle, partition) 0 explicit errors: the router migrates a request whose
worker or KV stream breaks, or whose worker hangs (docs/architecture.md, request migration);
no deaths beyond the ones the scenario causes; every killed service back and serving within
10 s, every frozen one within 10 s of its SIGCONT; RSS after each scenario within
20% of its start (after a warm-up load); at 10x the admission limit every request answered
(200 or 429) within 5 s of its admission decision.
Run: {when}, {mode}, {host}, {seconds:.0f} s in all.
"""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter faults, 1,000 frames and 200 bodies")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), default=[])
    parser.add_argument("--out", type=Path, default=Path("docs/reliability.md"))
    # What the default mesh's workers hold on two cores while answering in seconds.
    parser.add_argument("--max-inflight", type=int, default=4)
    # Small enough to fill during a scenario's warm-up (services/chaos/harness.py MeshConfig).
    parser.add_argument("--cache-mib", type=float, default=32.0,
                        help="each worker's prefix cache budget in MiB (default 32)")
    parser.add_argument("--workdir", type=Path, help="mesh log and files (default: temporary)")
    return parser.parse_args(argv)


WARM_UP_S = 20.0


async def warm_up(run: Run, seconds: float, seed: int) -> list[Result]:
    """Load the mesh so that RSS compares a warm service with itself: prefix caches fill to
    their budget and the allocators reach their working size. Half the time every prompt is
    prefilled in the PD cluster (t pinned past every length), half in the PrfaaS cluster
    (t = 0), so each prefill worker has seen long prompts before a scenario sends them its
    way (a killed PrfaaS worker or a cut link moves the long ones to PD prefill)."""
    results: list[Result] = []
    for t in (1e12, 0.0):
        await run.faults.pin_threshold(t)
        load = Load(run.client, run.load_config, seed=seed)
        await load.run(seconds / 2)
        results += load.results
    await run.faults.pin_threshold(None)
    return results


async def run_scenarios(run: Run, names: list[str]) -> list[ScenarioResult]:
    print("chaos: warming up ...", file=sys.stderr, flush=True)
    warm = await warm_up(run, 5.0 if run.quick else WARM_UP_S, seed=1)
    # The background load is sized to this host's speed, measured by the warm-up: a fixed
    # rate that one machine serves is overload on a slower one, and a fault scenario would
    # then count admission refusals, not what the fault did.
    rate = sized_rate(warm, run.max_inflight, ceiling=run.load_config.rate)
    run.load_config = msgspec.structs.replace(run.load_config, rate=rate)
    print(f"chaos: background load {rate:.2f} req/s (warm-up latency sized to "
          f"{LOAD_OCCUPANCY:.0%} of the admission limit {run.max_inflight})",
          file=sys.stderr, flush=True)
    results = []
    for name in names:
        # Each scenario is judged against the RSS its services had when it began, warm (a
        # service killed by the last one comes back cold): a leak grows across a scenario; a
        # cache warming up does not.
        await warm_up(run, 2.0 if run.quick else 12.0, seed=2)
        run.rss_start = await run.rss()
        print(f"chaos: {name} ...", file=sys.stderr, flush=True)
        result = await SCENARIOS[name](run)
        failures = verdict(result).failures
        print(f"chaos: {name}: {result.outcomes} recover {result.recover_s} "
              f"{'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}",
              file=sys.stderr, flush=True)
        results.append(result)
    return results


async def _main(args: argparse.Namespace, workdir: Path, config: MeshConfig
                ) -> list[ScenarioResult]:
    with running_mesh(workdir, config) as mesh:
        assert mesh.urls is not None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32,
                              keepalive_expiry=CLIENT_KEEPALIVE_S)
        async with httpx.AsyncClient(base_url=mesh.urls.api, timeout=httpx.Timeout(None),
                                     limits=limits) as client:
            faults = Faults(client, mesh.urls.supervisor, mesh.urls.link_control,
                            mesh.headers(), mesh.urls.api)
            run = Run(mesh, client, faults, args.quick, config.max_inflight)
            return await run_scenarios(run, args.only or list(SCENARIOS))


def chaos_main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    config = MeshConfig(max_inflight=args.max_inflight, cache_mib=args.cache_mib)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="prfaas-chaos-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            results = anyio.run(_main, args, workdir, config, backend="asyncio")
        except ChaosMeshError as exc:
            print(f"prfaas chaos: {exc}", file=sys.stderr)
            return 2
    seconds = time.monotonic() - started
    header = HEADER.format(max_inflight=args.max_inflight, cache_mib=args.cache_mib,
                           when=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                           mode="--quick" if args.quick else "full", seconds=seconds,
                           host=f"{platform.machine()}, {_cpus()} CPUs, 1-minute load "
                                f"average {load_before:.1f} at the start and "
                                f"{os.getloadavg()[0]:.1f} at the end")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, header))
    passed = sum(verdict(r).passed for r in results)
    print(json.dumps({"scenarios": len(results), "passed": passed,
                      "seconds": round(seconds, 1), "report": str(args.out)}))
    return exit_status(results)


def exit_status(results: list[ScenarioResult]) -> int:
    """0 when every scenario passed, else 1."""
    return 0 if all(verdict(r).passed for r in results) else 1


def _cpus() -> int:
    return len(os.sched_getaffinity(0))
