"""Tests for services.contract.prefix: the block hash chain."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.contract.prefix import (
    MAX_HASH,
    BlockHash,
    block_hashes,
    block_hashes_reference,
    chain_from_ids,
    check_chain_end,
    extend_chain,
    extend_hashes,
)
from services.data import trace_path

TRACES = trace_path().parent
tokens_strategy = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70)


class HashBox(msgspec.Struct):
    hashes: list[BlockHash]


def test_known_values_are_stable_across_processes_and_versions() -> None:
    # Computed once and frozen: any change to the chain's definition breaks cached ids.
    assert block_hashes(list(range(32)), 16) == [5591920404487023243, 8995860973906370296]
    assert block_hashes(list(range(32)), 16, seed=7) == [7596734078342971043, 4063852752707895535]
    assert chain_from_ids([0, 1, 2]) == [
        1704547543715537822,
        6458699683858516673,
        7909612616807562639,
    ]


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_strategy, block_size=st.sampled_from([1, 3, 7, 16]), seed=st.integers(0, 9))
def test_fast_path_equals_reference(tokens: list[int], block_size: int, seed: int) -> None:
    fast = block_hashes(tokens, block_size, seed)
    assert fast == block_hashes_reference(tokens, block_size, seed)
    assert len(fast) == len(tokens) // block_size
    assert all(0 <= value <= MAX_HASH for value in fast)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_strategy, block_size=st.sampled_from([1, 3, 7, 16]), seed=st.integers(0, 9),
       data=st.data())
def test_extending_a_known_chain_equals_hashing_it_whole(tokens: list[int], block_size: int,
                                                         seed: int, data: st.DataObject) -> None:
    whole = block_hashes_reference(tokens, block_size, seed)
    known = data.draw(st.integers(0, len(whole)))
    assert extend_hashes(tokens, block_size, whole[:known], seed) == whole
    assert extend_chain(whole[:known], tokens[known * block_size:], block_size, seed) == whole
    check_chain_end(tokens, block_size, whole[:known], seed)


def test_extending_hashes_only_the_blocks_after_the_known_ones() -> None:
    tokens = list(range(64))
    whole = block_hashes(tokens, 16)
    # A wrong known block stays wrong: the extension chains from what it was given.
    forged = [whole[0], 123, *block_hashes_reference(tokens[32:], 16, seed=123)]
    assert extend_hashes(tokens, 16, forged[:2]) == forged
    assert extend_hashes(tokens, 16, whole[:2]) == whole


def test_a_chain_made_another_way_is_refused_at_its_end() -> None:
    tokens = list(range(1000, 1064))
    good = block_hashes(tokens, 4)
    check_chain_end(tokens, 4, good[:3])
    made_otherwise = [
        block_hashes(tokens, 8)[:3],  # another block size
        block_hashes([t + 1 for t in tokens], 4)[:3],  # another token encoding
        [*good[:2], good[3]],  # shifted by a block
    ]
    for hashes in made_otherwise:
        with pytest.raises(ValueError, match=r"hashes\[2\] is not the hash of block 2"):
            check_chain_end(tokens, 4, hashes)
    # Another seed shows at block 0 only: later links chain from the blocks before them.
    with pytest.raises(ValueError, match=r"hashes\[0\] is not the hash of block 0"):
        check_chain_end(tokens, 4, block_hashes(tokens, 4, seed=1)[:1])
    with pytest.raises(ValueError, match="hashes must name at most the 1 full blocks of 20"):
        check_chain_end(tokens[:20], 16, good[:2])
    with pytest.raises(ValueError, match="hashes must name at most"):
        extend_hashes(tokens[:20], 16, good[:2])


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 63, 64])
def test_partial_last_block_is_ignored(length: int) -> None:
    tokens = list(range(1000, 1000 + length))
    full = length // 16 * 16
    assert block_hashes(tokens, 16) == block_hashes(tokens[:full], 16)
    assert block_hashes(tokens + [5] * (15 - length % 16), 16)[: full // 16] == block_hashes(
        tokens, 16
    )


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 50_000), min_size=8, max_size=64), data=st.data())
def test_a_change_in_block_i_changes_later_hashes(tokens: list[int], data: st.DataObject) -> None:
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] += 1
    before, after = block_hashes(tokens, 4), block_hashes(changed, 4)
    block = position // 4
    assert before[:block] == after[:block]
    assert all(x != y for x, y in zip(before[block:], after[block:], strict=True))


def test_equal_prefixes_share_hashes_and_inputs_agree() -> None:
    rng = np.random.default_rng(3)
    root = rng.integers(0, 50_000, 64).tolist()
    one, two = root + [1] * 32, root + [2] * 32
    assert block_hashes(one, 16)[:4] == block_hashes(two, 16)[:4]
    assert block_hashes(one, 16)[4:] != block_hashes(two, 16)[4:]
    expected = block_hashes(one, 16)
    assert block_hashes(np.array(one, dtype=np.int64), 16) == expected
    assert block_hashes(np.array(one, dtype=np.uint16), 16) == expected
    assert block_hashes(torch.tensor(one), 16) == expected
    assert block_hashes(one, 16, seed=1) != expected


def test_hashes_fit_int64_and_round_trip_msgpack() -> None:
    hashes = [*block_hashes(list(range(4096)), 1), MAX_HASH, 0]
    assert np.array(hashes, dtype=np.int64).tolist() == hashes
    assert np.array(hashes, dtype=np.uint64).tolist() == hashes
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(HashBox(hashes)), type=HashBox)
    assert decoded.hashes == hashes
    for bad in (-1, MAX_HASH + 1):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode({"hashes": [bad]}), type=HashBox)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: block_hashes([1, 2], 0), "block_size must be >= 1, got 0"),
        (lambda: block_hashes([1, 2], 1, seed=-1), "seed must be in"),
        (lambda: block_hashes([2**31], 1), "tokens must fit int32"),
        (lambda: block_hashes([[1, 2]], 1), "flat sequence of ints"),
        (lambda: block_hashes([1.5], 1), "flat sequence of ints"),
        (lambda: chain_from_ids([3, -4]), r"hash_ids\[1\] must be in"),
    ],
)
def test_bad_arguments_name_the_parameter(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=message):
        call()


def test_chain_from_ids_keeps_prefix_identity() -> None:
    one, two = chain_from_ids([0, 1, 2, 3]), chain_from_ids([0, 1, 9, 3])
    assert one[:2] == two[:2]
    assert one[2] != two[2]
    assert one[3] != two[3]  # same id after a different block: a different prefix
    assert chain_from_ids([0, 1]) != block_hashes([0, 1], 1)


@pytest.mark.skipif(not TRACES.is_dir(), reason="Mooncake traces not present beside the repo")
def test_mooncake_hash_ids_are_prefix_chained() -> None:
    # The docstring of chain_from_ids relies on this: each id has one position and predecessor.
    decoder = msgspec.json.Decoder(dict[str, object])
    seen: dict[object, tuple[int, object]] = {}
    with (TRACES / "synthetic_trace.jsonl").open("rb") as lines:
        for line in lines:
            ids = decoder.decode(line)["hash_ids"]
            assert isinstance(ids, list)
            for index, (block, before) in enumerate(zip(ids, [None, *ids], strict=False)):
                assert seen.setdefault(block, (index, before)) == (index, before)
    assert len(seen) > 40_000
