"""The engine: what a worker's prefill and decode sides ask of the model, and the KV stream
between them.

The prefill and decode workers (queueing, the KV stream protocol, the prefix store, continuous
batching) are the same in every mode; only the engine under them changes. `ModelEngine` runs
the real hybrid model (live and emulated modes). The simulation swaps in a modeled engine
(services/sim/engine.py) whose caches and KV pieces carry sizes instead of tensors and whose
compute takes the hardware profile's time on the loop's clock.

One prefill meets this module in the order it is written:

1. The job. The prefill worker plans a `PrefillJob`: the computed suffix cut into chunks of
   tokens (`chunk_bounds`: chunked prefill) and, per chunk, the pieces its layers export as
   they finish (`stream_plan`): the full-attention KV of the chunk's new tokens that the
   decode side lacks and, in the last chunk only, each linear or window layer's fixed-size
   state at the prompt's end (services.model.export).
2. The compute. `PrefillCompute` runs the engine's `compute_prefill` through a
   `ComputeRunner` (a worker thread live, so the loop keeps sending; the loop itself on a
   virtual clock). Each finished layer's piece goes to the loop, where `release` deals it to
   the next upload lane, in emulated mode once the modeled hardware has finished its
   (chunk, layer) step (`step_ends`), never earlier. The first token comes back as the return
   value, with the compute's end; the prefill worker's lane tasks send what they are dealt.
   Chunks keep the last piece small, so little is left to send once the compute is done:
   with transfer as long as compute, the time to "KV fully received" is about (1 + tail) / 2
   of compute-then-transfer, tail being the states' and the last chunk's share of the bytes
   (layer-wise streaming alone leaves a whole full-attention layer, often the largest, for
   the end).
3. The receiving side. The decode worker collects a request's pieces from all its lanes
   (services/worker/decode.py, `KVInbox`), then the engine's `import_kv` rebuilds the cache
   (`import_pieces`: each layer's consecutive full-attention pieces joined, checksums
   checked first, on top of the KV the decode side already holds).

An engine answers:
- `cfg`: the model's shape as the workers read it (block_size, n_layers, layer_kinds,
  vocab_size, eos_id, family, config_hash());
- `dtype_name`; `empty_cache()`; `kv_bytes(length, start, dtype)`: the payload an export of
  tokens [start, length) carries;
- `compute_prefill(job, emit, snapshot_every)`: prefill a job's chunks, emitting each finished
  layer's piece, returning the first token and setting `job.first_logprob` when the request
  asked for logprobs;
- `new_batch(slots)`, `step(batch, interrupt)`: the decode batch and one step of it (a modeled
  batch may take several steps at once, sleeping on `interrupt`, a `mesh.native.Alarm`, which
  the worker wakes when a request joins: that cuts the run short);
- `import_kv(opening, base, pieces)`: the cache rebuilt from a stream's pieces;
- `paces_decode`: True when `step` itself takes the modeled time (else emulated mode's pacer
  stretches each real step);
- `release_memory()`: give the memory a finished computation freed back to the system (the
  prefill worker calls it, through its compute, when it goes idle).

The types both sides hand an engine live here too: `PrefillJob`, `Pacing` (emulated mode's
modeled times) and `sampling_params` (a request's sampling as the model takes it).
"""

from __future__ import annotations

import array
import itertools
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import anyio
import msgspec
import torch

from mesh import native
from mesh.allocator import release_free_memory
from mesh.mailbox import Mailbox
from mesh.native import soon_from_thread
from services.contract.errors import DataPathError, KVTransferError, RequestError
from services.contract.messages import KVChunk, KVClose, KVOpen, PrefillRequest
from services.contract.prefix import check_chain_end
from services.contract.sampling import Sampling, TokenLogprob
from services.model.batch import DecodeBatch, StepResult
from services.model.cache import RequestCache, dtype_name, torch_dtype
from services.model.config import (
    FULL_ATTENTION_KINDS,
    ModelConfig,
    ModelError,
    kv_bytes,
    kv_layout,
)
from services.model.export import KVImporter, KVImportError, KVPiece, TensorSpec, export_layer
from services.model.generate import block_boundaries, prefill
from services.model.model import HybridLM
from services.model.sampling import RequestSampler, SamplingParams
from services.paper.hardware import CostModel, Pacer

