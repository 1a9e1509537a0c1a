"""One simulation run: a deployment, a list of arrivals, virtual time; what happened.

`simulate` opens the world (services/sim/world.py), sends each arrival to the router's
scheduler at its time as a streaming client would (`Scheduler.submit`, then reading the answer
to its end), applies scheduled link changes, samples the mesh every `sample_s`, and collects
each request's record from the router's own events (`RoutingDecision`, `RequestDone`), the
prefill worker's answer (`PrefillDone.queue_s`: how long the request waited for the compute)
and the client's own clock: TTFT and the time to the second token are when the client reads
them (the second waits for a decode batch slot). The sim measures what the live router and a
live client would report.

Busy fractions: every `busy_s` of virtual time (1 s) each stage's occupancy is read and
integrated: a prefill instance is busy while it holds a job (computing, or waiting until
the decode side has accepted its KV), a decode instance holds running/BS_max of its slots,
the link is busy for the wire time of the bytes it released. Each `Sample` carries the
integrals so far (`busy`, and `units`, the instance-seconds of each stage), so any window's
busy fraction is a difference.

Run it under trio with a `JumpClock` (`run_virtual`): an hour of traffic takes seconds to
minutes of wall time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import msgspec
import trio

from mesh import native
from mesh.events import Subscription
from mesh.run import fewer_collections
from netem.params import LinkParams
from services.contract.events import Event, RequestDone, RoleChanged, RoutingDecision
from services.contract.sampling import Sampling
from services.router.errors import RouterError
from services.router.requests import GenerationRequest
from services.sim.clock import JumpClock, settle
from services.sim.exposition import world_metrics
from services.sim.workload import Arrival
from services.sim.world import Deployment, SimWorld, open_world

Progress = Callable[[float], None]
BUSY_S = 1.0
# Stages, as the throughput model names them: PrfaaS prefill, the link, PD prefill, decode.
STAGES = ("prfaas", "link", "pd_p", "pd_d")


class LinkChange(msgspec.Struct, frozen=True):
    """At virtual time `at`, link-0 takes `params`."""

    at: float
    params: LinkParams


class Record(msgspec.Struct, frozen=True):
    """One request, as the router saw it."""

    request_id: str
    arrival_s: float
    paper_len: int
    prompt_tokens: int
    cluster: str
    incremental_len: int
    cached_tokens: int
    threshold: float | None
    ttft_s: float  # arrival to the first token, on the client's clock
    tpot_s: float
    e2e_s: float
    output_tokens: int
    ok: bool
    error: str = ""
    ttst_s: float = math.nan  # arrival to the second token, on the client's clock
    queue_s: float = math.nan  # waiting at its prefill worker before the compute began


class Sample(msgspec.Struct, frozen=True):
    """The mesh at one instant (virtual s)."""

    at: float
    threshold: float | None
    egress_bps: float
    utilisation: float
    bandwidth_bps: float
    queue_prfaas: int
    queue_pd: int
    decode_running: int
    decode_waiting: int
    in_flight: int
    egress_bytes: int = 0  # link-0's egress bytes released so far
    busy: dict[str, float] = {}  # per stage: busy instance-seconds so far (module docstring)
    units: dict[str, float] = {}  # per stage: instance-seconds so far
    # link-0's bandwidth as the router estimates it from its transfers (bandwidth_bps: the truth)
    estimate_bps: float = 0.0


class SimResult(msgspec.Struct, frozen=True):
    deployment: Deployment
    records: list[Record]
    samples: list[Sample]
    arrivals: int
    unfinished: int  # still in flight when the run stopped
    virtual_s: float
    link_bytes: int  # egress bytes that crossed link-0
    conversions: int
    role_changes: list[tuple[float, str]]  # (virtual s, "worker: old -> new")
    events: int  # telemetry events the services published (router and workers)
    metrics: str = ""  # its Prometheus exposition at the end (services/sim/exposition.py)
    arrivals_end_s: float = 0.0  # the last arrival (virtual s): the end of the arrival window
    # (virtual s, cluster) of every routing decision, finished or not: the shares of arrivals
    routes: list[tuple[float, str]] = []


class _Collector:
    """Joins the router's decision and completion events into records."""

    def __init__(self, arrivals: dict[str, Arrival], offset: float) -> None:
        self.arrivals, self.offset = arrivals, offset
        self.decisions: dict[str, RoutingDecision] = {}
        # request id -> (first token, second token) since arrival and the prefill's queue_s,
        # as the client saw them
        self.client: dict[str, tuple[float, float, float]] = {}
        self.records: list[Record] = []
        self.routes: list[tuple[float, str]] = []
        self.role_changes: list[tuple[float, str]] = []

    def take(self, event: Event) -> None:
        if isinstance(event, RoutingDecision):
            self.decisions[event.request_id] = event
            self.routes.append((event.ts - self.offset, event.cluster))
        elif isinstance(event, RequestDone):
            self._done(event)
        elif isinstance(event, RoleChanged):
            self.role_changes.append((event.ts - self.offset,
                                      f"{event.worker}: {event.old} -> {event.new}"))

    def _done(self, done: RequestDone) -> None:
        decision = self.decisions.pop(done.request_id, None)
        arrival = self.arrivals.pop(done.request_id, None)
        first, second, queue = self.client.pop(done.request_id,
                                               (done.ttft_s, math.nan, math.nan))
        if decision is None or arrival is None:
            return
        self.records.append(Record(
            request_id=done.request_id, arrival_s=arrival.at, paper_len=arrival.paper_len,
            prompt_tokens=done.prompt_tokens, cluster=decision.cluster,
            incremental_len=decision.incremental_len, cached_tokens=done.cached_tokens,
            threshold=decision.threshold, ttft_s=first, tpot_s=done.tpot_s,
            e2e_s=done.e2e_s, output_tokens=done.output_tokens, ok=done.ok, error=done.error,
            ttst_s=second, queue_s=queue))


