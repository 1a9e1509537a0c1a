"""Eager: `await Eager(coro, hook)` is `await coro` plus one call of `hook` at the first yield."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from mesh.eager import Eager
from tests.backends import backends_fixture

anyio_backend = backends_fixture()


async def returns_at_once(log: list[str]) -> int:
    log.append("ran")
    return 1


async def raises_at_once(log: list[str]) -> int:
    log.append("ran")
    raise ValueError("at once")


async def suspends_then_returns(log: list[str]) -> int:
    log.append("before")
    await anyio.sleep(0)
    log.append("between")
    await anyio.sleep(0)
    log.append("after")
    return 3


async def suspends_then_raises(log: list[str]) -> int:
    await anyio.sleep(0)
    log.append("about to raise")
    raise KeyError("later")


async def catches_its_own_cancel(log: list[str]) -> int:
    with anyio.CancelScope() as scope:
        scope.cancel()
        await anyio.sleep(10)
    log.append(f"cancelled: {scope.cancelled_caught}")
    return 4


async def sleeps_until_stopped(log: list[str], last_word: str) -> None:
    """Sleeps long; notes `last_word` in `log` however the sleep ends."""
    try:
        await anyio.sleep(10)
    finally:
        log.append(last_word)


BEHAVIOURS = [
    returns_at_once,
    raises_at_once,
    suspends_then_returns,
    suspends_then_raises,
    catches_its_own_cancel,
]


async def outcome(run: Callable[[list[str]], Awaitable[int]]) -> tuple[object, list[str]]:
    log: list[str] = []
    try:
        result: object = await run(log)
    except Exception as exc:
        result = repr(exc)
    return result, log


@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda b: b.__name__)
@pytest.mark.anyio
async def test_eager_matches_plain_await(behaviour: Callable[[list[str]], Any]) -> None:
    hooks: list[list[str]] = []

    async def eagerly(log: list[str]) -> int:
        # The hook sees the log as it stands at the first suspension.
        result: int = await Eager(behaviour(log), lambda: hooks.append(list(log)))
        return result

    expected = await outcome(behaviour)
    assert await outcome(eagerly) == expected
    suspends = behaviour not in (returns_at_once, raises_at_once)
    assert len(hooks) == (1 if suspends else 0)
    if behaviour is suspends_then_returns:
        assert hooks == [["before"]]


@pytest.mark.anyio
async def test_cancellation_reaches_the_eager_coroutine() -> None:
    log: list[str] = []

    def hook() -> None:
        # Cancelled at the first suspension, the way a deadline set by the hook would land.
        log.append("suspended")
        scope.cancel()

    with anyio.CancelScope() as scope:
        await Eager(sleeps_until_stopped(log, "cleaned up"), hook)
    assert scope.cancelled_caught
    assert log == ["suspended", "cleaned up"]


@pytest.mark.anyio
async def test_a_failing_hook_closes_the_coroutine() -> None:
    log: list[str] = []

    def hook() -> None:
        raise RuntimeError("no new reader")

    with pytest.raises(RuntimeError, match="no new reader"):
        await Eager(sleeps_until_stopped(log, "closed"), hook)
    assert log == ["closed"]