if TYPE_CHECKING:
    from opentelemetry.trace import Span

Emit = Callable[[int, KVChunk], None]
LaneItem = KVChunk | KVClose
Computed = tuple[int, KVChunk]  # (step, piece): step = chunk * n_layers + layer
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Pacing:
    """Emulated mode: modeled times of one hardware profile, stretched by the pacer's scale.

    A served token stands for `tokens_per_served` modeled tokens (the topology's scale: the
    demo serves the paper's lengths at 1/32), so a 32x longer request costs what the profile
    says a 32x longer request costs, on either hardware, at any scale."""

    cost: CostModel
    pacer: Pacer
    tokens_per_served: float = 1.0

    def modeled(self, served_tokens: int) -> int:
        return round(served_tokens * self.tokens_per_served)

    def prefill_time(self, new: int, cached: int) -> float:
        """Modeled seconds to prefill `new` served tokens after `cached` ones."""
        return self.cost.prefill_time(self.modeled(new), self.modeled(cached))

    def decode_step_time(self, batch: int, context: int) -> float:
        """Modeled seconds of one decode step of `batch` requests holding `context` tokens."""
        return self.cost.decode_step_time(batch, self.modeled(context))


class PieceSpec(NamedTuple):
    """One piece: a layer's full-attention tokens [start, end), or its state (start == end)."""

    layer: int
    start: int
    end: int


@dataclass
class PrefillJob:
    """One planned prefill: the request, its cache resumed from the store, and its stream plan."""

    request: PrefillRequest
    hashes: list[int]
    cache: Any  # the engine's cache (RequestCache for the real model)
    reused: int  # tokens resumed from the store
    params: SamplingParams
    lanes: int
    chunks: list[tuple[int, int]]
    plan: list[list[PieceSpec]]  # per chunk, the pieces its layers export
    sent: list[int] = field(default_factory=lambda: [0, 0])  # pieces, bytes
    # Set on the loop when the job is given up; the compute (in its thread) stops at the next
    # chunk instead of finishing a prefill nobody waits for.
    cancelled: bool = False
    # The first token's logprob, set by the compute when the request asked for logprobs.
    first_logprob: TokenLogprob | None = None
    # The prefill's span when the request is traced (services/contract/tracing.py): its compute's
    # and its lanes' spans are children of it.
    trace: Span | None = None

    @property
    def length(self) -> int:
        return len(self.request.prompt)

    @property
    def pieces(self) -> int:
        """Pieces the plan exports, over all chunks and lanes."""
        return sum(map(len, self.plan))


def sampling_params(sampling: Sampling) -> SamplingParams:
    """The model's SamplingParams for a request's `Sampling`; SamplingError names a bad value."""
    return SamplingParams(
        max_new_tokens=sampling.max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, seed=sampling.seed, stop_on_eos=sampling.stop_on_eos,
        logprobs=sampling.logprobs, min_tokens=sampling.min_tokens,
        stop_token_ids=tuple(sampling.stop_token_ids),
    )


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


