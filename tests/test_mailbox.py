"""Mailbox: bounded FIFO with end, failure, close, and no lost wake-ups."""

from __future__ import annotations

import asyncio
import contextlib

import anyio
import pytest
import trio
import trio.testing

from mesh.errors import PeerGone
from mesh.mailbox import Mailbox


@pytest.mark.trio
async def test_fifo_order_and_statistics() -> None:
    box: Mailbox[int] = Mailbox(4)
    for n in range(3):
        assert await box.put(n)
        box.check_integrity()
    assert [await box.get() for _ in range(2)] == [0, 1]
    box.check_integrity()
    stats = box.statistics()
    assert (stats.depth, stats.capacity, stats.high_water) == (1, 4, 3)
    assert (stats.put, stats.taken) == (3, 2)


@pytest.mark.trio
async def test_full_mailbox_makes_the_producer_wait(autojump_clock: trio.testing.MockClock) -> None:
    box: Mailbox[int] = Mailbox(1)
    await box.put(1)
    done: list[float] = []

    async def producer() -> None:
        await box.put(2)
        done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        await trio.sleep(10)
        assert done == []
        assert await box.get() == 1
    assert done == [10.0]
    assert await box.get() == 2


@pytest.mark.trio
async def test_end_drains_then_ends_iteration() -> None:
    box: Mailbox[str] = Mailbox(8)
    await box.put("a")
    await box.put("b")
    box.end()
    box.check_integrity()
    assert not await box.put("late")
    assert [item async for item in box] == ["a", "b"]
    with pytest.raises(anyio.EndOfStream):
        await box.get()


@pytest.mark.trio
async def test_failure_is_raised_after_queued_items() -> None:
    box: Mailbox[int] = Mailbox(8)
    await box.put(1)
    box.fail(PeerGone("gone"))
    assert await box.get() == 1
    with pytest.raises(PeerGone, match="gone"):
        await box.get()
    assert isinstance(box.failure, PeerGone)


@pytest.mark.trio
async def test_end_wakes_a_waiting_consumer() -> None:
    box: Mailbox[int] = Mailbox(1)
    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_end_soon, box)
            with pytest.raises(anyio.EndOfStream):
                await box.get()
    assert not scope.cancelled_caught


async def _end_soon(box: Mailbox[int]) -> None:
    await trio.testing.wait_all_tasks_blocked()
    box.end()


@pytest.mark.trio
async def test_close_discards_and_refuses() -> None:
    box: Mailbox[int] = Mailbox(2)
    await box.put(1)
    box.close()
    box.check_integrity()
    assert box.get_nowait() is None
    assert not await box.put(2)


@pytest.mark.trio
async def test_put_nowait_takes_what_fits_and_wakes_the_consumer() -> None:
    box: Mailbox[int] = Mailbox(1)
    got: list[int] = []

    async def consumer() -> None:
        got.extend([item async for item in box])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        assert box.put_nowait(1)
        assert not box.put_nowait(2)  # full until the consumer takes 1
        await trio.testing.wait_all_tasks_blocked()
        assert box.put_nowait(3)
        box.end()
        assert not box.put_nowait(4)
    assert got == [1, 3]
    box.check_integrity()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.anyio
async def test_cancelled_waiter_passes_its_turn_on() -> None:
    box: Mailbox[int] = Mailbox(4)
    got: list[int] = []
    first = anyio.CancelScope()

    async def getter(scope: anyio.CancelScope) -> None:
        with scope, contextlib.suppress(anyio.EndOfStream):
            got.append(await box.get())

    async with anyio.create_task_group() as group:
        group.start_soon(getter, first)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(getter, anyio.CancelScope())
        await anyio.wait_all_tasks_blocked()
        # The put wakes the first getter; cancelling it before it runs must not strand the
        # item (asyncio delivers the cancel, so the turn passes on; trio lets it finish).
        await box.put(7)
        first.cancel()
        await anyio.wait_all_tasks_blocked()
        assert got == [7]
        box.end()


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        Mailbox(0)


def test_task_cancelled_after_its_wake_up_passes_the_item_on() -> None:
    # A bare asyncio cancel lands even after the wake-up (anyio's scopes wait for the next
    # checkpoint instead): the woken getter must hand its turn to the next one.
    async def main() -> list[int]:
        box: Mailbox[int] = Mailbox(4)
        got: list[int] = []

        async def getter() -> None:
            with contextlib.suppress(anyio.EndOfStream):
                got.append(await box.get())

        first = asyncio.create_task(getter())
        await asyncio.sleep(0)
        second = asyncio.create_task(getter())
        await asyncio.sleep(0)
        await box.put(7)
        first.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        before_end = list(got)
        box.end()
        await asyncio.gather(first, second, return_exceptions=True)
        return before_end

    assert asyncio.run(main()) == [7]


