"""Deadlines: the watch fails waiting mailboxes on time; the scope turns expiry into an error."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from mesh.deadlines import DeadlineWatch, deadline_scope, relative_timeout
from mesh.errors import DeadlineExceeded
from mesh.mailbox import Mailbox
from mesh.wire import MAX_TIMEOUT


@pytest.mark.trio
async def test_watch_fails_open_mailboxes_at_their_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watch = DeadlineWatch()
    waiting: Mailbox[int] = Mailbox(1)
    answered: Mailbox[int] = Mailbox(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        watch.watch(10, waiting, "call A")
        watch.watch(5, answered, "call B")
        watch.check_integrity()
        answered.close()  # B got its answer in time
        with pytest.raises(DeadlineExceeded, match="call A: deadline passed"):
            await waiting.get()
        assert trio.current_time() == 10
        nursery.cancel_scope.cancel()
    assert watch.expired == 1


@pytest.mark.trio
async def test_an_earlier_deadline_wakes_the_watch_sooner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    expiries: list[float] = []
    watch = DeadlineWatch(lambda: expiries.append(trio.current_time()))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        watch.watch(100, Mailbox(1), "late")
        await trio.sleep(1)
        watch.watch(3, Mailbox(1), "early")
        await trio.sleep(200)
        nursery.cancel_scope.cancel()
    assert expiries == [3, 100]


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
