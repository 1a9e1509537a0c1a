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
