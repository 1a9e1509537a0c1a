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
from typing import Protocol

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
