"""The global KV cache directory's service: the handlers on the mesh around one
`CacheDirectory` (services/cachedir/directory.py), and `run_cachedir`, the `cachedir` runner of
`prfaas serve`.

Workers cast `BlocksStored` / `BlocksEvicted` as their prefix caches change and a full
`WorkerReport` when they start or after a lost report; the router (or `prfaas send`) calls
`PrefixQuery` (longest cached prefix per worker and cluster) and `PlanQuery` (what a decode
worker lacks). The directory keeps no state on disk: after a restart it asks every worker of
the topology for its `ReportCache` and rebuilds itself from the answers (a worker that is not
up yet reports itself when it starts). Every change is published as a `CacheActivity` event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import anyio.abc

from mesh.errors import MeshError
from mesh.events import EventBus
from mesh.node import Node
from mesh.server import Context
from mesh.transport import Address
from services.cachedir.directory import (
    CacheDirectory,
    CacheDirectoryStatistics,
    CacheEvent,
    loop_time,
)
from services.contract.events import CacheActivity, Event
from services.contract.messages import (
    BlocksEvicted,
    BlocksStored,
    CacheReport,
    PlanQuery,
    PlanReply,
    PrefixQuery,
    PrefixReply,
    ReportCache,
    WorkerReport,
)
from services.contract.types import Role
from services.service import WORKER_KINDS, ServiceContext, serve_events, serve_metrics

log = logging.getLogger(__name__)


class CacheDirService:
    """Handlers around one `CacheDirectory`, publishing its events on `bus`."""

    def __init__(self, node: Node, workers: dict[str, tuple[str, Role]],
                 bus: EventBus[Event] | None = None) -> None:
        self.node = node
        self.workers = workers
        self.bus = bus or EventBus()
        self.directory = CacheDirectory(clock=loop_time)
        self._totals: dict[str, int] = {}
        for name, (cluster, role) in workers.items():
            self.directory.register_worker(name, cluster, role)
        self._register()

    def _register(self) -> None:
        node, directory = self.node, self.directory
        serve_events(node, self.bus)

        @node.handles(BlocksStored)
        async def on_stored(msg: BlocksStored, ctx: Context) -> None:
            self.take(msg)

        @node.handles(BlocksEvicted)
        async def on_evicted(msg: BlocksEvicted, ctx: Context) -> None:
            self.take(msg)

        @node.handles(WorkerReport)
        async def on_report(msg: WorkerReport, ctx: Context) -> None:
            self.take(msg)

        @node.handles(PrefixQuery)
        async def on_prefix(msg: PrefixQuery, ctx: Context) -> PrefixReply:
            return self.lookup(msg)

        @node.handles(PlanQuery)
        async def on_plan(msg: PlanQuery, ctx: Context) -> PlanReply:
            return PlanReply(directory.transfer_plan(msg.hashes, msg.target_worker,
                                                     msg.source_worker))

    def take(self, report: CacheReport) -> None:
        """Applies one worker's cache report, as its cast's handler does (the simulation,
        whose workers run in this event loop, hands them over in process)."""
        directory = self.directory
        if isinstance(report, BlocksStored):
            self._apply(lambda: directory.apply_stored(report))
        elif isinstance(report, BlocksEvicted):
            self._apply(lambda: directory.apply_evicted(report))
        else:
            self._apply(lambda: directory.replace_worker(report))

    def lookup(self, query: PrefixQuery) -> PrefixReply:
        """The answer to a `PrefixQuery` (the router's lookup, over the mesh or in process)."""
        return PrefixReply(self.directory.longest_prefix(query.hashes, query.role))

    def _apply(self, change: Callable[[], object]) -> None:
        """Runs one change of the directory, then publishes what it did (even on error)."""
        try:
            change()
        finally:
            self._publish(self.directory.drain_events())

    async def rebuild(self, timeout: float = 5.0) -> int:
        """Asks every worker for its whole cache; returns how many answered."""
        answered = 0

        async def ask(worker: str) -> None:
            nonlocal answered
            try:
                report = await self.node.call(worker, ReportCache(), WorkerReport,
                                              timeout=timeout)
            except MeshError as exc:
                log.info("no cache report from %s yet (%s): it reports when it starts",
                         worker, exc)
                return
            self._apply(lambda: self.directory.replace_worker(report))
            answered += 1

        async with anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(ask, worker)
        return answered

    def statistics(self) -> CacheDirectoryStatistics:
        return self.directory.statistics()

    def check_integrity(self) -> None:
        self.directory.check_integrity()

    def _publish(self, events: list[CacheEvent]) -> None:
        for event in events:
            if event.kind in ("replaced", "forgotten"):
                self._totals[event.worker] = event.n_blocks if event.kind == "replaced" else 0
            elif event.kind in ("stored", "evicted"):
                sign = 1 if event.kind == "stored" else -1
                self._totals[event.worker] = self._totals.get(event.worker, 0) + (
                    sign * event.n_blocks)
            if event.kind in ("stored", "evicted", "replaced") and event.worker \
                    and self.bus.subscribed:
                self.bus.publish(CacheActivity(
                    ts=event.ts, source=self.node.name, worker=event.worker,
                    cluster=event.cluster, kind="evicted" if event.kind == "evicted" else "stored",
                    blocks=event.n_blocks, total_blocks=self._totals[event.worker],
                ))


def topology_workers(ctx: ServiceContext) -> dict[str, tuple[str, Role]]:
    """Every prefill and decode worker of the topology: name -> (cluster, starting role)."""
    return {s.name: (s.cluster, "decode" if s.kind == "decode" else "prefill")
            for s in ctx.topology.services if s.kind in WORKER_KINDS}


async def run_cachedir(
    ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The `cachedir` runner of `prfaas serve`."""
    node = ctx.node()
    service = CacheDirService(node, topology_workers(ctx))
    ctx.expose(ctx.name, service)
    async with node, anyio.create_task_group() as tg:
        tg.start_soon(serve_metrics, ctx, {"node": node.statistics,
                                           "cachedir": service.statistics,
                                           "events": service.bus.statistics})
        task_status.started(await node.listen())
        answered = await service.rebuild()
        log.info("cache directory rebuilt from %d of %d workers", answered,
                 len(service.workers))
        await anyio.sleep_forever()
