"""The global KV cache directory: which worker holds which prefix blocks and state snapshots,
served on the mesh.

Workers cast `BlocksStored` / `BlocksEvicted` as their prefix caches change and a full
`WorkerReport` when they start or after a lost report; the router (or `prfaas send`) calls
`PrefixQuery` (longest cached prefix per worker and cluster) and `PlanQuery` (what a decode
worker lacks). The directory keeps no state on disk: after a restart it asks every worker of
the topology for its `ReportCache` and rebuilds itself from the answers (a worker that is not
up yet reports itself when it starts). Every change is published as a `CacheActivity` event.

A lookup meets three things, in the order they are written here:

- `CacheDirService`: the handlers on the mesh around one directory (and `run_cachedir`, the
  `cachedir` runner of `prfaas serve`).
- `CacheDirectory`: pure state, no I/O. Workers' stored/evicted reports go in, prefix matches
  and transfer plans come out, and typed `CacheEvent`s collect in an outbox the service drains
  (the dashboard's feed). Two lengths per worker, because hybrid models cache two kinds of
  things (docs/architecture.md section 5): `blocks_held`, leading blocks whose full-attention
  KV the worker holds (any held prefix is usable as KV, so the router uses it for the
  *transfer plan* to a decode worker: send only the blocks it lacks, plus the
  linear-attention states at the new end), and `blocks_resumable`, the longest held prefix
  that also ends at a state snapshot (linear and SWA state is reusable only at exactly the
  length it was taken, so this is what a prefill worker can *resume computing* from: the
  router's l_prfaas and l_pd, paper section 3.3). Queries must be hash chains from block 0
  (`services.contract.prefix.block_hashes` or `chain_from_ids`).
- `PrefixTree`: the held blocks as the tree their hash chains (services.contract.prefix) form
  (each block knows its parent and depth) and, per holder (a small int the directory maps
  workers onto), which blocks close an unbroken chain from block 0. Along a query chain the
  set of holders with an unbroken chain only shrinks, so the longest held prefix of every
  holder is found by binary search: O(distinct lengths * log(query blocks)) dict probes,
  however many blocks are cached.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Literal

import anyio
import anyio.abc
import msgspec

from mesh import native
from mesh.errors import MeshError
from mesh.events import EventBus
from mesh.node import Node
from mesh.server import Context
from mesh.transport import Address
from services.contract.errors import PrefixCacheError, UnknownWorkerError
from services.contract.events import CacheActivity, Event
from services.contract.messages import (
    BlockRun,
    BlocksEvicted,
    BlocksStored,
    CacheReport,
    ClusterMatch,
    PlanQuery,
    PlanReply,
    PrefixMatch,
    PrefixQuery,
    PrefixReply,
    ReportCache,
    TransferPlan,
    WorkerMatch,
    WorkerReport,
)
from services.contract.prefix import MAX_HASH, check_hash
from services.contract.types import Role
from services.service import WORKER_KINDS, ServiceContext, serve_events, serve_metrics

log = logging.getLogger(__name__)


def _loop_time() -> float:
    """The running loop's clock, read as `anyio.current_time` reads it but without its
    backend lookup (an event is stamped for every cache report)."""
    return native.clock()()


class CacheDirService:
    """Handlers around one `CacheDirectory`, publishing its events on `bus`."""

    def __init__(self, node: Node, workers: dict[str, tuple[str, Role]],
                 bus: EventBus[Event] | None = None) -> None:
        self.node = node
        self.workers = workers
        self.bus = bus or EventBus()
        self.directory = CacheDirectory(clock=_loop_time)
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


EventKind = Literal["stored", "evicted", "forgotten", "replaced", "rebuilt"]


class CacheEvent(msgspec.Struct, frozen=True, tag=True):
    kind: EventKind
    worker: str
    cluster: str
    n_blocks: int
    n_snapshots: int
    seq: int
    ts: float


class CacheDirectoryStatistics(msgspec.Struct, frozen=True):
    workers: int
    clusters: int
    blocks: int  # distinct blocks held by anyone
    block_entries: int  # (worker, block) pairs
    snapshots: int
    nodes: int  # held blocks plus unheld ancestors kept to reconnect gaps
    lookups: int
    plans: int
    stored_reports: int
    evicted_reports: int
    blocks_stored: int
    blocks_evicted: int
    stale_evictions: int  # evicted blocks the directory did not know the worker held
    rebuilds: int
    events_dropped: int  # outbox overflow: the caller did not drain in time


class _Worker(msgspec.Struct):
    name: str
    cluster: str
    role: Role
    holder: int


class CacheDirectory:
    """Per worker, which prefix blocks and state snapshots it holds; prefix lookups over them."""

    def __init__(
        self,
        workers: Mapping[str, str] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_events: int = 4096,
    ) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._clock = clock
        self._tree = PrefixTree()
        self._workers: dict[str, _Worker] = {}
        self._by_holder: dict[int, _Worker] = {}
        # Kept with the workers (see _reindex) so that lookups need not scan them.
        self._clusters: list[str] = []
        self._role_masks: dict[str, int] = {}
        self._outbox: deque[CacheEvent] = deque(maxlen=max_events)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._seq = 0
        for name, cluster in (workers or {}).items():
            self.register_worker(name, cluster)

    def register_worker(self, name: str, cluster: str, role: Role = "prefill") -> None:
        if name in self._workers:
            raise ValueError(f"worker {name!r} is already registered")
        worker = _Worker(name, cluster, role, self._tree.add_holder())
        self._workers[name] = self._by_holder[worker.holder] = worker
        self._reindex()

    def set_role(self, name: str, role: Role) -> None:
        """A PD worker switched between prefill and decode; its cache stays."""
        self._worker(name).role = role
        self._reindex()

    def forget_worker(self, name: str) -> None:
        worker = self._worker(name)
        self._emit("forgotten", worker, *self._remove(worker))

    def stored(
        self,
        worker: str,
        hashes: Sequence[int],
        snapshot_at: Iterable[int] = (),
        *,
        first: int = 0,
        parent: int | None = None,
    ) -> int:
        """`worker` now holds blocks first.. of a chain; returns how many it did not hold."""
        run = BlockRun(list(hashes), list(snapshot_at), first, parent)
        return self.apply_stored(BlocksStored(worker, [run]))

    def apply_stored(self, message: BlocksStored) -> int:
        worker = self._worker(message.worker)
        new_from = self._check_runs(message.runs)
        blocks = snapshots = 0
        for run, cut in zip(message.runs, new_from, strict=True):
            new = self._tree.add_run(worker.holder, run, cut)
            blocks, snapshots = blocks + new[0], snapshots + new[1]
        self._count(stored_reports=1, blocks_stored=blocks)
        self._emit("stored", worker, blocks, snapshots)
        return blocks

    def evicted(self, worker: str, hashes: Iterable[int], snapshots_only: bool = False) -> int:
        """`worker` dropped these blocks (or their snapshots); returns how many it held."""
        return self.apply_evicted(BlocksEvicted(worker, list(hashes), snapshots_only))

    def apply_evicted(self, message: BlocksEvicted) -> int:
        worker = self._worker(message.worker)
        blocks, snapshots, stale = self._tree.drop_many(worker.holder, message.hashes,
                                                        message.snapshots_only)
        self._count(evicted_reports=1, blocks_evicted=blocks, stale_evictions=stale)
        self._emit("evicted", worker, blocks, snapshots)
        return blocks

    def replace_worker(self, report: WorkerReport) -> None:
        """Make one worker's entry exactly its report (registering it if new)."""
        self._check_runs(report.runs)
        if report.worker in self._workers:
            self._remove(self._workers[report.worker])
        self._load(report)
        self._emit("replaced", self._workers[report.worker], *self._totals(report.worker))

    def rebuild(self, reports: Iterable[WorkerReport]) -> None:
        """Replace all state with the workers' full reports (after a directory restart).

        Every report is checked before anything changes; on error the old state stays.
        """
        reports = list(reports)
        names = [report.worker for report in reports]
        if len(set(names)) != len(names):
            raise ValueError(f"reports name a worker twice: {sorted(names)}")
        pending: dict[int, tuple[int, int]] = {}
        fresh = PrefixTree()
        for report in reports:
            self._check_runs(report.runs, fresh, pending)
        self._tree, self._workers, self._by_holder = fresh, {}, {}
        self._reindex()
        for report in reports:
            self._load(report)
        self._count(rebuilds=1)
        stats = self.statistics()
        self._emit("rebuilt", None, stats.block_entries, stats.snapshots)

    def longest_prefix(self, hashes: Sequence[int], role: Role | None = None) -> PrefixMatch:
        """Held and resumable leading blocks per worker (of `role`, if given) and per cluster."""
        self._count(lookups=1)
        return self._assemble(len(hashes), self._matches(hashes, role))

    def longest_prefix_reference(
        self, hashes: Sequence[int], role: Role | None = None
    ) -> PrefixMatch:
        """Slow, obvious `longest_prefix`: walk the query against every worker's blocks."""
        found = []
        for worker in self._workers.values():
            held, resumable = self._tree.match_reference(worker.holder, hashes)
            if held and role in (None, worker.role):
                found.append((worker, held, resumable))
        return self._assemble(len(hashes), found)

    def transfer_plan(
        self, hashes: Sequence[int], target_worker: str, source_worker: str | None = None
    ) -> TransferPlan:
        """The blocks `target_worker` lacks, and which worker can send the cached ones.

        Without `source_worker`, the source is whoever else holds the most leading blocks
        (ties: the target's own cluster first, then by name).
        """
        self._count(plans=1)
        target = self._worker(target_worker)
        lengths = {w.name: (held, res) for w, held, res in self._matches(hashes, None)}
        held, resumable = lengths.get(target.name, (0, 0))
        source = self._pick_source(target, lengths, source_worker)
        source_held = lengths.get(source.name, (0, 0))[0] if source else 0
        lacking = range(held, len(hashes))
        send = [i for i in lacking if not self._tree.holds(target.holder, hashes[i])]
        return TransferPlan(
            n_blocks=len(hashes),
            target_worker=target.name,
            target_held=held,
            target_resumable=resumable,
            source_worker=source.name if source else None,
            source_held=source_held,
            cross_cluster=source is not None and source.cluster != target.cluster,
            send=send,
            states_needed=resumable < len(hashes),
        )

    def drain_events(self) -> list[CacheEvent]:
        events = list(self._outbox)
        self._outbox.clear()
        return events

    def statistics(self) -> CacheDirectoryStatistics:
        totals = [self._tree.totals(w.holder) for w in self._workers.values()]
        return CacheDirectoryStatistics(
            workers=len(self._workers),
            clusters=len(self._clusters),
            blocks=self._tree.held,
            block_entries=sum(t[0] for t in totals),
            snapshots=sum(t[1] for t in totals),
            nodes=len(self._tree.nodes),
            **self._counts,
        )

    def check_integrity(self) -> None:
        self._tree.check_integrity()
        holders = {w.holder: w for w in self._workers.values()}
        if holders != self._by_holder or len(holders) != len(self._workers):
            raise IntegrityError(f"worker holders {holders} != index {self._by_holder}")
        expected = self._indexes()
        if (self._clusters, self._role_masks) != expected:
            kept = (self._clusters, self._role_masks)
            raise IntegrityError(f"clusters and role masks {kept} != {expected} of the workers")

    def _check_runs(
        self,
        runs: Iterable[BlockRun],
        tree: PrefixTree | None = None,
        pending: dict[int, tuple[int, int]] | None = None,
    ) -> list[int]:
        """Checks the runs as one batch (see `PrefixTree.check_run`); returns, per run, the
        index from which its blocks are new."""
        runs = list(runs)
        if len(runs) == 1 and tree is None and pending is None:
            return [self._tree.check_lone_run(runs[0])]
        pending = {} if pending is None else pending
        tree = tree or self._tree
        return [tree.check_run(run, pending) for run in runs]

    def _remove(self, worker: _Worker) -> tuple[int, int]:
        del self._workers[worker.name], self._by_holder[worker.holder]
        self._reindex()
        return self._tree.remove_holder(worker.holder)

    def _load(self, report: WorkerReport) -> None:
        self.register_worker(report.worker, report.cluster, report.role)
        for run in report.runs:
            self._tree.add_run(self._workers[report.worker].holder, run)

    def _matches(self, hashes: Sequence[int], role: Role | None) -> list[_Found]:
        allowed = -1 if role is None else self._role_masks.get(role, 0)
        found = []
        for mask, held in self._tree.held_lengths(hashes, allowed):
            for worker in self._workers_in(mask):
                found.append((worker, held, self._tree.resumable(worker.holder, hashes, held)))
        return found

    def _assemble(self, n_blocks: int, found: list[_Found]) -> PrefixMatch:
        found.sort(key=lambda item: item[0].name)
        by_cluster: dict[str, list[_Found]] = {cluster: [] for cluster in self._clusters}
        for item in found:
            by_cluster[item[0].cluster].append(item)
        return PrefixMatch(
            n_blocks=n_blocks,
            workers=[WorkerMatch(w.name, w.cluster, w.role, h, r) for w, h, r in found],
            clusters=[_cluster_match(c, items) for c, items in by_cluster.items()],
        )

    def _pick_source(
        self, target: _Worker, lengths: dict[str, tuple[int, int]], name: str | None
    ) -> _Worker | None:
        if name is not None:
            return self._worker(name)
        others = sorted(n for n in lengths if n != target.name)
        if not others:
            return None
        # max() keeps the first of equal keys, so ties go by name.
        local = {n for n in others if self._workers[n].cluster == target.cluster}
        return self._workers[max(others, key=lambda n: (lengths[n][0], n in local))]

    def _worker(self, name: str) -> _Worker:
        worker = self._workers.get(name)
        if worker is None:
            raise UnknownWorkerError(f"worker {name!r} is not registered")
        return worker

    def _workers_in(self, mask: int) -> Iterator[_Worker]:
        while mask:
            lowest = mask & -mask
            yield self._by_holder[lowest.bit_length() - 1]
            mask ^= lowest

    def _reindex(self) -> None:
        self._clusters, self._role_masks = self._indexes()

    def _indexes(self) -> tuple[list[str], dict[str, int]]:
        roles: dict[str, int] = {}
        for worker in self._workers.values():
            roles[worker.role] = roles.get(worker.role, 0) | 1 << worker.holder
        return sorted({w.cluster for w in self._workers.values()}), roles

    def _totals(self, name: str) -> tuple[int, int]:
        return self._tree.totals(self._workers[name].holder)

    def _count(self, **increments: int) -> None:
        for key, value in increments.items():
            self._counts[key] += value

    def _emit(self, kind: EventKind, worker: _Worker | None, blocks: int, snapshots: int) -> None:
        if len(self._outbox) == self._outbox.maxlen:
            self._count(events_dropped=1)
        self._seq += 1
        self._outbox.append(
            CacheEvent(
                kind=kind,
                worker=worker.name if worker else "",
                cluster=worker.cluster if worker else "",
                n_blocks=blocks,
                n_snapshots=snapshots,
                seq=self._seq,
                ts=self._clock(),
            )
        )


