"""The modeled engine's free mode: an unpaced profile makes decoding cost no time."""

from __future__ import annotations

import itertools
import random

import anyio
import pytest
import trio
import trio.testing

from mesh import native
from services.model.batch import TokenEvent
from services.model.cache import StateSnapshot
from services.model.sampling import SamplingParams
from services.paper.hardware import CostModel
from services.sim.clock import JumpClock
from services.sim.engine import MODELED_TOKEN, CountingBatch, ModeledBatch, ModeledEngine


@pytest.mark.trio
async def test_an_unpaced_profile_decodes_at_once_a_token_an_event_with_flush_one(
        autojump_clock: trio.testing.MockClock) -> None:
    engine = ModeledEngine(CostModel.load("cpu"), 1.0, max_steps=1, flush=1)
    batch = engine.new_batch(4)
    batch.join("r", engine.empty_cache(), MODELED_TOKEN, SamplingParams(max_new_tokens=4))
    start, events = anyio.current_time(), list[TokenEvent]()
    while "r" in batch:
        events += (await engine.step(batch, native.Alarm())).events
    assert anyio.current_time() == start
    assert [(e.index, e.count, e.finish_reason) for e in events] == [
        (1, 1, None), (2, 1, None), (3, 1, "length")]


@pytest.mark.trio
@pytest.mark.parametrize(("flush", "counts"), [(1, [1] * 9), (4, [1, 4, 4]), (None, [1, 8])])
async def test_the_second_token_comes_alone_then_flush_tokens_an_event(
        autojump_clock: trio.testing.MockClock, flush: int | None, counts: list[int]) -> None:
    engine = ModeledEngine(CostModel.load("cpu"), 1.0, flush=flush)
    batch = engine.new_batch(4)
    batch.join("r", engine.empty_cache(), MODELED_TOKEN, SamplingParams(max_new_tokens=10))
    second = await engine.step(batch, native.Alarm())
    # The first step stops at the second token (the client's time to second token).
    assert [(e.index, e.count) for e in second.events] == [(1, 1)] and not second.finished
    result = await engine.step(batch, native.Alarm())
    assert "r" in result.finished and batch.statistics().tokens == 9
    events = [*second.events, *result.events]
    assert [e.count for e in events] == counts
    assert [e.index for e in events] == [1 + sum(counts[:i]) for i in range(len(counts))]
    assert [e.finish_reason for e in events] == [None] * (len(counts) - 1) + ["length"]


@pytest.mark.trio
async def test_a_decoded_token_adds_one_modeled_token_of_context(
        autojump_clock: trio.testing.MockClock) -> None:
    """At 1/32 a served prompt token stands for 32 modeled ones; an output token for one."""
    h20 = CostModel.load("h20", "hybrid_1t")
    engine = ModeledEngine(h20, 32.0)
    batch = engine.new_batch(4)
    cache = engine.empty_cache()
    cache.length = 100  # served prompt tokens: 3,200 modeled
    batch.join("r", cache, MODELED_TOKEN, SamplingParams(max_new_tokens=1000))
    assert batch.modeled_context() == 3201
    await engine.step(batch, native.Alarm())
    start = anyio.current_time()
    await engine.step(batch, native.Alarm())
    steps = batch.statistics().steps - 1
    assert steps == 64 and batch.modeled_context() == 3200 + 2 + 64
    # Each step timed at its start's context (3,202 modeled tokens), not 3,200 + 32 * 2.
    assert anyio.current_time() - start == pytest.approx(64 * h20.decode_step_time(1, 3202))


@pytest.mark.trio
async def test_a_paced_profile_still_takes_its_step_time(
        autojump_clock: trio.testing.MockClock) -> None:
    engine = ModeledEngine(CostModel.load("h20", "hybrid_1t"), 8.0)
    batch = engine.new_batch(4)
    batch.join("r", engine.empty_cache(), MODELED_TOKEN, SamplingParams(max_new_tokens=4))
    start = anyio.current_time()
    await engine.step(batch, native.Alarm())
    result = await engine.step(batch, native.Alarm())
    assert anyio.current_time() > start and result.finished


