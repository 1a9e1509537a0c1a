"""Benchmark: the cache directory's share of bench-sim, replayed in one process.

Runs bench-sim's deployment (paper PrfaaS-PD 4/3/5, 3.0 req/s, seed 0) once and records, in
order, every cache report the workers hand the directory and every prefix lookup the router
makes. Then replays that stream into fresh `CacheDirectory`s, rounds interleaved: this
checkout's and, with `--baseline DIR`, the one in DIR/services/cachedir/ (directory.py, or
service.py in older checkouts; imported beside it, against this checkout's contract), whose
every answer, event and final statistic must equal this one's. Each round runs under the
simulation's collector thresholds (mesh.run.fewer_collections). Ends with one JSON line:
seconds per kind of input, the minimum over rounds, and the baseline's total over this one's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from mesh.run import fewer_collections
from services.cachedir import service
from services.cachedir.service import CacheDirService
from services.contract.messages import BlocksEvicted, BlocksStored, CacheReport, PrefixQuery
from services.contract.types import Role
from services.paper.case_study import PRFAAS_PD
from services.paper.planner import Scenario, solve_scenario
from services.sim.run import run_virtual
from services.sim.scenarios import paper_deployments
from services.sim.workload import lognormal

Input = CacheReport | PrefixQuery
KINDS = ("stored", "evicted", "report", "lookup")
KIND_OF = {BlocksStored: "stored", BlocksEvicted: "evicted", PrefixQuery: "lookup"}


class Recording(msgspec.Struct):
    workers: dict[str, tuple[str, Role]]  # as the directory registered them, in order
    stream: list[Input]


def record(duration: float) -> Recording:
    """One bench-sim run with the directory's two entry points wrapped to note their inputs."""
    recording = Recording({}, [])
    take, lookup = CacheDirService.take, CacheDirService.lookup

    def noted_take(self: CacheDirService, report: CacheReport) -> None:
        recording.workers = recording.workers or dict(self.workers)
        recording.stream.append(report)
        take(self, report)

    def noted_lookup(self: CacheDirService, query: PrefixQuery) -> Any:
        recording.stream.append(query)
        return lookup(self, query)

    deployment = paper_deployments(solve_scenario(Scenario()))[PRFAAS_PD]
    CacheDirService.take, CacheDirService.lookup = noted_take, noted_lookup  # type: ignore[method-assign]
    try:
        run_virtual(deployment, lognormal(3.0, duration, deployment.scale, 0))
    finally:
        CacheDirService.take, CacheDirService.lookup = take, lookup  # type: ignore[method-assign]
    return recording


def load_baseline(checkout: Path) -> ModuleType:
    """The module that defines `CacheDirectory` in `checkout`: directory.py, or service.py
    before the two were split (a split one imports this checkout's prefix tree)."""
    package = checkout / "services" / "cachedir"
    path = package / "directory.py"
    if not path.exists():
        path = package / "service.py"
    spec = importlib.util.spec_from_file_location("baseline_cachedir_service", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline: no module at {path}")
    module = importlib.util.module_from_spec(spec)
    # msgspec resolves the module's annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def replay(module: ModuleType, recording: Recording,
           answers: list[object] | None = None) -> dict[str, float]:
    """Seconds per kind of input; with `answers`, every answer and event appended to it."""
    directory = module.CacheDirectory(clock=lambda: 0.0)
    for name, (cluster, role) in recording.workers.items():
        directory.register_worker(name, cluster, role)
    calls: dict[str, Callable[[Any], object]] = {
        "stored": directory.apply_stored, "evicted": directory.apply_evicted,
        "report": directory.replace_worker,
        "lookup": lambda query: directory.longest_prefix(query.hashes, query.role),
    }
    seconds = dict.fromkeys(KINDS, 0.0)
    with fewer_collections():
        for item in recording.stream:
            kind = KIND_OF.get(type(item), "report")
            call = calls[kind]
            began = time.perf_counter()
            answer = call(item)
            events = directory.drain_events()
            seconds[kind] += time.perf_counter() - began
            if answers is not None:
                answers.append(msgspec.to_builtins((answer, events)))
    if answers is not None:
        directory.check_integrity()
        answers.append(msgspec.to_builtins(directory.statistics()))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=3600.0, help="virtual seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", type=Path, help="a checkout to replay beside this one")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    recording = record(args.duration)
    versions = {"this": service}
    if args.baseline:
        versions["baseline"] = load_baseline(args.baseline)
    answers: dict[str, list[object]] = {name: [] for name in versions}
    for name, module in versions.items():
        replay(module, recording, answers[name])
    if args.baseline and answers["baseline"] != answers["this"]:
        raise SystemExit("the baseline's answers differ from this checkout's")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in versions}
    for _ in range(args.rounds):
        for name, module in versions.items():
            rounds[name].append(replay(module, recording))
    counts = dict.fromkeys(KINDS, 0)
    for item in recording.stream:
        counts[KIND_OF.get(type(item), "report")] += 1
    totals = {name: min(sum(r.values()) for r in seconds) for name, seconds in rounds.items()}
    figures: dict[str, object] = {"bench": "replay-cachedir", "inputs": counts}
    for name, seconds in rounds.items():
        figures[name] = {kind: round(min(r[kind] for r in seconds), 4) for kind in KINDS}
        figures[f"{name}_total_s"] = round(totals[name], 4)
    if args.baseline:
        figures["answers_equal"] = True
        figures["baseline_over_this"] = round(totals["baseline"] / totals["this"], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
