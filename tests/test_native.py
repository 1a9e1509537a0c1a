"""mesh.native: the loop's own primitives behave alike on trio and asyncio."""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio
import pytest
import trio.testing

from mesh.native import Alarm, WakeUp, new_event, new_event_reference, now, start_soon


async def _sleep_on(alarm: Alarm, until: float, woke: list[float]) -> None:
    began = anyio.current_time()
    await alarm.sleep_until(until)
    woke.append(anyio.current_time() - began)


@pytest.mark.trio
async def test_an_alarm_wakes_at_its_instant_at_a_moved_one_or_when_woken(
        autojump_clock: trio.testing.MockClock) -> None:
    alarm, woke = Alarm(), list[float]()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            assert not alarm.sleeping
            tg.start_soon(_sleep_on, alarm, anyio.current_time() + 2.0, woke)
            await anyio.sleep(0.5)
            assert alarm.sleeping
        async with anyio.create_task_group() as tg:
            tg.start_soon(_sleep_on, alarm, math.inf, woke)
            await anyio.sleep(0.5)
            alarm.move(anyio.current_time() + 1.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_sleep_on, alarm, anyio.current_time() + 9.0, woke)
            await anyio.sleep(0.5)
            alarm.wake()
    assert woke == [2.0, 1.5, 0.5] and not alarm.sleeping
    # Nobody sleeps: moving or waking does nothing, and the next sleep is a fresh one.
    alarm.move(0.0)
    alarm.wake()
    with anyio.move_on_after(3.0) as scope:
        await alarm.sleep_until(math.inf)
    assert scope.cancelled_caught


def test_an_alarm_is_moved_and_woken_alike_under_asyncio() -> None:
    async def main() -> list[float]:
        alarm, woke = Alarm(), list[float]()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_sleep_on, alarm, math.inf, woke)
                await anyio.sleep(0.01)
                alarm.move(anyio.current_time() + 0.05)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_sleep_on, alarm, math.inf, woke)
                await anyio.sleep(0.01)
                alarm.wake()
        return woke

    moved, woken = anyio.run(main, backend="asyncio")
    assert moved >= 0.05 and woken < 5.0


async def _started_native(backend_failures: list[str]) -> None:
    """native.start_soon's tasks run, fail and are cancelled with their anyio group."""
    ran: list[int] = []

    async def work(n: int) -> None:
        await anyio.sleep(0)
        ran.append(n)

    async def fail() -> None:
        await anyio.sleep(0)
        raise KeyError("lane")

    async def forever() -> None:
        await anyio.sleep(math.inf)

    async with anyio.create_task_group() as tg:
        for n in range(3):
            start_soon(tg, work, n)
    assert sorted(ran) == [0, 1, 2]
    with pytest.raises(ExceptionGroup) as caught:
        async with anyio.create_task_group() as tg:
            start_soon(tg, forever)
            start_soon(tg, fail)
    cancelled = anyio.get_cancelled_exc_class()
    assert caught.group_contains(KeyError) and not caught.group_contains(cancelled)
    with anyio.move_on_after(1.0) as scope:
        async with anyio.create_task_group() as tg:
            start_soon(tg, forever)
    assert scope.cancelled_caught
    # A group that has ended refuses new tasks, as its own start_soon does.
    with pytest.raises(RuntimeError):
        start_soon(tg, work, 9)
    backend_failures.append("ok")


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_native_start_soon_runs_fails_and_cancels_with_the_group(backend: str) -> None:
    done: list[str] = []
    anyio.run(_started_native, done, backend=backend)
    assert done == ["ok"]


async def _wake_up_story(make: Callable[[], WakeUp]) -> list[object]:
    """What one waiter sees of a wake-up: set before, set while waiting, cancelled."""
    seen: list[object] = []
    early = make()
    early.set()
    early.set()
    with anyio.CancelScope() as scope:
        scope.cancel()
        # A wait on a set one is a checkpoint: a cancelled scope is seen there.
        await early.wait()
    seen += ["early", early.is_set(), scope.cancelled_caught]
    late = make()

    async def wake_later() -> None:
        await anyio.sleep(1.0)
        late.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(wake_later)
        began = anyio.current_time()
        await late.wait()
        seen += ["late", anyio.current_time() - began, late.is_set()]
    never = make()
    with anyio.move_on_after(2.0) as timeout:
        await never.wait()
    seen += ["cancelled", timeout.cancelled_caught, never.is_set()]
    never.set()  # nobody waits any more: nothing to wake
    await never.wait()
    seen += ["after", never.is_set()]
    return seen


@pytest.mark.trio
async def test_the_native_wake_up_behaves_as_trios_event_for_one_waiter(
        autojump_clock: trio.testing.MockClock) -> None:
    with anyio.fail_after(60):
        fast = await _wake_up_story(new_event)
        assert fast == await _wake_up_story(new_event_reference)
    assert fast == ["early", True, True, "late", 1.0, True, "cancelled", True, False,
                    "after", True]


@pytest.mark.trio
async def test_a_native_wake_up_refuses_a_second_waiter(
        autojump_clock: trio.testing.MockClock) -> None:
    wake = new_event()
    with pytest.raises(ExceptionGroup) as caught:
        async with anyio.create_task_group() as tg:
            tg.start_soon(wake.wait)
            await anyio.sleep(0.1)
            await wake.wait()
    assert caught.group_contains(RuntimeError, match="one waiter")


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_native_now_is_anyios_current_time(backend: str) -> None:
    async def main() -> tuple[float, float, float]:
        return anyio.current_time(), now(), anyio.current_time()

    before, ours, after = anyio.run(main, backend=backend)
    assert before <= ours <= after


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_an_alarm_woken_with_a_meaning_sleeps_on_to_it(backend: str) -> None:
    """`woken` turns a wake at t into a move to woken(t); one already reached ends the sleep."""
    async def main() -> list[float]:
        alarm, woke = Alarm(), list[float]()

        async def sleeper(later: float) -> None:
            began = anyio.current_time()
            await alarm.sleep_until(math.inf, woken=lambda t: t + later)
            woke.append(anyio.current_time() - began)

        with anyio.fail_after(10):
            for later in (0.05, -1.0):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sleeper, later)
                    await anyio.sleep(0.01)
                    alarm.wake()
        return woke

    moved, ended = anyio.run(main, backend=backend)
    assert 0.06 <= moved < 5.0 and 0.01 <= ended < 0.05