_Found = tuple[_Worker, int, int]  # (worker, blocks held, blocks resumable)
_COUNTERS = (
    "lookups",
    "plans",
    "stored_reports",
    "evicted_reports",
    "blocks_stored",
    "blocks_evicted",
    "stale_evictions",
    "rebuilds",
    "events_dropped",
)


def _cluster_match(cluster: str, found: list[_Found]) -> ClusterMatch:
    if not found:
        return ClusterMatch(cluster, 0, 0, None)
    # `found` is in name order and max() keeps the first of equal keys.
    top = max(found, key=lambda item: (item[2], item[1]))
    return ClusterMatch(cluster, max(item[1] for item in found), top[2], top[0].name)


# Parent markers, and the no-child marker; real hashes are never negative.
ROOT = -1
UNKNOWN = -2
NO_CHILD = -1


class ChainError(PrefixCacheError, ValueError):
    """A report or query that contradicts the hash chain (parent, depth or index)."""


class IntegrityError(PrefixCacheError, AssertionError):
    """`check_integrity` found derived indexes out of step with the held blocks."""


class _Node(msgspec.Struct, gc=False):
    """One block of the tree. Built in C (a report makes tens) and not tracked by the cycle
    collector: a node refers to ints and to its own set of ints only, so it is in no cycle."""

    parent: int  # hash of block depth-1, ROOT, or UNKNOWN
    depth: int  # block index in its chain
    holders: int = 0  # bitmask of holders holding this block's KV
    # Bitmask of holders whose chain is unbroken from block 0 to here, what a lookup probes.
    # Kept on the node rather than in a dict of its own: a report touches each block's node
    # anyway, and on a tree of 10^5 blocks every further dict is a further cache miss.
    complete: int = 0
    # Bitmask of holders that also hold the state snapshot at this block's end (a subset of
    # `holders`): kept here, not in a dict per holder, for the reason `complete` is.
    snaps: int = 0
    # Its children: one hash (NO_CHILD: none) and, from the second child on, a set of the
    # others. Nearly every node has one child or none, and a set each was most of a node's
    # memory (what a report's blocks cost on a tree of 10^5 nodes is mostly memory traffic).
    child: int = NO_CHILD
    more: set[int] | None = None

    def children(self) -> tuple[int, ...]:
        if self.more is None:
            return () if self.child == NO_CHILD else (self.child,)
        return (self.child, *self.more)

    def add_child(self, block: int) -> None:
        if self.child == NO_CHILD:
            self.child = block
        elif self.child != block:
            if self.more is None:
                self.more = {block}
            else:
                self.more.add(block)

    def remove_child(self, block: int) -> None:
        more = self.more
        if more is not None:
            if block == self.child:
                self.child = more.pop()
            else:
                more.discard(block)
            if not more:
                self.more = None
        elif block == self.child:
            self.child = NO_CHILD


