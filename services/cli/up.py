"""`prfaas up`: the whole demo mesh under the supervisor, until Ctrl-C or SIGTERM.

    prfaas up [--procfile Procfile] [--topology FILE] [--control-port 8090]
              [--here NAME[,NAME...]]

Runs every process of the Procfile (services.cli.supervisor: prefixed output, restarts with
backoff, an orderly stop), serves the supervisor's control API on 127.0.0.1 (the dashboard's
kill and restart buttons), and prints one line

    ready: dashboard http://127.0.0.1:8080/ API http://127.0.0.1:8000/v1

once the router's /health answers 200 with status "ready" (or "ok", what a router without
the readiness check answers when every worker is up). Every child gets the run's admin token
in PRFAAS_ADMIN_TOKEN (one is generated unless the environment has one), the mesh's secret
(where the topology's [mesh] section says, else PRFAAS_MESH_SECRET; generated into that
variable when it is unset, so every run is authenticated), the control API's
URL in PRFAAS_SUPERVISOR_URL, and the topology file in PRFAAS_TOPOLOGY (`prfaas serve`
reads it when given no --topology). Ctrl-C or SIGTERM stops every child, last started first,
and exits 0.

`--here` runs only the named processes, so that several machines run one topology file and
Procfile, each its own share. They must then agree on the admin token and the mesh's secret:
neither is generated, both must be given (the environment, or the topology's [mesh]).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import anyio
import httpx
import msgspec
from starlette.applications import Starlette

from mesh.allocator import allocator_env
from mesh.errors import ConfigError, MeshError
from mesh.hosts import allowed_hosts
from mesh.http import serve_http
from mesh.topology import Topology, load_topology
from services.cli.lifeline import die_with_parent
from services.cli.procfile import ProcessSpec, load_procfile
from services.cli.serve import DEFAULT_TOPOLOGY_PATH, TOPOLOGY_ENV
from services.cli.supervisor import RestartPolicy, Supervisor
from services.cli.supervisor_api import SUPERVISOR_URL_ENV, supervisor_app
from services.contract.access import (
    MESH_SECRET_ENV,
    TOKEN_ENV,
    service_secret,
    token_from_env,
)
from services.service import http_dial_host

READY_STATUSES = ("ready", "ok")
# The supervisor's control API listens on loopback only.
CONTROL_HOST = "127.0.0.1"


class Endpoints(msgspec.Struct, frozen=True):
    dashboard: str
    api: str
    health: str


def endpoints(topology: Topology) -> Endpoints:
    """The dashboard's and the router's URLs, from the topology (the defaults otherwise)."""
    router = next(iter(topology.find(kind="router")), None)
    ui = next(iter(topology.find(kind="ui")), None)
    api = "http://127.0.0.1:8000"
    if router is not None:
        api = f"http://{http_dial_host(router)}:{router.options.get('http_port', 8000)}"
    dashboard = "http://127.0.0.1:8080/"
    if ui is not None:
        dashboard = f"http://{http_dial_host(ui)}:{ui.options.get('http_port', 8080)}/"
    return Endpoints(dashboard, f"{api}/v1", f"{api}/health")


async def wait_ready(health_url: str, interval_s: float = 0.5) -> None:
    """Polls the router's /health until it says ready (forever: the caller bounds it)."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            try:
                response = await client.get(health_url)
                status = response.json().get("status") if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                status = None
            if status in READY_STATUSES:
                return
            await anyio.sleep(interval_s)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas up", description=__doc__.splitlines()[0])
    parser.add_argument("--procfile", type=Path, default=Path("Procfile"))
    parser.add_argument("--topology", type=Path, help="topology TOML (default: embedded)")
    parser.add_argument("--control-port", type=int, default=8090,
                        help="the supervisor's control API on 127.0.0.1 (0: any free port)")
    parser.add_argument("--here", metavar="NAME[,NAME...]",
                        help="run only these processes of the Procfile (the rest run elsewhere)")
    parser.add_argument("--initial-backoff", type=float, default=0.5)
    parser.add_argument("--max-backoff", type=float, default=5.0)
    return parser.parse_args(argv)


