"""A deployment composed in this event loop: the live services over an in-memory network.

`SimWorld` starts, in one trio task group, exactly what a live mesh runs, built by the live
code from a generated topology: the cache directory (`run_cachedir`), the prefill and decode
workers (`WorkerService` over a `ModeledEngine`, paced by the live emulated-mode pacing), the
router's scheduler with a registered policy and its control loop (`Scheduler`, `RouterControl`),
and each inter-cluster link (`netem.memory.MemoryLink` around the live `LinkShaper`, reached
through the live `resolve_from` routing). The world routes, places, indexes caches, shapes the
link and moves KV with none of its own code: only compute and payload bytes are modeled.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import msgspec

from mesh import native
from mesh.errors import ConfigError, PeerGone
from mesh.topology import ClusterSpec, LinkSpec, ServiceSpec, Topology
from mesh.transport import MemoryHub, MemoryTransport
from mesh.wire import Codec
from netem.memory import MemoryLink, MemoryRoute
from netem.params import LinkParams
from netem.shaper import LinkShaper
from services.cachedir.service import CacheDirService, run_cachedir
from services.contract.messages import CODEC_MESSAGES, WorkerState
from services.link.frames import payload_weight
from services.paper.case_study import PRFAAS_PD
from services.paper.hardware import CostModel
from services.router.config import SchedulerConfig, link_ends
from services.router.control import ControlConfig, RouterControl
from services.router.link_meter import EstimatorConfig
from services.router.placement import DirectoryReader
from services.router.policies import create_policy
from services.router.policy import LinkSample
from services.router.scheduler import Scheduler
from services.router.workers import StatusReader, WorkerTable
from services.service import ServiceContext, link_routes
from services.sim.engine import ModeledConfig, ModeledEngine, ModeledTokenizer
from services.worker.compute import InlineRunner
from services.worker.service import WorkerService

HOST = "sim"
# Served tokens per paper token: a 64-token block is one 512-token block of the traces.
DEFAULT_SCALE = 1 / 8
# Workloads without prefix reuse need no block to match the traces': served at 1/32, what
# grows with the served length (prompt hashing, the cache index, encoding prompts) costs a
# quarter, and the results move by under 2% (the same 5-minute run at 1/8 and 1/32: mean
# TTFT 7.85 against 7.98 s, P90 16.17 against 16.11 s, equal offload share).
COARSE_SCALE = 1 / 32
# Served tokens per prefill chunk at scale 1: 16K paper tokens, the chunk the profiles time.
CHUNK_PAPER_TOKENS = 16384
GIB = 1 << 30
PATIENCE_S = 86_400.0


class Deployment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What runs: instances per stage, their hardware, the link, the policy."""

    name: str = PRFAAS_PD
    n_prfaas: int = 4
    n_pd_prefill: int = 3
    n_decode: int = 5
    prfaas_profile: str = "h200"
    pd_profile: str = "h20"
    model: str = "hybrid_1t"
    bandwidth_bps: float = 100e9
    delay_s: float = 0.005
    policy: str = "prfaas"
    policy_options: dict[str, Any] = {}
    scale: float = DEFAULT_SCALE
    chunk_tokens: int = round(CHUNK_PAPER_TOKENS * DEFAULT_SCALE)  # served tokens per chunk
    # One lane per KV stream: lanes share the link's shaper, so more add messages, not speed.
    connections: int = 1
    snapshot_every: int = 4
    cache_gib: float = 1024.0  # each worker's prefix store (Mooncake keeps it in host DRAM)
    tick_s: float = 1.0
    seed: int = 0
    # Seconds a PD worker converting between prefill and decode serves neither role (a model
    # reload is not free; the live worker's option of the same name).
    conversion_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.n_prfaas, self.n_pd_prefill) < 0 or self.n_decode < 1:
            raise ConfigError(f"instances must be >= 0 (decode >= 1), got {self.n_prfaas}/"
                              f"{self.n_pd_prefill}/{self.n_decode}")
        if self.n_prfaas + self.n_pd_prefill < 1:
            raise ConfigError("a deployment needs at least one prefill instance")
        if not (self.scale > 0 and self.bandwidth_bps > 0):
            raise ConfigError(f"scale and bandwidth_bps must be > 0, got {self.scale} and "
                              f"{self.bandwidth_bps}")


def _worker(name: str, kind: str, cluster: str, port: int) -> ServiceSpec:
    return ServiceSpec(name=name, kind=kind, cluster=cluster, host=HOST, port=port)