def _same_step(reference: ModeledBatch, fast: CountingBatch, steps: int) -> list[str]:
    """Advances both; what the fast batch got wrong (nothing, when they agree)."""
    wrong = []
    if fast.steps_to_next_event() != reference.steps_to_next_event():
        wrong.append("steps_to_next_event")
    if fast.modeled_context() != reference.modeled_context():
        wrong.append("modeled_context")
    a, b = reference.advance(steps), fast.advance(steps)
    if a.events != b.events:
        wrong.append(f"events {a.events} != {b.events}")
    if list(a.finished) != list(b.finished) or [c.length for c in a.finished.values()] != [
            c.length for c in b.finished.values()]:
        wrong.append("finished")
    return wrong


@pytest.mark.parametrize("seed", range(12))
def test_the_counting_batch_makes_the_reference_batchs_events_in_its_order(seed: int) -> None:
    """Random joins, leaves and advances: equal events, finishes, contexts and statistics."""
    rng = random.Random(seed)
    engine = ModeledEngine(CostModel.load("h20", "hybrid_1t"), 8.0)
    fast = engine.new_batch(4)
    assert isinstance(fast, CountingBatch)
    reference = ModeledBatch(4, None, 8.0)
    names = itertools.count()
    for _ in range(400):
        roll = rng.random()
        if roll < 0.3 or not len(reference):
            rid, length = f"r{next(names)}", rng.randrange(1, 5000)
            limit = rng.choice([2, 3, rng.randrange(2, 300)])
            for batch in (reference, fast):
                cache = engine.empty_cache()
                cache.length = length
                batch.join(rid, cache, MODELED_TOKEN, SamplingParams(max_new_tokens=limit))
        elif roll < 0.4:
            rid = rng.choice(reference.request_ids())
            assert reference.leave(rid).length == fast.leave(rid).length
        else:
            steps = rng.randrange(1, reference.steps_to_next_event() + 3)
            assert _same_step(reference, fast, steps) == []
        assert fast.request_ids() == reference.request_ids()
        assert fast.statistics() == reference.statistics()
        fast.check_integrity()
    assert reference.statistics().joined > 50


def test_the_counting_batch_is_only_taken_where_it_applies() -> None:
    h20 = CostModel.load("h20", "hybrid_1t")
    assert isinstance(ModeledEngine(h20, 32.0).new_batch(4), CountingBatch)
    assert isinstance(ModeledEngine(h20, 32.0, flush=4).new_batch(4), ModeledBatch)
    assert isinstance(ModeledEngine(h20, 2.5).new_batch(4), ModeledBatch)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 4096])
def test_a_virtual_caches_held_bytes_are_its_statistics_allocated_and_snapshot_bytes(
        length: int) -> None:
    engine = ModeledEngine(CostModel.load("h20", "hybrid_1t"), 32.0)
    cache = engine.empty_cache()
    assert cache.held_bytes() == cache.statistics().allocated_bytes
    block = engine.cfg.block_size
    cache.length = length
    for blocks in range(1, length // block + 1, 3):
        cache.add_snapshot(StateSnapshot(blocks * block, ()))
    stats = cache.statistics()
    assert stats.snapshot_bytes > 0 or length < block
    assert cache.held_bytes() == stats.allocated_bytes + stats.snapshot_bytes


async def _cut_run(engine: ModeledEngine, cost: CostModel) -> tuple[int, float, float]:
    """A multi-step run woken 2.5 steps in: (steps made, seconds taken, step time)."""
    batch = engine.new_batch(4)
    batch.join("r", engine.empty_cache(), MODELED_TOKEN, SamplingParams(max_new_tokens=1000))
    alarm = native.Alarm()
    await engine.step(batch, alarm)  # the second token, alone
    step_s = cost.decode_step_time(1, batch.modeled_context())
    before, start = batch.statistics().steps, anyio.current_time()

    async def join_later() -> None:
        await anyio.sleep(2.5 * step_s)
        alarm.wake()

    async with anyio.create_task_group() as tg:
        tg.start_soon(join_later)
        await engine.step(batch, alarm)
        took = anyio.current_time() - start
    return batch.statistics().steps - before, took, step_s


@pytest.mark.parametrize("clock", ["jump", "mock"])
def test_a_join_cuts_a_run_at_the_end_of_the_step_in_progress(clock: str) -> None:
    cost = CostModel.load("h20", "hybrid_1t")
    chosen = JumpClock() if clock == "jump" else trio.testing.MockClock(autojump_threshold=0)
    steps, took, step_s = trio.run(_cut_run, ModeledEngine(cost, 8.0), cost, clock=chosen)
    assert steps == 3 and took == pytest.approx(3 * step_s)
