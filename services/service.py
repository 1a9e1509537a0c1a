"""What every service shares: its context (topology, spec, mode, how to reach peers), its
event feed and its `/metrics` endpoint, with the buckets of every histogram it observes.

A runner (`prfaas serve NAME` picks one per service kind, services/cli/serve.py) gets a
`ServiceContext`: the topology, its own spec, the mode, and the means to build mesh nodes that
find their peers - directly inside a cluster, through the link's proxy port across clusters
(`resolve_from`) - and prove the mesh's secret to them. Every server of a service (its mesh
node, HTTP APIs, /metrics, a link's proxy ports) listens on its spec's `bind_host` and is
dialled at its `host`. Once listening, a service announces `ready NAME HOST:PORT`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

import msgspec
from prometheus_client import CollectorRegistry, Info
from prometheus_client.registry import Collector

from mesh import native
from mesh.errors import ConfigError
from mesh.events import EventBus
from mesh.hosts import WILDCARD_HOSTS
from mesh.http import serve_http
from mesh.metrics import metrics_app, register_process, register_statistics
from mesh.node import Node, NodeConfig
from mesh.server import Context
from mesh.topology import LinkSpec, ServiceSpec, Topology
from mesh.transport import Address, MemoryTransport, TcpTransport, Transport
from mesh.wire import Codec
from services.contract.events import Event
from services.contract.messages import CODEC_MESSAGES, ClockQuery, ClockReading, Subscribe

Mode = Literal["live", "emulated"]
KVPath = Literal["emulator", "direct"]
KV_PATHS: tuple[KVPath, ...] = get_args(KVPath)
# Who adds a link's delay, jitter and loss: the link service's emulator, or the network
# between the clusters (a kernel netem qdisc, as `prfaas multihost` sets where it can).
Impairer = Literal["emulator", "kernel"]
IMPAIRERS: tuple[Impairer, ...] = get_args(Impairer)
WORKER_KINDS = frozenset({"prefill", "decode"})
T = TypeVar("T")
StatisticsSource = Callable[[], msgspec.Struct]

# The buckets of every PrfaaS histogram, one series per unit, live and simulated alike
# (docs/observability.md). Times run from a fraction of a millisecond (a decode step of the
# small CPU model, one gap between streamed tokens) to minutes (a queue of 128K-token prefills
# on the emulated H20, each seconds long): 0.1 ms to 750 s, eight bounds a decade (1, 1.5, 2,
# 2.5, 3, 4, 5, 7.5), so neighbouring bounds are at most 1.5x apart and the SLO's 25 ms
# (the paper's decode SLO) is a bound. Written as decimal literals so that each prints as it reads
# (le="0.025"). Token counts (1 to 1M) and KV bytes (1 KiB to 64 GiB: a paper-scale 128K
# prefix is about 2.3 GiB) go in powers of two.
SECONDS_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m}e{exponent}") for exponent in range(-4, 3)
    for m in ("1", "1.5", "2", "2.5", "3", "4", "5", "7.5"))
TOKENS_BUCKETS: tuple[float, ...] = tuple(float(2 ** k) for k in range(21))
BYTES_BUCKETS: tuple[float, ...] = tuple(float(2 ** k) for k in range(10, 37))


def http_bind_host(spec: ServiceSpec) -> str:
    """Where the service's HTTP API listens: options.http_host, else its bind host."""
    return str(spec.options.get("http_host") or spec.bind_host)


def http_dial_host(spec: ServiceSpec) -> str:
    """Where others reach the service's HTTP API: options.http_host when that names one
    address, else the service's host."""
    bound = str(spec.options.get("http_host", ""))
    return spec.host if bound in WILDCARD_HOSTS else bound


def link_service_of(topology: Topology, link: LinkSpec) -> ServiceSpec:
    """The `link` service emulating `link`: named like it, or naming it in options.link."""
    for spec in topology.find(kind="link"):
        if link.name in (spec.name, spec.options.get("link")):
            return spec
    raise ConfigError(f"link {link.name!r} has no service of kind 'link' (name it "
                      f"{link.name!r} or set options.link)")


class LinkRoute(msgspec.Struct, frozen=True):
    """One proxy route of a link: `service` is reached at `listen`, forwarded to `upstream`;
    `reverse`: the route carries b -> a (its senders are in cluster b)."""

    service: str
    listen: Address
    upstream: Address
    reverse: bool = False


def link_routes(topology: Topology, link: LinkSpec) -> list[LinkRoute]:
    """The routes of `link`: one per worker of cluster b (the receiving, PD side), in file
    order, at the link service's options.proxy_base_port + i, used by senders in cluster a;
    then one per worker of cluster a at the next ports, used by senders in cluster b (a
    cached prefix moved to a PrfaaS worker, services/worker/prefix_pull.py)."""
    proxy = link_service_of(topology, link)
    base = int(proxy.options.get("proxy_base_port", 0))
    if base < 1:
        raise ConfigError(f"link service {proxy.name!r}: options.proxy_base_port must be a "
                          f"port, got {proxy.options.get('proxy_base_port')!r}")
    forward = [s for s in topology.find(cluster=link.b) if s.kind in WORKER_KINDS]
    backward = [s for s in topology.find(cluster=link.a) if s.kind in WORKER_KINDS]
    return ([LinkRoute(s.name, Address(proxy.host, base + i), s.address)
             for i, s in enumerate(forward)] +
            [LinkRoute(s.name, Address(proxy.host, base + len(forward) + i), s.address, True)
             for i, s in enumerate(backward)])


