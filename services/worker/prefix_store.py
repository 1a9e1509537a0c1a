"""A worker's own prefix cache: request caches indexed by their block hash chain, LRU by bytes.

Each entry is one `RequestCache` (full-attention KV of its tokens, plus state snapshots at
block boundaries) and the hash chain of its full blocks (services.contract.prefix). Because a block
hash names its whole prefix, an entry holding hash h at block i holds every block before it,
so "how many leading blocks of this prompt do I hold" is a search over the chain.

Two lengths matter (as in the cache directory): blocks *held* (KV reusable as a base for an
import: the decode side) and blocks *resumable* (held and ending at a state snapshot: where a
prefill can restart computing). Entries are evicted least recently used first when their
bytes exceed the budget; an entry whose chain a newer entry extends is folded into it (its
snapshots move over). Every change comes back as the cache directory's own messages
(`BlocksStored`, `BlocksEvicted`), ready to cast. The store is pure state, no I/O;
`CacheReporter` casts its changes to the cache directory in order (after a lost cast, the
whole cache first), so the workers that store hand each change straight to it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import msgspec

from mesh.errors import MeshError
from mesh.node import Node
from services.contract.errors import PrefixCacheError
from services.contract.messages import (
    BlockRun,
    BlocksEvicted,
    BlocksStored,
    CacheReport,
    WorkerReport,
)
from services.contract.prefix import extend_hashes
from services.contract.types import Role
from services.model.cache import RequestCache, StateSnapshot

log = logging.getLogger(__name__)

MIB = 2**20


class PrefixStoreError(ValueError):
    """A store operation got a chain or cache that does not fit; names the value."""


def prompt_hashes(tokens: Sequence[int], block_size: int,
                  known: Sequence[int] = ()) -> list[int]:
    """The hash chain of `tokens`' full blocks, as every service computes it (seed 0);
    `known`, the chain of its first blocks as a request brought it, is not hashed again."""
    if not tokens:
        return []
    return extend_hashes(tokens if isinstance(tokens, list) else list(tokens), block_size,
                         known)


class PrefixStoreConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    budget_bytes: int = 256 * MIB

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise PrefixStoreError(f"budget_bytes must be >= 0, got {self.budget_bytes}")


class LocalMatch(msgspec.Struct, frozen=True):
    """Leading blocks of a chain this store holds, and those it can resume computing from."""

    held: int
    resumable: int


class StoreChange(msgspec.Struct, frozen=True):
    """What one `store` did, as messages for the cache directory (None / [] when nothing)."""

    stored: BlocksStored | None
    evicted: list[BlocksEvicted]

    def reports(self) -> list[CacheReport]:
        """The messages in the order the directory must apply them."""
        return [self.stored, *self.evicted] if self.stored is not None else [*self.evicted]


class PrefixStoreStatistics(msgspec.Struct, frozen=True):
    entries: int
    blocks: int  # distinct block hashes held
    snapshots: int
    bytes: int
    budget_bytes: int
    stores: int
    folded: int  # entries merged into a newer entry extending them
    evictions: int  # entries evicted for the budget
    blocks_evicted: int
    hits: int  # resume / base lookups that found something
    misses: int


@dataclass(slots=True)
class _Entry:
    id: int
    hashes: tuple[int, ...]
    cache: RequestCache
    nbytes: int
    # Block counts n with a snapshot at n * block_size. Taken once: a stored cache is not
    # changed (check_integrity compares), and the store asks for it per block of a chain.
    snapshot_blocks: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.snapshot_blocks = _snapshot_blocks(self.cache)


def _snapshot_blocks(cache: RequestCache) -> frozenset[int]:
    block = cache.cfg.block_size
    return frozenset([length // block for length in cache.snapshots])


class PrefixStore:
    """Prefix caches of one worker, within `config.budget_bytes`."""

    def __init__(self, worker: str, block_size: int, config: PrefixStoreConfig | None = None):
        self.worker = worker
        self.block_size = block_size
        self.config = config or PrefixStoreConfig()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        # hash -> ids of the entries holding it, ascending (the order they were stored in).
        # Tuples: most blocks have one holder, and a new entry's blocks share its 1-tuple,
        # no allocation per block (a dict per block was one).
        self._by_hash: dict[int, tuple[int, ...]] = {}
        self._next_id = 0
        self._bytes = 0
        self._counts = dict.fromkeys(("stores", "folded", "evictions", "blocks_evicted",
                                      "hits", "misses"), 0)

    def match(self, hashes: Sequence[int]) -> LocalMatch:
        held = self._held(hashes)
        return LocalMatch(held, self._resumable(hashes, held)[0])

    def resume(self, hashes: Sequence[int], max_blocks: int) -> RequestCache | None:
        """A fresh cache at the longest resumable prefix of at most `max_blocks` blocks."""
        held = min(self._held(hashes), max_blocks)
        blocks, entry = self._resumable(hashes, held)
        if entry is None:
            self._counts["misses"] += 1
            return None
        self._touch(entry)
        return entry.cache.resume_point(blocks * self.block_size)

    def kv_base(self, hashes: Sequence[int], blocks: int) -> RequestCache:
        """A (shared, read-only) cache holding the KV of the chain's first `blocks` blocks."""
        if blocks < 1 or blocks > len(hashes):
            raise PrefixStoreError(f"blocks must be in [1, {len(hashes)}], got {blocks}")
        holders = self._by_hash.get(hashes[blocks - 1], ())
        if not holders:
            self._counts["misses"] += 1
            raise PrefixStoreError(
                f"worker {self.worker!r} holds no KV for the first {blocks} blocks "
                f"(holds {self._held(hashes)})"
            )
        entry = self._entries[holders[0]]
        self._touch(entry)
        return entry.cache

    def store(self, hashes: Sequence[int], cache: RequestCache) -> StoreChange:
        """Keep `cache` (now owned by the store) under `hashes`, its full blocks' chain.

        `stored` is None when the store held every block of the chain already, with a
        snapshot wherever the new entry has one: the directory, told of each block and
        snapshot as it came, learns nothing from it (a hot prefix stored again by every
        request that reuses it)."""
        self._check_chain(hashes, cache)
        if not hashes:
            return StoreChange(None, [])
        leading = self._held(hashes)
        held = leading == len(hashes)
        snapshots_held = ({n for n in range(1, len(hashes) + 1)
                           if self._snapshot_left(hashes[n - 1], n)} if held else set())
        # An entry this chain extends ends at a held block: among the leading ones.
        for old in self.prefixes_of(hashes[:leading]):
            self._fold(old, cache)
        # A cache that ends at a block boundary is resumable there (a fold may have brought
        # that snapshot already: the state at the same block of the same chain).
        if cache.length % self.block_size == 0 and cache.length not in cache.snapshots:
            cache.add_snapshot(StateSnapshot(cache.length, cache.request_states()))
        entry = _Entry(self._next_id, tuple(hashes), cache, cache.held_bytes())
        self._next_id += 1
        if entry.nbytes > self.config.budget_bytes:
            return StoreChange(None, [])
        self._add(entry)
        self._counts["stores"] += 1
        evicted = self._evict_over_budget(keep=entry.id)
        if held and entry.snapshot_blocks <= snapshots_held:
            return StoreChange(None, evicted)
        return StoreChange(BlocksStored(self.worker, [self._run(entry)]), evicted)

    def report(self, cluster: str, role: Role) -> WorkerReport:
        """Every entry's chain: the full report the cache directory rebuilds itself from."""
        return WorkerReport(self.worker, cluster, role,
                            [self._run(e) for e in self._entries.values()])

    @property
    def blocks(self) -> int:
        """Distinct blocks held (what the worker's status reports, at every poll)."""
        return len(self._by_hash)

    def statistics(self) -> PrefixStoreStatistics:
        return PrefixStoreStatistics(
            entries=len(self._entries),
            blocks=len(self._by_hash),
            snapshots=sum(len(e.cache.snapshots) for e in self._entries.values()),
            bytes=self._bytes,
            budget_bytes=self.config.budget_bytes,
            **self._counts,
        )

    def check_integrity(self) -> None:
        index: dict[int, tuple[int, ...]] = {}
        for entry in sorted(self._entries.values(), key=lambda e: e.id):
            if entry.cache.length < len(entry.hashes) * self.block_size:
                raise PrefixStoreError(f"entry {entry.id}: cache length {entry.cache.length} "
                                       f"< {len(entry.hashes)} blocks")
            entry.cache.check_integrity()
            if entry.snapshot_blocks != _snapshot_blocks(entry.cache):
                raise PrefixStoreError(f"entry {entry.id}: its cache's snapshots changed")
            for h in entry.hashes:
                index[h] = (*index.get(h, ()), entry.id)
        if index != self._by_hash:
            raise PrefixStoreError("hash index does not match the entries")
        total = sum(e.nbytes for e in self._entries.values())
        if total != self._bytes or total > max(self.config.budget_bytes, 0):
            raise PrefixStoreError(f"bytes {self._bytes} != {total} or over the budget")

    def _held(self, hashes: Sequence[int]) -> int:
        """Leading blocks held: held-ness only shrinks along a chain, so binary search."""
        low, high = 0, len(hashes)
        while low < high:
            mid = (low + high + 1) // 2
            if self._by_hash.get(hashes[mid - 1]):
                low = mid
            else:
                high = mid - 1
        return low

    def _resumable(self, hashes: Sequence[int], held: int) -> tuple[int, _Entry | None]:
        for blocks in range(held, 0, -1):
            for entry_id in self._by_hash[hashes[blocks - 1]]:
                entry = self._entries[entry_id]
                if blocks in entry.snapshot_blocks:
                    self._counts["hits"] += 1
                    return blocks, entry
        return 0, None

    def _check_chain(self, hashes: Sequence[int], cache: RequestCache) -> None:
        full = cache.length // self.block_size
        if len(hashes) != full:
            raise PrefixStoreError(f"hashes must name the cache's {full} full blocks, "
                                   f"got {len(hashes)}")

    def _extends(self, hashes: Sequence[int], old: _Entry) -> bool:
        n = len(old.hashes)
        return n <= len(hashes) and hashes[n - 1] == old.hashes[-1]

    def prefixes_of(self, hashes: Sequence[int]) -> list[_Entry]:
        """The entries whose chain `hashes` extends, found through the block index: an entry
        qualifies when its last block is block i of `hashes` (a hash names its whole chain)."""
        found = []
        for i, block_hash in enumerate(hashes):
            for entry_id in self._by_hash.get(block_hash, ()):
                entry = self._entries[entry_id]
                if len(entry.hashes) == i + 1 and entry.hashes[i] == block_hash:
                    found.append(entry)
        return sorted(found, key=lambda e: e.id)

    def prefixes_of_reference(self, hashes: Sequence[int]) -> list[_Entry]:
        """`prefixes_of` by a scan of every entry (the slow, obvious reference)."""
        return sorted((e for e in self._entries.values() if self._extends(hashes, e)),
                      key=lambda e: e.id)

    def _fold(self, old: _Entry, cache: RequestCache) -> None:
        """The new cache holds all of `old`'s blocks: take its snapshots, drop it quietly."""
        for length, snapshot in old.cache.snapshots.items():
            if length <= len(old.hashes) * self.block_size:
                cache.snapshots.setdefault(length, snapshot)
        self._remove(old)
        self._counts["folded"] += 1

    def _add(self, entry: _Entry) -> None:
        self._entries[entry.id] = entry
        by_hash, alone = self._by_hash, (entry.id,)
        for h in entry.hashes:
            holders = by_hash.get(h)
            # Ids only grow: the new entry's comes last, and the holders stay ascending.
            by_hash[h] = alone if holders is None else holders + alone
        self._bytes += entry.nbytes

    def _remove(self, entry: _Entry) -> list[int]:
        """Drop `entry`; the hashes it held alone (no entry holds them now), in chain order."""
        del self._entries[entry.id]
        by_hash, gone = self._by_hash, entry.id
        freed: list[int] = []
        for h in entry.hashes:
            holders = by_hash[h]
            if len(holders) == 1:
                del by_hash[h]
                freed.append(h)
            else:
                by_hash[h] = tuple(i for i in holders if i != gone)
        self._bytes -= entry.nbytes
        return freed

    def _touch(self, entry: _Entry) -> None:
        self._entries.move_to_end(entry.id)

    def _evict_over_budget(self, keep: int) -> list[BlocksEvicted]:
        gone: list[int] = []
        snapshots_gone: list[int] = []
        while self._bytes > self.config.budget_bytes:
            victim = next(e for e in self._entries.values() if e.id != keep)
            gone += self._remove(victim)
            self._counts["evictions"] += 1
            # A block another entry still holds may have lost its last snapshot (only the
            # chain's blocks count: a snapshot length past them names none).
            for n in sorted(victim.snapshot_blocks):
                h = victim.hashes[n - 1] if 0 < n <= len(victim.hashes) else None
                if h in self._by_hash and not self._snapshot_left(h, n):
                    snapshots_gone.append(h)
        self._counts["blocks_evicted"] += len(gone)
        out = [BlocksEvicted(self.worker, gone)] if gone else []
        if snapshots_gone:
            out.append(BlocksEvicted(self.worker, snapshots_gone, snapshots_only=True))
        return out

    def _snapshot_left(self, block_hash: int, blocks: int) -> bool:
        return any(blocks in self._entries[i].snapshot_blocks for i in self._by_hash[block_hash])

    def _run(self, entry: _Entry) -> BlockRun:
        return BlockRun(list(entry.hashes), [n - 1 for n in sorted(entry.snapshot_blocks)])


