"""`prfaas sim-dashboard`: the dashboard on the simulation, or a recording of it.

    prfaas sim-dashboard [--speed 10] [--port 8080] [--rate 1] [--policy prfaas]
    prfaas sim-dashboard --record ui/replays/sample.jsonl --seconds 120
    prfaas sim-dashboard --compare prfaas-pd,homogeneous[,naive] [--rate 2.5] [--speed 60]

The simulated deployment (services/sim/world.py: the live router, workers, cache directory
and netem link over an in-memory network) runs in this process on a `PacedClock`: virtual time
passes at `--speed` times the wall clock (the page's speed control changes it live) and never
runs ahead of the simulation's work. The dashboard is served from the same trio loop, fed by
every service's event bus (`LiveSim`); its controls act on the world (`SimControls`).
Services never import ui: the dashboard's server is found through the entry point
`prfaas.dashboard:serve` and handed the simulation's event source and controls, which have
the shapes of ui's `EventSource` and `ControlClient`.

`--compare` runs two or three deployments of the paper scenario (services/sim/compare.py) on
one clock and one load, each arrival to all of them, and serves the compare page: a column per
deployment, charts with a line each, the ratio of their completed rates.

`--record FILE` runs the same world on an autojumping clock instead and writes its events as
a JSON-lines log (the format of ui/replays/).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import trio

from mesh.errors import ConfigError, MeshError
from mesh.run import fewer_collections
from services.contract.events import write_event_log
from services.paper.case_study import T_STAR_TOKENS
from services.router.policies import POLICIES
from services.sim.clock import PacedClock
from services.sim.compare import (
    COMPARABLE,
    COMPARE_DEFAULT_RATE,
    CompareSim,
    compare_deployments,
)
from services.sim.controls import CompareControls, SimControls
from services.sim.live import LOAD_KINDS, LiveConfig, LiveSim
from services.sim.record import record_virtual
from services.sim.run import LinkChange
from services.sim.workload import Arrival
from services.sim.world import DEFAULT_SCALE, Deployment

log = logging.getLogger(__name__)

DASHBOARD_GROUP = "prfaas.dashboard"
# The page's and the CLI's default load: the paper deployment at 1/8 scale holds it (near 1 req/s
# decode KV waits time out).
SIM_DEFAULT_RATE = 0.5
DashboardServer = Callable[..., Awaitable[None]]


def dashboard_server() -> DashboardServer:
    """ui's `serve_dashboard`, through its entry point (services never import ui)."""
    found = entry_points(group=DASHBOARD_GROUP, name="serve")
    if not found:
        raise ConfigError(f"no dashboard: entry point {DASHBOARD_GROUP}:serve is not "
                          f"installed (reinstall the package: pip install -e .)")
    try:
        return cast(DashboardServer, next(iter(found)).load())
    except ImportError as exc:
        raise ConfigError(f"the dashboard (ui/) cannot be loaded: {exc}") from exc


def dashboard_options(deployment: Deployment) -> dict[str, Any]:
    """The page's configuration: it says "simulated", and offers the registered policies."""
    return {"title": f"PrfaaS simulation ({deployment.name})", "live_mode": "simulated",
            "prfaas_clusters": ["prfaas"], "policies": list(POLICIES),
            "token_scale": deployment.scale, "default_rate": SIM_DEFAULT_RATE}


async def serve_sim_dashboard(sim: LiveSim, host: str, port: int, *,
                              server: DashboardServer | None = None,
                              replay_dirs: Sequence[Path] = (),
                              task_status: anyio.abc.TaskStatus[tuple[str, int]] = (
                                  anyio.TASK_STATUS_IGNORED)) -> None:
    """Serves the dashboard on `sim` (which the dashboard runs) until cancelled."""
    clock = sim.clock

    async def wall_sleep(seconds: float) -> None:
        # Replays wait wall seconds; this loop's clock is virtual, `rate` times faster.
        await anyio.sleep(seconds * (clock.rate if clock is not None else 1.0))

    serve = server or dashboard_server()
    await serve(host, port, sim, SimControls(sim), options=dashboard_options(sim.deployment),
                replay_dirs=tuple(replay_dirs), replay_sleep=wall_sleep, task_status=task_status)


def compare_options(sim: CompareSim, rate: float) -> dict[str, Any]:
    """The compare page's configuration: the deployments' names in its title."""
    titles = " vs ".join(str(column["title"]) for column in sim.describe())
    return {"title": f"PrfaaS simulation: {titles}", "live_mode": "simulated",
            "prfaas_clusters": ["prfaas"], "default_rate": rate or COMPARE_DEFAULT_RATE}


