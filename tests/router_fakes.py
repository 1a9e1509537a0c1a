"""Fake-but-honest workers on the memory mesh, for the router's tests (not a test module).

The workers here speak the real messages (services/contract/messages.py) over the real mesh runtime
(memory transport) and report their caches to the real cache directory service; only their
compute is faked (virtual seconds per token, a deterministic token sequence, the reusable
prefix read from the directory instead of a store of their own), and KV bytes crossing
clusters are paced by netem's real `LinkShaper` on the same clock. `fake_mesh` starts all of
it with the router's scheduler and control loops, on trio (virtual time) or asyncio.
"""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from mesh.events import Subscription
from mesh.node import Node
from mesh.server import Context
from mesh.topology import Topology, parse_topology
from mesh.transport import MemoryHub, MemoryTransport
from mesh.wire import Codec
from netem.params import LinkParams
from netem.shaper import Direction, LinkShaper
from netem.toxics import apply_link_update
from services.cachedir.service import CacheDirService
from services.contract.errors import DataPathError
from services.contract.events import Event, RoutingDecision
from services.contract.messages import (
    CODEC_MESSAGES,
    BlockRun,
    BlocksStored,
    DecodeRequest,
    KVAccepted,
    KVChunk,
    KVClose,
    KVOpen,
    ModelInfo,
    PrefillDone,
    PrefillRequest,
    SetRole,
    StatusQuery,
    TokenChunk,
    WorkerState,
)
from services.contract.prefix import block_hashes
from services.contract.sampling import Sampling
from services.contract.tracing import Tracer
from services.contract.types import Role
from services.model.tokenizer import ByteTokenizer
from services.router.config import LinkEnds, SchedulerConfig
from services.router.control import ControlConfig, RouterControl
from services.router.link_meter import EstimatorConfig
from services.router.placement import Placement
from services.router.policies import create_policy
from services.router.policy import LinkSample, RouteInputs
from services.router.requests import Finished, GenerationRequest, RequestHandle
from services.router.scheduler import Scheduler
from services.router.static_policies import threshold_rule
from services.router.workers import WorkerTable
from services.worker.send_meter import SendMeter
from tests.topologies import MEMORY_PORTS, mesh_toml

BLOCK = 16
TOPOLOGY = mesh_toml(MEMORY_PORTS)
# The same with a second PD decode worker (a decode worker lost has one to migrate to).
TWO_DECODERS = mesh_toml({**MEMORY_PORTS, "pd-decode-1": 7131})
INFO = ModelInfo(family="fake", size="tiny", config_hash="0", dtype="float32", vocab_size=257,
                 block_size=BLOCK, eos_id=0, source="fake")


@dataclass(frozen=True)
class Timing:
    """Virtual seconds of the fake work and the KV size model (bytes)."""

    prfaas_s_per_token: float = 0.0005
    pd_s_per_token: float = 0.002
    decode_step_s: float = 0.01
    kv_bytes_per_token: int = 1000
    kv_fixed_bytes: int = 20_000


def fake_token(prompt: Sequence[int], index: int) -> int:
    """The deterministic 'model': lowercase letters (byte tokens are byte + 1)."""
    return ord("a") + (sum(prompt) + 7 * index) % 26 + 1


