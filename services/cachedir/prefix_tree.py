"""The held prefix blocks as the tree their hash chains (services.contract.prefix) form:
`PrefixTree`, the directory's index (each block knows its parent and depth) and, per holder
(a small int the directory maps workers onto), which blocks close an unbroken chain from
block 0. Along a query chain the set of holders with an unbroken chain only shrinks, so the
longest held prefix of every holder is found by binary search: O(distinct lengths * log(query
blocks)) dict probes, however many blocks are cached.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import msgspec

from services.contract.errors import PrefixCacheError
from services.contract.messages import (
    BlockRun,
)
from services.contract.prefix import MAX_HASH, check_hash

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
