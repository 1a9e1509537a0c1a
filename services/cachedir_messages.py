"""The cache directory's typed messages: what workers report, what lookups and plans answer.

Workers send `BlocksStored`, `BlocksEvicted` and (after a directory restart) `WorkerReport`;
the router asks with `PrefixQuery` and gets a `PrefixMatch` or a `TransferPlan` back. The
directory (services.cachedir.CacheDirectory) emits `CacheEvent`s and reports
`CacheDirectoryStatistics`. Block runs and hashes are those of services.prefix_tree and
services.prefix.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from services.prefix import BlockHash
from services.prefix_tree import BlockRun, PrefixCacheError

Role = Literal["prefill", "decode"]
EventKind = Literal["stored", "evicted", "forgotten", "replaced", "rebuilt"]


class UnknownWorkerError(PrefixCacheError, LookupError):
    """A worker or cluster name the directory does not know."""


class BlocksStored(msgspec.Struct, frozen=True, tag=True):
    worker: str
    runs: list[BlockRun]


class BlocksEvicted(msgspec.Struct, frozen=True, tag=True):
    """Blocks dropped; with `snapshots_only` their KV stays and only their snapshots go."""

    worker: str
    hashes: list[BlockHash]
    snapshots_only: bool = False


class WorkerReport(msgspec.Struct, frozen=True, tag=True):
    """A worker's whole cache, sent after a directory restart (or to re-sync one worker)."""

    worker: str
    cluster: str
    role: Role
    runs: list[BlockRun]


class PrefixQuery(msgspec.Struct, frozen=True, tag=True):
    hashes: list[BlockHash]
    role: Role | None = None


class WorkerMatch(msgspec.Struct, frozen=True):
    worker: str
    cluster: str
    role: Role
    blocks_held: int
    blocks_resumable: int


class ClusterMatch(msgspec.Struct, frozen=True):
    """Per-cluster maxima; `best_worker` resumes most (ties: holds most, then first by name)."""

    cluster: str
    blocks_held: int
    blocks_resumable: int
    best_worker: str | None


class PrefixMatch(msgspec.Struct, frozen=True):
    """`workers`: those holding at least block 0, by name. `clusters`: every cluster, by name."""

    n_blocks: int
    workers: list[WorkerMatch]
    clusters: list[ClusterMatch]

    def cluster(self, name: str) -> ClusterMatch:
        for match in self.clusters:
            if match.cluster == name:
                return match
        raise UnknownWorkerError(f"cluster {name!r} has no registered workers")


class TransferPlan(msgspec.Struct, frozen=True):
    """What `target_worker` lacks of a request's blocks. `send`: every block index from its
    first missing one (`target_held`) on that it does not hold; those below `source_held` can
    come from the source's cache, the rest must be computed. `states_needed` is False only if
    the target can resume at the last hashed block (a partial tail block always needs them)."""

    n_blocks: int
    target_worker: str
    target_held: int
    target_resumable: int
    source_worker: str | None
    source_held: int
    cross_cluster: bool
    send: list[int]
    states_needed: bool


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
