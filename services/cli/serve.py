"""`prfaas serve NAME`: run one named service of the topology in this process.

    prfaas serve pd-decode-0 [--topology FILE] [--backend uvloop|asyncio|trio]
                             [--mode live|emulated] [--time-scale X]
    prfaas serve ui --simulated    the dashboard alone, fed by a synthetic mesh (offline demo)

The topology (services/topology.toml unless a file is given) says what NAME is: its kind picks
the runner (`RUNNERS`, imported lazily), its options configure it (service options override
its cluster's). Every runner gets a `ServiceContext`: the topology, its own spec, the mode, and
the means to build mesh nodes that find their peers - directly inside a cluster, through the
link's proxy port across clusters (`resolve_from`). Once listening, a service prints one line
`ready NAME HOST:PORT` on stdout, which launchers (services.launch: tests, benchmarks) wait for.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast

import anyio
import anyio.abc
import hypercorn.asyncio
import hypercorn.trio
import msgspec
import sniffio
from hypercorn.config import Config as HypercornConfig
from prometheus_client import CollectorRegistry

from mesh.errors import ConfigError, MeshError
from mesh.events import EventBus
from mesh.metrics import metrics_app, register_statistics
from mesh.node import Node, NodeConfig
from mesh.run import BACKENDS, Backend, run
from mesh.server import Context
from mesh.topology import LinkSpec, ServiceSpec, Topology, load_topology
from mesh.transport import Address, TcpTransport, Transport
from mesh.wire import Codec
from services.messages import CODEC_MESSAGES, Subscribe
from services.telemetry import Event

log = logging.getLogger(__name__)

DEFAULT_TOPOLOGY_PATH = Path(__file__).parent / "topology.toml"
Mode = Literal["live", "emulated"]
WORKER_KINDS = frozenset({"prefill", "decode"})
T = TypeVar("T")
StatisticsSource = Callable[[], msgspec.Struct]

# kind -> (module, coroutine function taking (ServiceContext, task_status)).
RUNNERS: dict[str, tuple[str, str]] = {
    "echo": ("services.echo", "run_echo"),
    "cachedir": ("services.cachedir_service", "run_cachedir"),
    "link": ("services.link_service", "run_link"),
    "prefill": ("services.worker", "run_worker"),
    "decode": ("services.worker", "run_worker"),
    "router": ("services.router", "run_router"),
    "ui": ("services.ui_feed", "run_ui"),
}


class Runner(Protocol):
    def __call__(
        self, ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address]
    ) -> Coroutine[Any, Any, None]: ...


def default_topology() -> Topology:
    return load_topology(None, DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8"))


def link_service_of(topology: Topology, link: LinkSpec) -> ServiceSpec:
    """The `link` service emulating `link`: named like it, or naming it in options.link."""
    for spec in topology.find(kind="link"):
        if link.name in (spec.name, spec.options.get("link")):
            return spec
    raise ConfigError(f"link {link.name!r} has no service of kind 'link' (name it "
                      f"{link.name!r} or set options.link)")


class LinkRoute(msgspec.Struct, frozen=True):
    """One proxy route of a link: `service` is reached at `listen`, forwarded to `upstream`."""

    service: str
    listen: Address
    upstream: Address


def link_routes(topology: Topology, link: LinkSpec) -> list[LinkRoute]:
    """The routes of `link`: one per worker of cluster b (the receiving, PD side), in file
    order, at the link service's options.proxy_base_port + i. Senders in cluster a use them."""
    proxy = link_service_of(topology, link)
    base = int(proxy.options.get("proxy_base_port", 0))
    if base < 1:
        raise ConfigError(f"link service {proxy.name!r}: options.proxy_base_port must be a "
                          f"port, got {proxy.options.get('proxy_base_port')!r}")
    workers = [s for s in topology.find(cluster=link.b) if s.kind in WORKER_KINDS]
    return [LinkRoute(s.name, Address(proxy.host, base + i), s.address)
            for i, s in enumerate(workers)]


def resolve_from(topology: Topology, cluster: str) -> Callable[[str], Address]:
    """The resolver of a node in `cluster`: peers in a cluster it has a link to (as side a)
    through that link's proxy, everyone else directly. A `#suffix` names a lane (another
    connection to the same peer)."""
    via: dict[str, Address] = {}
    for link in topology.links:
        if link.a == cluster:
            via.update((r.service, r.listen) for r in link_routes(topology, link))

    def resolve(peer: str) -> Address:
        name = peer.split("#", 1)[0]
        return via.get(name) or topology.address(name)

    return resolve


def link_of_peer(topology: Topology, cluster: str) -> Callable[[str], str | None]:
    """The link name a peer is reached through from `cluster`, None when direct."""
    names: dict[str, str] = {}
    for link in topology.links:
        if link.a == cluster:
            names.update((r.service, link.name) for r in link_routes(topology, link))
    return lambda peer: names.get(peer.split("#", 1)[0])


