"""Tests for the prefill compute's runners (services.worker.compute): both return the compute's
result and hand its pieces to the event loop in order; and for `release`, which deals the
pieces to the lanes (the compute loop itself: test_prefill, test_overlap)."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

import pytest
import trio
import trio.testing

from mesh.mailbox import Mailbox
from services.contract.messages import KVChunk
from services.paper.hardware import CostModel
from services.worker.compute import Computed, ComputeRunner, InlineRunner, ThreadRunner
from services.worker.kv_out import LaneItem, chunk_bounds, release, step_ends


@pytest.mark.trio
@pytest.mark.parametrize("runner", [InlineRunner(), ThreadRunner()], ids=["inline", "thread"])
async def test_runners_return_the_result_and_deliver_pieces_in_order(
    runner: ComputeRunner,
) -> None:
    delivered: list[int] = []

    def compute() -> int:
        for piece in range(5):
            runner.to_loop(partial(delivered.append, piece))
        return 42

    assert await runner.run(compute) == 42
    assert delivered == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_the_compute_thread_never_waits_for_the_loop(backend: str) -> None:
    # The loop is held (a blocking wait on it) while the compute hands over pieces: a runner
    # whose hand-over waited for the loop would never get to `emitted` in time.
    import threading

    import anyio

    runner = ThreadRunner()
    emitted, held = threading.Event(), threading.Event()
    delivered: list[int] = []

    def compute() -> int:
        held.wait(timeout=5.0)
        for piece in range(3):
            runner.to_loop(partial(delivered.append, piece))
        emitted.set()
        return 7

    async def main() -> tuple[bool, int]:
        async with anyio.create_task_group() as tg:
            result: list[int] = []

            async def run() -> None:
                result.append(await runner.run(compute))
            tg.start_soon(run)
            await anyio.sleep(0.05)  # the compute thread has started
            held.set()
            in_time = emitted.wait(timeout=5.0)  # blocks the loop itself
        return in_time, result[0]

    in_time, result = anyio.run(main, backend=backend)
    assert in_time and result == 7
    assert delivered == [0, 1, 2]


@pytest.mark.trio
async def test_a_failing_hand_over_is_logged_not_raised_into_the_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    runner = ThreadRunner()

    def compute() -> int:
        runner.to_loop(partial(int, "not a number"))
        return 1

    assert await runner.run(compute) == 1
    assert "failed" in caplog.text and "ValueError" in caplog.text



class Steps(trio.abc.Instrument):
    """Counts the steps (resumptions) of one task."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += task is self.task


@pytest.mark.trio
async def test_release_ends_with_the_last_piece_still_queued_for_the_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each piece leaves at its step's end, one wake-up each; once the last step has ended
    with the last piece, `release` returns without a trip through the scheduler, so the
    lane's reader finds the last piece and the close (put by the caller next) in one
    backlog: one write, one wake-up."""
    computed = Mailbox[Computed](8)
    lane = Mailbox[LaneItem](8)
    start = trio.current_time()
    ends = [start + 1.0, start + 2.0, start + 3.0]
    for step in range(3):
        computed.put_nowait((step, KVChunk(request_id="r", layer=step, start=0,
                                           data=memoryview(b""), nbytes=1)))
    computed.end()
    steps = Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        compute_end = await release(computed, [lane], ends)
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert compute_end == ends[-1] and lane.depth == 3
    assert steps.count == 3


def step_ends_by_chunk(chunks: list[tuple[int, int]], n_layers: int,
                       prefill_time: Callable[[int, int], float]) -> list[float]:
    """`step_ends` written chunk by chunk, both edges of each chunk computed from scratch."""
    reused, length = chunks[0][0], chunks[-1][1]
    fixed = prefill_time(0, reused)
    new = max(1, length - reused)

    def until(token: int) -> float:
        done = token - reused
        return prefill_time(done, reused) - fixed + fixed * done / new

    ends: list[float] = []
    for start, end in chunks:
        low, high = until(start), until(end)
        ends.extend(low + (high - low) * (layer + 1) / n_layers for layer in range(n_layers))
    return ends


@pytest.mark.parametrize("seed", range(4))
def test_step_ends_equal_the_chunk_by_chunk_sum_to_the_bit(seed: int) -> None:
    # The simulation's records hang on these instants: equal, not approximately.
    rng = random.Random(seed)
    cost = CostModel.load(rng.choice(["h200", "h20"]))
    for _ in range(200):
        length = rng.randint(1, 20000)
        reused = rng.randrange(0, length) // 64 * 64 if rng.random() < 0.7 else 0
        chunks = chunk_bounds(reused, length, rng.choice([0, 64, 512, 4096]))
        layers = rng.randint(1, 61)
        assert step_ends(chunks, layers, cost.prefill_time) == step_ends_by_chunk(
            chunks, layers, cost.prefill_time)
