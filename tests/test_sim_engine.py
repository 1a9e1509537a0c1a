"""The modeled engine's free mode: an unpaced profile makes decoding cost no time."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing

from services.model.sampling import SamplingParams
from services.paper.hardware import CostModel
from services.sim.engine import MODELED_TOKEN, ModeledEngine


@pytest.mark.trio
async def test_an_unpaced_profile_decodes_at_once_a_token_an_event_with_flush_one(
        autojump_clock: trio.testing.MockClock) -> None:
    engine = ModeledEngine(CostModel.load("cpu"), 1.0, max_steps=1, flush=1)
    batch = engine.new_batch(4)
    batch.join("r", engine.empty_cache(), MODELED_TOKEN, SamplingParams(max_new_tokens=4))
    start, events = anyio.current_time(), []
    while "r" in batch:
        events += (await engine.step(batch, anyio.Event())).events
    assert anyio.current_time() == start
    assert [(e.index, e.count, e.finish_reason) for e in events] == [
        (1, 1, None), (2, 1, None), (3, 1, "length")]


@pytest.mark.trio
@pytest.mark.parametrize(("flush", "counts"), [(1, [1] * 9), (4, [4, 4, 1]), (None, [9])])
async def test_several_steps_at_once_hand_out_flush_tokens_an_event(
        autojump_clock: trio.testing.MockClock, flush: int | None, counts: list[int]) -> None:
    engine = ModeledEngine(CostModel.load("cpu"), 1.0, flush=flush)
    batch = engine.new_batch(4)
    batch.join("r", engine.empty_cache(), MODELED_TOKEN, SamplingParams(max_new_tokens=10))
    result = await engine.step(batch, anyio.Event())
    assert "r" in result.finished and batch.statistics().tokens == 9
    assert [e.count for e in result.events] == counts
    assert [e.index for e in result.events] == [1 + sum(counts[:i]) for i in range(len(counts))]
    assert [e.finish_reason for e in result.events] == [None] * (len(counts) - 1) + ["length"]


@pytest.mark.trio
async def test_a_paced_profile_still_takes_its_step_time(
        autojump_clock: trio.testing.MockClock) -> None:
    engine = ModeledEngine(CostModel.load("h20", "hybrid_1t"), 8.0)
    batch = engine.new_batch(4)
    batch.join("r", engine.empty_cache(), MODELED_TOKEN, SamplingParams(max_new_tokens=4))
    start = anyio.current_time()
    result = await engine.step(batch, anyio.Event())
    assert anyio.current_time() > start and result.finished
