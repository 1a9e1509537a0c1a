"""A worker process: one model, one prefix cache, a prefill and a decode engine, one role.

`run_worker` is what `prfaas serve` runs for services of kind "prefill" and "decode". The
process loads the model once (the shipped checkpoint, or a random-init model of the named
family with a fixed seed: every worker of a topology builds the same weights) and serves
whichever role it holds; a PD-cluster worker switches role when told (`SetRole`: stop taking
new work, drain, switch, re-report its cache), so the router's long-term loop can rebalance.
It reports its cached blocks to the cache directory as they change, and its whole cache when
it starts, when the directory asks (`ReportCache`) and after a report was lost.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import torch

from mesh.errors import ConfigError
from mesh.events import EventBus
from mesh.mailbox import Mailbox
from mesh.node import Node, NodeConfig
from mesh.server import Context
from mesh.transport import Address
from services.contract.errors import WrongRole
from services.contract.events import Event, RoleChanged, WorkerStatus
from services.contract.messages import (
    CacheReport,
    DecodeRequest,
    KVAccepted,
    KVOpen,
    ModelInfo,
    PrefillDone,
    PrefillRequest,
    PrefixPushed,
    PushPrefix,
    ReportCache,
    SetRole,
    StatusQuery,
    WorkerReport,
    WorkerState,
)
from services.contract.tracing import Tracer, tracer_for
from services.contract.types import Role
from services.model.cache import dtype_name
from services.model.config import family_config
from services.model.model import HybridLM, build_model
from services.paper.hardware import CostModel, Pacer
from services.service import (
    ServiceContext,
    StatisticsSource,
    link_of_peer,
    serve_events,
    serve_metrics,
)
from services.worker.compute import ComputeRunner, Pacing
from services.worker.config import WorkerConfig, worker_config
from services.worker.decode import DecodeWorker
from services.worker.engine import Engine, ModelEngine
from services.worker.kv_metrics import KVTransferMetrics
from services.worker.prefill import PrefillWorker
from services.worker.prefix_pull import PrefixTransfer
from services.worker.prefix_store import MIB, CacheReporter, PrefixStore, PrefixStoreConfig

log = logging.getLogger(__name__)

def checkpoint_path(option: str, family: str, size: str) -> Path | None:
    """The weights file to load: an explicit path, the shipped kimi-linear checkpoint when
    "auto" finds it (default size only), or None for a random-init model."""
    if option == "none":
        return None
    if option != "auto":
        return Path(option)
    from services.model.train import DEFAULT_CHECKPOINT

    if (family, size) == ("kimi-linear", "default") and DEFAULT_CHECKPOINT.is_file():
        return DEFAULT_CHECKPOINT
    return None


def load_model(name: str, config: WorkerConfig) -> tuple[HybridLM, str]:
    """The model named by worker `name`'s options, and where its weights came from (every
    worker of a topology must end up with the same weights: same file, or same seed)."""
    family, size, seed = config.family, config.size, config.seed
    path = checkpoint_path(config.checkpoint, family, size)
    if path is None:
        log.info("no checkpoint for %s/%s: random init with seed %d", family, size, seed)
        cfg = family_config(family, size)
        return build_model(cfg, seed=seed, dtype=config.dtype), f"random-init seed {seed}"
    from services.model.train import load_checkpoint

    model, cfg, _ = load_checkpoint(path, dtype=config.dtype)
    if (cfg.family, cfg.size) != (family, size):
        raise ConfigError(f"service {name!r}: checkpoint {str(path)!r} holds "
                          f"{cfg.family}/{cfg.size}, options say {family}/{size}")
    assert isinstance(model, HybridLM)
    return model, f"checkpoint {path}"


def model_info(model: HybridLM, source: str) -> ModelInfo:
    cfg = model.cfg
    return ModelInfo(family=cfg.family, size=cfg.size, config_hash=cfg.config_hash(),
                     dtype=dtype_name(model.dtype), vocab_size=cfg.vocab_size,
                     block_size=cfg.block_size, eos_id=cfg.eos_id, source=source)


def serve_prefill(node: Node, worker: PrefillWorker,
                  admit: Callable[[], None] = lambda: None, *, slots: int | None = None) -> None:
    """Registers the prefill handler on `node` (in a pool of `slots`, if given); `admit`
    raises when the worker may not take new prefill work (its role gate)."""

    @node.handles(PrefillRequest, slots=slots)
    async def on_prefill(request: PrefillRequest, ctx: Context) -> PrefillDone:
        admit()
        return await worker.prefill(request)


def serve_decode(node: Node, worker: DecodeWorker,
                 admit: Callable[[], None] = lambda: None, *,
                 upload_slots: int | None = None,
                 prefixes: PrefixTransfer | None = None) -> None:
    """Registers the decode handlers on `node`: decode streams in a pool of the worker's
    `max_streams` slots, uploads in one of `upload_slots` (if given); `admit` raises when the
    worker may not take new decode work (its role gate). KV for a request already being
    decoded always gets in; a prefix pushed to this worker (KVOpen purpose "prefix") goes to
    `prefixes`."""

    @node.accepts_stream(KVOpen, slots=upload_slots)
    async def on_kv(opening: KVOpen, items: Mailbox[msgspec.Struct], ctx: Context) -> KVAccepted:
        if opening.purpose == "prefix" and prefixes is not None:
            return await prefixes.receive(opening, items, ctx.peer)
        if not worker.inbox.expects(opening.request_id):
            admit()
        return await worker.inbox.receive(opening, items, ctx.peer)

    @node.serves_stream(DecodeRequest, slots=worker.config.max_streams)
    async def on_decode(
        request: DecodeRequest, ctx: Context
    ) -> AsyncGenerator[msgspec.Struct, None]:
        admit()
        async for chunk in worker.decode(request):
            yield chunk


class WorkerService:
    """The role gate and the glue around the prefill and decode engines of one process."""

    def __init__(self, ctx: ServiceContext, engine: Engine, info: ModelInfo,
                 runner: ComputeRunner | None = None, *,
                 cache_reports: Callable[[CacheReport], None] | None = None,
                 tracer: Tracer | None = None, config: WorkerConfig | None = None) -> None:
        """`cache_reports`: the cache directory's own intake when it runs in this event loop
        (the simulation's `CacheDirService.take`): the worker's cache reports are handed to
        it rather than cast (`CacheReporter`). `tracer`: the OpenTelemetry spans of its
        prefills and decodes (services/contract/tracing.py); None: tracing is off.
        `config`: its options, if already built from the topology (`worker_config`)."""
        self.ctx = ctx
        self.config = config or worker_config(ctx.topology, ctx.spec)
        self.name = ctx.name
        self.cluster = ctx.spec.cluster
        self.cluster_kind = ctx.topology.cluster(self.cluster).kind if self.cluster else ""
        self.role: Role = "decode" if ctx.spec.kind == "decode" else "prefill"
        self.draining = False
        self.info = info
        self.bus: EventBus[Event] = EventBus()
        self.node = ctx.node()
        lane_config = NodeConfig(max_concurrency=1)
        self.lanes = [self.node] + [ctx.node(f"{self.name}#{k}", lane_config)
                                    for k in range(1, self.config.connections)]
        budget = int(self.config.cache_mib * MIB)
        self.store = PrefixStore(self.name, engine.cfg.block_size, PrefixStoreConfig(
            budget_bytes=budget))
        cachedir = next((s.name for s in ctx.topology.find(kind="cachedir")), None)
        self.reporter = CacheReporter(self.node, cachedir, self.report,
                                      hand_over=cache_reports)
        pacing = self._pacing()
        # One owner for both receiving sides: the decode worker's and a pulled prefix's.
        self.kv_metrics = KVTransferMetrics(self.name, link_of_peer(ctx.topology, self.cluster))
        self.transfer = PrefixTransfer(self.name, engine, self.store, self.lanes,
                                       report=self.reporter.submit, kv_metrics=self.kv_metrics)
        self.prefill = PrefillWorker(
            engine, self.store, self.lanes,
            self.config.prefill_config(self.name, self.cluster),
            bus=self.bus, pacing=pacing, report=self.reporter.submit,
            link_of=link_of_peer(ctx.topology, self.cluster), runner=runner,
            transfer=self.transfer, tracer=tracer,
        )
        self.decode = DecodeWorker(
            engine, self.store, self.config.decode_config(self.name, self.cluster),
            bus=self.bus, pacing=pacing, report=self.reporter.submit,
            kv_metrics=self.kv_metrics, tracer=tracer,
        )
        self._register()

    def _pacing(self) -> Pacing | None:
        if self.ctx.mode != "emulated":
            return None
        # The topology's scale: served tokens per modeled (paper-length) token.
        return Pacing(CostModel.load(self.config.profile), Pacer(self.ctx.time_scale),
                      1.0 / self.config.scale)

    def _register(self) -> None:
        serve_prefill(self.node, self.prefill, lambda: self._admit("prefill"),
                      slots=self.config.prefill_slots)
        serve_decode(self.node, self.decode, lambda: self._admit("decode"),
                     upload_slots=self.config.upload_slots, prefixes=self.transfer)
        serve_events(self.node, self.bus)

        @self.node.handles(StatusQuery)
        async def on_status(msg: StatusQuery, ctx: Context) -> WorkerState:
            return self.state()

        @self.node.handles(SetRole)
        async def on_set_role(msg: SetRole, ctx: Context) -> WorkerState:
            await self.switch(msg.role, msg.reason or f"asked by {ctx.peer}")
            return self.state()

        @self.node.handles(PushPrefix)
        async def on_push(msg: PushPrefix, ctx: Context) -> PrefixPushed:
            return await self.transfer.push(msg)

        @self.node.handles(ReportCache)
        async def on_report(msg: ReportCache, ctx: Context) -> WorkerReport:
            return self.report()

    def _admit(self, role: Role) -> None:
        if self.role != role or self.draining:
            state = f"{self.role}{' (draining)' if self.draining else ''}"
            raise WrongRole(f"{self.name} holds role {state}, cannot take {role} work")

    async def switch(self, role: Role, reason: str) -> None:
        """Stop taking work, let what is queued and running finish, wait the topology's
        `conversion_s` (the time a real instance takes to reload for its new role; 0 by
        default), then take `role`."""
        if role == self.role and not self.draining:
            return
        if self.cluster_kind != "pd":
            raise WrongRole(f"only PD-cluster workers switch roles; {self.name} is in cluster "
                            f"{self.cluster!r} of kind {self.cluster_kind!r}")
        if self.draining:
            raise WrongRole(f"{self.name} is already switching to {self.role}")
        old, self.draining = self.role, True
        self._publish_status()
        try:
            await self.prefill.wait_idle()
            await self.decode.wait_idle()
            # A new role is not free: reloading for it serves neither role meanwhile.
            await anyio.sleep(self.config.conversion_s)
        finally:
            self.draining = False
        self.role = role
        self.bus.publish(RoleChanged(ts=anyio.current_time(), source=self.name,
                                     worker=self.name, old=old, new=role, reason=reason))
        self.reporter.resync()

    def report(self) -> WorkerReport:
        return self.store.report(self.cluster, self.role)

    def state(self) -> WorkerState:
        # Read at every status poll (each tick): the counts alone, not whole statistics.
        prefill, decode = self.prefill, self.decode
        sent = prefill.meter.reading()
        return WorkerState(
            name=self.name, cluster=self.cluster, role=self.role, draining=self.draining,
            queue_depth=prefill.queue_depth + decode.waiting,
            running=prefill.running + decode.running,
            cached_blocks=self.store.blocks, model=self.info,
            max_streams=self.config.max_streams if self.role == "decode" else 0,
            kv_sent_bytes=sent.sent_bytes, kv_held_s=sent.held_s,
        )

    def _publish_status(self) -> None:
        state = self.state()
        self.bus.publish(WorkerStatus(
            ts=anyio.current_time(), source=self.name, worker=self.name, cluster=self.cluster,
            role="draining" if self.draining else self.role, queue_depth=state.queue_depth,
            running=state.running, busy=state.running > 0, cached_blocks=state.cached_blocks,
            model=f"{self.info.family} {self.info.size} {self.info.dtype}",
        ))

    async def _publish_status_every(self, interval: float) -> None:
        while True:
            # Nobody watching (the simulation, a mesh without its dashboard): no status to
            # make, and no wake-up every interval for it.
            await self.bus.wait_subscribed()
            self._publish_status()
            await anyio.sleep(interval)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with AsyncExitStack() as stack:
            for node in self.lanes:
                await stack.enter_async_context(node)
            address = await self.node.listen()
            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(self.decode.run)
            tg.start_soon(self.reporter.run)
            tg.start_soon(self._publish_status_every, self.config.status_interval)
            sources: dict[str, StatisticsSource] = {
                "node": self.node.statistics, "prefill": self.prefill.statistics,
                "decode": self.decode.statistics, "prefix_cache": self.store.statistics,
                "events": self.bus.statistics, "prefix_transfer": self.transfer.statistics,
            }
            model = {"family": self.info.family, "size": self.info.size,
                     "dtype": self.info.dtype, "source": self.info.source}
            tg.start_soon(serve_metrics, self.ctx, sources, {"model": model},
                          [self.kv_metrics])
            log.info("%s serving role %s with %s %s in %s (%s)", self.name, self.role,
                     self.info.family, self.info.size, self.info.dtype, self.info.source)
            task_status.started(address)
            await anyio.sleep_forever()


async def run_worker(
    ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The `prefill` / `decode` runner of `prfaas serve`."""
    config = worker_config(ctx.topology, ctx.spec)
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    model, source = await anyio.to_thread.run_sync(load_model, ctx.name, config)
    service = WorkerService(ctx, ModelEngine(model), model_info(model, source),
                            tracer=tracer_for(ctx.name, config.otlp_endpoint), config=config)
    ctx.expose(ctx.name, service)
    await service.run(task_status=task_status)
