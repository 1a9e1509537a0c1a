"""The engine: what a worker's prefill and decode sides ask of the model, and nothing more.

The prefill and decode workers (queueing, the KV stream protocol, the prefix store, continuous
batching) are the same in every mode; only the engine under them changes. `ModelEngine` runs
the real hybrid model (live and emulated modes). The simulation swaps in a modeled engine
(services/sim/engine.py) whose caches and KV pieces carry sizes instead of tensors and whose
compute takes the hardware profile's time on the loop's clock.

An engine answers:
- `cfg`: the model's shape as the workers read it (block_size, n_layers, layer_kinds,
  vocab_size, eos_id, family, config_hash());
- `dtype_name`; `empty_cache()`; `kv_bytes(length, start, dtype)`: the payload an export of
  tokens [start, length) carries;
- `compute_prefill(job, emit, snapshot_every)`: prefill a job's chunks, emitting each finished
  layer's piece, returning the first token (called through the prefill's `ComputeRunner`) and
  setting `job.first_logprob` when the request asked for logprobs;
- `new_batch(slots)`, `step(batch, interrupt)`: the decode batch and one step of it (a modeled
  batch may take several steps at once, cut short when `interrupt` is set: a request joined);
- `import_kv(opening, base, pieces)`: the cache rebuilt from a stream's pieces;
- `paces_decode`: True when `step` itself takes the modeled time (else emulated mode's pacer
  stretches each real step);
- `release_memory()`: give the memory a finished computation freed back to the system (the
  prefill worker calls it, through its runner, when it goes idle).

The seam also owns the types both sides hand an engine: `PrefillJob` (one planned prefill),
`Pacing` (emulated mode's modeled times) and `sampling_params` (a request's sampling as the
model takes it), so the prefill's compute and the decode side import them from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from mesh.allocator import release_free_memory
from services.contract.messages import KVChunk, KVOpen, PrefillRequest
from services.contract.sampling import Sampling, TokenLogprob
from services.model.batch import DecodeBatch, StepResult
from services.model.cache import RequestCache, dtype_name
from services.model.config import kv_bytes, kv_layout
from services.model.export import export_layer
from services.model.generate import block_boundaries, prefill
from services.model.model import HybridLM
from services.model.sampling import RequestSampler, SamplingParams
from services.paper.hardware import CostModel, Pacer
from services.worker.kv_stream import PieceSpec, import_pieces

Emit = Callable[[int, KVChunk], None]


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

    async def step(self, batch: Any, interrupt: anyio.Event) -> StepResult: ...

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
        """Full-attention KV of tokens [start, length) plus every fixed-size state."""
        cfg = self.model.cfg
        return kv_bytes(cfg, length, dtype) - kv_layout(cfg, dtype).per_token * start

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

    async def step(self, batch: DecodeBatch, interrupt: anyio.Event) -> StepResult:
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
