"""Slots: a bound on running handlers, handed over in FIFO order."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import trio
import trio.testing

from mesh.errors import ConfigError
from mesh.slots import Slots


def test_try_take_stops_at_capacity_and_give_frees() -> None:
    slots = Slots(2)
    assert slots.try_take() and slots.try_take()
    assert not slots.try_take()
    slots.check_integrity()
    slots.give()
    assert slots.try_take()
    stats = slots.statistics()
    assert (stats.busy, stats.capacity, stats.high_water, stats.waiting) == (2, 2, 2, 0)
    with pytest.raises(ConfigError, match="capacity must be >= 1, got 0"):
        Slots(0)


def one_slot_taken() -> Slots:
    """A bound of one, already taken: whoever asks next waits."""
    slots = Slots(1)
    assert slots.try_take()
    return slots


async def take_then_note(slots: Slots, got: list[str], name: str) -> None:
    await slots.take()
    got.append(name)


@pytest.mark.trio
async def test_waiters_get_freed_slots_in_order_and_newcomers_wait_behind_them() -> None:
    slots = one_slot_taken()
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        for name in ("w0", "w1", "w2"):
            nursery.start_soon(take_then_note, slots, order, name)
            await trio.testing.wait_all_tasks_blocked()
        # A free slot goes to the first waiter, not to whoever asks without waiting.
        assert slots.statistics().waiting == 3
        slots.give()
        assert not slots.try_take()
        slots.check_integrity()
        for _ in range(3):
            await trio.testing.wait_all_tasks_blocked()
            slots.give()
    assert order == ["w0", "w1", "w2"]
    assert slots.statistics().busy == 0


@pytest.mark.trio
async def test_a_waiter_cancelled_while_waiting_leaves_the_queue() -> None:
    slots = one_slot_taken()
    got: list[str] = []

    async def wait_for_slot(name: str, scope: trio.CancelScope) -> None:
        with scope:
            await take_then_note(slots, got, name)

    first, second = trio.CancelScope(), trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for_slot, "first", first)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait_for_slot, "second", second)
        await trio.testing.wait_all_tasks_blocked()
        first.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert slots.statistics().waiting == 1
        slots.give()
    assert got == ["second"]
    slots.check_integrity()


@pytest.fixture
def anyio_backend() -> str:
    # On trio, and through anyio's scopes, a woken waiter always runs; a bare asyncio
    # task.cancel() can land between the hand-over and the run.
    return "asyncio"


@pytest.mark.anyio
async def test_a_waiter_cancelled_after_its_wake_up_passes_the_slot_on() -> None:
    slots = one_slot_taken()
    got: list[str] = []
    first = asyncio.ensure_future(take_then_note(slots, got, "first"))
    second = asyncio.ensure_future(take_then_note(slots, got, "second"))
    await anyio.wait_all_tasks_blocked()
    slots.give()
    first.cancel()
    await second
    with pytest.raises(asyncio.CancelledError):
        await first
    assert got == ["second"]
    slots.check_integrity()
    assert slots.statistics().busy == 1
