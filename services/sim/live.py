"""The simulation played live: a world that a dashboard watches and steers.

`LiveSim` is an event source of the dashboard (`run(publish)`, the shape of ui's
`EventSource`): it opens the world (services/sim/world.py) in the caller's event loop, hands
on every event of it (`SimFeed`), plays a scenario's arrivals and link changes at their
virtual times, and runs `LiveLoad`, the load the page starts, stops and re-rates (the
paper's log-normal prompts, Poisson arrivals). Under a `PacedClock` virtual time follows
the wall clock at the chosen speed; under an autojumping clock (tests, recordings) it runs
as fast as the machine allows.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Literal

import anyio
import anyio.abc
import msgspec

from mesh.errors import ConfigError
from services.contract.events import AnyEvent
from services.contract.sampling import Sampling
from services.paper.workload import PAPER_MU, TruncatedLogNormal
from services.router.errors import RouterError
from services.router.load import WorkloadStatistics
from services.router.requests import GenerationRequest
from services.sim.clock import PacedClock
from services.sim.feed import SimFeed
from services.sim.run import LinkChange
from services.sim.workload import BLOCK, Arrival, served
from services.sim.world import Deployment, SimWorld, open_world

LoadKind = Literal["mixed", "short", "long"]
LOAD_KINDS: tuple[LoadKind, ...] = ("mixed", "short", "long")
# exp(mu) of the paper's log-normal: "short" and "long" keep the halves below and above it.
MEDIAN_PAPER_TOKENS = math.exp(PAPER_MU)
MAX_LOAD_RATE = 1000.0


class LiveConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """rate: the page's load at the start (requests/s, 0: none until started);
    output_len: served tokens each of its requests generates; wall_clock: restamp events to
    times of day (a recording keeps virtual times); max_outstanding bounds the load's open
    requests (arrivals beyond it are dropped and counted)."""

    rate: float = 0.0
    kind: LoadKind = "mixed"
    output_len: int = 1024
    seed: int = 0
    wall_clock: bool = True
    stats_interval_s: float = 1.0
    max_outstanding: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= MAX_LOAD_RATE:
            raise ConfigError(f"rate must be within [0, {MAX_LOAD_RATE:g}], got {self.rate!r}")
        if min(self.output_len, self.max_outstanding) < 1:
            raise ConfigError(f"output_len and max_outstanding must be >= 1, got "
                              f"{self.output_len} and {self.max_outstanding}")


async def send_arrival(world: SimWorld, arrival: Arrival) -> bool:
    """Sends one request to the router as a client would and reads it to its end; whether
    it was served (a refusal is the router's own answer, counted in `world.refused`)."""
    request = GenerationRequest(prompt=arrival.prompt(),
                                sampling=Sampling(max_tokens=arrival.output_len))
    try:
        handle = await world.scheduler.submit(request)
        await handle.collect()
    except RouterError as exc:
        world.refused.append(exc.message)
        return False
    return True


class LiveLoad:
    """Poisson arrivals of the paper's prompts at a rate the page changes while it runs.

    Each arrival goes to `send` (by default `send_arrival` to `world`; the comparison hands
    it to several worlds at once), which says whether it was served."""

    def __init__(self, world: SimWorld, config: LiveConfig, *,
                 send: Callable[[Arrival], Awaitable[bool]] | None = None) -> None:
        self.world, self.config = world, config
        self._deliver = send or partial(send_arrival, world)
        self.rate, self.running = config.rate, config.rate > 0
        self.kind: str = config.kind
        self._rng = random.Random(config.seed)
        self._lengths = TruncatedLogNormal.paper()
        self._changed: anyio.Event | None = None
        self._counts = dict.fromkeys(("sent", "completed", "failed", "dropped"), 0)
        self._outstanding = 0

    def start(self, rate: float, kind: str = "mixed") -> None:
        if not 0 < rate <= MAX_LOAD_RATE:
            raise ConfigError(f"rate must be within (0, {MAX_LOAD_RATE:g}], got {rate!r}")
        if kind not in LOAD_KINDS:
            raise ConfigError(f"kind must be one of {', '.join(LOAD_KINDS)}, got {kind!r}")
        self.rate, self.kind, self.running = rate, kind, True
        self._wake()

    def stop(self) -> None:
        self.running = False
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def run(self) -> None:
        """Until cancelled; a change of rate draws the next gap afresh (Poisson forgets)."""
        async with anyio.create_task_group() as requests:
            while True:
                changed = self._changed = anyio.Event()
                gap = self._rng.expovariate(self.rate) if self.running else math.inf
                with anyio.move_on_after(gap):
                    await changed.wait()
                if not changed.is_set():
                    self._arrive(requests)

    def _arrive(self, requests: anyio.abc.TaskGroup) -> None:
        if self._outstanding >= self.config.max_outstanding:
            self._counts["dropped"] += 1
            return
        self._counts["sent"] += 1
        self._outstanding += 1
        requests.start_soon(self._send, self.arrival())

    async def _send(self, arrival: Arrival) -> None:
        try:
            ok = await self._deliver(arrival)
        finally:
            self._outstanding -= 1
        self._counts["completed" if ok else "failed"] += 1

    def arrival(self) -> Arrival:
        """The next request: a fresh prompt (nothing shared) of the paper's lengths."""
        paper_len = self._length()
        length = served(paper_len, self.world.deployment.scale)
        # Random first blocks: the live load shares no prefix with itself or a scenario.
        first = self._rng.randrange(1 << 40) * 512
        blocks = tuple(range(first, first + length // BLOCK + 1))
        return Arrival(anyio.current_time(), blocks, length, self.config.output_len, paper_len)

    def _length(self) -> int:
        while True:
            paper_len = self._lengths.sample(self._rng)
            if self.kind == "mixed" or (paper_len < MEDIAN_PAPER_TOKENS) == (
                    self.kind == "short"):
                return paper_len

    def statistics(self) -> WorkloadStatistics:
        """The shape of the router's demo load (GET /admin/state's "workload")."""
        return WorkloadStatistics(self.running, self.rate, self.kind, self._outstanding,
                                  **self._counts)


class LiveSim:
    """The dashboard's event source over a simulated deployment (module docstring).

    `world` and `load` exist while `run` runs (None before and after); `clock` is the
    `PacedClock` the loop runs on, when it does (the speed control needs it).
    """

    def __init__(self, deployment: Deployment, *, arrivals: Sequence[Arrival] = (),
                 changes: Sequence[LinkChange] = (), config: LiveConfig | None = None,
                 clock: PacedClock | None = None) -> None:
        self.deployment, self.arrivals, self.changes = deployment, arrivals, changes
        self.config = config or LiveConfig()
        self.clock = clock
        self.world: SimWorld | None = None
        self.load: LiveLoad | None = None
        self.feed: SimFeed | None = None
        self.started_at = 0.0  # virtual time the world opened at

    async def run(self, publish: Callable[[AnyEvent], None]) -> None:
        async with open_world(self.deployment) as world:
            self.started_at = now = anyio.current_time()
            offset = time.time() - now if self.config.wall_clock else 0.0
            self.feed = SimFeed(world, offset=offset,
                                stats_interval_s=self.config.stats_interval_s)
            self.world, self.load = world, LiveLoad(world, self.config)
            try:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(self.feed.run, publish)
                    tasks.start_soon(self.load.run)
                    tasks.start_soon(self._play, world, now)
                    tasks.start_soon(self._change_link, world, now)
            finally:
                self.world = self.load = None

    async def _play(self, world: SimWorld, start: float) -> None:
        async with anyio.create_task_group() as requests:
            for arrival in self.arrivals:
                await anyio.sleep_until(start + arrival.at)
                requests.start_soon(send_arrival, world, arrival)

    async def _change_link(self, world: SimWorld, start: float) -> None:
        for change in sorted(self.changes, key=lambda c: c.at):
            await anyio.sleep_until(start + change.at)
            world.links["link-0"].shaper.set_params(change.params)

    def virtual_s(self) -> float:
        """Virtual seconds since the world opened (0 before)."""
        return anyio.current_time() - self.started_at if self.world is not None else 0.0