@dataclass
class FakeWorker:
    """A prefill or decode worker that fakes only its compute."""

    mesh: FakeMesh
    name: str
    cluster: str
    role: Role
    node: Node
    draining: bool = False
    hung: bool = False  # answers nothing (a worker that is down)
    # Stopped (SIGSTOP): answers no status poll, and its streams and calls make no progress
    # until `thaw` (SIGCONT).
    _thawed: anyio.Event | None = None
    fail_prefill: bool = False
    break_prefill: bool = False  # fails as a broken data path does (DataPathError)
    prefills: list[PrefillRequest] = field(default_factory=list)
    decodes: list[DecodeRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    kv_bytes: dict[str, int] = field(default_factory=dict)
    _kv: dict[str, anyio.Event] = field(default_factory=dict)
    _first: dict[str, int] = field(default_factory=dict)
    _resumable: int = 0
    # What it sees of its KV crossing the link (a PrfaaS worker's; the router's estimate).
    meter: SendMeter = field(default_factory=lambda: SendMeter(anyio.current_time))

    def register(self) -> None:
        node = self.node
        node.handles(StatusQuery)(self._status)
        node.handles(SetRole)(self._set_role)
        node.handles(PrefillRequest)(self._prefill)
        node.serves_stream(DecodeRequest)(self._decode)
        node.accepts_stream(KVOpen)(self._receive_kv)

    def state(self) -> WorkerState:
        sent = self.meter.reading()
        return WorkerState(name=self.name, cluster=self.cluster, role=self.role,
                           draining=self.draining, queue_depth=0, running=0, cached_blocks=0,
                           model=INFO, kv_sent_bytes=sent.sent_bytes, kv_held_s=sent.held_s)

    def freeze(self) -> None:
        self.hung, self._thawed = True, anyio.Event()

    def thaw(self) -> None:
        if self._thawed is not None:
            self._thawed.set()
        self.hung, self._thawed = False, None

    async def _unless_frozen(self) -> None:
        if self._thawed is not None:
            await self._thawed.wait()

    async def _status(self, msg: StatusQuery, ctx: Context) -> WorkerState:
        if self.hung:
            await anyio.sleep_forever()
        return self.state()

    async def _set_role(self, msg: SetRole, ctx: Context) -> WorkerState:
        self.draining = True
        await anyio.sleep(0.5)
        self.role, self.draining = msg.role, False
        return self.state()

    async def _report(self, tokens: Sequence[int]) -> None:
        hashes = block_hashes(list(tokens), BLOCK)
        run = BlockRun(hashes, list(range(len(hashes))))
        await self.node.cast("cachedir", BlocksStored(self.name, [run]))

    async def _prefill(self, msg: PrefillRequest, ctx: Context) -> PrefillDone:
        self.prefills.append(msg)
        await self._unless_frozen()
        if self.fail_prefill:
            raise RuntimeError(f"{self.name} is told to fail")
        if self.break_prefill:
            raise DataPathError(f"{self.name} is told to break")
        timing = self.mesh.timing
        match = self.mesh.cachedir.directory.longest_prefix(block_hashes(msg.prompt, BLOCK))
        own = next((w.blocks_resumable for w in match.workers if w.worker == self.name), 0)
        reused = min(own * BLOCK, len(msg.prompt) - 1)
        per_token = timing.prfaas_s_per_token if self.cluster == "prfaas" else \
            timing.pd_s_per_token
        await anyio.sleep(per_token * (len(msg.prompt) - reused))
        nbytes = timing.kv_fixed_bytes + timing.kv_bytes_per_token * (
            len(msg.prompt) - msg.decode_has_tokens)
        if self.cluster == "prfaas":
            # The whole KV crosses after the compute here: all its wire time is held.
            self.meter.waiting()
            try:
                await self.mesh.cross_link(nbytes)
            finally:
                self.meter.crossed()
            self.meter.delivered(nbytes)
        first = fake_token(msg.prompt, 0)
        opening = KVOpen(request_id=msg.request_id, family="fake", config_hash="0",
                         dtype="float32", start=msg.decode_has_tokens, end=len(msg.prompt),
                         pieces=1)
        async with self.node.stream_to(msg.decode_worker, opening) as sink:
            await sink.send(KVChunk(request_id=msg.request_id, layer=0, data=b"kv"))
            await sink.send(KVClose(request_id=msg.request_id, first_token=first))
        await self._report(msg.prompt)
        return PrefillDone(
            request_id=msg.request_id, worker=self.name, prompt_tokens=len(msg.prompt),
            reused_tokens=reused, computed_tokens=len(msg.prompt) - reused,
            sent_from_token=msg.decode_has_tokens, kv_bytes=nbytes, pieces=1, lanes=1,
            first_token=first, queue_s=0.0, compute_s=0.0, transfer_s=0.0, total_s=0.0)

    def _arrival(self, request_id: str) -> anyio.Event:
        return self._kv.setdefault(request_id, anyio.Event())

    async def _receive_kv(self, opening: KVOpen, items: Any, ctx: Context) -> KVAccepted:
        count = 0
        async for item in items:
            count += 1
            if isinstance(item, KVClose):
                self._first[opening.request_id] = item.first_token
        self.kv_bytes[opening.request_id] = opening.end - opening.start
        self._arrival(opening.request_id).set()
        return KVAccepted(request_id=opening.request_id, lane=0, pieces=count, bytes=0)

    async def _decode(self, msg: DecodeRequest,
                      ctx: Context) -> AsyncGenerator[TokenChunk, None]:
        self.decodes.append(msg)
        done = False
        try:
            with anyio.fail_after(msg.kv_timeout):
                await self._arrival(msg.request_id).wait()
            out = [self._first.pop(msg.request_id)]
            for index in range(msg.sampling.max_tokens):
                reason = "length" if index + 1 >= msg.sampling.max_tokens else None
                await self._unless_frozen()
                yield TokenChunk(request_id=msg.request_id, tokens=[out[-1]], index=index,
                                 finish_reason=reason)
                if reason:
                    break
                await anyio.sleep(self.mesh.timing.decode_step_s)
                out.append(fake_token(msg.prompt, index + 1))
            done = True
            await self._report(msg.prompt + out)
            self.finished.append(msg.request_id)
        finally:
            self._kv.pop(msg.request_id, None)
            if not done:
                self.aborted.append(msg.request_id)


@dataclass
class FakeMesh:
    """A whole fake mesh: cache directory, workers, a link shaper, the router's scheduler."""

    topology: Topology
    timing: Timing
    hub: MemoryHub
    codec: Codec
    shaper: LinkShaper
    cachedir: CacheDirService = field(init=False)
    scheduler: Scheduler = field(init=False)
    control: RouterControl = field(init=False)
    workers: dict[str, FakeWorker] = field(default_factory=dict)
    subscription: Subscription[Event] = field(init=False)

    def node(self, name: str) -> Node:
        return Node(name, self.codec, MemoryTransport(self.hub), self.topology.address)

    async def cross_link(self, nbytes: int) -> None:
        """Pushes nbytes of KV across the PrfaaS -> PD link on virtual time."""
        flow = self.shaper.open_flow(Direction.EGRESS)
        try:
            admission = self.shaper.admit(flow, nbytes)
            # A change of the link's rate re-times what is queued (admission.release moves):
            # look again every quarter second, as netem.memory's sleepers are woken to.
            while (wait := self.shaper.wall_time(admission.release) - anyio.current_time()) > 0:
                await anyio.sleep(min(wait, 0.25))
            self.shaper.released(flow, nbytes)
        finally:
            self.shaper.close_flow(flow)

    def set_link(self, **update: Any) -> None:
        """The link's control API (POST /link), applied to the shaper."""
        self.shaper.set_params(apply_link_update(self.shaper.params, update))

    async def link_probe(self) -> LinkSample:
        stats = self.shaper.statistics()
        return LinkSample(now=anyio.current_time(), stalls=stats.egress.stalls,
                          up=stats.params.up, queued_bytes=stats.egress.queued_bytes)

    async def take_events(self) -> list[Event]:
        """Every event the router published since the last call."""
        events = self.subscription
        return [await events.receive() for _ in range(events.statistics().queued)]


@asynccontextmanager
async def fake_mesh(policy: str = "prfaas", policy_options: dict[str, object] | None = None, *,
                    timing: Timing | None = None, config: SchedulerConfig | None = None,
                    bandwidth_bps: float = 1e9, tokenizer: Any = None,
                    hub: MemoryHub | None = None, directory_in_process: bool = False,
                    topology_text: str = TOPOLOGY,
                    tracer: Tracer | None = None) -> AsyncIterator[FakeMesh]:
    """Starts everything on the current event loop; stops it on exit. The router asks the
    cache directory in process (`Scheduler(directory=)`) when `directory_in_process`, and
    makes its spans with `tracer` (None: tracing off)."""
    topology = parse_topology(topology_text)
    shaper = LinkShaper(LinkParams(bandwidth_bps=bandwidth_bps, delay_s=0.005),
                        anyio.current_time, random.Random(1))
    mesh = FakeMesh(topology, timing or Timing(), hub or MemoryHub(), Codec(CODEC_MESSAGES),
                    shaper)
    async with AsyncExitStack() as stack:
        cachedir_node = await stack.enter_async_context(mesh.node("cachedir"))
        mesh.cachedir = CacheDirService(cachedir_node, {
            s.name: (s.cluster, "decode" if s.kind == "decode" else "prefill")
            for s in topology.services if s.kind in ("prefill", "decode")})
        await cachedir_node.listen()
        for spec in topology.services:
            if spec.kind in ("prefill", "decode"):
                worker = FakeWorker(mesh, spec.name, spec.cluster, spec.kind,  # type: ignore[arg-type]
                                    await stack.enter_async_context(mesh.node(spec.name)))
                worker.register()
                await worker.node.listen()
                mesh.workers[spec.name] = worker
        router = await stack.enter_async_context(mesh.node("router"))
        mesh.scheduler = Scheduler(
            router, create_policy(policy, policy_options), WorkerTable.from_topology(topology),
            tokenizer or ByteTokenizer(),
            config or SchedulerConfig(
                block_size=BLOCK, connections=2, links=(LinkEnds("", "prfaas", "pd"),),
                link_estimator=EstimatorConfig(provisioned_bps=bandwidth_bps)),
            directory=mesh.cachedir.lookup if directory_in_process else None, tracer=tracer)
        mesh.control = RouterControl(mesh.scheduler, ControlConfig(tick_s=1.0),
                                     link_probe=mesh.link_probe)
        mesh.subscription = stack.enter_context(mesh.scheduler.events.subscribe(10**6))
        group = await stack.enter_async_context(anyio.create_task_group())
        await group.start(mesh.scheduler.run)
        yield mesh
        group.cancel_scope.cancel()


def generation(prompt: Sequence[int], max_tokens: int = 4, stop: Sequence[str] = ()
               ) -> GenerationRequest:
    return GenerationRequest(prompt=list(prompt), sampling=Sampling(max_tokens=max_tokens),
                             stop=tuple(stop))


def decisions(events: Sequence[Event]) -> list[RoutingDecision]:
    return [e for e in events if isinstance(e, RoutingDecision)]


DONE = Finished(finish_reason="length", prompt_tokens=3, completion_tokens=2, cached_tokens=0)


def placed_handle() -> RequestHandle:
    """A request placed on p (prefill) and d (decode), as the scheduler hands it out."""
    decision = threshold_rule(RouteInputs(request_id="r", total_len=3), 100, True)
    placement = Placement(request_id="r", cluster="pd", prefill_worker="p", decode_worker="d",
                          prompt_tokens=3, cached_tokens=0, decode_has_tokens=0,
                          decision=decision)
    return RequestHandle(placement, GenerationRequest(prompt=[1, 2, 3],
                                                      sampling=Sampling(max_tokens=2)))
