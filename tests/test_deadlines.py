"""Deadlines: the watch fails waiting mailboxes on time; the scope turns expiry into an error."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from mesh.deadlines import DeadlineWatch, deadline_scope, relative_timeout
from mesh.errors import DeadlineExceeded
from mesh.mailbox import Mailbox
from mesh.wire import MAX_TIMEOUT


@asynccontextmanager
async def running_watch(
    on_expiry: Callable[[], None] | None = None,
) -> AsyncIterator[DeadlineWatch]:
    """A DeadlineWatch with its task running; leaving the block stops the task."""
    watch = DeadlineWatch(on_expiry)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        yield watch
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_watch_fails_open_mailboxes_at_their_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    waiting: Mailbox[int] = Mailbox(1)
    answered: Mailbox[int] = Mailbox(1)
    async with running_watch() as watch:
        watch.watch(10, waiting, "call A")
        watch.watch(5, answered, "call B")
        watch.check_integrity()
        answered.close()  # B got its answer in time
        with pytest.raises(DeadlineExceeded, match="call A: deadline passed"):
            await waiting.get()
        assert trio.current_time() == 10
    assert watch.expired == 1


@pytest.mark.trio
async def test_an_earlier_deadline_wakes_the_watch_sooner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    expiries: list[float] = []
    async with running_watch(lambda: expiries.append(trio.current_time())) as watch:
        watch.watch(100, Mailbox(1), "late")
        await trio.sleep(1)
        watch.watch(3, Mailbox(1), "early")
        await trio.sleep(200)
    assert expiries == [3, 100]


@pytest.mark.trio
async def test_the_watch_sleeps_past_waits_finished_in_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    late: Mailbox[int] = Mailbox(1)
    async with running_watch() as watch:
        await trio.testing.wait_all_tasks_blocked()
        for n in range(5):
            answered: Mailbox[int] = Mailbox(1)
            watch.watch(1 + n, answered, "answered")
            answered.close()
        watch.watch(10, late, "late")
        await trio.sleep(20)
    assert late.failure is not None and watch.expired == 1
    # Woken at the first wait's deadline (its alarm set while it was open), then at the late
    # one's: not at the deadlines of the four answered while the watch slept.
    assert watch.wake_ups == 2


@pytest.mark.trio
@pytest.mark.parametrize("seed", range(8))
async def test_the_watch_fails_what_the_obvious_rule_says(
    autojump_clock: trio.testing.MockClock, seed: int,
) -> None:
    """Waits registered one after another, each answered at a random time or never: each
    fails exactly at its deadline if it is still open then (the reference), whatever the
    watch skipped or swept meanwhile."""
    rng = random.Random(seed)
    # (registered, deadline, answered); a deadline never equals its own answer's instant.
    waits = [(n / 2, n / 2 + rng.choice([rng.randrange(30) + 0.25, math.inf]),
              n / 2 + rng.choice([rng.randrange(30) + 0.75, math.inf])) for n in range(60)]
    expected = sorted((deadline, n) for n, (_, deadline, answered) in enumerate(waits)
                      if deadline < answered)
    failed: list[tuple[float, int]] = []
    watch = DeadlineWatch()
    boxes: list[Mailbox[int]] = [Mailbox(1) for _ in waits]

    async def wait(n: int, answered: float) -> None:
        with trio.move_on_at(answered):
            try:
                await boxes[n].get()
            except DeadlineExceeded:
                failed.append((trio.current_time(), n))
                return
        boxes[n].close()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        for n, (registered, deadline, answered) in enumerate(waits):
            await trio.sleep_until(registered)
            watch.watch(deadline, boxes[n], f"wait {n}")
            watch.check_integrity()
            nursery.start_soon(wait, n, answered)
        await trio.sleep(100)
        nursery.cancel_scope.cancel()
    assert sorted(failed) == [d for d in expected if d[0] < math.inf]
    assert watch.expired == len(failed)


def test_finished_waits_are_swept_from_the_heap() -> None:
    watch = DeadlineWatch()
    for n in range(10_000):
        box: Mailbox[int] = Mailbox(1)
        watch.watch(1000 + n, box, "done")
        box.close()
    watch.check_integrity()
    assert len(watch._heap) <= 2048


@pytest.mark.trio
async def test_deadline_scope_raises_and_reports(autojump_clock: trio.testing.MockClock) -> None:
    expired: list[bool] = []
    scope = deadline_scope(trio.current_time() + 2, "dial x", lambda: expired.append(True))
    with pytest.raises(DeadlineExceeded, match="dial x: deadline passed"), scope:
        await trio.sleep_forever()
    assert expired == [True] and trio.current_time() == 2
    with deadline_scope(trio.current_time() + 2, "quick"):
        await trio.sleep(1)


@pytest.mark.trio
async def test_relative_timeout(autojump_clock: trio.testing.MockClock) -> None:
    assert relative_timeout(math.inf) is None
    assert relative_timeout(trio.current_time() + 4) == pytest.approx(4)
    assert relative_timeout(trio.current_time() - 4) == 0.0


@pytest.mark.trio
async def test_relative_timeout_beyond_the_wire_cap_means_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The callee would refuse a larger timeout; the caller's own watch still keeps time.
    assert relative_timeout(trio.current_time() + MAX_TIMEOUT + 1) is None
    assert relative_timeout(trio.current_time() + MAX_TIMEOUT) == pytest.approx(MAX_TIMEOUT)
