"""Tests for the prefill compute's runners (services.worker.engine): both return the compute's
result and hand its pieces to the event loop in order (the compute loop itself: test_prefill,
test_overlap)."""

from __future__ import annotations

from functools import partial

import pytest

from services.worker.engine import ComputeRunner, InlineRunner, ThreadRunner


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
