"""run(): backend options built per backend (docs/engineering-notes.md G2), refusing silent
no-ops."""

from __future__ import annotations

import asyncio
import gc

import anyio
import pytest
import trio
import trio.testing
import uvloop

from mesh.errors import ConfigError
from mesh.run import YOUNG_THRESHOLD, backend_options, fewer_collections, run


def test_options_per_backend() -> None:
    clock = trio.testing.MockClock()
    assert backend_options("trio") == ("trio", {})
    assert backend_options("trio", clock=clock) == ("trio", {"clock": clock})
    assert backend_options("uvloop") == ("asyncio", {"use_uvloop": True})
    assert backend_options("asyncio") == ("asyncio", {"use_uvloop": False})


def test_clock_on_asyncio_and_unknown_backends_are_refused() -> None:
    with pytest.raises(ConfigError, match="clock works only with backend='trio'"):
        backend_options("uvloop", clock=trio.testing.MockClock())
    with pytest.raises(ConfigError, match="got 'curio'"):
        backend_options("curio")  # type: ignore[arg-type]


async def loop_kind() -> str:
    await anyio.sleep(0)
    try:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]
    except RuntimeError:
        return "trio"


def test_run_uses_the_named_event_loop() -> None:
    assert run(loop_kind, backend="trio") == "trio"
    assert run(loop_kind, backend="uvloop") == uvloop.__name__
    assert run(loop_kind, backend="asyncio") == "asyncio"


def test_run_on_virtual_time() -> None:
    async def nap() -> float:
        await anyio.sleep(1000)
        return anyio.current_time()

    assert run(nap, backend="trio", clock=trio.testing.MockClock(autojump_threshold=0)) == 1000


async def young_threshold() -> int:
    await anyio.sleep(0)
    return gc.get_threshold()[0]


def test_fewer_collections_holds_for_a_run_and_restores_the_collector() -> None:
    before = gc.get_threshold()
    assert before[0] < YOUNG_THRESHOLD
    with fewer_collections():
        assert run(young_threshold, backend="trio") == YOUNG_THRESHOLD
    assert gc.get_threshold() == before


def test_fewer_collections_restores_the_thresholds_after_an_error() -> None:
    before = gc.get_threshold()
    with pytest.raises(KeyError), fewer_collections(5000):
        assert gc.get_threshold() == (5000, *before[1:])
        raise KeyError("boom")
    assert gc.get_threshold() == before
    with pytest.raises(ConfigError, match="young must be >= 1"), fewer_collections(0):
        pass
