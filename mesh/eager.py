"""Eager awaiting: run a coroutine in the current task and learn whether it ever suspends.

`await Eager(coro, on_suspend)` behaves exactly like `await coro` (same result, same
exceptions, same cancellation, same task), except that `on_suspend()` is called once, just
before the coroutine first yields to the event loop. Nothing is called for a coroutine that
finishes without suspending.

The server uses it to run a request's handler inside the connection's reader task: most
control handlers never suspend, so the reply goes out with no hand-off to another task; the
first time one does suspend, `on_suspend` starts a new reader, and the current task carries
on as the handler's own (mesh.server). It works the same on trio and asyncio because it only
forwards what the coroutine yields (trio traps, asyncio futures) and what the loop sends or
throws back, as `yield from` does (PEP 380), with a hook at the first yield.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Eager(Generic[T]):
    """An awaitable that runs `coro` here and calls `on_suspend` at its first suspension."""

    __slots__ = ("_coro", "_on_suspend")

    def __init__(self, coro: Coroutine[Any, Any, T], on_suspend: Callable[[], None]) -> None:
        self._coro = coro
        self._on_suspend = on_suspend

    def __await__(self) -> Generator[Any, Any, T]:
        coro = self._coro
        try:
            signal = coro.send(None)
        except StopIteration as done:
            result: T = done.value
            return result
        try:
            self._on_suspend()
        except BaseException:
            coro.close()
            raise
        return (yield from _forward(coro, signal))


def _forward(coro: Coroutine[Any, Any, T], signal: Any) -> Generator[Any, Any, T]:
    """`yield from coro` for a coroutine already started, whose first yield was `signal`."""
    while True:
        try:
            value = yield signal
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:
            try:
                signal = coro.throw(exc)
            except StopIteration as done:
                result: T = done.value
                return result
        else:
            try:
                signal = coro.send(value)
            except StopIteration as done:
                result = done.value
                return result