def link_kv_path(link: LinkSpec) -> KVPath:
    """How KV crosses `link`: through its link service's proxy (options.kv "emulator", the
    default) or straight to the receiving worker ("direct")."""
    path = link.options.get("kv", "emulator")
    if path not in KV_PATHS:
        raise ConfigError(f"link {link.name!r}: options.kv must be one of {list(KV_PATHS)}, "
                          f"got {path!r}")
    return path


def link_impairer(link: LinkSpec) -> Impairer:
    """Who adds `link`'s delay, jitter and loss: the emulator (options.impairments
    "emulator", the default) or the network it crosses ("kernel": the emulator adds none)."""
    impairer = link.options.get("impairments", "emulator")
    if impairer not in IMPAIRERS:
        raise ConfigError(f"link {link.name!r}: options.impairments must be one of "
                          f"{list(IMPAIRERS)}, got {impairer!r}")
    return impairer


def _routes_from(topology: Topology, cluster: str) -> list[tuple[LinkSpec, LinkRoute]]:
    """The routes senders in `cluster` use: forward routes of links it is side a of,
    reverse routes of links it is side b of."""
    return [(link, route) for link in topology.links for route in link_routes(topology, link)
            if (link.a, link.b)[route.reverse] == cluster]


def resolve_from(topology: Topology, cluster: str) -> Callable[[str], Address]:
    """The resolver of a node in `cluster`: peers in a cluster it has a link to through that
    link's proxy, everyone else directly; a link whose options.kv is "direct" is crossed
    straight (the network between the clusters shapes it: a kernel qdisc, a real line). A
    `#suffix` names a lane (another connection to the same peer)."""
    via = {r.service: r.listen for link, r in _routes_from(topology, cluster)
           if link_kv_path(link) == "emulator"}

    def resolve(peer: str) -> Address:
        name = peer.split("#", 1)[0]
        return via.get(name) or topology.address(name)

    return resolve


def link_of_peer(topology: Topology, cluster: str) -> Callable[[str], str | None]:
    """The link name a peer is reached through from `cluster`, None when direct."""
    names = {r.service: link.name for link, r in _routes_from(topology, cluster)}
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
    # The mesh's shared secret (services.contract.access.service_secret); None: loopback only.
    secret: bytes | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def option(self, key: str, default: T) -> T:
        """Service option `key`, else its cluster's, else `default` (type-checked against it)."""
        value = self.topology.options_of(self.spec).get(key, default)
        if type(default) is float and type(value) is int:
            value = float(value)
        if type(value) is not type(default):
            raise ConfigError(f"service {self.name!r}: option {key}={value!r} must be a "
                              f"{type(default).__name__}")
        return value

    def node(self, name: str | None = None, config: NodeConfig | None = None, *,
             resolve: Callable[[str], Address] | None = None) -> Node:
        """A node of this service holding the mesh's secret; `resolve` (default: the
        context's, else through the links) finds its peers, and the service's own node finds
        its listen address under its own name. Over a network, listening beyond loopback
        without a secret is a ConfigError; an in-memory mesh needs none."""
        dial = resolve or self.resolve or resolve_from(self.topology, self.spec.cluster)
        listen_at = self.spec.listen_address

        def find(peer: str) -> Address:
            # Only the service's own node listens (lanes, named NAME#k, dial out only).
            return listen_at if peer == self.name and name in (None, self.name) else dial(peer)

        return Node(name or self.name, self.codec, self.transport, find, config,
                    secret=self.secret,
                    require_secret_beyond_loopback=not isinstance(self.transport,
                                                                  MemoryTransport))

    def ready(self, address: Address) -> None:
        self.announce(f"ready {self.name} {address}")


def serve_events(node: Node, bus: EventBus[Event],
                 clock: Callable[[], float] = native.now) -> None:
    """Any subscriber (the dashboard) reads this service's events from the moment it asks,
    and `clock`, the one the events' `ts` are read from, to a `ClockQuery`."""

    @node.handles(ClockQuery)
    async def on_clock(msg: ClockQuery, ctx: Context) -> ClockReading:
        return ClockReading(now=clock())

    @node.serves_stream(Subscribe)
    async def on_subscribe(msg: Subscribe, ctx: Context) -> Any:
        with bus.subscribe(msg.maxlen) as events:
            async for event in events:
                yield event


async def serve_metrics(ctx: ServiceContext, sources: dict[str, StatisticsSource],
                        info: dict[str, dict[str, str]] | None = None,
                        collectors: Sequence[Collector] = ()) -> None:
    """`/metrics` of the service's statistics on options.metrics_port (0: none), until
    cancelled; each source's numbers under prfaas_<prefix>_..., labelled with the service;
    each `info` entry a constant prfaas_<name>_info{service, its labels} 1 (what it runs);
    `collectors` as they are (histograms their owners observe); and the process's own
    (CPU, memory, file descriptors: mesh.metrics.register_process)."""
    port = ctx.option("metrics_port", 0)
    if port == 0:
        return
    registry = CollectorRegistry(auto_describe=False)
    register_process(registry)
    for collector in collectors:
        registry.register(collector)
    for prefix, source in sources.items():
        register_statistics(registry, f"prfaas_{prefix}", source, {"service": ctx.name})
    for name, labels in (info or {}).items():
        Info(f"prfaas_{name}", f"the {name} this service runs", ["service"],
             registry=registry).labels(service=ctx.name).info(labels)
    await serve_http(metrics_app(registry), ctx.spec.bind_host, port)
