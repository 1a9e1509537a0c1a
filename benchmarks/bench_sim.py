"""bench-sim: one virtual hour of the paper's PrfaaS-PD deployment (4/3/5, t from the
planner, 100 Gbps) at 3.0 req/s, on trio's virtual clock; how much faster than real time.

The simulation is the live services composed in one process (services/sim), so this measures
the cost of the real router, workers, cache directory and link per simulated request. It
runs the same seed twice when `--check-determinism` is given and reports whether the two
summaries are equal byte for byte. The last line printed is one JSON object; it names the
CPU it ran on (`cpu`, `cpus`) and the run's CPU time beside its wall time (`cpu_s`: on a busy
host the wall time also counts other processes' turns), with the 1-minute load average
when the run began.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import msgspec

from services.bench.host import cpu_name, load_average
from services.paper.case_study import PRFAAS_PD
from services.paper.planner import Scenario, solve_scenario
from services.sim.run import SimResult, run_virtual
from services.sim.scenarios import egress_gbps, offload_share, paper_deployments, ttft
from services.sim.workload import lognormal


def summary(result: SimResult) -> bytes:
    """What a run says, as bytes: equal bytes for equal runs."""
    done = [r for r in result.records if r.ok]
    mean, p90 = ttft(done)
    return msgspec.json.encode({
        "requests": len(done), "unfinished": result.unfinished,
        "ttft_mean_s": round(mean, 6), "ttft_p90_s": round(p90, 6),
        "offload_share": round(offload_share(done), 6), "link_bytes": result.link_bytes,
        "egress_mean_gbps": round(egress_gbps(result)[0], 6),
        "tpot_mean_s": round(statistics.fmean(r.tpot_s for r in done), 9),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=3600.0, help="virtual seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-determinism", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    deployment = paper_deployments(solve_scenario(Scenario()))[PRFAAS_PD]
    arrivals = lognormal(args.rate, args.duration, deployment.scale, args.seed)
    load = load_average()
    began = time.process_time()
    result, wall = run_virtual(deployment, arrivals)
    cpu = time.process_time() - began
    first = summary(result)
    print(f"{len(arrivals)} arrivals over {args.duration:.0f} virtual s at {args.rate} req/s "
          f"(paper PrfaaS-PD 4/3/5): {result.virtual_s:.0f} virtual s in {wall:.1f} s wall")
    print(first.decode())
    figures: dict[str, object] = {
        "bench": "sim", "virtual_s": round(result.virtual_s, 1), "wall_s": round(wall, 2),
        "speedup": round(result.virtual_s / wall, 1), "requests": len(result.records),
        "events_per_s": round(result.events / wall, 1), "cpu_s": round(cpu, 2),
        "cpu": cpu_name(), "cpus": os.cpu_count(), "load_avg": round(load, 2),
    }
    if args.check_determinism:
        again, _ = run_virtual(deployment, arrivals)
        figures["deterministic"] = summary(again) == first
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