class PrefillCompute:
    """Computes one job at a time on `engine` through `runner`, paced when `pacing` is given
    (module docstring, step 2)."""

    def __init__(self, engine: Engine, snapshot_every: int, runner: ComputeRunner,
                 pacing: Pacing | None = None) -> None:
        self.engine = engine
        self._snapshot_every = snapshot_every
        self._runner = runner
        self._pacing = pacing

    async def compute_and_release(
        self, job: PrefillJob, lanes: Sequence[Mailbox[LaneItem]]
    ) -> tuple[int, float]:
        """Runs the compute beside the release of its pieces, then puts the stream's KVClose
        (the first token) on lane 0 and ends the lanes at once, so that the close and the
        streams' ends leave with the last pieces; (first token, compute end)."""
        start = native.clock()()
        computed = Mailbox[Computed](job.pieces + 1)
        first: list[int] = []
        if self._runner.inline:
            # Nothing runs beside an inline compute: it is done (every piece in `computed`)
            # before the release deals the pieces at their step ends, at the times the task
            # below would give, without the task.
            await self._compute_task(job, computed, first)
            compute_end = await self._release(job, computed, lanes, start, first)
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._compute_task, job, computed, first)
                compute_end = await self._release(job, computed, lanes, start, first)
        return first[0], compute_end

    async def _release(self, job: PrefillJob, computed: Mailbox[Computed],
                       lanes: Sequence[Mailbox[LaneItem]], start: float,
                       first: list[int]) -> float:
        """The computed pieces to the lanes, then the close with the first token and the
        lanes' ends (unless the compute failed: its error is raised where it ran)."""
        ends = self._step_ends(job, start)
        try:
            compute_end = await release(computed, lanes, ends, hold=not job.request.overlap)
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

    async def _compute_task(self, job: PrefillJob, computed: Mailbox[Computed],
                            first: list[int]) -> None:
        def emit(step: int, chunk: KVChunk) -> None:
            if not job.cancelled:
                self._runner.to_loop(partial(computed.put_nowait, (step, chunk)))

        try:
            clock = native.clock()
            began = clock()
            first.append(await self._runner.run(partial(self._compute, job, emit)))
            if self._pacing is not None:
                modeled = self._pacing.prefill_time(job.length - job.reused, job.reused)
                self._pacing.pacer.remaining(clock() - began, modeled)
        finally:
            computed.end()

    def _compute(self, job: PrefillJob, emit: Emit) -> int:
        """Through the runner: the engine prefills the suffix chunk by chunk, emitting each
        piece as its layer finishes; returns the first token."""
        return self.engine.compute_prefill(job, emit, self._snapshot_every)

    def _step_ends(self, job: PrefillJob, start: float) -> list[float]:
        """Emulated mode: each (chunk, layer) step's end on the loop's clock; else none."""
        if self._pacing is None:
            return []
        scale = self._pacing.pacer.time_scale
        modeled = step_ends(job.chunks, self.engine.cfg.n_layers, self._pacing.prefill_time)
        return [start + scale * end for end in modeled]


class ComputeRunner(Protocol):
    """Where the model compute runs, and how it hands a piece back to the event loop.
    `inline`: the compute runs to its end on the loop when awaited, so nothing overlaps it."""

    inline: bool

    async def run(self, compute: Callable[[], T]) -> T: ...

    def to_loop(self, call: Callable[[], object]) -> None: ...


class ThreadRunner:
    """The live default: compute in a worker thread, pieces handed over to the loop.

    A hand-over queues the call on the loop and returns at once; the compute thread never
    waits for the loop. Waiting (anyio's `from_thread.run_sync`) cost a round trip to the
    loop's thread per piece, a sleeping CPU woken twice on a VM, and made the compute's pace
    hang on whatever the loop was doing. Order holds: the loop runs the calls as queued, all
    before the report of the compute's end (`mesh.native.soon_from_thread`)."""

    inline = False

    def __init__(self) -> None:
        self._soon: Callable[[Callable[[], object]], None] | None = None

    async def run(self, compute: Callable[[], T]) -> T:
        self._soon = soon_from_thread()
        return await anyio.to_thread.run_sync(compute)

    def to_loop(self, call: Callable[[], object]) -> None:
        if self._soon is None:
            raise RuntimeError("ThreadRunner.to_loop outside a computation run by it")
        self._soon(partial(_logged, call))


def _logged(call: Callable[[], object]) -> None:
    """A handed-over call on the loop: a failure is logged, never raised into the loop (trio
    would end the whole service on it)."""
    try:
        call()
    except Exception:
        log.exception("a piece handed from the compute to the loop failed")


class InlineRunner:
    """Compute on the event loop itself, blocking it: on a virtual clock (trio's MockClock)
    the compute then takes no time and only the pacing does, so runs are deterministic.
    Tests and simulation only."""

    inline = True

    async def run(self, compute: Callable[[], T]) -> T:
        return compute()

    def to_loop(self, call: Callable[[], object]) -> None:
        call()


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