def test_a_waiter_cancelled_as_it_is_woken_passes_its_turn_on_under_asyncio() -> None:
    # On asyncio a cancelled waiter's wake-up future is cancelled at once, so a put in the
    # same loop turn pops that waiter and its set() does nothing: the waiter must see it was
    # popped (not that it was set), pass the item's turn on, and not fail to remove itself.
    async def main() -> str:
        box: Mailbox[str] = Mailbox(4)
        first = asyncio.ensure_future(box.get())
        second = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        first.cancel()
        await box.put("x")
        with pytest.raises(asyncio.CancelledError):
            await first
        return await asyncio.wait_for(second, 1.0)

    assert asyncio.run(main()) == "x"


@pytest.mark.trio
async def test_wait_returns_once_an_item_is_queued_or_the_end_taking_nothing() -> None:
    box: Mailbox[int] = Mailbox(1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.wait)
        await trio.testing.wait_all_tasks_blocked()
        assert box.getters == 1
        assert box.put_nowait(5)
    # Still queued, and it still takes the room: a second item does not fit.
    assert box.depth == 1 and not box.put_nowait(6)
    await box.wait()
    assert await box.get() == 5
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.wait)
        await trio.testing.wait_all_tasks_blocked()
        box.end()
    box.check_integrity()


async def _consume(fast: bool, script: list[tuple[float, str, int]], raise_at: int | None,
                   ) -> list[object]:
    """A producer following `script` (delay, put/end/fail, n) and a consumer taking each item
    (raising at `raise_at`): through take_each (fast), or by iterating (the reference)."""
    box: Mailbox[int] = Mailbox(3)
    seen: list[object] = []
    start = anyio.current_time()

    def take(n: int) -> None:
        if n == raise_at:
            raise KeyError(n)
        seen.append((n, anyio.current_time() - start))

    async def produce() -> None:
        for delay, what, n in script:
            await anyio.sleep(delay)
            if what == "put":
                await box.put(n)
            elif what == "end":
                box.end()
            else:
                box.fail(PeerGone(f"gone after {n}"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        try:
            if fast:
                await box.take_each(take)
            else:
                async for n in box:
                    take(n)
            seen.append("ended")
        except (KeyError, PeerGone) as exc:
            seen.append(repr(exc))
        box.close()
    return seen


SCRIPTS = [
    [(0.0, "put", n) for n in range(5)] + [(0.0, "end", 0)],
    [(0.5 * (n % 3), "put", n) for n in range(9)] + [(1.0, "end", 0)],
    [(0.0, "put", 0), (1.0, "put", 1), (0.0, "put", 2), (0.0, "put", 3), (2.0, "fail", 3)],
]


@pytest.mark.trio
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("raise_at", [None, 0, 2])
async def test_take_each_takes_what_iterating_takes_when_it_does(
        autojump_clock: trio.testing.MockClock, script: list[tuple[float, str, int]],
        raise_at: int | None) -> None:
    """Items, their instants, the end, a failure and what `take` raises: as `async for`."""
    fast = await _consume(True, script, raise_at)
    assert fast == await _consume(False, script, raise_at)
    assert fast[-1] in ("ended", "KeyError(0)", "KeyError(2)", "PeerGone('gone after 3')")
def test_a_mailbox_consumer_takes_only_while_nothing_is_queued() -> None:
    box: Mailbox[int] = Mailbox(4)
    taken: list[int] = []

    def even(n: int) -> bool:
        if n % 2:
            return False
        taken.append(n)
        return True

    box.consume_directly(even)
    assert box.put_nowait(2) and box.put_nowait(3)  # 2 taken; 3 declined, so queued
    assert box.put_nowait(4)  # queued behind 3, never offered: order is kept
    assert taken == [2] and box.get_nowait() == 3 and box.get_nowait() == 4
    assert box.put_nowait(6) and taken == [2, 6] and box.empty
    box.consume_directly(None)
    assert box.put_nowait(8) and taken == [2, 6] and box.get_nowait() == 8
    stats = box.statistics()
    assert stats.put == stats.taken == 5

