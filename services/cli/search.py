"""`prfaas search`: the best PrfaaS deployment per dollar, each configuration measured by the
simulation's capacity search, the simulations as Ray tasks (services/sim/search/).

    prfaas search --config services/sim/searches/paper-equal-cost.toml --out search-paper
    prfaas search --config FILE --out DIR --address ray://HOST:10001   on a Ray cluster
    prfaas search --config FILE --out DIR --against-serial             also time it serially

A local Ray instance on every core by default; `--address` (or RAY_ADDRESS) sends the same
search to a cluster. Started again over the same DIR, a search skips the configurations it
already holds. Writes DIR/summary.json, DIR/table.md and DIR/*.png. `--against-serial` runs the
search twice from scratch, in this process (into DIR/serial) and then on Ray, and records both
wall times, the machine's load and whether the two found the same.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no stubs

from mesh.errors import ConfigError
from services.bench.host import cpu_name
from services.sim.search.explorer import Pool, Summary, run_search
from services.sim.search.pool import RayPool, SerialPool
from services.sim.search.report import write_report
from services.sim.search.space import SearchSpace, load_space


class SearchBar:
    """Configurations done out of all, with how many are running and left."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self._bar: Any = tqdm(total=total, desc=desc, unit="config", file=sys.stderr) \
            if enabled else None

    def __call__(self, done: int, running: int, left: int) -> None:
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            self._bar.set_postfix(running=running, left=left)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas search", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[3:6]))
    parser.add_argument("--config", type=Path, required=True, help="the search space (TOML)")
    parser.add_argument("--out", type=Path, required=True, help="results folder (resumable)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="a Ray cluster (ray://HOST:PORT; default RAY_ADDRESS, else a "
                             "local instance)")
    parser.add_argument("--cpus", type=int, default=None,
                        help="local Ray instance: CPUs to use (default: all)")
    parser.add_argument("--serial", action="store_true", help="no Ray: run in this process")
    parser.add_argument("--against-serial", action="store_true",
                        help="time the search serially and on Ray, both from scratch")
    parser.add_argument("--quick", action="store_true",
                        help="half-length runs, two seeds: a smoke check")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def _search(space: SearchSpace, out: Path, pool: Pool, progress: bool, desc: str) -> Summary:
    from services.sim.search.space import configurations

    bar = SearchBar(len(configurations(space)), progress, desc)
    try:
        return run_search(space, out, pool, bar)
    finally:
        bar.close()


def _open(args: argparse.Namespace) -> RayPool | SerialPool:
    return SerialPool() if args.serial else RayPool(args.address, args.cpus)


def _against_serial(space: SearchSpace, args: argparse.Namespace) -> Summary:
    """The same search serially then on Ray, both from empty folders (module docstring)."""
    serial_dir = args.out / "serial"
    for folder in (serial_dir, args.out / "configurations"):
        shutil.rmtree(folder, ignore_errors=True)
    load = [os.getloadavg()[0]]
    with SerialPool() as serial_pool:
        serial = _search(space, serial_dir, serial_pool, not args.no_progress, "serial")
    load.append(os.getloadavg()[0])
    with RayPool(args.address, args.cpus) as pool:
        ray = _search(space, args.out, pool, not args.no_progress, f"ray x{pool.cpus}")
    load.append(os.getloadavg()[0])
    same = _found(serial) == _found(ray)
    timing = {"serial_wall_s": serial.wall_s, "ray_wall_s": ray.wall_s,
              "ratio": ray.wall_s / serial.wall_s, "ray_cpus": ray.ray["cpus"],
              "same_results": same, "cpu": cpu_name(), "logical_cpus": os.cpu_count(),
              "load_1min_before_during_after": load}
    return msgspec.structs.replace(ray, against_serial=timing)


def _found(summary: Summary) -> Any:
    return msgspec.to_builtins(msgspec.structs.replace(summary, wall_s=0.0, ray={},
                                                       computed=0))


def search_main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    began = time.perf_counter()
    try:
        space = load_space(args.config)
        space = space.quick() if args.quick else space
        args.out.mkdir(parents=True, exist_ok=True)
        if args.against_serial:
            summary = _against_serial(space, args)
        else:
            with _open(args) as pool:
                summary = _search(space, args.out, pool, not args.no_progress, space.name)
    except ConfigError as exc:
        print(f"prfaas search: {exc}", file=sys.stderr)
        return 2
    (args.out / "summary.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    write_report(args.out, summary)
    print((args.out / "table.md").read_text(encoding="utf-8"))
    print(f"report: {args.out}/ (summary.json, table.md, *.png) in "
          f"{time.perf_counter() - began:.0f} s")
    return 0
