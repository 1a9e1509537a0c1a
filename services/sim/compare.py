"""Deployments side by side on the same traffic: `prfaas sim-dashboard --compare`.

`CompareSim` opens two or three deployments of the `paper` scenario (Table 6's, as
services/sim/scenarios.py builds them: instances and t from the planner) in one event loop,
so one clock drives them all, and plays one load (`LiveLoad`: the paper's lengths, Poisson
arrivals at the rate the page sets). Each arrival goes to every deployment at the same virtual
instant as the same request (`serve`, a streaming client); nothing else is shared.

Each deployment is a column: its world's events go to its own publisher (the dashboard's hub
of that column, through `SimFeed`), and a `Tally` keeps what its clients saw. Every `sample_s`
of virtual time the tally closes a `CompareSample` over a sliding window: completed and
offered requests per second, TTFT P90, the share of requests within the SLO the capacity
search uses (services/sim/capacity.py `Slo`: queueing before prefill and TPOT), queued
requests, link egress. The compare page polls them (`samples`), draws a line per deployment
and states the ratio of completed rates over the last `ratio_window_s` (10 virtual minutes).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack, suppress
from typing import Any

import anyio
import msgspec

from mesh.errors import ConfigError
from services.contract.events import AnyEvent
from services.contract.sampling import Sampling
from services.paper.case_study import DEPLOYMENTS, HOMOGENEOUS, NAIVE, PRFAAS_PD
from services.paper.planner import Scenario, solve_scenario
from services.router.errors import RouterError
from services.router.requests import GenerationRequest
from services.sim.capacity import Slo
from services.sim.clock import PacedClock
from services.sim.feed import SimFeed
from services.sim.live import LiveConfig, LiveLoad
from services.sim.scenarios import paper_deployments
from services.sim.workload import Arrival
from services.sim.world import Deployment, SimWorld, open_world, sim_topology

Publish = Callable[[AnyEvent], None]
JsonObject = dict[str, Any]
# Table 6's deployments, in the order the page shows them; the first named is the one whose
# completed rate the summary divides by homogeneous's (or by the last column's without it).
COMPARABLE = DEPLOYMENTS
TITLES = {PRFAAS_PD: "PrfaaS-PD", HOMOGENEOUS: "homogeneous PD", NAIVE: "naive heterogeneous"}
BASELINE = HOMOGENEOUS
# Between homogeneous's capacity and PrfaaS-PD's (docs/simulation.md, `paper`): the rate at
# which the page shows one queue grow and the other hold.
COMPARE_DEFAULT_RATE = 2.5


def compare_deployments(names: Sequence[str], *, tick_s: float = 1.0,
                        seed: int = 0) -> dict[str, Deployment]:
    """The named deployments of the `paper` scenario (two or three of COMPARABLE)."""
    unknown = [name for name in names if name not in COMPARABLE]
    if unknown or not 2 <= len(names) <= 3 or len(set(names)) != len(names):
        raise ConfigError(f"--compare takes two or three distinct names of "
                          f"{', '.join(COMPARABLE)}, got {','.join(names)!r}")
    table = paper_deployments(solve_scenario(Scenario()))
    return {name: msgspec.structs.replace(table[name], tick_s=tick_s, seed=seed)
            for name in names}


class Served(msgspec.Struct, frozen=True):
    """One request as its client saw it (virtual seconds)."""

    done_at: float
    ok: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    queue_s: float = math.nan  # at its prefill worker before the compute began


async def serve(world: SimWorld, arrival: Arrival) -> Served:
    """Sends `arrival` to the world's router as a streaming client and reads it to its end."""
    request = GenerationRequest(prompt=arrival.prompt(), stream=True,
                                sampling=Sampling(max_tokens=arrival.output_len))
    began = anyio.current_time()
    first, tokens = math.nan, 0
    try:
        handle = await world.scheduler.submit(request)
        with suppress(StopAsyncIteration):
            while True:
                tokens += (await handle.next_delta()).tokens
                if tokens and math.isnan(first):
                    first = anyio.current_time() - began
    except RouterError as exc:
        world.refused.append(exc.message)
        return Served(anyio.current_time(), ok=False)
    now = anyio.current_time()
    # The simulation hands a request its tokens in few pieces: TPOT from the first to the last.
    tpot = (now - began - first) / (tokens - 1) if tokens > 1 else 0.0
    queue = handle.prefill.queue_s if handle.prefill is not None else math.nan
    return Served(now, True, first, tpot, queue)


