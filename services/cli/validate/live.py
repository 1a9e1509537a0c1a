"""The live side of `prfaas validate-sim`: the router's scheduler in this process sends each
phase's requests to the live mesh and records their outcomes and the decode worker's own step
timing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.abc
import httpx
import msgspec
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no stubs

from mesh.topology import Topology
from mesh.transport import TcpTransport
from services.bench.host import load_average
from services.cli.validate.compare import service_rate
from services.cli.validate.config import Job, Outcome, ValidationConfig, policy_options
from services.cli.validate.jobs import burst, jobs, load_jobs, probe_jobs, rerun_jobs, rerun_name
from services.cli.validate.live_mesh import live_mesh
from services.contract.events import RequestDone
from services.contract.sampling import Sampling
from services.model.config import family_config
from services.paper.hardware import (
    LinearDecode,
)
from services.router.config import SchedulerConfig, link_ends
from services.router.control import ControlConfig, RouterControl
from services.router.errors import RouterError
from services.router.policies import create_policy
from services.router.requests import GenerationRequest, RequestHandle
from services.router.scheduler import Scheduler
from services.router.workers import WorkerTable
from services.service import ServiceContext
from services.sim.engine import ModeledConfig, ModeledTokenizer


class LiveRouter:
    """The router's scheduler in this process, on the live mesh (as the router service runs
    it, minus HTTP): requests go in as token ids, outcomes come from its own events."""

    def __init__(self, topology: Topology, config: ValidationConfig) -> None:
        ctx = ServiceContext(topology, topology.service("router"), "live", 1.0, TcpTransport())
        policy = create_policy("prfaas", policy_options(config))
        vocab = family_config(config.family, config.size).vocab_size
        self.scheduler = Scheduler(ctx.node(), policy, WorkerTable.from_topology(topology),
                                   ModeledTokenizer(ModeledConfig(vocab_size=vocab)),
                                   SchedulerConfig(connections=1, links=link_ends(topology),
                                                   max_inflight=1024))

    async def run(self, load: Sequence[Job], progress: str = "") -> list[Outcome]:
        scheduler = self.scheduler
        async with anyio.create_task_group() as tg:
            await tg.start(scheduler.run)
            await tg.start(RouterControl(scheduler, ControlConfig(tick_s=1.0)).run)
            with scheduler.events.subscribe(1 << 16) as events:
                handles: dict[str, tuple[float, Job, RequestHandle]] = {}
                tg.start_soon(self._send, load, handles, tg)
                done: dict[str, RequestDone] = {}
                with tqdm(total=len(load), desc=progress, unit="req", file=sys.stderr,
                          disable=not progress, leave=False) as bar:
                    while len(done) < len(load):
                        event = await events.receive()
                        if isinstance(event, RequestDone):
                            done[event.request_id] = event
                            bar.update()
            tg.cancel_scope.cancel()
        # The jobs' order (handles is filled as they are sent), as `simulate` gives its own.
        return [_outcome(sent, done[rid]) for rid, sent in handles.items()]

    async def _send(self, load: Sequence[Job],
                    handles: dict[str, tuple[float, Job, RequestHandle]],
                    tg: anyio.abc.TaskGroup) -> None:
        start = anyio.current_time()
        for job in load:
            await anyio.sleep_until(start + job.arrival.at)
            sent = anyio.current_time() - start
            handle = await self.scheduler.submit(GenerationRequest(
                prompt=job.prompt, sampling=Sampling(max_tokens=job.arrival.output_len,
                                                     stop_on_eos=False)))
            handles[handle.placement.request_id] = (sent, job, handle)
            tg.start_soon(_collect, handle)


async def _collect(handle: RequestHandle) -> None:
    try:
        await handle.collect()
    except RouterError:
        # A placed request's RequestDone (ok False) carries its error into the outcomes.
        return


def _outcome(sent: tuple[float, Job, RequestHandle], done: RequestDone) -> Outcome:
    at, job, handle = sent
    p = handle.prefill
    return Outcome(at, done.prompt_tokens, done.output_tokens, done.ttft_s, done.tpot_s,
                   done.e2e_s, done.ok, p.queue_s if p else 0.0, p.compute_s if p else 0.0,
                   p.transfer_s if p else 0.0, done.error, job.probe, done.cluster)


class DecodeSteps(msgspec.Struct, frozen=True):
    """The decode worker's engine steps over one phase, as it timed them itself (its
    statistics' step_seconds and sums, read from its /metrics before and after)."""

    seconds: float = 0.0
    steps: int = 0
    sequences: int = 0  # the steps' batch sizes, summed
    context_tokens: int = 0  # the tokens their batches held, summed

    def speed(self, fit: LinearDecode) -> float:
        """Seconds the steps took over what `fit` predicts for the same steps (0: none)."""
        predicted = (fit.fixed_s * self.steps + fit.per_sequence_s * self.sequences
                     + fit.per_token_s * self.context_tokens)
        return self.seconds / predicted if self.steps and predicted > 0 else 0.0

    def minus(self, before: DecodeSteps) -> DecodeSteps:
        return DecodeSteps(self.seconds - before.seconds, self.steps - before.steps,
                           self.sequences - before.sequences,
                           self.context_tokens - before.context_tokens)


