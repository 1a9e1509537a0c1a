"""Tests for services.cachedir.prefix_tree: the PrefixTree of held chains."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachedir.prefix_tree import ChainError, IntegrityError, PrefixTree
from services.contract.messages import BlockRun
from services.contract.prefix import chain_from_ids


def test_tree_reconnects_a_refilled_gap_and_prunes() -> None:
    tree, chain = PrefixTree(), chain_from_ids(range(6))
    holder = tree.add_holder()
    tree.check_run(BlockRun(chain, [5]), {})
    assert tree.add_run(holder, BlockRun(chain, [5])) == (6, 1)
    assert tree.drop(holder, chain[2]) == (1, 0)
    assert tree.held_lengths(chain, -1) == [(1 << holder, 2)]
    assert tree.resumable(holder, chain, 2) == 0
    tree.check_run(BlockRun(chain[2:3], first=2, parent=chain[1]), {})
    tree.add_run(holder, BlockRun(chain[2:3], first=2, parent=chain[1]))
    assert tree.held_lengths(chain, -1) == [(1 << holder, 6)]
    assert tree.resumable(holder, chain, 6) == 6
    tree.check_integrity()
    assert tree.remove_holder(holder) == (6, 1)
    assert tree.nodes == {}
    assert tree.complete_masks() == {}
    tree.check_integrity()


def test_tree_unknown_parent_placeholder_and_conflicts() -> None:
    tree, chain = PrefixTree(), chain_from_ids(range(4))
    holder = tree.add_holder()
    tree.check_run(BlockRun(chain[2:], first=2, parent=chain[1]), {})
    tree.add_run(holder, BlockRun(chain[2:], first=2, parent=chain[1]))
    assert tree.held_lengths(chain, -1) == []  # blocks 0 and 1 are missing
    assert tree.match_reference(holder, chain) == (0, 0)
    tree.check_integrity()
    with pytest.raises(ChainError, match="depth 3"):
        tree.check_run(BlockRun([chain[1]], first=3, parent=chain[0]), {})
    with pytest.raises(ChainError, match=f"parent {chain[0]}"):
        tree.check_run(BlockRun([chain[3]], first=3, parent=chain[0]), {})
    with pytest.raises(ChainError, match="parent None iff first == 0"):
        tree.check_run(BlockRun([chain[0]], first=1), {})
    with pytest.raises(ChainError, match=r"snapshot_at \[0\]"):
        tree.check_run(BlockRun([chain[3]], [0], first=3, parent=chain[2]), {})
    pending: dict[int, tuple[int, int]] = {}
    tree.check_run(BlockRun([101, 102]), pending)
    with pytest.raises(ChainError, match="block 102"):
        tree.check_run(BlockRun([102]), pending)


def test_tree_rejects_a_query_that_does_not_start_at_block_0() -> None:
    tree, chain = PrefixTree(), chain_from_ids(range(4))
    tree.add_run(tree.add_holder(), BlockRun(chain))
    with pytest.raises(ChainError, match=r"not a chain from block 0: hashes\[2\] is block 3"):
        tree.held_lengths(chain[1:], -1)


def test_integrity_check_catches_corruption() -> None:
    tree, chain = PrefixTree(), chain_from_ids(range(3))
    tree.add_run(tree.add_holder(), BlockRun(chain))
    tree.nodes[chain[2]].complete = 0b10
    with pytest.raises(IntegrityError, match=r"complete\[\d+\] is 2, expected 1"):
        tree.check_integrity()



def test_integrity_check_names_node_problems() -> None:
    tree, chain = PrefixTree(), chain_from_ids(range(3))
    tree.add_run(tree.add_holder(), BlockRun(chain))
    tree.nodes[chain[1]].depth = 5
    tree.nodes[chain[0]].holders = 0b100
    with pytest.raises(IntegrityError, match="holders 100") as caught:
        tree.check_integrity()
    assert f"block {chain[2]} is not a child of {chain[1]} at depth 2" in str(caught.value)


def tree_state(tree: PrefixTree) -> tuple[object, ...]:
    """Everything a tree holds, to compare two trees."""
    nodes = {b: (n.parent, n.depth, sorted(n.children()), n.holders, n.snaps)
             for b, n in tree.nodes.items()}
    holders = {h: (tree.blocks_of(h), dict(s.resume), s.blocks, s.snapshots)
               for h, s in tree._holders.items()}
    return nodes, tree.complete_masks(), tree.held, holders


CHAINS = [chain_from_ids(ids) for ids in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 10, 11, 12],
                                          [0, 20, 21], [30, 31, 32, 33])]


class Add(NamedTuple):
    holder: int
    chain: int
    first: int
    size: int
    snapshots: frozenset[int]

    def run(self) -> BlockRun:
        chain = CHAINS[self.chain]
        first = min(self.first, len(chain) - 1)
        hashes = chain[first:first + self.size]
        return BlockRun(hashes, sorted(i for i in self.snapshots
                                       if first <= i < first + len(hashes)),
                        first, chain[first - 1] if first else None)


class Drop(NamedTuple):
    holder: int
    chain: int
    position: int
    snapshot_only: bool

    def block(self) -> int:
        chain = CHAINS[self.chain]
        return chain[min(self.position, len(chain) - 1)]


class DropMany(NamedTuple):
    """A worker's eviction report: a chain from `position` down (as workers evict it), else
    blocks picked anywhere; hashes the tree never saw and repeats count as stale."""

    holder: int
    chain: int
    position: int
    picks: tuple[int, ...]
    snapshots_only: bool

    def blocks(self) -> list[int]:
        chain = CHAINS[self.chain]
        if not self.picks:
            return chain[min(self.position, len(chain) - 1):]
        everything = [block for chain in CHAINS for block in chain] + [12345]
        return [everything[pick % len(everything)] for pick in self.picks]


HOLDERS, CHOSEN = st.integers(0, 1), st.integers(0, len(CHAINS) - 1)
ADDS = st.builds(Add, HOLDERS, CHOSEN, st.integers(0, 7), st.integers(1, 8),
                 st.frozensets(st.integers(0, 7)))
DROPS = st.builds(Drop, HOLDERS, CHOSEN, st.integers(0, 7), st.booleans())
DROP_MANYS = st.builds(DropMany, HOLDERS, CHOSEN, st.integers(0, 7),
                       st.lists(st.integers(0, 40), max_size=10).map(tuple), st.booleans())


def tree_with_two_holders() -> PrefixTree:
    """An empty tree with two holders."""
    tree = PrefixTree()
    tree.add_holder(), tree.add_holder()
    return tree


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.one_of(ADDS, DROPS), max_size=25))
def test_add_run_equals_its_reference_through_gaps_refills_and_drops(
        steps: list[Add | Drop]) -> None:
    """Runs anywhere in branching chains (gaps, refills, re-reports with new snapshots),
    between drops: the fast `add_run` (told by the check where the new blocks begin) leaves
    the tree `add_run_reference` leaves, and says the same (blocks, snapshots)."""
    fast, slow = tree_with_two_holders(), tree_with_two_holders()
    for step in steps:
        if isinstance(step, Add):
            run = step.run()
            new_from = fast.check_lone_run(run) if step.size % 2 else fast.check_run(run, {})
            assert fast.add_run(step.holder, run, new_from) == slow.add_run_reference(
                step.holder, run)
        else:
            assert fast.drop(step.holder, step.block(), step.snapshot_only) == slow.drop(
                step.holder, step.block(), step.snapshot_only)
        assert tree_state(fast) == tree_state(slow)
        fast.check_integrity()


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.one_of(ADDS, DROP_MANYS), max_size=25))
def test_drop_many_equals_its_reference(steps: list[Add | DropMany]) -> None:
    """Eviction reports (chains from a block down, or any blocks, with repeats and unknown
    hashes, whole blocks or snapshots only) between runs stored by two holders: `drop_many`
    leaves the tree its block-by-block reference leaves, and says the same."""
    fast, slow = tree_with_two_holders(), tree_with_two_holders()
    for step in steps:
        if isinstance(step, Add):
            run = step.run()
            fast.check_run(run, {})
            assert fast.add_run(step.holder, run) == slow.add_run(step.holder, run)
        else:
            blocks, holder, only = step.blocks(), step.holder, step.snapshots_only
            assert fast.drop_many(holder, blocks, only) == slow.drop_many_reference(
                holder, blocks, only)
        assert tree_state(fast) == tree_state(slow)
        fast.check_integrity()


def outcome(check: Callable[[], int]) -> int | str:
    """What a check returns, or the message of the ChainError it raises."""
    try:
        return check()
    except ChainError as exc:
        return str(exc)


# Runs a report may or may not make: blocks of the chains placed at any depth under any
# parent (with repeated hashes and hashes equal to their own parent), and pieces of the
# chains with one block swapped for another (the block below it then has the right depth
# under the wrong parent).
EVERY_BLOCK = [block for chain in CHAINS for block in chain]
ODD_RUNS = st.builds(
    lambda picks, first, parent: BlockRun(
        [EVERY_BLOCK[p % len(EVERY_BLOCK)] for p in picks], [], first,
        None if first == 0 else EVERY_BLOCK[parent % len(EVERY_BLOCK)]),
    st.lists(st.integers(0, 40), min_size=1, max_size=8), st.integers(0, 7),
    st.integers(0, 40))


def swapped(run: BlockRun, position: int, pick: int) -> BlockRun:
    hashes = list(run.hashes)
    hashes[position % len(hashes)] = EVERY_BLOCK[pick % len(EVERY_BLOCK)]
    return BlockRun(hashes, run.snapshot_at, run.first, run.parent)


SWAPPED_RUNS = st.builds(swapped, ADDS.map(Add.run), st.integers(0, 7), st.integers(0, 40))


@settings(max_examples=300, deadline=None)
@given(adds=st.lists(ADDS, max_size=8),
       runs=st.lists(st.one_of(ADDS.map(Add.run), ODD_RUNS, SWAPPED_RUNS), min_size=1, max_size=6))
def test_check_lone_run_equals_check_run(adds: list[Add], runs: list[BlockRun]) -> None:
    """On a tree of stored runs, a run checked alone (`check_lone_run`) passes, with the same
    index of its first new block, or fails, with the same message, as through `check_run`;
    the index is where the blocks the tree has no node for begin."""
    tree = PrefixTree()
    tree.add_holder(), tree.add_holder()
    for add in adds:
        tree.add_run(add.holder, add.run(), tree.check_run(add.run(), {}))
    for run in runs:
        lone = outcome(partial(tree.check_lone_run, run))
        assert lone == outcome(partial(tree.check_run, run, {}))
        if isinstance(lone, int):
            known = [i + 1 for i, block in enumerate(run.hashes) if block in tree.nodes]
            repeats = len(set(run.hashes)) < len(run.hashes) or run.parent in run.hashes
            assert lone == max(known, default=0) or repeats