class CompareSample(msgspec.Struct, frozen=True):
    """One deployment over the window ending at `at` (virtual s since the start)."""

    at: float
    offered_rps: float  # arrivals per second (the same for every deployment)
    completed_rps: float
    ttft_p90_s: float | None  # None: nothing completed in the window
    slo_attained: float | None  # share of the completed within `Slo` (queueing and TPOT)
    queued: int  # requests waiting for a prefill or for a decode slot
    in_flight: int  # arrived, not yet completed
    egress_gbps: float  # PrfaaS -> PD link's mean over the window, 0 without one


def p90(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else None


class Tally:
    """What one deployment's clients saw, over the last `keep_s` of virtual time."""

    def __init__(self, keep_s: float, slo: Slo) -> None:
        self.keep_s, self.slo = keep_s, slo
        self.arrivals: deque[float] = deque()
        self.done: deque[Served] = deque()
        self.egress: deque[tuple[float, int]] = deque()  # (virtual s, link bytes out so far)
        self.in_flight = self.completed = self.failed = 0

    def arrive(self, now: float) -> None:
        self.arrivals.append(now)
        self.in_flight += 1

    def finish(self, served: Served) -> None:
        self.in_flight -= 1
        if served.ok:
            self.done.append(served)
            self.completed += 1
        else:
            self.failed += 1

    def forget(self, now: float) -> None:
        while self.arrivals and self.arrivals[0] <= now - self.keep_s:
            self.arrivals.popleft()
        while self.done and self.done[0].done_at <= now - self.keep_s:
            self.done.popleft()
        while self.egress and self.egress[0][0] <= now - self.keep_s:
            self.egress.popleft()

    def completed_since(self, since: float) -> int:
        return sum(1 for s in self.done if s.done_at > since)

    def within_slo(self, served: Served) -> bool:
        return served.queue_s <= self.slo.queue_s and served.tpot_s <= self.slo.tpot_s

    def sample(self, now: float, start: float, window_s: float, world: SimWorld) -> CompareSample:
        since = now - window_s
        span = max(min(window_s, now - start), 1e-9)
        done = [s for s in self.done if s.done_at > since]
        arrived = sum(1 for at in self.arrivals if at > since)
        return CompareSample(
            at=now - start, offered_rps=arrived / span, completed_rps=len(done) / span,
            ttft_p90_s=p90([s.ttft_s for s in done]),
            slo_attained=(sum(map(self.within_slo, done)) / len(done)) if done else None,
            queued=queued(world), in_flight=self.in_flight,
            egress_gbps=self._egress_gbps(now, since, world))

    def _egress_gbps(self, now: float, since: float, world: SimWorld) -> float:
        """The link's mean egress over the window (its bytes out, differenced)."""
        link = world.links.get("link-0")
        if link is None:
            return 0.0
        self.egress.append((now, link.shaper.statistics().egress.bytes_out))
        first = next((entry for entry in self.egress if entry[0] >= since), self.egress[-1])
        span = now - first[0]
        return 8.0 * (self.egress[-1][1] - first[1]) / span / 1e9 if span > 0 else 0.0


def queued(world: SimWorld) -> int:
    """Requests waiting in the world's queues: for a prefill worker, or for a decode slot."""
    total = 0
    for worker in world.workers.values():
        total += worker.prefill.statistics().queue_depth + worker.decode.statistics().waiting
    return total


class CompareColumn:
    """One deployment of the comparison: its world (while running), tally and samples."""

    def __init__(self, name: str, deployment: Deployment, tally: Tally, keep: int) -> None:
        self.name, self.deployment, self.tally = name, deployment, tally
        self.world: SimWorld | None = None
        self.samples: deque[CompareSample] = deque(maxlen=keep)

    def describe(self) -> JsonObject:
        """What the page shows in the column's header and needs to draw its topology."""
        d = self.deployment
        links = [[spec.name, spec.a, spec.b] for spec in sim_topology(d).links]
        return {"name": self.name, "title": TITLES.get(self.name, self.name),
                "instances": f"{d.n_prfaas or '-'}/{d.n_pd_prefill or '-'}/{d.n_decode}",
                "policy": d.policy, "threshold": d.policy_options.get("threshold"),
                "token_scale": d.scale, "bandwidth_gbps": d.bandwidth_bps / 1e9 if links else 0,
                "links": links}


class CompareSim:
    """The deployments of `deployments`, driven by one load on one clock (module docstring).

    `load` and each column's `world` exist while `run_columns` runs."""

    def __init__(self, deployments: Mapping[str, Deployment], *, config: LiveConfig,
                 clock: PacedClock | None = None, sample_s: float = 1.0,
                 window_s: float = 60.0, ratio_window_s: float = 600.0,
                 slo: Slo | None = None) -> None:
        if not (0 < sample_s <= window_s and ratio_window_s > 0):
            raise ConfigError(f"need 0 < sample_s <= window_s and ratio_window_s > 0, got "
                              f"{sample_s}, {window_s}, {ratio_window_s}")
        keep_s = max(window_s, ratio_window_s)
        self.columns = [CompareColumn(name, d, Tally(keep_s, slo or Slo()),
                                      keep=math.ceil(keep_s / sample_s) + 1)
                        for name, d in deployments.items()]
        self.config, self.clock = config, clock
        self.sample_s, self.window_s, self.ratio_window_s = sample_s, window_s, ratio_window_s
        self.load: LiveLoad | None = None
        self.started_at = 0.0
        self.running = False

    def describe(self) -> list[JsonObject]:
        return [column.describe() for column in self.columns]

    async def run_columns(self, publishers: Mapping[str, Publish]) -> None:
        """Runs every deployment until cancelled, each column's events to its publisher."""
        async with AsyncExitStack() as stack:
            for column in self.columns:
                column.world = await stack.enter_async_context(open_world(column.deployment))
            worlds = [column.world for column in self.columns if column.world is not None]
            self.started_at = now = anyio.current_time()
            offset = time.time() - now if self.config.wall_clock else 0.0
            self.load = LiveLoad(worlds[0], self.config, send=self._fan_out)
            self.running = True
            try:
                async with anyio.create_task_group() as tasks:
                    for column in self.columns:
                        feed = SimFeed(worlds[self.columns.index(column)], offset=offset,
                                       stats_interval_s=self.config.stats_interval_s)
                        tasks.start_soon(feed.run, publishers[column.name])
                    tasks.start_soon(self.load.run)
                    tasks.start_soon(self._sample)
            finally:
                self.running, self.load = False, None
                for column in self.columns:
                    column.world = None

    async def _fan_out(self, arrival: Arrival) -> bool:
        """The same arrival to every deployment at once; whether all served it."""
        now = anyio.current_time()
        results: list[bool] = []

        async def one(column: CompareColumn, world: SimWorld) -> None:
            column.tally.arrive(now)
            served = await serve(world, arrival)
            column.tally.finish(served)
            results.append(served.ok)

        async with anyio.create_task_group() as requests:
            for column in self.columns:
                if column.world is not None:
                    requests.start_soon(one, column, column.world)
        return all(results)

    async def _sample(self) -> None:
        while True:
            await anyio.sleep(self.sample_s)
            now = anyio.current_time()
            for column in self.columns:
                if column.world is None:
                    continue
                column.tally.forget(now)
                column.samples.append(column.tally.sample(now, self.started_at, self.window_s,
                                                          column.world))

    def virtual_s(self) -> float:
        return anyio.current_time() - self.started_at if self.running else 0.0

    def summary(self) -> JsonObject:
        """Completed rates over the last `ratio_window_s` (or since the start, if shorter),
        and each deployment's ratio to the baseline (homogeneous, else the last column)."""
        elapsed = self.virtual_s()
        window = min(self.ratio_window_s, elapsed)
        since = self.started_at + elapsed - window
        rates = {c.name: c.tally.completed_since(since) / window if window > 0 else 0.0
                 for c in self.columns}
        base = BASELINE if BASELINE in rates else self.columns[-1].name
        ratios = {name: rate / rates[base] if rates[base] > 0 else None
                  for name, rate in rates.items()}
        return {"window_s": window, "baseline": base, "completed_rps": rates, "ratios": ratios,
                "completed": {c.name: c.tally.completed for c in self.columns},
                "failed": {c.name: c.tally.failed for c in self.columns}}

    def samples(self, after: float) -> JsonObject:
        """The page's poll: every column's samples after virtual time `after`, the summary,
        the load and the clock."""
        load = self.load.statistics() if self.load is not None else None
        clock = self.clock
        return {
            "virtual_s": self.virtual_s(),
            "speed": clock.rate if clock is not None else None,
            "achieved": clock.statistics().achieved if clock is not None else None,
            "load": msgspec.to_builtins(load) if load is not None else None,
            "samples": {c.name: [msgspec.to_builtins(s) for s in c.samples if s.at > after]
                        for c in self.columns},
            "summary": self.summary(),
        }