async def serve_compare_dashboard(sim: CompareSim, host: str, port: int, *,
                                  server: DashboardServer | None = None,
                                  task_status: anyio.abc.TaskStatus[tuple[str, int]] = (
                                      anyio.TASK_STATUS_IGNORED)) -> None:
    """Serves the compare page on `sim` (which the page runs) until cancelled."""
    serve = server or dashboard_server()
    await serve(host, port, sim, CompareControls(sim),
                options=compare_options(sim, sim.config.rate), task_status=task_status)


def run_sim_dashboard(sim: LiveSim | CompareSim, host: str, port: int, *,
                      replay_dirs: Sequence[Path] = ()) -> None:
    """Runs the dashboard (the compare page for a `CompareSim`) on `sim` under trio on the
    sim's clock until SIGINT or SIGTERM."""
    server = dashboard_server()
    serving = (partial(serve_compare_dashboard, sim, host, port, server=server)
               if isinstance(sim, CompareSim) else
               partial(serve_sim_dashboard, sim, host, port, server=server,
                       replay_dirs=replay_dirs))

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            bound = await tasks.start(serving)
            print(f"dashboard: http://{bound[0]}:{bound[1]}/", flush=True)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tasks.cancel_scope.cancel()
                    break

    with fewer_collections():
        trio.run(main, clock=sim.clock)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prfaas sim-dashboard",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=10.0,
                        help="virtual seconds per wall second (the page changes it live)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--policy", default="prfaas", choices=list(POLICIES))
    parser.add_argument("--bandwidth-gbps", type=float, default=100.0,
                        help="the PrfaaS -> PD link")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests per second of the load at the start (0: none; default "
                        f"{SIM_DEFAULT_RATE:g}, with --compare {COMPARE_DEFAULT_RATE:g})")
    parser.add_argument("--kind", default="mixed", choices=LOAD_KINDS)
    parser.add_argument("--output-len", type=int, default=1024, help="served tokens per answer")
    parser.add_argument("--tick", type=float, default=1.0,
                        help="virtual seconds between control ticks and worker samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay-dir", type=Path, action="append", default=[])
    parser.add_argument("--record", type=Path, metavar="FILE",
                        help="no dashboard: write the events of --seconds to FILE (JSON lines)")
    parser.add_argument("--seconds", type=float, default=120.0, help="of virtual time, --record")
    parser.add_argument("--compare", metavar="NAMES",
                        help="the page compares deployments of the paper scenario on the same "
                        f"arrivals: two or three of {','.join(COMPARABLE)} (--rate defaults "
                        f"to {COMPARE_DEFAULT_RATE:g}; --policy and --bandwidth-gbps do not "
                        "apply)")
    return parser


def scaled_options(policy: str, scale: float) -> dict[str, Any]:
    """The prfaas policy's t is in the router's tokens: the paper's case-study optimum
    (t*, in paper tokens) at the simulation's scale."""
    return {"threshold": T_STAR_TOKENS * scale} if policy == "prfaas" else {}


def compare_sim(args: argparse.Namespace, clock: PacedClock | None = None) -> CompareSim:
    """`--compare a,b[,c]`: the named deployments of the paper scenario on one load."""
    names = [name.strip() for name in args.compare.split(",")]
    deployments = compare_deployments(names, tick_s=args.tick, seed=args.seed)
    rate = COMPARE_DEFAULT_RATE if args.rate is None else args.rate
    config = LiveConfig(rate=rate, kind=args.kind, output_len=args.output_len, seed=args.seed)
    return CompareSim(deployments, config=config, clock=clock)


def live_sim(args: argparse.Namespace, *, arrivals: Sequence[Arrival] = (),
             changes: Sequence[LinkChange] = (), clock: PacedClock | None = None) -> LiveSim:
    options = scaled_options(args.policy, DEFAULT_SCALE)
    deployment = Deployment(policy=args.policy, bandwidth_bps=args.bandwidth_gbps * 1e9,
                            tick_s=args.tick, seed=args.seed, policy_options=options)
    rate = SIM_DEFAULT_RATE if args.rate is None else args.rate
    config = LiveConfig(rate=rate, kind=args.kind, output_len=args.output_len,
                        seed=args.seed)
    return LiveSim(deployment, arrivals=arrivals, changes=changes, config=config, clock=clock)


def sim_dashboard_main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        if args.compare is not None:
            if args.record is not None:
                raise ConfigError("--record and --compare: a recording holds one deployment")
            run_sim_dashboard(compare_sim(args, PacedClock(args.speed)), args.host, args.port)
            return 0
        if args.record is not None:
            sim = live_sim(args)
            events = record_virtual(sim.deployment, args.seconds, config=sim.config)
            count = write_event_log(args.record, events)
            print(f"{count} events, {args.record.stat().st_size} bytes -> {args.record}")
            return 0
        run_sim_dashboard(live_sim(args, clock=PacedClock(args.speed)), args.host, args.port,
                          replay_dirs=args.replay_dir)
    except MeshError as exc:
        print(f"prfaas sim-dashboard: {exc}", file=sys.stderr)
        return 2
    return 0
