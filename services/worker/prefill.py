"""The prefill worker: computes a prompt's uncached suffix and streams its KV as it goes.

One job computes at a time, in arrival order (prefill saturates the compute). For each job:

0. With `request.pull`, first fetch that cached prefix from the worker holding it
   (services/worker/prefix_pull.py).
1. Resume from the longest prefix of the prompt in this worker's own `PrefixStore` that ends
   at a state snapshot, so only the suffix is computed; plan its chunks and the pieces they
   export (services/worker/kv_out.py).
2. Compute the suffix while its KV streams to the decode worker over its lanes (`KVSender`,
   services/worker/kv_out.py): transfer overlaps compute (paper section 3.3). The compute slot
   passes to the next job as soon as there is room to stream (`PrefillConfig.max_streaming`),
   while this job's KV keeps crossing: an instance computes its next prompt while the last
   one's KV drains, as Eq. 3's min(compute, bandwidth) assumes. The job is done when the
   decode worker has accepted every lane ("KV fully received"), or fails with `KVStalled`
   when `request.kv_stall` passes first after the compute's end (the router re-prefills it
   in the PD cluster).
3. Keep the new cache (with snapshots at block boundaries) in the store and report the
   stored and evicted blocks to the cache directory.

Lanes are separate mesh nodes (one TCP connection each, the same peer), given by the caller.

With tracing on (services/contract/tracing.py) a job whose request carries a traceparent is a
`prefill` span, with its wait for the compute slot, its compute and each lane as children.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar, Literal

import anyio
import msgspec

from mesh import native
from mesh.events import EventBus
from mesh.node import Node
from services.contract.errors import RequestError
from services.contract.events import Event, RequestPhase
from services.contract.messages import PrefillDone, PrefillRequest
from services.contract.prefix import reusable_blocks
from services.contract.tracing import Tracer
from services.model.model import HybridLM
from services.worker.compute import ComputeRunner, Pacing, ThreadRunner
from services.worker.engine import Engine, PrefillJob, as_engine
from services.worker.kv_out import KVSender, PrefillCompute, chunk_bounds, stream_plan
from services.worker.prefix_pull import PrefixTransfer
from services.worker.prefix_store import PrefixStore, StoreChange
from services.worker.request_checks import check_prefill

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)


class PrefillConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    cluster: str = ""
    snapshot_every: int = 1  # keep a state snapshot every this many blocks
    chunk_tokens: int = 512  # chunked prefill: tokens per chunk (a block multiple; 0: one)
    transfer_timeout: float = 120.0  # one upload lane, open to accepted
    # Jobs whose compute is done and whose KV is still crossing, at most. One is enough for
    # the link never to idle between prompts: the finished job's KV drains while the next
    # computes, and the next job's own pieces start leaving within its first chunk. More would
    # only queue KV on a link that is already the bottleneck. It is also the backpressure: a
    # job whose compute ends with no room keeps the slot until an earlier job's KV is
    # accepted, so the next one waits in the queue and a worker holds at most
    # 1 + max_streaming jobs' KV. 0: the slot is held until the KV is accepted.
    max_streaming: int = 1

    def __post_init__(self) -> None:
        if self.snapshot_every < 1:
            raise RequestError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if self.chunk_tokens < 0:
            raise RequestError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")
        if not self.transfer_timeout > 0:
            raise RequestError(f"transfer_timeout must be > 0, got {self.transfer_timeout}")
        if self.max_streaming < 0:
            raise RequestError(f"max_streaming must be >= 0, got {self.max_streaming}")


class PrefillStatistics(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset(
        {"jobs", "failures", "cancelled", "computed_tokens", "reused_tokens", "kv_bytes_sent",
         "pieces_sent"}
    )

    queue_depth: int
    running: int  # holding the compute slot: computing, or done with no room to stream yet
    jobs: int
    failures: int
    computed_tokens: int
    reused_tokens: int
    kv_bytes_sent: int
    pieces_sent: int
    # Jobs given up by their caller (an Abort, a cut connection), queued or running.
    cancelled: int = 0
    streaming: int = 0  # compute done, slot given back, KV not yet accepted


Stage = Literal["queued", "running", "streaming"]


@dataclass
class _JobStage:
    """Where one job is: queued, running (it holds the compute slot) or streaming (compute
    done, it holds a room to stream and its KV is still crossing)."""

    stage: Stage = "queued"


@dataclass
class _Counts:
    jobs: int = 0
    failures: int = 0
    cancelled: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0


class PrefillWorker:
    """Runs prefill jobs on `model`, streaming KV over `lanes` (lanes[0] is the worker's node)."""

    def __init__(
        self,
        model: HybridLM | Engine,
        store: PrefixStore,
        lanes: Sequence[Node],
        config: PrefillConfig,
        *,
        bus: EventBus[Event] | None = None,
        pacing: Pacing | None = None,
        report: Callable[[StoreChange], None] | None = None,
        link_of: Callable[[str], str | None] = lambda peer: None,
        runner: ComputeRunner | None = None,
        transfer: PrefixTransfer | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        if not lanes:
            raise RequestError("lanes must hold at least the worker's own node, got none")
        self.model = as_engine(model)
        self.store = store
        self.config = config
        self._lanes = list(lanes)
        self._bus = bus or EventBus()
        self._report = report
        self._transfer = transfer
        self._tracer = tracer  # None: tracing is off (services/contract/tracing.py)
        self._compute = PrefillCompute(self.model, config.snapshot_every, runner or ThreadRunner(),
                                       pacing)
        self._sender = KVSender(config.name, self.model, lanes, self._compute,
                                config.transfer_timeout, bus=self._bus, link_of=link_of,
                                tracer=tracer)
        # What this sender sees of its KV transfers (the router estimates the link from it).
        self.meter = self._sender.meter
        # The compute (FIFO, released at the compute's end) and the room to stream. A free one
        # is taken without a scheduler pass (fast_acquire); a waiting job still comes first,
        # as a release hands the semaphore straight to it.
        self._slot = anyio.Semaphore(1, fast_acquire=True)
        self._room = (anyio.Semaphore(config.max_streaming, fast_acquire=True)
                      if config.max_streaming else None)
        self._in: dict[Stage, int] = {"queued": 0, "running": 0, "streaming": 0}
        self._idle = anyio.Event()
        self._idle.set()
        self._counts = _Counts()

    @property
    def busy(self) -> int:
        """Jobs queued, running or streaming."""
        return sum(self._in.values())

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for the compute (what `statistics` reports, without building it)."""
        return self._in["queued"]

    @property
    def running(self) -> int:
        """Jobs holding the compute slot."""
        return self._in["running"]

    async def prefill(self, request: PrefillRequest) -> PrefillDone:
        """Queue, compute and stream one request; KVTransferError if the KV did not get there."""
        with self._span(request) as span:
            done = await self._prefill(request, span)
            if span is not None:
                span.set_attributes({
                    "prfaas.prefill.cached_tokens": done.reused_tokens,
                    "prfaas.prefill.computed_tokens": done.computed_tokens,
                    "prfaas.prefill.chunks": done.chunks, "prfaas.kv.bytes": done.kv_bytes,
                    "prfaas.kv.pieces": done.pieces, "prfaas.kv.lanes": done.lanes,
                    "prfaas.prefill.queue_s": done.queue_s,
                    "prfaas.prefill.compute_s": done.compute_s,
                    "prfaas.prefill.transfer_s": done.transfer_s})
            return done

    def _span(self, request: PrefillRequest) -> AbstractContextManager[Span | None]:
        """The job's `prefill` span when tracing is on and the request carries a traceparent."""
        if self._tracer is None or not request.trace:
            return nullcontext()
        return self._tracer.span("prefill", request.trace, {
            "prfaas.worker": self.config.name, "gen_ai.usage.input_tokens": len(request.prompt),
            "prfaas.prefill.decode_has_tokens": request.decode_has_tokens,
            "prfaas.prefill.decode_worker": request.decode_worker}, kind="server")

    async def _prefill(self, request: PrefillRequest, span: Span | None) -> PrefillDone:
        queued_at = native.clock()()
        job = await self._plan(request)
        job.trace = span
        place = _JobStage()
        self._enter()
        self._phase(request.request_id, "queued")
        try:
            if span is None or self._tracer is None:
                await self._slot.acquire()
            else:
                with self._tracer.span("prefill.queue", span):
                    await self._slot.acquire()
            self._move(place, "running")
            done = await self._run(job, native.clock()() - queued_at,
                                   partial(self._hand_over, place))
        except anyio.get_cancelled_exc_class():
            # Queued: it leaves the queue; running: its compute stops at the next chunk;
            # streaming: its lanes close.
            self._counts.cancelled += 1
            raise
        except BaseException:
            self._counts.failures += 1
            raise
        finally:
            self._leave(place)
        if self.busy == 0:
            # Idle: a long prompt's activations go back to the system, not kept at their peak
            # (mesh/allocator.py). The first token has left with the KV; only this answer waits.
            await self._compute.release_memory()
        return done

    async def wait_idle(self) -> None:
        """Returns once no job is queued or running."""
        await self._idle.wait()

    def statistics(self) -> PrefillStatistics:
        return PrefillStatistics(
            queue_depth=self.queue_depth, running=self.running,
            streaming=self._in["streaming"], jobs=self._counts.jobs,
            failures=self._counts.failures, computed_tokens=self._counts.computed_tokens,
            reused_tokens=self._counts.reused_tokens, kv_bytes_sent=self._sender.sent[1],
            pieces_sent=self._sender.sent[0], cancelled=self._counts.cancelled,
        )

    def check_integrity(self) -> None:
        most = {"queued": None, "running": 1, "streaming": self.config.max_streaming}
        for stage, count in self._in.items():
            bound = most[stage]
            if count < 0 or (bound is not None and count > bound):
                raise RequestError(f"{count} jobs {stage} (at most {bound}): one computes at "
                                   f"a time, max_streaming stream, never fewer than none")
        if self._idle.is_set() != (self.busy == 0):
            raise RequestError(f"idle flag {self._idle.is_set()} with {self.busy} jobs")
        self.store.check_integrity()

    def _enter(self) -> None:
        self._in["queued"] += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle

    def _move(self, place: _JobStage, stage: Stage) -> None:
        self._in[place.stage] -= 1
        self._in[stage] += 1
        place.stage = stage

    async def _hand_over(self, place: _JobStage) -> None:
        """At the compute's end: once there is room to stream, the slot goes to the next job
        while this one's KV keeps crossing. Until then the slot stays held: a congested link
        pushes back on the compute (PrefillConfig.max_streaming)."""
        if self._room is None:
            return
        await self._room.acquire()
        self._move(place, "streaming")
        self._slot.release()

    def _leave(self, place: _JobStage) -> None:
        if place.stage == "running":
            self._slot.release()
        elif place.stage == "streaming" and self._room is not None:
            self._room.release()
        self._in[place.stage] -= 1
        if self.busy == 0:
            self._idle.set()

    async def _plan(self, request: PrefillRequest) -> PrefillJob:
        """Steps 0-1 of the module docstring: the request checked, a cached prefix pulled,
        the cache resumed, the chunks and their pieces planned."""
        cfg, length = self.model.cfg, len(request.prompt)
        params, hashes = check_prefill(request, cfg.vocab_size, cfg.block_size, len(self._lanes))
        if self._transfer is not None and request.pull is not None:
            await self._transfer.pull(request, hashes)  # a cached prefix from another worker
        # At least one token must be computed: its logits give the first output token.
        cache = self.store.resume(hashes, reusable_blocks(length, cfg.block_size))
        if cache is None:
            cache = self.model.empty_cache()
        size = self.config.chunk_tokens if request.chunk_tokens is None else (
            request.chunk_tokens)
        if size % cfg.block_size:
            raise RequestError(f"chunk_tokens must be a multiple of {cfg.block_size}, got {size}")
        chunks = chunk_bounds(cache.length, length, size)
        return PrefillJob(request, hashes, cache, cache.length, params, request.connections, chunks,
                          stream_plan(cfg, chunks, request.decode_has_tokens))

    async def _run(self, job: PrefillJob, queue_s: float,
                   computed: Callable[[], Awaitable[None]]) -> PrefillDone:
        """Steps 2-3 of the module docstring, for a job that holds the compute slot;
        `computed` is awaited at the compute's end (it may give the slot away)."""
        request = job.request
        self._phase(request.request_id, "prefill", f"{job.length - job.reused} new tokens")
        start = native.clock()()
        try:
            async with self._sender.streaming(job) as (first_token, compute_end):
                await computed()
        except BaseException as exc:
            self._phase(request.request_id, "failed", str(exc))
            raise
        done = native.clock()()
        self._counts.jobs += 1
        self._counts.computed_tokens += job.length - job.reused
        self._counts.reused_tokens += job.reused
        self._keep(job)
        return PrefillDone(
            request_id=request.request_id, worker=self.config.name,
            prompt_tokens=job.length, reused_tokens=job.reused,
            computed_tokens=job.length - job.reused, sent_from_token=request.decode_has_tokens,
            kv_bytes=job.sent[1], pieces=job.sent[0], lanes=job.lanes, chunks=len(job.chunks),
            first_token=first_token,
            queue_s=queue_s, compute_s=compute_end - start, transfer_s=done - compute_end,
            total_s=done - start,
        )

    def _keep(self, job: PrefillJob) -> None:
        change = self.store.store(job.hashes, job.cache)
        if self._report is not None:
            self._report(change)


    def _phase(self, request_id: str, phase: str, detail: str = "") -> None:
        if not self._bus.subscribed:
            return
        self._bus.publish(RequestPhase(
            ts=native.clock()(), source=self.config.name, request_id=request_id,
            phase=phase,  # type: ignore[arg-type]
            worker=self.config.name, detail=detail,
        ))
