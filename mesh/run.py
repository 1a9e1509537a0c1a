"""Running a mesh program on a chosen event loop, with the backend options each one accepts.

anyio's backend options are not symmetric (docs/engineering-notes.md G2): the trio backend passes
them to
`trio.run` (so `use_uvloop` is a TypeError there), while asyncio silently ignores unknown keys
(so a MockClock given to asyncio would quietly sleep in real time). `backend_options` builds
them per backend and refuses combinations that would not do what they say. uvloop is chosen
through anyio's `use_uvloop`, not the deprecated `uvloop.install()` (G7).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, get_args

import anyio

from mesh.errors import ConfigError

Backend = Literal["trio", "asyncio", "uvloop"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

T = TypeVar("T")


def backend_options(backend: Backend, *, clock: Any = None) -> tuple[str, dict[str, Any]]:
    """The anyio backend name and options for `backend`; `clock` (a trio Clock) is trio-only."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if clock is not None and backend != "trio":
        raise ConfigError(f"clock works only with backend='trio', got backend={backend!r}")
    if backend == "trio":
        return "trio", ({} if clock is None else {"clock": clock})
    return "asyncio", {"use_uvloop": backend == "uvloop"}


def run(
    main: Callable[..., Awaitable[T]], *args: Any, backend: Backend = "uvloop", clock: Any = None
) -> T:
    """Runs `main(*args)` to completion on `backend` (uvloop is the fast live default)."""
    name, options = backend_options(backend, clock=clock)
    return anyio.run(main, *args, backend=name, backend_options=options)
