"""Running a mesh program on a chosen event loop, with the backend options each one accepts.

anyio's backend options are not symmetric (docs/engineering-notes.md G2): the trio backend passes
them to
`trio.run` (so `use_uvloop` is a TypeError there), while asyncio silently ignores unknown keys
(so a MockClock given to asyncio would quietly sleep in real time). `backend_options` builds
them per backend and refuses combinations that would not do what they say. uvloop is chosen
through anyio's `use_uvloop`, not the deprecated `uvloop.install()` (G7).

`fewer_collections` runs the cyclic garbage collector less often while inside. A mesh allocates
objects at every message and timer (frames, envelopes, futures, cancelled sleeps' exceptions
with their tracebacks); at Python's default (a young-generation pass every 700 net allocations)
those passes, and the older-generation passes they trigger over every long-lived task and cache
entry, cost the simulation, which runs inside it, much of its CPU time (docs/simulation.md,
docs/engineering-notes.md 3d). Cycles are still collected, only in larger batches. Live
services do not use it: a worker's cycles may hold tensors.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, get_args

import anyio

from mesh.errors import ConfigError

Backend = Literal["trio", "asyncio", "uvloop"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

T = TypeVar("T")

YOUNG_THRESHOLD = 100_000  # net allocations between young-generation passes (Python's: 700)


def backend_options(backend: Backend, *, clock: Any = None) -> tuple[str, dict[str, Any]]:
    """The anyio backend name and options for `backend`; `clock` (a trio Clock) is trio-only."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if clock is not None and backend != "trio":
        raise ConfigError(f"clock works only with backend='trio', got backend={backend!r}")
    if backend == "trio":
        return "trio", ({} if clock is None else {"clock": clock})
    return "asyncio", {"use_uvloop": backend == "uvloop"}


@contextmanager
def fewer_collections(young: int = YOUNG_THRESHOLD) -> Iterator[None]:
    """A young-generation collection every `young` net allocations while inside; the
    collector's thresholds as they were afterwards (module docstring)."""
    if young < 1:
        raise ConfigError(f"young must be >= 1 allocation, got {young!r}")
    before = gc.get_threshold()
    gc.set_threshold(young, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run(
    main: Callable[..., Awaitable[T]], *args: Any, backend: Backend = "uvloop", clock: Any = None
) -> T:
    """Runs `main(*args)` to completion on `backend` (uvloop is the fast live default)."""
    name, options = backend_options(backend, clock=clock)
    return anyio.run(main, *args, backend=name, backend_options=options)
