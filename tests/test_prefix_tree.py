"""Tests for services.cachedir.service: the PrefixTree of held chains."""

from __future__ import annotations

import pytest

from services.cachedir.service import ChainError, IntegrityError, PrefixTree
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
    assert tree.complete == {}
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
    tree.complete[chain[2]] = 0b10
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
