"""Which worker holds which prefix blocks and state snapshots, and prefix lookups over them:
`CacheDirectory`, pure state, no I/O (services/cachedir/service.py serves it on the mesh).
Workers' stored/evicted reports go in, prefix matches and transfer plans come out, and typed
`CacheEvent`s collect in an outbox the service drains (the dashboard's feed). Two lengths per
worker, because hybrid models cache two kinds of things (docs/architecture.md section 5):
`blocks_held`, leading blocks whose full-attention KV the worker holds (any held prefix is
usable as KV, so the router uses it for the *transfer plan* to a decode worker: send only the
blocks it lacks, plus the linear-attention states at the new end), and `blocks_resumable`,
the longest held prefix that also ends at a state snapshot (linear and SWA state is reusable
only at exactly the length it was taken, so this is what a prefill worker can *resume
computing* from: the router's l_prfaas and l_pd, paper section 3.3). Queries must be hash
chains from block 0 (`services.contract.prefix.block_hashes` or `chain_from_ids`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Literal

import msgspec

from mesh import native
from services.cachedir.prefix_tree import IntegrityError, PrefixTree
from services.contract.errors import UnknownWorkerError
from services.contract.messages import (
    BlockRun,
    BlocksEvicted,
    BlocksStored,
    ClusterMatch,
    PrefixMatch,
    TransferPlan,
    WorkerMatch,
    WorkerReport,
)
from services.contract.types import Role


def loop_time() -> float:
    """The running loop's clock, read as `anyio.current_time` reads it but without its
    backend lookup (an event is stamped for every cache report): the service's clock."""
    return native.clock()()


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
