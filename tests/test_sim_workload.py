"""Tests for services.sim.workload: the simulation's requests and their prompts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.sim.workload import (
    BLOCK,
    Arrival,
    block_tokens,
    lognormal,
    prompt_of,
    prompt_of_reference,
)

_WRAP = 1 << 22  # block ids wrap here (block_tokens): a run of ids whose tokens do not follow on


def _block_ids() -> st.SearchStrategy[tuple[int, ...]]:
    """Runs of consecutive ids (across the wrap too), repeats, and scattered ids."""
    run = st.builds(lambda first, n: tuple(range(first, first + n)),
                    st.sampled_from([0, 5, _WRAP - 2, 2 * _WRAP - 1, 10**12]),
                    st.integers(0, 6))
    scattered = st.lists(st.integers(-3, 3 * _WRAP), max_size=6).map(tuple)
    pieces = st.lists(st.one_of(run, scattered), max_size=4)
    return pieces.map(lambda parts: tuple(i for part in parts for i in part))


@settings(max_examples=300, deadline=None)
@given(block_ids=_block_ids(),
       length=st.one_of(st.sampled_from([-BLOCK - 1, -1, 0, 1, BLOCK - 1, BLOCK, BLOCK + 1]),
                        st.integers(0, 30 * BLOCK)))
def test_prompt_equals_its_reference(block_ids: tuple[int, ...], length: int) -> None:
    assert prompt_of(block_ids, length) == prompt_of_reference(block_ids, length)


def test_a_prompt_is_its_blocks_tokens_cut_to_its_length() -> None:
    blocks = (7, 8, _WRAP - 1, _WRAP, 3)
    whole = [t for block in blocks for t in block_tokens(block)]
    assert prompt_of(blocks, 4 * BLOCK + 5) == whole[: 4 * BLOCK + 5]
    assert prompt_of(blocks, 10 * BLOCK) == whole
    assert block_tokens(_WRAP) == block_tokens(0) == list(range(1, BLOCK + 1))


def test_log_normal_prompts_are_their_fresh_blocks() -> None:
    arrivals = lognormal(3.0, 20.0, 1 / 32, seed=4)
    assert arrivals
    for arrival in arrivals:
        assert isinstance(arrival, Arrival)
        prompt = arrival.prompt()
        assert len(prompt) == arrival.length
        assert prompt == prompt_of_reference(arrival.blocks, arrival.length)