class _Busy:
    """Per stage, the integrals of busy and of instances over virtual time (module docstring)."""

    def __init__(self) -> None:
        self.busy = dict.fromkeys(STAGES, 0.0)
        self.units = dict.fromkeys(STAGES, 0.0)
        self._egress = 0

    def add(self, world: SimWorld, dt: float) -> None:
        # The workers' counts, not their whole statistics: this runs every virtual second.
        for worker in world.workers.values():
            if worker.role == "decode":
                decode = worker.decode
                stage, busy = "pd_d", decode.running / max(1, decode.config.max_batch)
            else:
                stage = "prfaas" if worker.cluster_kind == "prfaas" else "pd_p"
                busy = float(worker.prefill.running > 0)
            self.busy[stage] += busy * dt
            self.units[stage] += dt
        link = world.links.get("link-0")
        if link is not None:
            egress = link.shaper.statistics().egress.bytes_out
            bandwidth = link.shaper.params.bandwidth_bps or math.inf
            # Not capped at dt: a modeled KV piece is released whole, so a tick may count
            # more than a second of wire time, and the next ones none.
            self.busy["link"] += 8.0 * (egress - self._egress) / bandwidth
            self.units["link"] += dt
            self._egress = egress


def _sample(world: SimWorld, now: float, in_flight: int, busy: _Busy) -> Sample:
    shaper = world.links["link-0"].shaper if world.links else None
    egress = shaper.statistics().egress if shaper else None
    estimate = world.scheduler.links.estimate("link-0")
    queues = {"prfaas": 0, "pd": 0}
    running = waiting = 0
    for worker in world.workers.values():
        prefill, decode = worker.prefill, worker.decode
        queues[worker.cluster_kind] = queues.get(worker.cluster_kind, 0) + (
            prefill.queue_depth + prefill.running)
        running += decode.running
        waiting += decode.waiting
    return Sample(at=now, threshold=world.scheduler.policy.threshold,
                  egress_bps=egress.throughput_bps if egress else 0.0,
                  utilisation=egress.utilisation if egress else 0.0,
                  bandwidth_bps=(shaper.params.bandwidth_bps or 0.0) if shaper else 0.0,
                  estimate_bps=estimate.available_bps if estimate else 0.0,
                  queue_prfaas=queues["prfaas"], queue_pd=queues["pd"],
                  decode_running=running, decode_waiting=waiting, in_flight=in_flight,
                  egress_bytes=egress.bytes_out if egress else 0, busy=dict(busy.busy),
                  units=dict(busy.units))


async def simulate(deployment: Deployment, arrivals: Sequence[Arrival], *,
                   changes: Sequence[LinkChange] = (), sample_s: float = 10.0,
                   drain_s: float = 600.0, progress: Progress | None = None) -> SimResult:
    """Runs the arrivals through the deployment; stops when all have finished, or `drain_s`
    after the last arrival (the rest count as unfinished)."""
    async with open_world(deployment) as world:
        with world.scheduler.events.subscribe(1 << 20) as events:
            start = anyio.current_time()
            pending: dict[str, Arrival] = {}
            collector = _Collector(pending, start)
            in_flight = [0]
            busy = _Busy()
            end = (arrivals[-1].at if arrivals else 0.0) + drain_s
            # trio's own nursery (a simulation runs on trio): anyio's wraps each task it
            # starts in a handle with a cancel scope and an event, and one starts per arrival.
            async with trio.open_nursery() as tg:
                tg.start_soon(_collect, events, collector, sample_s)
                samples: list[Sample] = []
                tg.start_soon(_sampler, world, start, sample_s, samples, in_flight, busy, progress)
                tg.start_soon(_integrate, world, busy)
                tg.start_soon(_apply_changes, world, start, changes)
                await _send_all(world, start, arrivals, pending, collector, in_flight, tg)
                with anyio.move_on_after(max(0.0, start + end - anyio.current_time())):
                    while in_flight[0]:
                        await native.sleep(1.0)
                # Whatever is due at the stop runs before it, in any order trio picks.
                await settle()
                now = anyio.current_time() - start
                samples.append(_sample(world, now, in_flight[0], busy))
                tg.cancel_scope.cancel()
            _drain(events, collector)
        link_bytes = (world.links["link-0"].shaper.statistics().egress.bytes_out
                      if world.links else 0)
        conversions = world.control.statistics().conversions
        published = world.scheduler.events.statistics().published + sum(
            w.bus.statistics().published for w in world.workers.values())
        metrics = world_metrics(world)
    records = sorted(collector.records, key=lambda r: r.arrival_s)
    return SimResult(deployment, records, samples, len(arrivals), in_flight[0], now,
                     link_bytes, conversions, collector.role_changes, published, metrics,
                     arrivals[-1].at if arrivals else 0.0, sorted(collector.routes))


