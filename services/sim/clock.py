"""The simulation's clocks: `JumpClock` for runs as fast as the machine goes, `PacedClock` for
runs watched live.

`JumpClock` is pure virtual time that jumps to the next deadline the moment no task can run.
trio's `MockClock(autojump_threshold=0)` means the same, but it reads the wall clock at every
`current_time` (to support a rate) and jumps one loop turn late (after an extra I/O poll):
the simulation asks the time about a million times an hour, so it is measurably slower, and
both clocks fire the same timers in the same order at the same virtual times.

`PacedClock`: virtual time paced to the wall clock, never ahead of the simulation's work.

Watching the simulation live (the dashboard) needs virtual time to pass at `rate` times the
wall clock. trio's `MockClock(rate=...)` does that, but it keeps advancing while the loop is
busy: when the simulation cannot keep up, every timer fires late in virtual time and the
modeled compute stretches by the lag. This clock stands still while tasks run (as an
autojumping clock does: computing costs no virtual time), advances at `rate` only while the
loop waits, and never past the next deadline, so each timer fires exactly on time. When the
machine cannot keep up, the run is slower than asked (`statistics().achieved`), not wrong.

trio asks `deadline_to_sleep_time` only when no task is runnable, just before it waits: that
call marks the wait's start; the first `current_time` after it ends the wait and freezes time.

`settle` ends a run at an instant the same way whatever order trio runs that instant's tasks
in. trio runs the tasks woken together in a random order (it reverses each batch on a coin
toss, from a generator seeded per process), so "stop now" races every task due at the same
virtual instant: a run stopped at its last arrival counted that request's routing or not by
that coin, and a capacity search's saturation moved with it (3.2181 or 3.2258 req/s). A
`JumpClock` knows the moment no task can run (trio asks it for the sleep time then): a task
in `JumpClock.settled` is woken there instead of the clock jumping on.

A `JumpClock` keeps the loop's timed sleeps itself (`mesh.native.Sleepers`: the sleeps of
`mesh.native.sleep`, `sleep_until` and `Alarm`): it jumps to the earlier of trio's next
deadline and its own sleepers' and wakes those due, in the same pass in which trio expires
its own deadlines, without a cancel scope per sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import msgspec
import trio

from mesh.errors import ConfigError
from mesh.native import Sleepers

MAX_RATE = 1e6


class ClockStatistics(msgspec.Struct, frozen=True):
    rate: float  # virtual seconds per wall second asked for
    virtual_s: float  # since the clock started
    wall_s: float
    achieved: float  # virtual_s / wall_s over the run so far


def check_rate(rate: float) -> float:
    if not (math.isfinite(rate) and 0 < rate <= MAX_RATE):
        raise ConfigError(f"rate must be a number in (0, {MAX_RATE:g}], got {rate!r}")
    return float(rate)


class JumpClock(trio.abc.Clock):
    """Virtual time that stands still while tasks run and jumps to the next deadline when none
    can (module docstring)."""

    def __init__(self) -> None:
        self._now = 0.0
        self._settling: trio.lowlevel.Task | None = None
        self.sleepers = Sleepers()

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        # trio asks only when no task is runnable: the instant has settled. A task waiting
        # for that runs next, at this same instant; otherwise jump to the next deadline,
        # trio's or a parked sleeper's, wake the sleepers due and wait for nothing (trio
        # then expires its own deadlines due). With no deadline at all every task waits
        # forever; sleep as long as trio allows, as a MockClock does (a deadlocked
        # simulation hangs rather than ending wrong).
        if self._settling is not None:
            task, self._settling = self._settling, None
            trio.lowlevel.reschedule(task)
            return 0.0
        deadline = min(deadline, self.sleepers.next_deadline())
        if math.isinf(deadline):
            return math.inf
        self._now = max(self._now, deadline)
        self.sleepers.wake_due(self._now)
        return 0.0

    async def settled(self) -> None:
        """Returns once no other task can run at the current virtual instant, before the
        clock moves on (module docstring); one task at a time."""
        if self._settling is not None:
            raise RuntimeError("another task is already waiting for this instant to settle")
        self._settling = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._settling = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


async def settle() -> None:
    """Waits until nothing else can run at this virtual instant on a `JumpClock`
    (`JumpClock.settled`); on any other clock, one checkpoint."""
    clock = trio.lowlevel.current_clock()
    if isinstance(clock, JumpClock):
        await clock.settled()
    else:
        await trio.lowlevel.checkpoint()


class PacedClock(trio.abc.Clock):
    """Virtual time at `rate` x wall time while the loop waits, frozen while it works."""

    def __init__(self, rate: float = 1.0, *, wall: Callable[[], float] = time.perf_counter
                 ) -> None:
        self._rate = check_rate(rate)
        self._wall = wall
        self._virtual = 0.0  # the frozen time, or the time the current wait began at
        self._since: float | None = None  # wall time the current wait began; None: not waiting
        self._cap = math.inf  # the deadline the current wait is for
        self._started = wall()

    @property
    def rate(self) -> float:
        return self._rate

    @rate.setter
    def rate(self, rate: float) -> None:
        # Set from a task, so the loop is not waiting: the next wait takes the new rate.
        self._rate = check_rate(rate)

    def start_clock(self) -> None:
        self._started = self._wall()

    def current_time(self) -> float:
        if self._since is not None:
            waited = (self._wall() - self._since) * self._rate
            self._virtual, self._since = min(self._virtual + waited, self._cap), None
        return self._virtual

    def deadline_to_sleep_time(self, deadline: float) -> float:
        now = self.current_time()
        self._since, self._cap = self._wall(), deadline
        return (deadline - now) / self._rate

    def statistics(self) -> ClockStatistics:
        wall = self._wall() - self._started
        return ClockStatistics(self._rate, self._virtual, wall,
                               self._virtual / wall if wall > 0 else 0.0)
