"""The KV stream out of a prefill worker: a job's KV cut into pieces, dealt to lanes as the
compute finishes them, sent to the decode worker while the compute goes on.

One job meets this module in the order it is written:

1. The plan. The prefill worker cuts the computed suffix into chunks of tokens
   (`chunk_bounds`: chunked prefill) and plans, per chunk, the pieces its layers export as
   they finish (`stream_plan`): the full-attention KV of the chunk's new tokens that the
   decode side lacks and, in the last chunk only, each linear or window layer's fixed-size
   state at the prompt's end (services.model.export).
2. The stream. `KVSender.streaming` starts the compute and opens beside it one upload lane
   (a mesh node of its own, one TCP connection each, the same peer) per
   `PrefillRequest.connections` to the decode worker; lane 0 ends with `KVClose`, carrying
   the first token. Its body runs at the compute's end (the prefill worker passes its
   compute slot on there); it is left once the decode worker has accepted every lane ("KV
   fully received"), with `request.kv_stall` at most that long after the compute's end,
   else with `KVStalled`.
3. The compute. `PrefillCompute` runs the engine's `compute_prefill` through a
   `ComputeRunner` (a worker thread live, so the loop keeps sending; the loop itself on a
   virtual clock). Each finished layer's piece goes to the loop, where `release` deals it to
   the next lane, in emulated mode once the modeled hardware has finished its (chunk, layer)
   step (`step_ends`), never earlier: transfer overlaps compute (paper section 3.3). Chunks
   keep the last piece small, so little is left to send once the compute is done: with
   transfer as long as compute, the time to "KV fully received" is about (1 + tail) / 2 of
   compute-then-transfer, tail being the states' and the last chunk's share of the bytes
   (layer-wise streaming alone leaves a whole full-attention layer, often the largest, for
   the end).

The decode worker's side of the stream is services/worker/kv_in.py.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise

import anyio
import anyio.abc

from mesh import native
from mesh.events import EventBus
from mesh.mailbox import Mailbox
from mesh.node import Node
from services.contract.errors import DataPathError, KVStalled, KVTransferError
from services.contract.events import Event, KVFlow
from services.contract.messages import KVAccepted, KVChunk, KVClose, KVOpen
from services.contract.tracing import Tracer
from services.model.config import FULL_ATTENTION_KINDS, ModelConfig
from services.worker.compute import Computed, ComputeRunner, Pacing, piece_emitter
from services.worker.engine import Engine, PieceSpec, PrefillJob
from services.worker.send_meter import SendMeter

LaneItem = KVChunk | KVClose


def chunk_bounds(reused: int, length: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Token ranges of the computed suffix [reused, length), cut at multiples of
    chunk_tokens (0: one chunk)."""
    if chunk_tokens <= 0:
        return [(reused, length)]
    cuts = list(range((reused // chunk_tokens + 1) * chunk_tokens, length, chunk_tokens))
    edges = [reused, *cuts, length]
    return list(pairwise(edges))


def stream_plan(cfg: ModelConfig, chunks: list[tuple[int, int]],
                sent_from: int) -> list[list[PieceSpec]]:
    """Per chunk, the pieces exported as its layers finish, in order.

    The first chunk's full-attention pieces start at `sent_from` (the decode side holds the
    tokens before it; the prefill side may hold more than it computes), later chunks at
    their own start; states go once, in the last chunk."""
    length = chunks[-1][1]
    plan: list[list[PieceSpec]] = []
    for index, (start, end) in enumerate(chunks):
        low = sent_from if index == 0 else max(sent_from, start)
        pieces = []
        for layer, kind in enumerate(cfg.layer_kinds):
            if kind in FULL_ATTENTION_KINDS:
                if end > low:
                    pieces.append(PieceSpec(layer, low, end))
            elif end == length:
                pieces.append(PieceSpec(layer, length, length))
        plan.append(pieces)
    return plan


class KVSender:
    """A prefill worker's KV stream out: per job, its lanes to the decode worker beside the
    compute (module docstring, step 2); `lanes[0]` is the worker's own node."""

    def __init__(self, name: str, engine: Engine, lanes: Sequence[Node],
                 compute: PrefillCompute, transfer_timeout: float, *, bus: EventBus[Event],
                 link_of: Callable[[str], str | None], tracer: Tracer | None) -> None:
        self.name = name
        self.engine = engine
        self._lanes = list(lanes)
        self._compute = compute
        self._transfer_timeout = transfer_timeout
        self._bus = bus
        self._link_of = link_of
        self._tracer = tracer
        self.sent = [0, 0]  # pieces, bytes over all jobs
        # What this sender sees of its KV transfers (the router estimates the link from it).
        self.meter = SendMeter(native.now)

    @asynccontextmanager
    async def streaming(self, job: PrefillJob) -> AsyncIterator[tuple[int, float]]:
        """Computes `job` while one task per lane sends; enters at the compute's end with
        (first token, compute end), the lanes still sending and the stall bound already
        counting; leaves once the decode worker has accepted every lane."""
        self._flow(job, "start", 0)
        crossing = False
        try:
            async with self._stream(job) as ended:
                # From here until the lanes are accepted, this job's KV is held back by the link.
                crossing = True
                self.meter.waiting()
                yield ended
        except BaseException:
            self._flow(job, "failed", 0)
            raise
        finally:
            if crossing:
                self.meter.crossed()
        self.meter.delivered(job.sent[1])
        self._flow(job, "done", self.engine.cfg.n_layers)

    @asynccontextmanager
    async def _stream(self, job: PrefillJob) -> AsyncIterator[tuple[int, float]]:
        """The lanes and the compute of `streaming`, and the stall bound; KVStalled when the
        lanes were cut at it."""
        lanes = [Mailbox[LaneItem](job.pieces + 1) for _ in range(job.lanes)]
        request = job.request
        try:
            async with anyio.create_task_group() as tg:
                ended = await self._compute_beside(tg, job, lanes)
                if request.kv_stall > 0:
                    # The stall bound: from the compute's end, the lanes' group expires
                    # kv_stall later (a deadline on its own scope, not a watcher task beside
                    # the lanes to wake and cancel, nor a scope of its own around them).
                    tg.cancel_scope.deadline = native.now() + request.kv_stall
                yield ended
        except BaseExceptionGroup as group:
            cause = stream_failure(group, request.request_id, request.decode_worker)
            if cause is None:
                raise
            raise cause from group
        if tg.cancel_scope.cancelled_caught:
            raise KVStalled(f"the KV of {request.request_id!r} was not accepted by "
                            f"{request.decode_worker} within kv_stall={request.kv_stall:g} s "
                            "of the compute's end")

    async def _compute_beside(self, lanes_group: anyio.abc.TaskGroup, job: PrefillJob,
                              lanes: list[Mailbox[LaneItem]]) -> tuple[int, float]:
        """The compute started, the lanes opened in `lanes_group` beside it, its pieces
        released to them as they finish; the lanes' items end with the compute. (first
        token, compute end)."""
        span = None if job.trace is None or self._tracer is None else self._tracer.start(
            "prefill.compute", job.trace, {
                "prfaas.prefill.computed_tokens": job.length - job.reused,
                "prfaas.prefill.chunks": len(job.chunks)})
        try:
            async with anyio.create_task_group() as group:
                computing = await self._compute.begin(group, job)
                for lane, items in enumerate(lanes):
                    native.start_soon(lanes_group, self._send_lane, job, lane, items)
                compute_end = await self._compute.to_lanes(job, computing, lanes)
        finally:
            for items in lanes:
                items.end()
            if span is not None:
                span.end()
        return computing.first[0], compute_end

    async def _send_lane(self, job: PrefillJob, lane: int, items: Mailbox[LaneItem]) -> None:
        if job.trace is None or self._tracer is None:
            await self._lane(job, lane, items)
            return
        peer = job.request.decode_worker
        link = self._link_of(peer)
        with self._tracer.span("kv.transfer", job.trace, {
                "prfaas.kv.lane": lane, "prfaas.kv.to": peer, "prfaas.kv.link": link or "local",
                "prfaas.kv.via_link": link is not None}, kind="producer") as span:
            started = native.clock()()
            accepted = await self._lane(job, lane, items)
            span.set_attributes({"prfaas.kv.bytes": accepted.bytes,
                                 "prfaas.kv.pieces": accepted.pieces,
                                 "prfaas.kv.seconds": native.clock()() - started})

    async def _lane(self, job: PrefillJob, lane: int, items: Mailbox[LaneItem]) -> KVAccepted:
        """One upload lane: open, the items as they come, the decode worker's KVAccepted."""
        request, cfg = job.request, self.engine.cfg
        opening = KVOpen(
            request_id=request.request_id, family=cfg.family, config_hash=cfg.config_hash(),
            dtype=job.cache.dtype_name, start=request.decode_has_tokens, end=job.length,
            pieces=len(range(lane, job.pieces, job.lanes)), lane=lane,
            lanes=job.lanes,
        )
        node, peer = self._lanes[lane], request.decode_worker
        async with node.stream_to(peer, opening, timeout=self._transfer_timeout) as sink:
            async for item in items:
                await sink.send(item)
                if isinstance(item, KVChunk):
                    self._count_sent(job, item.size)
                    self._flow(job, "progress", job.sent[0])
        if not isinstance(sink.result, KVAccepted):
            raise KVTransferError(f"{peer} answered lane {lane} of {request.request_id!r} "
                                  f"with {sink.result!r}, expected KVAccepted")
        return sink.result

    def _count_sent(self, job: PrefillJob, nbytes: int) -> None:
        job.sent[0] += 1
        job.sent[1] += nbytes
        self.sent[0] += 1
        self.sent[1] += nbytes

    def _flow(self, job: PrefillJob, phase: str, layers_done: int) -> None:
        if not self._bus.subscribed:  # the dashboard's; a few per piece are not free
            return
        cfg, request = self.engine.cfg, job.request
        self._bus.publish(KVFlow(
            ts=native.clock()(), source=self.name, request_id=request.request_id,
            src=self.name, dst=request.decode_worker,
            via_link=self._link_of(request.decode_worker),
            phase=phase,  # type: ignore[arg-type]
            layers_done=layers_done, layers_total=cfg.n_layers, bytes_done=job.sent[1],
            bytes_total=self.engine.kv_bytes(job.length, request.decode_has_tokens,
                                            job.cache.dtype_name),
            incremental=request.decode_has_tokens > 0,
            tokens_sent=job.length - request.decode_has_tokens,
        ))



@dataclass
class Computing:
    """A job's compute under way: its pieces as the compute hands them over, and its first
    token once the compute is done."""

    start: float  # on the loop's clock
    computed: Mailbox[Computed]
    first: list[int] = field(default_factory=list)


class PrefillCompute:
    """Computes one job at a time on `engine` through `runner`, paced when `pacing` is given
    (module docstring, step 3)."""

    def __init__(self, engine: Engine, snapshot_every: int, runner: ComputeRunner,
                 pacing: Pacing | None = None) -> None:
        self.engine = engine
        self._snapshot_every = snapshot_every
        self._runner = runner
        self._pacing = pacing

    async def begin(self, group: anyio.abc.TaskGroup, job: PrefillJob) -> Computing:
        """Starts the compute of `job` in `group`. Nothing runs beside an inline compute: it
        runs to its end here (every piece in `computed`), and the release deals the pieces at
        their step ends, at the times the task would give, without the task."""
        computing = Computing(native.clock()(), Mailbox[Computed](job.pieces + 1))
        if self._runner.inline:
            await self._compute_task(job, computing)
        else:
            native.start_soon(group, self._compute_task, job, computing)
        return computing

    async def _compute_task(self, job: PrefillJob, computing: Computing) -> None:
        """Through the runner: the engine prefills the suffix chunk by chunk, handing each
        piece to the loop as its layer finishes; the first token into `computing.first`."""
        computed = computing.computed
        emit = piece_emitter(job, self._runner, computed.put_nowait)
        try:
            clock = native.clock()
            began = clock()
            computing.first.append(await self._runner.run(partial(
                self.engine.compute_prefill, job, emit, self._snapshot_every)))
            if self._pacing is not None:
                modeled = self._pacing.prefill_time(job.length - job.reused, job.reused)
                self._pacing.pacer.remaining(clock() - began, modeled)
        finally:
            computed.end()

    async def to_lanes(self, job: PrefillJob, computing: Computing,
                       lanes: Sequence[Mailbox[LaneItem]]) -> float:
        """The computed pieces to the lanes, then the stream's KVClose (the first token) on
        lane 0 and the lanes' ends at once, so that the close and the streams' ends leave with
        the last pieces (unless the compute failed: its error is raised where it ran); the
        compute's end."""
        first = computing.first
        ends = self._step_ends(job, computing.start)
        try:
            compute_end = await release(computing.computed, lanes, ends,
                                        hold=not job.request.overlap)
        except BaseException:
            job.cancelled = True
            raise
        if first:
            lanes[0].put_nowait(KVClose(request_id=job.request.request_id,
                                        first_token=first[0], first_logprob=job.first_logprob))
            for lane in lanes:
                lane.end()
        return compute_end

    async def release_memory(self) -> None:
        """The engine gives back what its computations freed, on the compute's side."""
        await self._runner.run(self.engine.release_memory)

    def _step_ends(self, job: PrefillJob, start: float) -> list[float]:
        """Emulated mode: each (chunk, layer) step's end on the loop's clock; else none."""
        if self._pacing is None:
            return []
        scale = self._pacing.pacer.time_scale
        modeled = step_ends(job.chunks, self.engine.cfg.n_layers, self._pacing.prefill_time)
        return [start + scale * end for end in modeled]


def step_ends(chunks: list[tuple[int, int]], n_layers: int,
              prefill_time: Callable[[int, int], float]) -> list[float]:
    """When each (chunk, layer) step of a paced prefill ends, in modeled seconds from its
    start: step k = chunk * n_layers + layer; a piece may leave once its step has ended.

    `prefill_time(new, cached)` is the modeled time of the whole suffix (CostModel): its
    length-dependent part is charged per chunk (a later chunk attends to a longer prefix),
    the fixed part spread evenly over the new tokens, each chunk's time evenly over layers."""
    reused, length = chunks[0][0], chunks[-1][1]
    fixed = prefill_time(0, reused)
    new = max(1, length - reused)

    def until(token: int) -> float:
        done = token - reused
        return prefill_time(done, reused) - fixed + fixed * done / new

    ends: list[float] = []
    # A chunk starts where the one before it ended: each edge's time is computed once.
    low = until(reused)
    for _, end in chunks:
        high = until(end)
        ends.extend(low + (high - low) * (layer + 1) / n_layers for layer in range(n_layers))
        low = high
    return ends


def lane_of(sequence: int, lanes: int) -> int:
    """Pieces are dealt to lanes in turn, in the order they are produced."""
    return sequence % lanes


async def release(pieces: Mailbox[Computed], lanes: Sequence[Mailbox[LaneItem]],
                  ends: Sequence[float], *, hold: bool = False) -> float:
    """Deals each computed piece to the next lane once its step has ended (`ends`, on the
    loop's clock; none: at once), or holds them all until the compute is done (`hold`: the
    one-after-the-other baseline). Returns when the compute is done: the last piece in, and
    the last step ended. Pieces that are in together are passed on together: mailboxes hand
    over a backlog without a trip through the scheduler, so the lane sends them in one write
    (an anyio memory stream took a loop turn per piece, and the lane a write per piece)."""
    held: list[tuple[int, KVChunk]] = []
    sequence = itertools.count()
    clock = native.clock()
    async for step, chunk in pieces:
        if ends:
            await _sleep_until(clock, ends[step])
        lane = lane_of(next(sequence), len(lanes))
        if hold:
            held.append((lane, chunk))
        else:
            lanes[lane].put_nowait(chunk)
    # Past the last step's end (it ended with the last piece) no sleep, not even a zero one:
    # a checkpoint there would let the lane send the last piece alone, and the caller's close
    # and the lanes' ends would follow in another write and another wake-up.
    if ends and ends[-1] > clock():
        await _sleep_until(clock, ends[-1])
    compute_end = clock()
    for lane, chunk in held:
        lanes[lane].put_nowait(chunk)
    return compute_end


async def _sleep_until(clock: Callable[[], float], deadline: float) -> None:
    """`anyio.sleep_until` on the loop's own sleep (`mesh.native`): the same arithmetic, so
    the same wake-up instant to the bit, without two backend lookups per piece released."""
    await native.sleep(max(deadline - clock(), 0))



def stream_failure(
    group: BaseExceptionGroup[BaseException], request_id: str, peer: str
) -> Exception | None:
    """The error that started a failed stream (lane errors over the broken-channel echoes);
    None when only cancellation is in the group (it must propagate as it is)."""
    errors = [e for e in leaves(group) if isinstance(e, Exception)]
    if not errors:
        return None
    primary = next((e for e in errors if not isinstance(e, anyio.BrokenResourceError)),
                   errors[0])
    if isinstance(primary, DataPathError):
        return primary
    return KVTransferError(f"KV stream of {request_id!r} to {peer!r} failed: "
                           f"{type(primary).__name__}: {primary}")


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions inside a (nested) exception group, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
