"""The running event loop's own primitives, for the few hot paths that need them.

anyio finds the running backend on every call (a sniffio lookup and two extra frames), which
costs about as much as the operation itself when the operation is a wake-up on the request
path (docs/engineering-notes.md G4, bench_wire). The mesh's hot paths therefore create trio's or
asyncio's
own Event directly; both are cancelled by anyio's cancel scopes like any other await. Code
off the hot path keeps using anyio.

Timed sleeps on a virtual clock that keeps `Sleepers` (the simulation's `JumpClock`) park the
task in the clock's own heap, and the clock wakes them when it jumps to their instant: a
sleep of trio's own is a cancel scope with a deadline, registered, expired, and unwound by
raising and catching `Cancelled`, which cost more than the rest of a simulated wake-up.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Protocol

import anyio
import anyio.abc
import trio


class WakeUp(Protocol):
    """What the mesh needs of an Event: set once, waited on by one or more tasks."""

    def set(self) -> object: ...

    def is_set(self) -> bool: ...

    def wait(self) -> Awaitable[object]: ...


def on_asyncio() -> bool:
    """True inside an asyncio loop (uvloop or not); False under trio."""
    # The private-looking getter is asyncio's documented fast path: None, never an exception.
    return asyncio._get_running_loop() is not None


def new_event() -> WakeUp:
    """A fresh one-shot wake-up of the running loop, for one waiting task."""
    loop = asyncio._get_running_loop()
    return _TaskWakeUp() if loop is None else _FutureEvent(loop)


def new_event_reference() -> WakeUp:
    """Slow, obvious `new_event`: trio's own Event (a parking lot of waiters) under trio."""
    loop = asyncio._get_running_loop()
    return trio.Event() if loop is None else _FutureEvent(loop)


def clock() -> Callable[[], float]:
    """The running loop's clock: what `anyio.current_time` reads, without the lookup."""
    loop = asyncio._get_running_loop()
    return trio.current_time if loop is None else loop.time


def now() -> float:
    """The running loop's time: `anyio.current_time()` without the backend lookup."""
    loop = asyncio._get_running_loop()
    return trio.current_time() if loop is None else loop.time()


async def sleep(seconds: float) -> None:
    """`anyio.sleep` without the backend lookup: asyncio's own sleep, trio's, or parked on a
    clock that keeps `Sleepers` until trio's instant (`trio.current_time() + seconds`)."""
    if asyncio._get_running_loop() is not None:
        await asyncio.sleep(seconds)
        return
    sleepers = parking()
    if sleepers is None or seconds <= 0:
        await trio.sleep(seconds)
    else:
        await sleepers.sleep_until(trio.current_time() + seconds)


async def sleep_until(deadline: float) -> None:
    """Returns at `deadline` on the running loop's clock (at once, after one checkpoint, if
    it has passed): parked on a clock that keeps `Sleepers`, else trio's or asyncio's own.
    Unlike `anyio.sleep_until`, the instant is `deadline` itself, not now plus the rest."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        await asyncio.sleep(max(deadline - loop.time(), 0.0))
        return
    sleepers = parking()
    if sleepers is None:
        await trio.sleep_until(deadline)
    else:
        await sleepers.sleep_until(deadline)


class Sleepers:
    """Tasks parked until instants of a virtual trio clock that wakes them itself: the clock
    owns one, and in `deadline_to_sleep_time` (trio asks only when no task can run) it jumps
    to `next_deadline()` if that comes before trio's own and calls `wake_due`. A sleeper's
    cancellation (its task group cancelled) unparks it, as trio's abort protocol asks.

    A sleep parked here wakes at the same virtual instant as trio's own sleep would, in the
    same scheduler pass (trio expires its deadlines in the pass the clock jumps in); the
    order among tasks woken together is trio's to shuffle either way.
    """

    __slots__ = ("_heap", "_order", "_parked")

    def __init__(self) -> None:
        # (instant, key) per timed sleep; a key no longer parked is stale, dropped lazily.
        self._heap: list[tuple[float, int]] = []
        self._parked: dict[int, trio.lowlevel.Task] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._parked)

    def next_deadline(self) -> float:
        """The earliest instant a parked task waits for (`math.inf` if none)."""
        heap, parked = self._heap, self._parked
        while heap and heap[0][1] not in parked:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def wake_due(self, now: float) -> None:
        """Reschedules every task parked until `now` or before, earliest first."""
        heap, parked = self._heap, self._parked
        while heap and heap[0][0] <= now:
            task = parked.pop(heapq.heappop(heap)[1], None)
            if task is not None:
                trio.lowlevel.reschedule(task)

    def park(self, deadline: float, task: trio.lowlevel.Task) -> int:
        """Registers `task` to be woken at `deadline` (never, for `math.inf`, until it is
        unparked); the key unparks it. The task must then wait (`wait_task_rescheduled`)."""
        key = next(self._order)
        self._parked[key] = task
        if deadline < math.inf:
            heapq.heappush(self._heap, (deadline, key))
        return key

    def unpark(self, key: int) -> trio.lowlevel.Task | None:
        """Takes the task parked under `key` out (None if it was already woken)."""
        return self._parked.pop(key, None)

    async def sleep_until(self, deadline: float) -> None:
        """trio's `sleep_until` parked here; a deadline already reached is one checkpoint, as
        trio's scope entered past its deadline is."""
        if deadline <= trio.current_time():
            await trio.lowlevel.checkpoint()
            return
        key = self.park(deadline, trio.lowlevel.current_task())

        def abort(_: object) -> trio.lowlevel.Abort:
            self._parked.pop(key, None)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


