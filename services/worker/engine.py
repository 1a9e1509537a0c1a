"""The engine: what the prefill and decode workers ask of the model.

The workers (queueing, the KV stream, the prefix store, continuous batching) are the same in
every mode; only the engine under them changes. `ModelEngine` runs the real hybrid model (live
and emulated modes). The simulation swaps in a modeled engine (services/sim/engine.py) whose
caches and KV pieces carry sizes instead of tensors and whose compute takes the hardware
profile's time on the loop's clock.

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
- `import_kv(opening, base, pieces)`: the cache rebuilt from a stream's pieces
  (`import_pieces` for the real model: each layer's consecutive full-attention pieces joined,
  checksums checked first, on top of the KV the decode side already holds);
- `export_kv(request_id, cache, plan)`: a held cache's pieces as a stream's chunks (a cached
  prefix pushed to another worker, services/worker/prefix_pull.py; `import_kv` takes them in);
- `paces_decode`: True when `step` itself takes the modeled time (else emulated mode's pacer
  stretches each real step);
- `release_memory()`: give the memory a finished computation freed back to the system (the
  prefill worker calls it, through its compute, when it goes idle).

The types the workers hand an engine live here too: `PrefillJob` (one planned prefill and its
stream plan of `PieceSpec`s) and `Emit` (how a compute hands back each finished layer's piece).
Where the compute runs and how long emulated mode says it takes are services/worker/compute.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import anyio

from mesh import native
from mesh.allocator import release_free_memory
from services.contract.errors import KVTransferError
from services.contract.messages import KVChunk, KVOpen, PrefillRequest
from services.contract.sampling import TokenLogprob
from services.model.batch import DecodeBatch, StepResult
from services.model.cache import RequestCache, dtype_name
from services.model.config import ModelConfig, ModelError, kv_bytes, kv_layout
from services.model.export import KVImporter, KVPiece, export_layer, merge_pieces
from services.model.generate import block_boundaries, prefill
from services.model.model import HybridLM
from services.model.sampling import RequestSampler, SamplingParams

if TYPE_CHECKING:
    from opentelemetry.trace import Span

Emit = Callable[[int, KVChunk], None]


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

    async def export_kv(self, request_id: str, cache: Any,
                        plan: Sequence[PieceSpec]) -> list[KVChunk]: ...

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

    async def export_kv(self, request_id: str, cache: RequestCache,
                        plan: Sequence[PieceSpec]) -> list[KVChunk]:
        # In a worker thread: it copies tensors.
        return await anyio.to_thread.run_sync(export_chunks, request_id, cache, plan)

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


def export_chunks(request_id: str, cache: RequestCache,
                  plan: Sequence[PieceSpec]) -> list[KVChunk]:
    """Each planned piece of `cache`, exported as one chunk of `request_id`'s stream."""
    return [KVChunk(request_id=request_id, layer=p.layer, start=p.start,
                    data=memoryview(export_layer(cache, p.layer, p.start, p.end).to_bytes()))
            for p in plan]


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