class Engine(Protocol):
    """What the workers need of a model (module docstring)."""

    @property
    def cfg(self) -> Any: ...

    @property
    def dtype_name(self) -> str: ...

    def empty_cache(self) -> Any: ...

    def kv_bytes(self, length: int, start: int, dtype: str) -> int: ...

    def compute_prefill(self, job: PrefillJob, emit: Emit, snapshot_every: int) -> int: ...

    def new_batch(self, slots: int) -> Any: ...

    async def step(self, batch: Any, interrupt: native.Alarm) -> StepResult: ...

    async def import_kv(self, opening: KVOpen, base: Any,
                        pieces: Mapping[tuple[int, int], bytes | memoryview]) -> Any: ...

    @property
    def paces_decode(self) -> bool: ...

    def release_memory(self) -> None: ...


class ModelEngine:
    """The real model: compute in torch, caches of tensors, KV pieces of bytes."""

    def __init__(self, model: HybridLM) -> None:
        self.model = model

    @property
    def cfg(self) -> Any:
        return self.model.cfg

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.model.dtype)

    def empty_cache(self) -> RequestCache:
        return RequestCache.empty(self.model.cfg, self.model.dtype)

    def kv_bytes(self, length: int, start: int, dtype: str) -> int:
        return expected_kv_bytes(self.model.cfg, length, start, dtype)

    def compute_prefill(self, job: PrefillJob, emit: Emit, snapshot_every: int) -> int:
        """Prefill the suffix chunk by chunk, emitting each piece as its layer finishes; a
        cancelled job stops at the next chunk."""
        cfg, request = self.model.cfg, job.request
        snapshots = block_boundaries(job.reused, job.length, cfg.block_size, snapshot_every)
        result = None
        for index, ((start, end), pieces) in enumerate(zip(job.chunks, job.plan, strict=True)):
            if job.cancelled:
                # Nobody reads the first token of a cancelled job.
                return 0
            on_layer = self._exporter(job, index * cfg.n_layers, pieces, end, emit)
            result = prefill(self.model, request.prompt[start:end], job.cache,
                             snapshot_at=[n for n in snapshots if start < n <= end],
                             on_layer=on_layer)
        assert result is not None
        sampler = RequestSampler(job.params, cfg.eos_id)
        first = sampler.sample(result.logits, 0)
        job.first_logprob = sampler.logprob(result.logits, 0, first)
        return first

    @staticmethod
    def _exporter(job: PrefillJob, first_step: int, pieces: list[PieceSpec], end: int,
                  emit: Emit) -> Callable[[int], None]:
        by_layer = {p.layer: p for p in pieces}

        def on_layer(layer: int) -> None:
            spec = by_layer.get(layer)
            if spec is not None:
                piece = export_layer(job.cache, layer, spec.start, end)
                emit(first_step + layer, KVChunk(request_id=job.request.request_id,
                                                 layer=layer, start=spec.start,
                                                 data=memoryview(piece.to_bytes())))
        return on_layer

    def new_batch(self, slots: int) -> DecodeBatch:
        return DecodeBatch(self.model, slots=slots)

    def release_memory(self) -> None:
        """A long prefill's activations stay in the allocator's heap when freed
        (mesh/allocator.py); this hands them back."""
        release_free_memory()

    async def step(self, batch: DecodeBatch, interrupt: native.Alarm) -> StepResult:
        # One real step in a worker thread; the loop keeps serving meanwhile.
        return await anyio.to_thread.run_sync(batch.step)

    async def import_kv(self, opening: KVOpen, base: RequestCache | None,
                        pieces: Mapping[tuple[int, int], bytes | memoryview]) -> RequestCache:
        return await anyio.to_thread.run_sync(import_pieces, self.model.cfg, opening.dtype,
                                              base, pieces)

    @property
    def paces_decode(self) -> bool:
        return False


def as_engine(model: HybridLM | Engine) -> Engine:
    """Workers take a model (the live case) or an engine."""
    return ModelEngine(model) if isinstance(model, HybridLM) else model