def parking() -> Sleepers | None:
    """The running trio clock's `Sleepers` (its `sleepers` attribute), None if it keeps none."""
    found = getattr(trio.lowlevel.current_clock(), "sleepers", None)
    return found if isinstance(found, Sleepers) else None


def soon_from_thread() -> Callable[[Callable[[], object]], None]:
    """The running loop's way for another thread to queue a call on it without waiting:
    trio's `run_sync_soon`, asyncio's `call_soon_threadsafe`. Calls run in the order queued,
    before anything the thread queues later (the report of its own end included). A call
    must not raise: trio ends the whole run on a failed `run_sync_soon` callback."""
    loop = asyncio._get_running_loop()
    if loop is None:
        return trio.lowlevel.current_trio_token().run_sync_soon
    running = loop

    def soon(call: Callable[[], object]) -> None:
        running.call_soon_threadsafe(call)
    return soon


def checkpoint_if_cancelled() -> Callable[[], Awaitable[None]] | None:
    """trio's `checkpoint_if_cancelled`; None on asyncio, where a task is only ever cancelled
    at an await that suspends, so a write that does not suspend needs no such check."""
    return None if on_asyncio() else trio.lowlevel.checkpoint_if_cancelled


class _TaskWakeUp:
    """A one-shot Event for one waiting trio task: the task itself is parked, where trio's
    Event builds a parking lot and a dict per instance (the mailboxes wait on one of these
    for nearly every wake-up on the request path). Like trio's: a wait on a set one is a
    checkpoint, and a cancelled waiter is unparked (it does not count as set)."""

    __slots__ = ("_set", "_task")

    def __init__(self) -> None:
        self._set = False
        self._task: trio.lowlevel.Task | None = None

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def is_set(self) -> bool:
        return self._set

    async def wait(self) -> None:
        if self._set:
            await trio.lowlevel.checkpoint()
            return
        if self._task is not None:
            raise RuntimeError("a native wake-up has one waiter; another task waits on it")
        self._task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED


class _FutureEvent:
    """A bare future as a one-shot Event (asyncio.Event makes a future per wait anyway).

    For one waiter: cancelling that waiter cancels the future, which then counts as not set.
    """

    __slots__ = ("_future",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._future: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    def is_set(self) -> bool:
        return self._future.done() and not self._future.cancelled()

    def wait(self) -> asyncio.Future[None]:
        return self._future


class DeadlineScope(Protocol):
    """What the mesh needs of a cancel scope with a deadline it may move while inside, or
    cancel."""

    deadline: float

    def cancel(self) -> object: ...

    @property
    def cancel_called(self) -> bool: ...

    @property
    def cancelled_caught(self) -> bool: ...

    def __enter__(self) -> object: ...

    # bool: a scope swallows the cancellation it caused.
    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool: ...


def start_soon(group: anyio.abc.TaskGroup, func: Callable[..., Coroutine[Any, Any, object]],
               *args: object) -> None:
    """`group.start_soon(func, *args)` without anyio's handle for the task: since anyio 4.16
    every task it starts gets a cancel scope, an event and a wrapping coroutine, which cost
    more than the task's own work on the request path. Under trio the task goes straight into
    the group's nursery; it fails, and is cancelled, with the group as before (anyio's own
    exit handles both). Elsewhere, or on an anyio without that nursery, anyio's own."""
    nursery = getattr(group, "_nursery", None)
    if isinstance(nursery, trio.Nursery) and getattr(group, "_active", False):
        nursery.start_soon(func, *args)
    else:
        group.start_soon(func, *args)


async def checkpoint() -> None:
    """`anyio.lowlevel.checkpoint` without the backend lookup."""
    if asyncio._get_running_loop() is None:
        await trio.lowlevel.checkpoint()
    else:
        await asyncio.sleep(0)


def deadline_scope(deadline: float = math.inf) -> DeadlineScope:
    """A cancel scope expiring at `deadline` on the running loop's clock: trio's own under
    trio (anyio's wrapper finds the backend on every construction), anyio's on asyncio."""
    if asyncio._get_running_loop() is None:
        return trio.CancelScope(deadline=deadline)
    return anyio.CancelScope(deadline=deadline)


class Alarm:
    """Parks one task until a time that other tasks may move while it waits (`move`), or
    until woken at once (`wake`); for a task that sleeps until the next of many instants,
    such as a link delivering its frames each at its release.

    A sleeper with nothing due parks until `math.inf`, and the one who gives it something
    to do moves its alarm to that instant: it wakes once, then, not once to learn of the
    work and again when it is due.

    On a clock that keeps `Sleepers` the task is parked there (a move re-parks it; a move to
    an instant already reached wakes it, as `wake` does); elsewhere it waits on an event in
    a cancel scope whose deadline a move changes.

    A sleeper may say what a wake means to it (`sleep_until(..., woken=)`): the instant to
    sleep on until, given the instant of the wake, which `wake` then moves the alarm to. A
    batch running several steps at once, cut short by a join at the step in progress, wakes
    once, at that step's end, not at the join and again at the end.
    """

    __slots__ = ("_event", "_key", "_scope", "_sleepers", "_woken")

    def __init__(self) -> None:
        self._scope: DeadlineScope | None = None
        self._event: WakeUp | None = None
        self._sleepers: Sleepers | None = None
        self._key: int | None = None
        self._woken: Callable[[float], float] | None = None

    @property
    def sleeping(self) -> bool:
        return self._scope is not None or self._key is not None

    async def sleep_until(self, deadline: float,
                          woken: Callable[[float], float] | None = None) -> None:
        """Returns at `deadline`, at a moved one, or when woken, whichever comes first; with
        `woken`, a wake at instant t moves the alarm to `woken(t)` instead of ending the
        sleep (an instant already reached ends it)."""
        self._woken = woken
        try:
            sleepers = None if asyncio._get_running_loop() is not None else parking()
            if sleepers is None:
                await self._wait_in_scope(deadline)
            elif deadline <= trio.current_time():
                await trio.lowlevel.checkpoint()
            else:
                self._sleepers = sleepers
                self._key = sleepers.park(deadline, trio.lowlevel.current_task())
                try:
                    await trio.lowlevel.wait_task_rescheduled(self._abort)
                finally:
                    self._sleepers = self._key = None
        finally:
            self._woken = None

    async def _wait_in_scope(self, deadline: float) -> None:
        event = self._event = new_event()
        scope = self._scope = deadline_scope(deadline)
        try:
            with scope:
                await event.wait()
        finally:
            self._scope = self._event = None

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        if self._sleepers is not None and self._key is not None:
            self._sleepers.unpark(self._key)
        return trio.lowlevel.Abort.SUCCEEDED

    def move(self, deadline: float) -> None:
        """The sleeper's new instant (nothing if none sleeps)."""
        if self._scope is not None:
            self._scope.deadline = deadline
        elif self._sleepers is not None and self._key is not None:
            task = self._sleepers.unpark(self._key)
            if task is None:
                return
            if deadline <= trio.current_time():
                self._key = None
                trio.lowlevel.reschedule(task)
            else:
                self._key = self._sleepers.park(deadline, task)

    def wake(self) -> None:
        """Ends the sleep now, or moves it where the sleeper's `woken` says (nothing if none
        sleeps)."""
        if self._woken is not None and self.sleeping:
            self.move(self._woken(now()))
        elif self._event is not None:
            self._event.set()
        elif self._sleepers is not None and self._key is not None:
            task = self._sleepers.unpark(self._key)
            self._key = None
            if task is not None:
                trio.lowlevel.reschedule(task)