def up_main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        topology = load_topology(args.topology, DEFAULT_TOPOLOGY_PATH.read_text("utf-8"))
        specs = here_only(load_procfile(args.procfile), args.here)
        policy = RestartPolicy(initial_backoff_s=args.initial_backoff,
                               max_backoff_s=args.max_backoff)
        env = children_env(topology, os.environ, generate=args.here is None)
    except MeshError as exc:
        print(f"prfaas up: {exc}", file=sys.stderr)
        return 2
    if args.topology is not None:
        env[TOPOLOGY_ENV] = str(args.topology.resolve())
    anyio.run(partial(_run, specs, env, policy, args.control_port, endpoints(topology)),
              backend="asyncio", backend_options={"use_uvloop": True})
    return 0


def here_only(specs: tuple[ProcessSpec, ...], here: str | None) -> tuple[ProcessSpec, ...]:
    """The processes named in `here` (comma-separated; None: all), in Procfile order."""
    if here is None:
        return specs
    names = {name.strip() for name in here.split(",") if name.strip()}
    if unknown := names - {spec.name for spec in specs}:
        raise ConfigError(f"--here: no process {sorted(unknown)} in the Procfile; there are "
                          f"{[spec.name for spec in specs]}")
    if not names:
        raise ConfigError("--here: name at least one process")
    return tuple(spec for spec in specs if spec.name in names)


def children_env(topology: Topology, environ: Mapping[str, str], *, generate: bool
                 ) -> dict[str, str]:
    """The children's environment: `environ` with the allocator settings, the run's admin
    token and the mesh's secret, each generated when missing if `generate` (else a missing
    one is a ConfigError: machines sharing a mesh must be given the same)."""
    token, fresh = token_from_env(environ), secret_env(topology, environ)
    if not generate and (token is None or fresh):
        missing = TOKEN_ENV if token is None else next(iter(fresh))
        raise ConfigError(f"--here: set {missing} (every machine of the mesh needs the same)")
    env = allocator_env({**environ, TOKEN_ENV: token or secrets.token_urlsafe(24), **fresh})
    # Resolved once here, so that a bad or missing secret stops the run before any child.
    service_secret(topology, env)
    return env


def secret_env(topology: Topology, environ: Mapping[str, str]) -> dict[str, str]:
    """The variable to add to the children's environment so that they share a fresh mesh
    secret: none when the topology's file or inline secret, or the environment, has one."""
    mesh = topology.mesh
    if mesh.secret_file or mesh.secret:
        return {}
    variable = mesh.secret_env or MESH_SECRET_ENV
    return {} if environ.get(variable) else {variable: secrets.token_urlsafe(32)}


def control_app(supervisor: Supervisor, env: Mapping[str, str]) -> Starlette:
    """The supervisor's control API as `prfaas up` serves it on CONTROL_HOST: the run's admin
    token on every request, and loopback Host names only (a DNS-rebound page gets 403)."""
    return supervisor_app(supervisor, env.get(TOKEN_ENV), allowed_hosts(CONTROL_HOST))


async def _run(specs: tuple[ProcessSpec, ...], env: dict[str, str], policy: RestartPolicy,
               control_port: int, urls: Endpoints) -> None:
    # Children read `env` when they start: the control API's URL is in it by then.
    supervisor = Supervisor(specs, env, policy=policy)
    app = control_app(supervisor, env)
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            host, port = await tg.start(partial(serve_http, app, CONTROL_HOST, control_port,
                                                log_name="supervisor.http"))
            env[SUPERVISOR_URL_ENV] = f"http://{host}:{port}"
            print(f"supervisor: control API on http://{host}:{port}/processes", flush=True)
            tg.start_soon(_announce_ready, urls)
            await tg.start(supervisor.run)
            async for signum in signals:
                print(f"supervisor: {signal.Signals(signum).name}: stopping every process",
                      flush=True)
                await supervisor.stop()
                print("supervisor: every process stopped", flush=True)
                tg.cancel_scope.cancel()
                break


async def _announce_ready(urls: Endpoints) -> None:
    await wait_ready(urls.health)
    print(f"ready: dashboard {urls.dashboard} API {urls.api}", flush=True)