def expected_kv_bytes(cfg: ModelConfig, length: int, start: int, dtype: str) -> int:
    """Payload bytes of an export of tokens [start, length): full-attention KV of the new
    tokens plus every fixed-size state (the pieces' headers come on top)."""
    return kv_bytes(cfg, length, dtype) - kv_layout(cfg, dtype).per_token * start


def import_pieces(cfg: ModelConfig, dtype: str, base: RequestCache | None,
                  pieces: Mapping[tuple[int, int], bytes | memoryview]) -> RequestCache:
    """The cache rebuilt from a stream's pieces (in a worker thread: it copies tensors);
    KVTransferError says which piece did not fit."""
    by_layer: dict[int, list[KVPiece]] = {}
    try:
        for layer, start in sorted(pieces):
            by_layer.setdefault(layer, []).append(KVPiece.from_bytes(pieces[layer, start]))
        importer = KVImporter(cfg, dtype, base)
        for group in by_layer.values():
            importer.add(group[0] if len(group) == 1 else merge_pieces(group))
        return importer.finish()
    except ModelError as exc:
        raise KVTransferError(f"KV rejected: {exc}") from exc


def merge_pieces(pieces: list[KVPiece]) -> KVPiece:
    """One full-attention piece from several of one layer over consecutive token ranges
    (each piece's checksum is checked before its bytes are trusted)."""
    for piece in pieces:
        if zlib.crc32(piece.payload) != piece.header.checksum:
            raise KVImportError("checksum", piece.header.checksum, zlib.crc32(piece.payload),
                                piece.header.layer)
    for a, b in pairwise(p.header for p in pieces):
        if (b.start, b.layer, b.kind) != (a.end, a.layer, "full_attn") or b.kind != a.kind:
            raise KVImportError("start", a.end, b.start, b.layer)
    parts = [_tensors(p) for p in pieces]
    joined = [torch.cat(group, dim=1) for group in zip(*parts, strict=True)]  # [A, n, X] each
    payload = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                       for t in joined)
    first, last = pieces[0].header, pieces[-1].header
    specs = tuple(TensorSpec(s.name, s.dtype, tuple(t.shape))
                  for s, t in zip(first.tensors, joined, strict=True))
    header = msgspec.structs.replace(first, end=last.end, tensors=specs,
                                     payload_bytes=len(payload), checksum=zlib.crc32(payload))
    return KVPiece(header, payload)


def _tensors(piece: KVPiece) -> list[torch.Tensor]:
    raw = torch.frombuffer(bytearray(piece.payload), dtype=torch.uint8)
    out, offset = [], 0
    for spec in piece.header.tensors:
        size = spec.nbytes()
        out.append(raw[offset : offset + size].view(torch_dtype(spec.dtype)).reshape(spec.shape))
        offset += size
    return out


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


def check_hashes(prompt: Sequence[int], block_size: int, hashes: Sequence[int]) -> None:
    """RequestError unless `hashes` (a request's chain of its prompt's first blocks) names at
    most the prompt's full blocks and its last hash is that of its block: a sender that hashes
    another way would fill the prefix store with chains no lookup matches."""
    try:
        check_chain_end(prompt, block_size, hashes)
    except ValueError as exc:
        raise RequestError(f"hashes: {exc}") from exc


def out_of_range(tokens: Sequence[int], vocab: int) -> int | None:
    """The first token id outside [0, vocab), or None; `out_of_range_reference`, faster on
    ids that are all in range (every request the workers take: its prompt is checked twice)."""
    if not tokens:
        return None
    try:
        # Packing to C unsigned ints checks in one pass that each id is an int >= 0, at half
        # the cost of min. (numpy's max over the packed ids, quick in a loop of its own, cost
        # more than min in the simulation, where its code is never warm.)
        array.array("I", tokens)
    except (TypeError, OverflowError):
        return out_of_range_reference(tokens, vocab)
    if max(tokens) < vocab:
        return None
    return out_of_range_reference(tokens, vocab)


def out_of_range_reference(tokens: Sequence[int], vocab: int) -> int | None:
    """`out_of_range` by min and max over the list and a scan (the slow, obvious reference)."""
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab):
        return None
    return next(t for t in tokens if not 0 <= t < vocab)