def sim_topology(d: Deployment) -> Topology:
    """The deployment as a topology: services on host "sim", one link PrfaaS -> PD."""
    bs_max, _ = CostModel.load(d.pd_profile, d.model).decode_slo()
    # Batches hold BS_max (the decode SLO); streams, prefill calls and uploads wait in
    # queues rather than being refused: the simulation measures queues, not rejections.
    worker_options = {"scale": d.scale, "chunk_tokens": d.chunk_tokens, "max_batch": bs_max,
                      "max_streams": 512, "prefill_slots": 512, "upload_slots": 64,
                      "connections": d.connections, "snapshot_every": d.snapshot_every,
                      "cache_mib": d.cache_gib * 1024, "status_interval": d.tick_s,
                      "conversion_s": d.conversion_s}
    clusters = [ClusterSpec(name="pd", kind="pd",
                            options={**worker_options, "profile": d.pd_profile})]
    services = [ServiceSpec(name="router", kind="router", host=HOST, port=100),
                ServiceSpec(name="cachedir", kind="cachedir", host=HOST, port=101)]
    services += [_worker(f"pd-prefill-{i}", "prefill", "pd", 300 + i)
                 for i in range(d.n_pd_prefill)]
    services += [_worker(f"pd-decode-{i}", "decode", "pd", 400 + i) for i in range(d.n_decode)]
    links: list[LinkSpec] = []
    if d.n_prfaas:
        clusters.append(ClusterSpec(name="prfaas", kind="prfaas",
                                    options={**worker_options, "profile": d.prfaas_profile}))
        services += [_worker(f"prfaas-prefill-{i}", "prefill", "prfaas", 200 + i)
                     for i in range(d.n_prfaas)]
        services.append(ServiceSpec(name="link-0", kind="link", host=HOST, port=102,
                                    options={"proxy_base_port": 1000}))
        links.append(LinkSpec(name="link-0", a="prfaas", b="pd",
                              bandwidth_bps=d.bandwidth_bps, delay_s=d.delay_s))
    return Topology(clusters=tuple(clusters), services=tuple(services), links=tuple(links))


def policy_options(d: Deployment) -> dict[str, Any]:
    """The policy's options at the deployment's shape and scale (its own options win)."""
    shape: dict[str, Any] = {}
    if d.policy == "prfaas-dynamic":
        shape = {"token_scale": d.scale, "n_prfaas": d.n_prfaas, "n_p": d.n_pd_prefill,
                 "n_d": d.n_decode, "bandwidth_gbps": d.bandwidth_bps / 1e9,
                 "prfaas_profile": d.prfaas_profile, "pd_profile": d.pd_profile,
                 "model": d.model}
    return {**shape, **d.policy_options}


@dataclass
class SimWorld:
    """The running world: its topology, scheduler, workers and links (see `open_world`)."""

    deployment: Deployment
    topology: Topology
    scheduler: Scheduler
    control: RouterControl
    workers: dict[str, WorkerService] = field(default_factory=dict)
    links: dict[str, MemoryLink] = field(default_factory=dict)
    cachedir: CacheDirService | None = None  # its bus carries the cache events
    refused: list[str] = field(default_factory=list)  # requests the router turned away

    def link_sample(self) -> LinkSample | None:
        """What the router's control loop reads of the PrfaaS egress link's transport (the
        live probe reads the same over the link's control API): up and stalls, no rate."""
        link = self.links.get("link-0")
        if link is None:
            return None
        shaper = link.shaper
        egress = shaper.statistics().egress
        return LinkSample(now=anyio.current_time(), link="link-0", stalls=egress.stalls,
                          up=shaper.params.up, queued_bytes=egress.queued_bytes)


def _context(topology: Topology, name: str, transport: MemoryTransport,
             expose: Callable[[str, object], None] = lambda name, service: None,
             ) -> ServiceContext:
    return ServiceContext(topology, topology.service(name), "emulated", 1.0, transport,
                          expose=expose, codec=Codec(CODEC_MESSAGES))


def _engine(d: Deployment) -> ModeledEngine:
    return ModeledEngine(CostModel.load(d.pd_profile, d.model), 1.0 / d.scale,
                         cfg=ModeledConfig())