@dataclass(frozen=True)
class ServiceContext:
    """Everything a runner needs to start one service; built once at the edge."""

    topology: Topology
    spec: ServiceSpec
    mode: Mode = "live"
    time_scale: float = 1.0
    transport: Transport = field(default_factory=TcpTransport)
    resolve: Callable[[str], Address] | None = None
    announce: Callable[[str], None] = lambda line: None
    # In-process meshes (tests, simulation) get each service's main object through this.
    expose: Callable[[str, object], None] = lambda name, service: None
    codec: Codec = field(default_factory=lambda: Codec(CODEC_MESSAGES))

    @property
    def name(self) -> str:
        return self.spec.name

    def option(self, key: str, default: T) -> T:
        """Service option `key`, else its cluster's, else `default` (type-checked against it)."""
        options = dict(self.topology.cluster(self.spec.cluster).options) if self.spec.cluster \
            else {}
        options.update(self.spec.options)
        value = options.get(key, default)
        if type(default) is float and type(value) is int:
            value = float(value)
        if type(value) is not type(default):
            raise ConfigError(f"service {self.name!r}: option {key}={value!r} must be a "
                              f"{type(default).__name__}")
        return value

    def node(self, name: str | None = None, config: NodeConfig | None = None) -> Node:
        resolve = self.resolve or resolve_from(self.topology, self.spec.cluster)
        return Node(name or self.name, self.codec, self.transport, resolve, config)

    def ready(self, address: Address) -> None:
        self.announce(f"ready {self.name} {address}")


def serve_events(node: Node, bus: EventBus[Event]) -> None:
    """Any subscriber (the dashboard) reads this service's events from the moment it asks."""

    @node.serves_stream(Subscribe)
    async def on_subscribe(msg: Subscribe, ctx: Context) -> Any:
        with bus.subscribe(msg.maxlen) as events:
            async for event in events:
                yield event


async def serve_metrics(ctx: ServiceContext, sources: dict[str, StatisticsSource]) -> None:
    """`/metrics` of the service's statistics on options.metrics_port (0: none), until
    cancelled; each source's numbers under prfaas_<prefix>_..., labelled with the service."""
    port = ctx.option("metrics_port", 0)
    if port == 0:
        return
    registry = CollectorRegistry(auto_describe=False)
    for prefix, source in sources.items():
        register_statistics(registry, f"prfaas_{prefix}", source, {"service": ctx.name})
    config = HypercornConfig()
    config.bind = [f"{ctx.spec.host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    serve = hypercorn.trio.serve if sniffio.current_async_library() == "trio" else (
        hypercorn.asyncio.serve)
    stop = anyio.Event()

    async def run_http() -> None:
        # Shielded, so that cancellation still lets hypercorn shut down cleanly (stop below).
        with anyio.CancelScope(shield=True):
            await serve(metrics_app(registry), config, shutdown_trigger=stop.wait)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_http)
        try:
            await anyio.sleep_forever()
        finally:
            stop.set()


def runner_for(kind: str) -> Runner:
    if kind not in RUNNERS:
        raise ConfigError(f"service kind must be one of {sorted(RUNNERS)}, got {kind!r}")
    module_name, function = RUNNERS[kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"service kind {kind!r} needs {module_name}, which is not "
                          f"available: {exc}") from exc
    return cast(Runner, getattr(module, function))


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
    parser.add_argument("--simulated", action="store_true",
                        help="ui only: an offline demo fed by a synthetic mesh, not the real one")
    return parser.parse_args(argv)


def _announce(line: str) -> None:
    print(line, flush=True)


def serve_main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: the router's link probe alone would fill the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        text = DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8")
        topology = load_topology(args.topology, text)
        ctx = ServiceContext(topology, topology.service(args.name), args.mode, args.time_scale,
                             announce=_announce)
        run_ = runner_for(ctx.spec.kind)
        if args.simulated and ctx.spec.kind != "ui":
            raise ConfigError(f"--simulated is for the dashboard (kind 'ui'), not {args.name!r} "
                              f"of kind {ctx.spec.kind!r}")
    except MeshError as exc:
        print(f"prfaas serve: {exc}", file=sys.stderr)
        return 2
    if args.simulated:
        return _simulated_ui(ctx)
    backend = cast(Backend, args.backend)
    try:
        run(_forever, run_, ctx, backend=backend)
    except KeyboardInterrupt:
        log.info("interrupted")
    return 0


def _simulated_ui(ctx: ServiceContext) -> int:
    """`prfaas serve ui --simulated`: the dashboard at the ui service's address, fed by the
    synthetic mesh (ui.demo); its page says `simulated` where the live one says `live`."""
    from ui.serve import ui_main

    host, port = ctx.option("http_host", ctx.spec.host), ctx.option("http_port", 8080)
    return ui_main(["--simulated", "--host", host, "--port", str(port)])


async def _forever(runner: Runner, ctx: ServiceContext) -> None:
    async with anyio.create_task_group() as tg:
        address = await tg.start(lambda task_status: runner(ctx, task_status=task_status))
        ctx.ready(address)