DECODE_METRICS = {"prfaas_decode_step_seconds_total": "seconds",
                  "prfaas_decode_steps_total": "steps",
                  "prfaas_decode_step_sequences_total": "sequences",
                  "prfaas_decode_step_context_tokens_total": "context_tokens"}


async def read_decode_steps(url: str) -> DecodeSteps:
    """The decode worker's step counters from its /metrics at `url`."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.get(url)
        response.raise_for_status()
    return parse_decode_steps(response.text)


def parse_decode_steps(text: str) -> DecodeSteps:
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in DECODE_METRICS:
            found[DECODE_METRICS[name]] = float(line.rsplit(" ", 1)[1])
    missing = sorted(name for name, key in DECODE_METRICS.items() if key not in found)
    if missing:
        raise ValueError(f"the decode worker's /metrics lacks {', '.join(missing)}")
    return DecodeSteps(found["seconds"], round(found["steps"]), round(found["sequences"]),
                       round(found["context_tokens"]))


class LiveRun(msgspec.Struct, frozen=True):
    """What the live mesh did, as measured: its capacity (measured, or as configured), each
    phase's outcomes (the in-situ probes' under "in-situ", the capacity burst's under
    "capacity", when measured, then each load's) and the decode worker's own step timing over
    each phase. Nothing here is derived: the profiles are (`derive_profiles`)."""

    capacity_rps: float
    outcomes: dict[str, list[Outcome]]
    wall_s: float
    # The machine's 1-minute load average as each phase began: what else was running.
    load_averages: dict[str, str] = {}
    # The decode worker's own step timing over each phase (DecodeSteps), by phase name.
    decode_steps: dict[str, DecodeSteps] = {}


async def _drive_live(config: ValidationConfig, topology: Topology,
                      say: Callable[[str], None], loads: dict[str, str],
                      steps: dict[str, DecodeSteps],
                      ) -> tuple[float, dict[str, list[Outcome]]]:
    """Warm-up, the capacity burst (unless configured), the in-situ probes, then each load on
    one live mesh; the machine's load average as each phase begins goes into `loads`, the
    decode worker's step timing over the probes and each load into `steps`."""
    router = LiveRouter(topology, config)
    out: dict[str, list[Outcome]] = {}
    capacity = config.capacity_rps
    decode = topology.service("pd-decode-0")
    url = f"http://{decode.host}:{topology.options_of(decode)['metrics_port']}/metrics"

    async def timed(name: str, load: Sequence[Job], progress: str) -> None:
        before = await read_decode_steps(url)
        out[name] = await router.run(load, progress)
        steps[name] = (await read_decode_steps(url)).minus(before)

    loads["warm-up"] = f"{load_average():.2f}"
    async with router.scheduler.node:
        await router.scheduler.node.listen()
        await router.run(jobs(config, 1.0, config.warmup_requests, config.seed + 99,
                              burst_s=2.0 * config.warmup_requests), "warm-up")
        if not capacity:
            loads["capacity"] = f"{load_average():.2f}"
            out["capacity"] = await router.run(burst(config), "capacity burst")
            capacity = service_rate(out["capacity"])
            say(f"live capacity: {capacity:.2f} req/s (a burst of {config.capacity_requests})")
        loads["in-situ"] = f"{load_average():.2f}"
        probes = probe_jobs(config, config.probe_load * capacity)
        if config.probe_load > 0:
            await timed("in-situ", probes, "in-situ profile")
        else:
            out["in-situ"] = []
            for job in tqdm(probes, desc="in-situ profile", unit="req", file=sys.stderr,
                            leave=False):
                out["in-situ"] += await router.run([job])
        for index, (name, fraction) in enumerate(config.loads):
            load = load_jobs(config, index, fraction * capacity)
            for again in range(config.repeats):
                key = rerun_name(name, again)
                loads[key] = f"{load_average():.2f}"
                say(f"live load {key}: {fraction * capacity:.2f} req/s, {config.requests} "
                    f"requests (load average {loads[key]})")
                await timed(key, rerun_jobs(config, load, again), f"live {key}")
    return capacity, out


def run_live(config: ValidationConfig, log_dir: Path,
             say: Callable[[str], None] = print) -> LiveRun:
    """The live side of the comparison (the command's docstring); service logs go to `log_dir`."""
    began = time.perf_counter()
    loads: dict[str, str] = {}
    steps: dict[str, DecodeSteps] = {}
    with live_mesh(config, log_dir) as topology:
        capacity, outcomes = anyio.run(_drive_live, config, topology, say, loads, steps,
                                       backend="trio")
    return LiveRun(capacity, outcomes, time.perf_counter() - began, loads, steps)
