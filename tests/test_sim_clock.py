"""The simulation's virtual clock (services/sim/clock.py): settling an instant, and the timed
sleeps it keeps itself (mesh.native.Sleepers) against trio's own."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from functools import partial

import trio
import trio.testing

from mesh import native
from mesh.native import Alarm
from services.sim.clock import JumpClock, settle


def test_settle_runs_every_task_due_now_and_leaves_the_clock_where_it_is() -> None:
    async def main() -> None:
        done: list[int] = []

        async def steps(n: int) -> None:
            for _ in range(n):
                await trio.lowlevel.checkpoint()
            done.append(n)

        async with trio.open_nursery() as nursery:
            for n in (1, 5, 40):
                nursery.start_soon(steps, n)
            nursery.start_soon(trio.sleep, 1.0)
            await settle()
            assert sorted(done) == [1, 5, 40]
            assert trio.current_time() == 0.0
            nursery.cancel_scope.cancel()

    trio.run(main, clock=JumpClock())


def test_a_cancelled_settle_lets_the_clock_jump_again() -> None:
    async def main() -> None:
        with trio.move_on_after(0):
            await settle()
        await trio.sleep(2.5)
        assert trio.current_time() == 2.5

    trio.run(main, clock=JumpClock())


async def _sleeps(woke: list[tuple[str, float]], parked: list[int]) -> None:
    """Timed sleeps of every kind mesh.native offers, moved, woken and cancelled; each
    sleeper notes the instant it woke at. `parked`: how many sleepers the running clock
    keeps itself at 0.5 s (none on a clock without `Sleepers`)."""
    moved, woken, early, past = Alarm(), Alarm(), Alarm(), Alarm()

    async def sleeper(name: str, sleep: Callable[[], Awaitable[None]]) -> None:
        await sleep()
        woke.append((name, trio.current_time()))

    # A bound: a sleeper never woken ends the run at 1000 s, with its note missing.
    with trio.move_on_after(1000):
        async with trio.open_nursery() as nursery:
            for name, sleep in [
                    ("sleep 1.5", partial(native.sleep, 1.5)),
                    ("sleep 0", partial(native.sleep, 0.0)),
                    ("until 0.25", partial(native.sleep_until, 0.25)),
                    ("until a past instant", partial(native.sleep_until, -1.0)),
                    ("alarm moved from inf to 3", partial(moved.sleep_until, math.inf)),
                    ("alarm woken at 0.5", partial(woken.sleep_until, 7.0)),
                    ("alarm moved from 9 to 2", partial(early.sleep_until, 9.0)),
                    ("alarm moved to a past instant", partial(past.sleep_until, 8.0)),
                    ("alarm until 1", partial(Alarm().sleep_until, 1.0))]:
                nursery.start_soon(sleeper, name, sleep)
            await native.sleep(0.5)
            sleepers = native.parking()
            parked.append(0 if sleepers is None else len(sleepers))
            moved.move(3.0)
            woken.wake()
            early.move(2.0)
            past.move(0.1)
            # Moved to an instant already reached: it wakes in the next scheduler pass (as
            # trio's scope does, expired at the end of this one), not once the instant settles.
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
            assert "alarm moved to a past instant" in dict(woke)
            async with trio.open_nursery() as inner:
                inner.start_soon(native.sleep, 50.0)
                await native.sleep(1.0)
                inner.cancel_scope.cancel()
            woke.append(("cancelled at 1.5", trio.current_time()))


def test_sleeps_parked_on_the_clock_wake_at_the_instants_trio_sleeps_would() -> None:
    parked_woke: list[tuple[str, float]] = []
    trio_woke: list[tuple[str, float]] = []
    parked: list[int] = []
    trio.run(_sleeps, parked_woke, parked, clock=JumpClock())
    trio.run(_sleeps, trio_woke, [], clock=trio.testing.MockClock(autojump_threshold=0))
    # The reference: trio's own sleeps and cancel scopes on trio's virtual clock.
    assert sorted(parked_woke) == sorted(trio_woke)
    assert dict(trio_woke) == {
        "sleep 0": 0.0, "until a past instant": 0.0, "until 0.25": 0.25,
        "alarm woken at 0.5": 0.5, "alarm moved to a past instant": 0.5, "alarm until 1": 1.0,
        "sleep 1.5": 1.5, "cancelled at 1.5": 1.5, "alarm moved from 9 to 2": 2.0,
        "alarm moved from inf to 3": 3.0}
    # The JumpClock kept the six timed sleeps still waiting at 0.5 s itself.
    assert parked == [6]


def test_a_cancelled_parked_sleep_leaves_no_wake_up_behind() -> None:
    async def main() -> None:
        sleepers = native.parking()
        assert sleepers is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(native.sleep, 100.0)
            await native.sleep(1.0)
            nursery.cancel_scope.cancel()
        assert len(sleepers) == 0 and sleepers.next_deadline() == math.inf
        await native.sleep(1.0)
        assert trio.current_time() == 2.0

    trio.run(main, clock=JumpClock())
