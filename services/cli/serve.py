"""`prfaas serve NAME`: run one named service of the topology in this process.

    prfaas serve pd-decode-0 [--topology FILE] [--backend uvloop|asyncio|trio]
                             [--mode live|emulated] [--time-scale X]

The topology (services/cli/topology.toml unless a file is given) says what NAME is: its kind picks
the runner (an entry point of group `prfaas.runners`, loaded lazily), its options configure it
(service options override
its cluster's). Every runner gets a `ServiceContext`: the topology, its own spec, the mode, and
the means to build mesh nodes that find their peers - directly inside a cluster, through the
link's proxy port across clusters (`resolve_from`), and the mesh's secret
(services.contract.access.service_secret): a service that would listen beyond loopback
without one refuses to start. Once listening, a service prints one line
`ready NAME HOST:PORT` on stdout, which launchers (services.cli.launch: tests, benchmarks) wait for.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Coroutine
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, cast

import anyio
import anyio.abc

from mesh.errors import ConfigError, MeshError
from mesh.membership import require_secret_beyond_loopback
from mesh.run import BACKENDS, Backend, run
from mesh.topology import Topology, load_topology
from mesh.transport import Address
from services.cli.lifeline import die_with_parent
from services.contract.access import service_secret
from services.service import ServiceContext

log = logging.getLogger(__name__)

DEFAULT_TOPOLOGY_PATH = Path(__file__).parent / "topology.toml"
# Each service kind's runner, registered as an entry point (pyproject.toml), so that the CLI
# finds the dashboard (ui/) without services importing it.
RUNNER_GROUP = "prfaas.runners"
# `prfaas up --topology FILE` hands its file to every child through this variable.
TOPOLOGY_ENV = "PRFAAS_TOPOLOGY"


class Runner(Protocol):
    def __call__(
        self, ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address]
    ) -> Coroutine[Any, Any, None]: ...


def default_topology() -> Topology:
    return load_topology(None, DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8"))


def runner_for(kind: str) -> Runner:
    found = {ep.name: ep for ep in entry_points(group=RUNNER_GROUP)}
    if kind not in found:
        raise ConfigError(f"service kind must be one of {sorted(found)}, got {kind!r}")
    try:
        return cast(Runner, found[kind].load())
    except ImportError as exc:
        raise ConfigError(f"service kind {kind!r} needs {found[kind].value}, which is not "
                          f"available: {exc}") from exc


async def run_service(
    ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Runs the context's service until cancelled; reports its listening address."""
    runner = runner_for(ctx.spec.kind)
    await runner(ctx, task_status=task_status)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas serve", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the service's name in the topology")
    parser.add_argument("--topology", type=Path, help="topology TOML (default: embedded)")
    parser.add_argument("--backend", default="uvloop", choices=BACKENDS)
    parser.add_argument("--mode", default="live", choices=["live", "emulated"])
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="emulated mode: wall seconds per modeled second")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def _announce(line: str) -> None:
    print(line, flush=True)


def serve_main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: the router's link probe alone would fill the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        text = DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8")
        topology = load_topology(args.topology or os.environ.get(TOPOLOGY_ENV) or None, text)
        ctx = ServiceContext(topology, topology.service(args.name), args.mode, args.time_scale,
                             announce=_announce, secret=service_secret(topology))
        require_secret_beyond_loopback(ctx.spec.bind_host, ctx.secret)
        run_ = runner_for(ctx.spec.kind)
    except MeshError as exc:
        print(f"prfaas serve: {exc}", file=sys.stderr)
        return 2
    backend = cast(Backend, args.backend)
    try:
        run(_forever, run_, ctx, backend=backend)
    except KeyboardInterrupt:
        log.info("interrupted")
    return 0


async def _forever(runner: Runner, ctx: ServiceContext) -> None:
    async with anyio.create_task_group() as tg:
        address = await tg.start(lambda task_status: runner(ctx, task_status=task_status))
        ctx.ready(address)