class _Holder:
    __slots__ = ("blocks", "resume", "snapshots")

    def __init__(self) -> None:
        # What it holds is on the nodes (`holders`, `snaps`); here only how much.
        self.blocks = 0
        # hash -> resumable blocks along the chain ending here; keys: unbroken chains only
        self.resume: dict[int, int] = {}
        self.snapshots = 0


class PrefixTree:
    """Which holder (small int) holds which blocks, as a tree of hash chains.

    A node exists while someone holds it or one of its descendants (so a refilled gap can
    reconnect the blocks below it). Runs must be checked (`check_run`) before `add_run`.
    """

    def __init__(self) -> None:
        self.nodes: dict[int, _Node] = {}
        self._holders: dict[int, _Holder] = {}
        self._free: list[int] = []
        self.held = 0  # distinct blocks held by anyone

    def add_holder(self) -> int:
        holder = heapq.heappop(self._free) if self._free else len(self._holders)
        self._holders[holder] = _Holder()
        return holder

    def remove_holder(self, holder: int) -> tuple[int, int]:
        """Drop everything `holder` holds; returns (blocks, snapshots) dropped. Goes over
        every node (a worker's restart or removal: rare) to find the holder's blocks."""
        blocks, state = self.blocks_of(holder), self._holders.pop(holder)
        for block in blocks:
            self._hold(block, holder, False)
            self.nodes[block].snaps &= ~(1 << holder)
            if block in state.resume:
                self._set_complete(block, holder, False)
        for block in blocks:
            self._prune(block)
        heapq.heappush(self._free, holder)
        return len(blocks), state.snapshots

    def holds(self, holder: int, block: int) -> bool:
        node = self.nodes.get(block)
        return node is not None and node.holders >> holder & 1 == 1

    def blocks_of(self, holder: int) -> dict[int, bool]:
        """Block -> whether it also holds the snapshot there, for every block `holder` holds
        (built from all the nodes: for integrity checks, references and removal)."""
        bit = 1 << holder
        return {block: bool(node.snaps & bit)
                for block, node in self.nodes.items() if node.holders & bit}

    def totals(self, holder: int) -> tuple[int, int]:
        """(blocks, snapshots) held by `holder`."""
        state = self._holders[holder]
        return state.blocks, state.snapshots

    def check_run(self, run: BlockRun, pending: dict[int, tuple[int, int]]) -> int:
        """Raise ChainError unless the run agrees with the tree and with `pending`; return the
        index into `run.hashes` from which no block is known (to the tree or to `pending`):
        `add_run` makes those blocks' nodes without looking for them.

        `pending` (block -> (parent, depth)) collects runs checked but not yet added, so a batch
        is checked as a whole before any of it is applied.
        """
        _check_run_shape(run)
        above = ROOT if run.parent is None else run.parent
        if run.parent is not None:
            self._expect(run.parent, None, run.first - 1, pending)
            pending.setdefault(run.parent, (UNKNOWN, run.first - 1))
        nodes, known_to = self.nodes, run.first
        for depth, block in enumerate(run.hashes, start=run.first):
            if block in pending or block in nodes:  # else nothing is known to contradict
                self._expect(block, above, depth, pending)
                known_to = depth + 1
            pending[block] = (above, depth)
            above = block
        return known_to - run.first

    def check_lone_run(self, run: BlockRun) -> int:
        """`check_run` of a run checked by itself (a message of one run: nearly every stored
        report). Unless a hash repeats or is the run's parent, nothing the run says of one
        block can contradict what it says of another, so only the tree is asked: no `pending`
        entry is made per block."""
        distinct = set(run.hashes)
        if len(distinct) < len(run.hashes) or run.parent in distinct:
            return self.check_run(run, {})
        _check_run_shape(run)
        if run.parent is not None:
            self._expect(run.parent, None, run.first - 1, {})
        above = ROOT if run.parent is None else run.parent
        nodes, known_to = self.nodes, run.first
        for depth, block in enumerate(run.hashes, start=run.first):
            node = nodes.get(block)
            if node is not None:
                if node.depth != depth or node.parent not in (above, UNKNOWN):
                    raise _conflict(block, above, depth, (node.parent, node.depth))
                known_to = depth + 1
            above = block
        return known_to - run.first

    def add_run(self, holder: int, run: BlockRun, new_from: int | None = None) -> tuple[int, int]:
        """Apply a checked run; returns (blocks, snapshots) newly held. `add_run_reference`
        block by block through the general helpers; here a block the holder did not hold and
        none of whose children it holds (a chain growing at its end, or a chain another worker
        holds reported again: nearly every report) gets its chain state in place, which is all
        `_refresh` would change; any other block goes through `_refresh`. The blocks from
        `new_from` on (what `check_run` returned: none has a node) are made without a probe."""
        if not run.hashes:
            return 0, 0
        nodes, state, bit = self.nodes, self._holders[holder], 1 << holder
        resume = state.resume
        snaps = set(run.snapshot_at)
        above = ROOT if run.parent is None else run.parent
        # The node above each block, carried from the one before (`_link`, inlined: this loop
        # runs for every block of every cache report).
        parent_node = None
        if run.parent is not None:
            parent_node = nodes.get(run.parent)
            if parent_node is None:
                parent_node = nodes[run.parent] = _Node(UNKNOWN, run.first - 1)
        cut = len(run.hashes) if new_from is None else new_from
        new_blocks = new_snaps = 0
        for depth, block in enumerate(run.hashes[:cut], start=run.first):
            node = nodes.get(block)
            if node is None:
                node = nodes[block] = _Node(above, depth)
            elif node.parent == UNKNOWN:
                node.parent = above
            if parent_node is not None and parent_node.child != block:
                parent_node.add_child(block)
            parent_node = node
            had, had_snap, snap = node.holders & bit, node.snaps & bit, depth in snaps
            if snap:
                node.snaps |= bit
            self.held += not node.holders
            node.holders |= bit
            above = block
            if had or (node.child != NO_CHILD
                       and any(nodes[c].holders & bit for c in node.children())):
                self._refresh(holder, block)
                new_blocks += not had
                new_snaps += snap and not had_snap
                continue
            new_blocks += 1
            new_snaps += snap
            base = 0 if node.parent == ROOT else resume.get(node.parent)
            if base is not None:
                resume[block] = node.depth + 1 if snap else base
                node.complete |= bit
        if cut < len(run.hashes):
            tail = self._add_new(holder, run, cut, (above, parent_node), snaps)
            new_blocks, new_snaps = new_blocks + tail[0], new_snaps + tail[1]
        state.blocks += new_blocks
        state.snapshots += new_snaps
        return new_blocks, new_snaps

    def _add_new(self, holder: int, run: BlockRun, cut: int,
                 top: tuple[int, _Node | None], snaps: set[int]) -> tuple[int, int]:
        """`add_run`'s blocks from `cut` on, none of which has a node: each is new, to
        everyone, and childless, so its node and the holder's entries are made outright, and
        its chain state follows from the block above's (carried, not looked up). `top` is the
        block above the first of them and its node (None above block 0)."""
        (above, parent_node), nodes, bit = top, self.nodes, 1 << holder
        resume = self._holders[holder].resume
        base = 0 if above == ROOT else resume.get(above)
        if parent_node is not None:
            parent_node.add_child(run.hashes[cut])
        made: _Node | None = None
        new_snaps = 0
        for depth, block in enumerate(run.hashes[cut:], start=run.first + cut):
            snap = depth in snaps
            new_snaps += snap
            if base is not None:
                base = resume[block] = depth + 1 if snap else base
            node = nodes[block] = _Node(above, depth, bit, 0 if base is None else bit,
                                        bit if snap else 0)
            # The node above, made here too, has this one child.
            if made is not None:
                made.child = block
            made = node
            above = block
        self.held += len(run.hashes) - cut
        return len(run.hashes) - cut, new_snaps

    def add_run_reference(self, holder: int, run: BlockRun) -> tuple[int, int]:
        """Slow, obvious `add_run`: each block linked, held and refreshed by the helpers."""
        state, snaps = self._holders[holder], set(run.snapshot_at)
        above = ROOT if run.parent is None else run.parent
        if not run.hashes:
            return 0, 0
        if run.parent is not None and run.parent not in self.nodes:
            self.nodes[run.parent] = _Node(UNKNOWN, run.first - 1)
        new_blocks = new_snaps = 0
        for depth, block in enumerate(run.hashes, start=run.first):
            self._link(block, above, depth)
            node, snap = self.nodes[block], depth in snaps
            had, had_snap = node.holders >> holder & 1, node.snaps >> holder & 1
            node.snaps |= snap << holder
            self._hold(block, holder, True)
            new_blocks += not had
            new_snaps += snap and not had_snap
            self._refresh(holder, block)
            above = block
        state.blocks += new_blocks
        state.snapshots += new_snaps
        return new_blocks, new_snaps

    def drop(self, holder: int, block: int, snapshot_only: bool = False) -> tuple[int, int]:
        """Evict a block (or only its snapshot); returns (blocks, snapshots) dropped."""
        state, node = self._holders[holder], self.nodes.get(block)
        if node is None or not node.holders >> holder & 1:
            return 0, 0
        snap = node.snaps >> holder & 1
        if snapshot_only and not snap:
            return 0, 0
        node.snaps &= ~(1 << holder)
        if not snapshot_only:
            state.blocks -= 1
            self._hold(block, holder, False)
        state.snapshots -= snap
        self._refresh(holder, block)
        if not snapshot_only:
            self._prune(block)
        return int(not snapshot_only), int(snap)

    def drop_many(self, holder: int, blocks: Iterable[int], snapshots_only: bool = False,
                  ) -> tuple[int, int, int]:
        """Evict blocks (or only their snapshots) as one set; returns (blocks, snapshots,
        stale), stale counting the named blocks (or snapshots) the holder did not hold, as
        `drop_many_reference` (block by block through `drop`) does. Whole blocks go here as a
        set: all of them first, then chain states fixed only below the ones that ended an
        unbroken chain, then pruning. Workers evict a chain from its first block down, so
        block by block each drop would break the chain below it again and walk it; here the
        chain is walked once. Snapshots alone (rare) go through the reference."""
        if snapshots_only:
            return self.drop_many_reference(holder, blocks, snapshots_only)
        state, nodes, keep = self._holders[holder], self.nodes, ~(1 << holder)
        resume = state.resume
        dropped: set[int] = set()
        # Blocks no one holds any more: only they (and so their ancestors) can be pruned.
        unheld: list[int] = []
        broken: list[_Node] = []
        snapshots = stale = 0
        for block in blocks:
            node = nodes.get(block)
            if node is None or not node.holders >> holder & 1:
                stale += 1
                continue
            dropped.add(block)
            snapshots += node.snaps >> holder & 1
            node.snaps &= keep
            node.holders &= keep
            if not node.holders:
                unheld.append(block)
            if resume.pop(block, None) is not None:
                node.complete &= keep
                broken.append(node)
        self.held -= len(unheld)
        state.blocks -= len(dropped)
        state.snapshots -= snapshots
        self._break_chains(holder, broken, dropped)
        for block in reversed(unheld):
            self._prune(block)
        return len(dropped), snapshots, stale

    def drop_many_reference(self, holder: int, blocks: Iterable[int],
                            snapshots_only: bool = False) -> tuple[int, int, int]:
        """Slow, obvious `drop_many`: each block dropped, refreshed and pruned by `drop`."""
        dropped = snapshots = stale = 0
        for block in blocks:
            gone = self.drop(holder, block, snapshots_only)
            dropped, snapshots = dropped + gone[0], snapshots + gone[1]
            stale += gone == (0, 0)
        return dropped, snapshots, stale

    def complete_masks(self) -> dict[int, int]:
        """Block -> bitmask of holders with an unbroken chain to it, for blocks anyone has."""
        return {block: node.complete for block, node in self.nodes.items() if node.complete}

    def held_lengths(self, hashes: Sequence[int], allowed: int) -> list[tuple[int, int]]:
        """(holder bitmask, leading blocks held) for every `allowed` holder holding block 0.

        Binary search for each point where the set of holders with unbroken chains shrinks.
        """
        # A block without a node is on no one's chain: probed as a node with no complete bits.
        nodes, missing, n = self.nodes, _Node(UNKNOWN, -1), len(hashes)
        current = nodes.get(hashes[0], missing).complete & allowed if n else 0
        start, out = 0, []
        while current:
            low, high = start + 1, n
            while low < high:
                middle = (low + high) // 2
                if nodes.get(hashes[middle], missing).complete & current == current:
                    low = middle + 1
                else:
                    high = middle
            self._expect_depth(hashes, low - 1)
            remaining = nodes.get(hashes[low], missing).complete & current if low < n else 0
            out.append((current & ~remaining, low))
            current, start = remaining, low
        return out

    def resumable(self, holder: int, hashes: Sequence[int], held: int) -> int:
        """Resumable blocks of `holder` given its `held` leading blocks of `hashes`."""
        return self._holders[holder].resume[hashes[held - 1]] if held else 0

    def match_reference(self, holder: int, hashes: Sequence[int]) -> tuple[int, int]:
        """Slow, obvious (held, resumable) of `holder`: walk the query block by block."""
        blocks = self.blocks_of(holder)
        held = 0
        while held < len(hashes) and hashes[held] in blocks:
            held += 1
        snapped = [index + 1 for index in range(held) if blocks[hashes[index]]]
        return held, max(snapped, default=0)

    def check_integrity(self) -> None:
        mask = sum(1 << holder for holder in self._holders)
        problems = [p for b, n in self.nodes.items() for p in self._node_problems(b, n, mask)]
        held = sum(1 for node in self.nodes.values() if node.holders)
        if self.held != held:
            problems.append(f"held count {self.held} != {held} blocks held")
        complete: dict[int, int] = {}
        for holder, state in self._holders.items():
            blocks = self.blocks_of(holder)
            expected = self._expected_resume(blocks)
            problems += _differences(f"holder {holder} resume", state.resume, expected)
            counts = (len(blocks), sum(blocks.values()))
            if (state.blocks, state.snapshots) != counts:
                problems.append(f"holder {holder} counts (blocks, snapshots) "
                                f"{(state.blocks, state.snapshots)}, not {counts}")
            for block in expected:
                complete[block] = complete.get(block, 0) | 1 << holder
        problems += _differences("complete", self.complete_masks(), complete)
        used, free = set(self._holders), set(self._free)
        if used & free or used | free != set(range(len(used) + len(free))):
            problems.append(f"holder ids {sorted(used)} and free ids {sorted(free)} overlap/gap")
        if problems:
            raise IntegrityError(f"{len(problems)} problems: " + "; ".join(problems[:8]))

    def _node_problems(self, block: int, node: _Node, mask: int) -> list[str]:
        parent = self.nodes.get(node.parent)
        checks = [
            (node.holders & ~mask == 0, f"holders {node.holders:b} of holders {mask:b}"),
            (node.snaps & ~node.holders == 0, f"snapshots {node.snaps:b} of {node.holders:b}"),
            (bool(node.holders or node.children()), "is held by no one and has no children"),
            (node.more is None or (node.child >= 0 and bool(node.more)
                                   and node.child not in node.more),
             f"keeps its children as {node.child} and {node.more}"),
            (not node.holders or node.parent != UNKNOWN, "is held but has no known parent"),
            (node.parent != ROOT or node.depth == 0, f"is a root at depth {node.depth}"),
            (
                node.parent < 0 or (parent is not None and block in parent.children()
                                    and parent.depth == node.depth - 1),
                f"is not a child of {node.parent} at depth {node.depth}",
            ),
            (all(self.nodes[c].parent == block for c in node.children()), "has foster children"),
        ]
        return [f"block {block} {what}" for ok, what in checks if not ok]

    def _expected_resume(self, blocks: dict[int, bool]) -> dict[int, int]:
        expected: dict[int, int] = {}
        for block in sorted(blocks, key=lambda b: self.nodes[b].depth):
            node = self.nodes[block]
            base = 0 if node.parent == ROOT else expected.get(node.parent)
            if base is not None:
                expected[block] = node.depth + 1 if blocks[block] else base
        return expected

    def _expect(
        self, block: int, parent: int | None, depth: int, pending: dict[int, tuple[int, int]]
    ) -> None:
        node = self.nodes.get(block)
        known = pending.get(block) or ((node.parent, node.depth) if node else None)
        if known is None:
            return
        if known[1] != depth or (parent is not None and known[0] not in (parent, UNKNOWN)):
            raise _conflict(block, parent, depth, known)

    def _expect_depth(self, hashes: Sequence[int], index: int) -> None:
        depth = self.nodes[hashes[index]].depth
        if depth != index:
            raise ChainError(
                f"hashes is not a chain from block 0: hashes[{index}] is block {depth} of its chain"
            )

    def _hold(self, block: int, holder: int, on: bool) -> None:
        node = self.nodes[block]
        was = node.holders
        node.holders = was | 1 << holder if on else was & ~(1 << holder)
        self.held += bool(node.holders) - bool(was)

    def _link(self, block: int, parent: int, depth: int) -> None:
        node = self.nodes.get(block)
        if node is None:
            self.nodes[block] = _Node(parent, depth)
        elif node.parent == UNKNOWN:
            node.parent = parent
        if parent != ROOT:
            self.nodes[parent].add_child(block)

    def _refresh(self, holder: int, block: int) -> None:
        """Recompute `holder`'s chain state at `block` and below it, wherever it changed."""
        state, stack, nodes = self._holders[holder], [block], self.nodes
        while stack:
            current = stack.pop()
            new, old = self._resume_value(holder, current), state.resume.get(current)
            if new == old:
                continue
            if new is None:
                del state.resume[current]
            else:
                state.resume[current] = new
            if (new is None) != (old is None):
                self._set_complete(current, holder, new is not None)
            stack.extend(c for c in nodes[current].children() if nodes[c].holders >> holder & 1)

    def _break_chains(self, holder: int, broken: list[_Node], dropped: set[int]) -> None:
        """`holder`'s chains through the `broken` nodes (whose chain state was just removed)
        no longer reach block 0: remove the chain state, and the complete bit, of every block
        below them. Only held blocks on an unbroken chain have a state, so the walk stops at
        a block without one (nothing below it has one either); the `dropped` blocks have none
        left (asked of that small set rather than of the holder's whole chain state)."""
        resume, nodes, keep = self._holders[holder].resume, self.nodes, ~(1 << holder)
        while broken:
            for child in broken.pop().children():
                if child not in dropped and resume.pop(child, None) is not None:
                    node = nodes[child]
                    node.complete &= keep
                    broken.append(node)

    def _resume_value(self, holder: int, block: int) -> int | None:
        node, resume = self.nodes[block], self._holders[holder].resume
        base = 0 if node.parent == ROOT else resume.get(node.parent)
        if not node.holders >> holder & 1 or base is None:
            return None
        return node.depth + 1 if node.snaps >> holder & 1 else base

    def _set_complete(self, block: int, holder: int, on: bool) -> None:
        node = self.nodes[block]
        node.complete = node.complete | 1 << holder if on else node.complete & ~(1 << holder)

    def _prune(self, block: int) -> None:
        node = self.nodes.get(block)
        while node is not None and not node.holders and node.child == NO_CHILD:
            del self.nodes[block]
            if node.parent < 0:
                return
            parent = self.nodes[node.parent]
            parent.remove_child(block)
            block, node = node.parent, parent


def _check_run_shape(run: BlockRun) -> None:
    first, parent, end = run.first, run.parent, run.first + len(run.hashes)
    if first < 0 or (parent is None) != (first == 0):
        raise ChainError(f"a run needs parent None iff first == 0: first {first}, parent {parent}")
    if run.hashes and not (min(run.hashes) >= 0 and max(run.hashes) <= MAX_HASH):
        # Found in C first: a report names tens of blocks, and this runs for every one.
        for index, block in enumerate(run.hashes):
            check_hash(f"hashes[{index}]", block)
    if parent is not None:
        check_hash("parent", parent)
    bad = [i for i in run.snapshot_at if not first <= i < end]
    if bad:
        raise ChainError(f"snapshot_at {bad} outside the run [{first}, {end})")


def _conflict(block: int, parent: int | None, depth: int, known: tuple[int, int]) -> ChainError:
    return ChainError(f"block {block} reported with parent {parent} at depth {depth}, "
                      f"but it is known with parent {known[0]} at depth {known[1]}")


def _differences(name: str, got: dict[int, int], want: dict[int, int]) -> list[str]:
    keys = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
    return [f"{name}[{k}] is {got.get(k)}, expected {want.get(k)}" for k in keys[:3]]
