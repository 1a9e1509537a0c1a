"""The tree of held prefix blocks: which holder holds which blocks of which hash chains.

`PrefixTree` keeps held blocks as the tree their hash chains (services.contract.prefix) form (each
block knows its parent and depth) and, per holder, which blocks close an unbroken chain from
block 0. Along a query chain the set of holders with an unbroken chain only shrinks, so the
longest held prefix of every holder is found by binary search: O(distinct lengths * log(query
blocks)) dict probes, however many blocks are cached. `services.cachedir.directory.CacheDirectory`
maps
workers onto holders.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from services.contract.errors import PrefixCacheError
from services.contract.messages import BlockRun
from services.contract.prefix import check_hash

# Parent markers; real hashes are never negative.
ROOT = -1
UNKNOWN = -2


class ChainError(PrefixCacheError, ValueError):
    """A report or query that contradicts the hash chain (parent, depth or index)."""


class IntegrityError(PrefixCacheError, AssertionError):
    """`check_integrity` found derived indexes out of step with the held blocks."""


class _Node:
    __slots__ = ("children", "depth", "holders", "parent")

    def __init__(self, parent: int, depth: int) -> None:
        self.parent = parent  # hash of block depth-1, ROOT, or UNKNOWN
        self.depth = depth  # block index in its chain
        self.children: set[int] = set()
        self.holders = 0  # bitmask of holders holding this block's KV


class _Holder:
    __slots__ = ("blocks", "resume", "snapshots")

    def __init__(self) -> None:
        # hash -> also holds the state snapshot at this block's end
        self.blocks: dict[int, bool] = {}
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
        self.complete: dict[int, int] = {}  # hash -> bitmask of holders with unbroken chains
        self._holders: dict[int, _Holder] = {}
        self._free: list[int] = []
        self.held = 0  # distinct blocks held by anyone

    def add_holder(self) -> int:
        holder = heapq.heappop(self._free) if self._free else len(self._holders)
        self._holders[holder] = _Holder()
        return holder

    def remove_holder(self, holder: int) -> tuple[int, int]:
        """Drop everything `holder` holds; returns (blocks, snapshots) dropped."""
        state = self._holders.pop(holder)
        for block in state.blocks:
            self._hold(block, holder, False)
            if block in state.resume:
                self._set_complete(block, holder, False)
        for block in state.blocks:
            self._prune(block)
        heapq.heappush(self._free, holder)
        return len(state.blocks), state.snapshots

    def holds(self, holder: int, block: int) -> bool:
        return block in self._holders[holder].blocks

    def totals(self, holder: int) -> tuple[int, int]:
        """(blocks, snapshots) held by `holder`."""
        state = self._holders[holder]
        return len(state.blocks), state.snapshots

    def check_run(self, run: BlockRun, pending: dict[int, tuple[int, int]]) -> None:
        """Raise ChainError unless the run agrees with the tree and with `pending`.

        `pending` (block -> (parent, depth)) collects runs checked but not yet added, so a batch
        is checked as a whole before any of it is applied.
        """
        _check_run_shape(run)
        above = ROOT if run.parent is None else run.parent
        if run.parent is not None:
            self._expect(run.parent, None, run.first - 1, pending)
            pending.setdefault(run.parent, (UNKNOWN, run.first - 1))
        for depth, block in enumerate(run.hashes, start=run.first):
            self._expect(block, above, depth, pending)
            pending[block] = (above, depth)
            above = block

    def add_run(self, holder: int, run: BlockRun) -> tuple[int, int]:
        """Apply a checked run; returns (blocks, snapshots) newly held."""
        state, snaps = self._holders[holder], set(run.snapshot_at)
        above = ROOT if run.parent is None else run.parent
        if not run.hashes:
            return 0, 0
        if run.parent is not None and run.parent not in self.nodes:
            self.nodes[run.parent] = _Node(UNKNOWN, run.first - 1)
        new_blocks = new_snaps = 0
        for depth, block in enumerate(run.hashes, start=run.first):
            self._link(block, above, depth)
            had = state.blocks.get(block)
            snap = depth in snaps
            state.blocks[block] = bool(had) or snap
            self._hold(block, holder, True)
            new_blocks += had is None
            new_snaps += snap and not had
            self._refresh(holder, block)
            above = block
        state.snapshots += new_snaps
        return new_blocks, new_snaps

    def drop(self, holder: int, block: int, snapshot_only: bool = False) -> tuple[int, int]:
        """Evict a block (or only its snapshot); returns (blocks, snapshots) dropped."""
        state = self._holders[holder]
        snap = state.blocks.get(block)
        if snap is None or (snapshot_only and not snap):
            return 0, 0
        if snapshot_only:
            state.blocks[block] = False
        else:
            del state.blocks[block]
            self._hold(block, holder, False)
        state.snapshots -= snap
        self._refresh(holder, block)
        if not snapshot_only:
            self._prune(block)
        return int(not snapshot_only), int(snap)

    def held_lengths(self, hashes: Sequence[int], allowed: int) -> list[tuple[int, int]]:
        """(holder bitmask, leading blocks held) for every `allowed` holder holding block 0.

        Binary search for each point where the set of holders with unbroken chains shrinks.
        """
        probe, n = self.complete.get, len(hashes)
        current = probe(hashes[0], 0) & allowed if n else 0
        start, out = 0, []
        while current:
            low, high = start + 1, n
            while low < high:
                middle = (low + high) // 2
                if probe(hashes[middle], 0) & current == current:
                    low = middle + 1
                else:
                    high = middle
            self._expect_depth(hashes, low - 1)
            remaining = probe(hashes[low], 0) & current if low < n else 0
            out.append((current & ~remaining, low))
            current, start = remaining, low
        return out

    def resumable(self, holder: int, hashes: Sequence[int], held: int) -> int:
        """Resumable blocks of `holder` given its `held` leading blocks of `hashes`."""
        return self._holders[holder].resume[hashes[held - 1]] if held else 0

    def match_reference(self, holder: int, hashes: Sequence[int]) -> tuple[int, int]:
        """Slow, obvious (held, resumable) of `holder`: walk the query block by block."""
        blocks = self._holders[holder].blocks
        held = 0
        while held < len(hashes) and hashes[held] in blocks:
            held += 1
        snapped = [index + 1 for index in range(held) if blocks[hashes[index]]]
        return held, max(snapped, default=0)

    def check_integrity(self) -> None:
        holders = self._expected_holders()
        problems = [p for b, n in self.nodes.items() for p in self._node_problems(b, n, holders)]
        problems += [f"held block {b} has no node" for b in holders if b not in self.nodes]
        if self.held != len(holders):
            problems.append(f"held count {self.held} != {len(holders)} blocks held")
        complete: dict[int, int] = {}
        for holder, state in self._holders.items():
            expected = self._expected_resume(state)
            problems += _differences(f"holder {holder} resume", state.resume, expected)
            if state.snapshots != sum(state.blocks.values()):
                problems.append(f"holder {holder} counts {state.snapshots} snapshots, wrongly")
            for block in expected:
                complete[block] = complete.get(block, 0) | 1 << holder
        problems += _differences("complete", self.complete, complete)
        used, free = set(self._holders), set(self._free)
        if used & free or used | free != set(range(len(used) + len(free))):
            problems.append(f"holder ids {sorted(used)} and free ids {sorted(free)} overlap/gap")
        if problems:
            raise IntegrityError(f"{len(problems)} problems: " + "; ".join(problems[:8]))

    def _node_problems(self, block: int, node: _Node, holders: dict[int, int]) -> list[str]:
        parent = self.nodes.get(node.parent)
        checks = [
            (node.holders == holders.get(block, 0), f"holders {node.holders:b}"),
            (bool(node.holders or node.children), "is held by no one and has no children"),
            (not node.holders or node.parent != UNKNOWN, "is held but has no known parent"),
            (node.parent != ROOT or node.depth == 0, f"is a root at depth {node.depth}"),
            (
                node.parent < 0 or (parent is not None and block in parent.children
                                    and parent.depth == node.depth - 1),
                f"is not a child of {node.parent} at depth {node.depth}",
            ),
            (all(self.nodes[c].parent == block for c in node.children), "has foster children"),
        ]
        return [f"block {block} {what}" for ok, what in checks if not ok]

    def _expected_holders(self) -> dict[int, int]:
        holders: dict[int, int] = {}
        for holder, state in self._holders.items():
            for block in state.blocks:
                holders[block] = holders.get(block, 0) | 1 << holder
        return holders

    def _expected_resume(self, state: _Holder) -> dict[int, int]:
        expected: dict[int, int] = {}
        known = [b for b in state.blocks if b in self.nodes]
        for block in sorted(known, key=lambda b: self.nodes[b].depth):
            node = self.nodes[block]
            base = 0 if node.parent == ROOT else expected.get(node.parent)
            if base is not None:
                expected[block] = node.depth + 1 if state.blocks[block] else base
        return expected

    def _expect(
        self, block: int, parent: int | None, depth: int, pending: dict[int, tuple[int, int]]
    ) -> None:
        node = self.nodes.get(block)
        known = pending.get(block) or ((node.parent, node.depth) if node else None)
        if known is None:
            return
        if known[1] != depth or (parent is not None and known[0] not in (parent, UNKNOWN)):
            raise ChainError(
                f"block {block} reported with parent {parent} at depth {depth}, "
                f"but it is known with parent {known[0]} at depth {known[1]}"
            )

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
            self.nodes[parent].children.add(block)

    def _refresh(self, holder: int, block: int) -> None:
        """Recompute `holder`'s chain state at `block` and below it, wherever it changed."""
        state, stack = self._holders[holder], [block]
        while stack:
            current = stack.pop()
            new, old = self._resume_value(state, current), state.resume.get(current)
            if new == old:
                continue
            if new is None:
                del state.resume[current]
            else:
                state.resume[current] = new
            if (new is None) != (old is None):
                self._set_complete(current, holder, new is not None)
            stack.extend(c for c in self.nodes[current].children if c in state.blocks)

    def _resume_value(self, state: _Holder, block: int) -> int | None:
        snap = state.blocks.get(block)
        node = self.nodes[block]
        base = 0 if node.parent == ROOT else state.resume.get(node.parent)
        if snap is None or base is None:
            return None
        return node.depth + 1 if snap else base

    def _set_complete(self, block: int, holder: int, on: bool) -> None:
        mask = self.complete.get(block, 0)
        mask = mask | 1 << holder if on else mask & ~(1 << holder)
        if mask:
            self.complete[block] = mask
        else:
            del self.complete[block]

    def _prune(self, block: int) -> None:
        node = self.nodes.get(block)
        while node is not None and not node.holders and not node.children:
            del self.nodes[block]
            if node.parent < 0:
                return
            parent = self.nodes[node.parent]
            parent.children.discard(block)
            block, node = node.parent, parent


def _check_run_shape(run: BlockRun) -> None:
    first, parent, end = run.first, run.parent, run.first + len(run.hashes)
    if first < 0 or (parent is None) != (first == 0):
        raise ChainError(f"a run needs parent None iff first == 0: first {first}, parent {parent}")
    for index, block in enumerate(run.hashes):
        check_hash(f"hashes[{index}]", block)
    if parent is not None:
        check_hash("parent", parent)
    bad = [i for i in run.snapshot_at if not first <= i < end]
    if bad:
        raise ChainError(f"snapshot_at {bad} outside the run [{first}, {end})")


def _differences(name: str, got: dict[int, int], want: dict[int, int]) -> list[str]:
    keys = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
    return [f"{name}[{k}] is {got.get(k)}, expected {want.get(k)}" for k in keys[:3]]
