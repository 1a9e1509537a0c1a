"""The simulation's virtual clock (services/sim/clock.py): settling an instant."""

from __future__ import annotations

import trio

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