async def _start_links(world: SimWorld, hub: MemoryHub, tg: anyio.abc.TaskGroup) -> None:
    weight = payload_weight(Codec(CODEC_MESSAGES))
    for spec in world.topology.links:
        routes = [MemoryRoute(r.listen, r.upstream, r.reverse)
                  for r in link_routes(world.topology, spec)]
        # The loop's own clock: the link reads it several times a frame (mesh.native).
        shaper = LinkShaper(LinkParams(bandwidth_bps=spec.bandwidth_bps, delay_s=spec.delay_s),
                            native.clock(), random.Random(world.deployment.seed))
        world.links[spec.name] = link = MemoryLink(hub, routes, shaper, weight)
        await tg.start(link.run)


async def _start_workers(world: SimWorld, transport: MemoryTransport,
                         tg: anyio.abc.TaskGroup) -> None:
    engine = _engine(world.deployment)
    info = engine.info()
    for spec in world.topology.services:
        if spec.kind in ("prefill", "decode"):
            ctx = _context(world.topology, spec.name, transport)
            # Cache reports go to the directory in this event loop, not cast to it.
            worker = WorkerService(ctx, engine, info, runner=InlineRunner(),
                                   cache_reports=world.cachedir.take if world.cachedir else None)
            world.workers[spec.name] = worker
            await tg.start(worker.run)


def _scheduler(d: Deployment, topology: Topology, transport: MemoryTransport,
               directory: DirectoryReader) -> Scheduler:
    ctx = _context(topology, "router", transport)
    policy = create_policy(d.policy, policy_options(d))
    # No request gives up: past capacity the queues grow (what the scenarios measure) rather
    # than requests failing after the live mesh's 60 s KV wait.
    config = SchedulerConfig(block_size=ModeledConfig().block_size, max_inflight=1_000_000,
                             kv_timeout_s=PATIENCE_S, request_timeout_s=PATIENCE_S,
                             connections=d.connections, links=link_ends(topology),
                             # What the operator bought: the estimator's prior and ceiling.
                             link_estimator=EstimatorConfig(provisioned_bps=d.bandwidth_bps),
                             id_prefix=f"{d.name}{d.seed}")
    return Scheduler(ctx.node(), policy, WorkerTable.from_topology(topology),
                     ModeledTokenizer(ModeledConfig()),
                     config, directory=directory)


@asynccontextmanager
async def open_world(d: Deployment) -> AsyncIterator[SimWorld]:
    """Starts the deployment's services (cache directory, links, workers, router) in this
    event loop, on its clock; stops them when the block ends."""
    topology = sim_topology(d)
    hub = MemoryHub()
    transport = MemoryTransport(hub)
    # The router asks the directory in this event loop (`world` is bound before any request).
    scheduler = _scheduler(d, topology, transport, lambda query: _directory(world).lookup(query))
    world = SimWorld(d, topology, scheduler, RouterControl(scheduler, ControlConfig(
        tick_s=d.tick_s)))
    async with anyio.create_task_group() as tg:
        exposed: dict[str, object] = {}
        await tg.start(run_cachedir, _context(topology, "cachedir", transport,
                                              exposed.__setitem__))
        cachedir = exposed.get("cachedir")
        world.cachedir = cachedir if isinstance(cachedir, CacheDirService) else None
        await _start_links(world, hub, tg)
        await _start_workers(world, transport, tg)
        async with scheduler.node:
            await scheduler.node.listen()
            await tg.start(scheduler.run)
            # A live switch back to the deployment's policy (the dashboard's) keeps its options.
            world.control = RouterControl(scheduler, ControlConfig(tick_s=d.tick_s),
                                          link_probe=_probe(world),
                                          policy_options={d.policy: policy_options(d)},
                                          status_reader=_status_reader(world))
            await tg.start(world.control.run)
            try:
                yield world
            finally:
                tg.cancel_scope.cancel()


def _probe(world: SimWorld) -> Any:
    async def probe() -> LinkSample | None:
        await native.checkpoint()
        return world.link_sample()
    return probe


def _directory(world: SimWorld) -> CacheDirService:
    """The directory as its handlers would answer; PeerGone (a lookup that failed) when none
    runs, as a router without a directory meets it over the mesh."""
    if world.cachedir is None:
        raise PeerGone("no cache directory runs in this simulation")
    return world.cachedir


def _status_reader(world: SimWorld) -> StatusReader:
    """Each worker's state as its status handler answers it, read in this event loop."""
    def read(name: str) -> WorkerState:
        worker = world.workers.get(name)
        if worker is None:
            raise PeerGone(f"no worker {name!r} runs in this simulation")
        return worker.state()
    return read
