"""The running event loop's own primitives, for the few hot paths that need them.

anyio finds the running backend on every call (a sniffio lookup and two extra frames), which
costs about as much as the operation itself when the operation is a wake-up on the request
path (docs/engineering-notes.md G4, bench_wire). The mesh's hot paths therefore create trio's or
asyncio's
own Event directly; both are cancelled by anyio's cancel scopes like any other await. Code
off the hot path keeps using anyio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Protocol

import anyio
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
    return trio.Event() if loop is None else _FutureEvent(loop)


def clock() -> Callable[[], float]:
    """The running loop's clock: what `anyio.current_time` reads, without the lookup."""
    loop = asyncio._get_running_loop()
    return trio.current_time if loop is None else loop.time


async def sleep(seconds: float) -> None:
    """`anyio.sleep` without the backend lookup: trio's or asyncio's own sleep."""
    if asyncio._get_running_loop() is None:
        await trio.sleep(seconds)
    else:
        await asyncio.sleep(seconds)


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
    """What the mesh needs of a cancel scope with a deadline it may move while inside."""

    deadline: float

    def __enter__(self) -> object: ...

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None: ...


def deadline_scope(deadline: float) -> DeadlineScope:
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
    """

    __slots__ = ("_event", "_scope")

    def __init__(self) -> None:
        self._scope: DeadlineScope | None = None
        self._event: WakeUp | None = None

    @property
    def sleeping(self) -> bool:
        return self._scope is not None

    async def sleep_until(self, deadline: float) -> None:
        """Returns at `deadline`, at a moved one, or when woken, whichever comes first."""
        event = self._event = new_event()
        scope = self._scope = deadline_scope(deadline)
        try:
            with scope:
                await event.wait()
        finally:
            self._scope = self._event = None

    def move(self, deadline: float) -> None:
        """The sleeper's new instant (nothing if none sleeps)."""
        if self._scope is not None:
            self._scope.deadline = deadline

    def wake(self) -> None:
        """Ends the sleep now (nothing if none sleeps)."""
        if self._event is not None:
            self._event.set()