class CacheReporter:
    """Casts cache changes to the directory in order; after a lost cast, a full report first.

    With `hand_over` (the simulation, whose cache directory runs in this event loop: its
    `CacheDirService.take`), each change is handed to the directory in process as it is
    submitted, in order, without a cast; a report the directory refuses is logged, as its
    cast's handler would log it."""

    def __init__(
        self, node: Node, cachedir: str | None, full: Callable[[], WorkerReport], *,
        hand_over: Callable[[CacheReport], None] | None = None,
    ) -> None:
        self._node = node
        self._cachedir = cachedir
        self._full = full
        self._hand_over = hand_over
        self._queue: deque[CacheReport] = deque()
        self._wakeup = anyio.Event()
        self._stale = True  # the directory may not know us yet: start with a full report

    def submit(self, change: StoreChange) -> None:
        if self._cachedir is None:
            return
        if self._hand_over is not None and not self._stale:
            # Nothing is queued once the full report is out: this is the next in order.
            for report in change.reports():
                self._give(report)
            return
        self._queue.extend(change.reports())
        self._wakeup.set()

    def resync(self) -> None:
        """Send the whole cache next (the role changed, or the directory asked)."""
        self._stale = True
        self._wakeup.set()

    async def run(self) -> None:
        self._wakeup.set()  # report the whole cache at once: the directory may be new
        while self._cachedir is not None:
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
            await self._deliver()

    async def _deliver(self) -> None:
        assert self._cachedir is not None
        try:
            if self._stale:
                self._queue.clear()  # the full report covers them
                await self._send(self._full())
                self._stale = False
            while self._queue:
                await self._send(self._queue[0])
                self._queue.popleft()
        except MeshError as exc:
            self._stale = True
            log.warning("cache report to %s lost (%s); a full report follows", self._cachedir,
                        exc)

    async def _send(self, report: CacheReport) -> None:
        assert self._cachedir is not None
        if self._hand_over is None:
            await self._node.cast(self._cachedir, report, timeout=5.0)
        else:
            self._give(report)

    def _give(self, report: CacheReport) -> None:
        assert self._hand_over is not None
        try:
            self._hand_over(report)
        except PrefixCacheError as exc:
            log.warning("cache report %s refused by %s: %s: %s", type(report).__name__,
                        self._cachedir, type(exc).__name__, exc)