def _drain(events: Subscription[Event], collector: _Collector) -> None:
    for event in events.drain():
        collector.take(event)


async def _send_all(world: SimWorld, start: float, arrivals: Sequence[Arrival],
                    pending: dict[str, Arrival], collector: _Collector, in_flight: list[int],
                    tg: trio.Nursery) -> None:
    """Each arrival at its time, as a task of `tg` (the run's: it may end them unfinished)."""
    for arrival in arrivals:
        # anyio.sleep_until's arithmetic, without its backend lookups, parked on the clock.
        await native.sleep(max(start + arrival.at - trio.current_time(), 0.0))
        in_flight[0] += 1
        tg.start_soon(_one, world, arrival, pending, collector.client, in_flight)


async def _one(world: SimWorld, arrival: Arrival, pending: dict[str, Arrival],
               client: dict[str, tuple[float, float, float]], in_flight: list[int]) -> None:
    """A streaming client's first and second token times. The router stamps them as the
    tokens reach it, in the instant a streaming client reading each delta would stamp them
    (virtual time stands still while tasks run), so the client waits once, for the end,
    rather than waking for every delta."""
    request = GenerationRequest(prompt=arrival.prompt(), stream=True,
                                sampling=Sampling(max_tokens=arrival.output_len))
    began = trio.current_time()
    try:
        handle = await world.scheduler.submit(request)
        rid = handle.placement.request_id
        pending[rid] = arrival
        await handle.collect_delta()
        stamps = [at - began if at else math.nan
                  for at in (handle.first_token_at, handle.second_token_at)]
        queue = handle.prefill.queue_s if handle.prefill is not None else math.nan
        client[rid] = (stamps[0], stamps[1], queue)
    except RouterError as exc:
        # A placed request's RequestDone (ok=False) carries the error into the records; one
        # refused at the door has none, so it is counted here.
        if exc.status >= 0:
            world.refused.append(exc.message)
    finally:
        in_flight[0] -= 1


async def _collect(events: Subscription[Event], collector: _Collector, every: float) -> None:
    """Reads the events every `every` virtual seconds: they carry their own times, so reading
    them late changes no record, and a poll costs no wake-up per event."""
    while True:
        await native.sleep(every)
        _drain(events, collector)


async def _sampler(world: SimWorld, start: float, every: float, out: list[Sample],
                   in_flight: list[int], busy: _Busy, progress: Progress | None) -> None:
    while True:
        await native.sleep(every)
        now = anyio.current_time() - start
        out.append(_sample(world, now, in_flight[0], busy))
        if progress is not None:
            progress(now)


async def _integrate(world: SimWorld, busy: _Busy) -> None:
    """Each stage's occupancy every BUSY_S, integrated (module docstring). Read half a period
    off the samples' times: trio wakes tasks due at the same instant in a random order, and a
    sample must not depend on it (the same seed gives the same summary)."""
    await native.sleep(BUSY_S / 2)
    while True:
        busy.add(world, BUSY_S)
        await native.sleep(BUSY_S)


async def _apply_changes(world: SimWorld, start: float, changes: Sequence[LinkChange]) -> None:
    for change in sorted(changes, key=lambda c: c.at):
        await anyio.sleep_until(start + change.at)
        world.links["link-0"].shaper.set_params(change.params)


def run_virtual(deployment: Deployment, arrivals: Sequence[Arrival], **options: object,
                ) -> tuple[SimResult, float]:
    """`simulate` under trio on a `JumpClock` (services/sim/clock.py);
    (result, wall seconds)."""
    began = time.perf_counter()
    clock = JumpClock()

    async def main() -> SimResult:
        return await simulate(deployment, arrivals, **options)  # type: ignore[arg-type]

    with fewer_collections():
        result = trio.run(main, clock=clock)
    return result, time.perf_counter() - began
