"""The modeled engine: the simulation's stand-in for the model under the live workers.

Everything above it is the live code (services/worker: the queue, the KV stream protocol, the
prefix store, continuous batching). Only these are modeled:
- caches (`VirtualCache`) hold a length and block-aligned snapshots, no tensors; their size is
  the modeled model's S_kv at the modeled length (the 1T hybrid of the paper's Table 5);
- prefill emits the live stream plan's pieces carrying their modeled sizes (`KVChunk.nbytes`)
  and no bytes; its time is the live emulated-mode pacing (`services.worker.compute.Pacing`);
- a cached prefix pushed to another worker (services/worker/prefix_pull.py) is exported as
  the same sized pieces (`export_kv`) and imported as a cache of the prefix's length;
- decode (`ModeledBatch`) advances a batch step by step at the hardware profile's step time
  for its size and context, several steps at once until a request finishes, a joining request
  cuts the run short, or `max_steps` is reached; a member's second token goes out on its own
  at the step that makes it, the rest as one event when it finishes (or every `flush` tokens
  when asked): an hour at the paper's rate is millions of tokens, not millions of messages,
  and what the simulation measures (the first token, which comes with the prefill, the
  second, which waits for a batch slot, and the last) needs no token in between.

A served token stands for `tokens_per_served` modeled tokens of the prompt; an output token is
an output token at any scale (the output lengths are not scaled), so a decode step's context
is the prompts' modeled length plus each member's generated tokens, one each.

(The simulation serves the traces' lengths at 1/8, so a 64-token block is one 512-token
block of the Mooncake traces, and the workloads without prefix reuse at 1/32.)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh import native
from services.contract.messages import KVChunk, KVOpen, ModelInfo
from services.model.batch import DecodeBatchStatistics, StepResult, TokenEvent
from services.model.cache import CacheStatistics, StateSnapshot
from services.model.config import ModelError
from services.model.generate import block_boundaries
from services.model.sampling import SamplingParams
from services.paper.hardware import CostModel
from services.worker.engine import Emit, PieceSpec, PrefillJob

MODELED_TOKEN = 1  # every modeled output token; never the end-of-text id
EOS_ID = 0


@dataclass(frozen=True)
class ModeledConfig:
    """The shape the workers read: a hybrid of `linear_layers` KDA groups and one MLA group.

    Coarse on purpose: each layer here stands for a group of the real model's layers, so a
    request streams a few pieces per chunk instead of one per real layer. One KDA group by
    default: more split the same state bytes into more pieces that leave a little apart,
    which costs messages and moves nothing measured (ten virtual minutes of the paper's
    PrfaaS-PD at 3 req/s give the same summary, byte for byte, with 1 and 3 groups)."""

    block_size: int = 64
    linear_layers: int = 1
    vocab_size: int = 1 << 30
    eos_id: int = EOS_ID
    family: str = "hybrid-1t-modeled"
    size: str = "paper"

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return ("kda",) * self.linear_layers + ("mla",)

    @property
    def n_layers(self) -> int:
        return self.linear_layers + 1

    def config_hash(self) -> str:
        return f"{self.family}-{self.block_size}-{self.linear_layers}"


@dataclass
class VirtualCache:
    """A request's cache as sizes: `length` served tokens, snapshots at block boundaries."""

    cfg: ModeledConfig
    sizes: KVSizes
    length: int = 0
    snapshots: dict[int, StateSnapshot] = field(default_factory=dict)
    dtype_name: str = "bfloat16"

    def statistics(self) -> CacheStatistics:
        payload = self.sizes.bytes(self.length)
        snapshots = len(self.snapshots) * self.sizes.fixed
        return CacheStatistics(length=self.length, full_blocks=self.length // self.cfg.block_size,
                               payload_bytes=payload, allocated_bytes=payload,
                               snapshot_lengths=tuple(sorted(self.snapshots)),
                               snapshot_bytes=snapshots)

    def held_bytes(self) -> int:
        """`statistics()`'s allocated plus snapshot bytes, without building it: the prefix
        store asks at every store."""
        return self.sizes.bytes(self.length) + len(self.snapshots) * self.sizes.fixed

    def resume_point(self, length: int) -> VirtualCache:
        if length != self.length and length not in self.snapshots:
            raise ModelError(f"length {length} is neither the cache length ({self.length}) "
                             f"nor a snapshot (have {sorted(self.snapshots)})")
        return VirtualCache(self.cfg, self.sizes, length)

    def add_snapshot(self, snapshot: StateSnapshot) -> None:
        if snapshot.length % self.cfg.block_size or not 0 < snapshot.length <= self.length:
            raise ModelError(f"snapshot length must be block-aligned in (0, {self.length}], "
                             f"got {snapshot.length}")
        self.snapshots[snapshot.length] = snapshot

    def request_states(self) -> tuple[None, ...]:
        return ()

    def check_integrity(self) -> None:
        if any(n > self.length for n in self.snapshots):
            raise ModelError(f"snapshots {sorted(self.snapshots)} beyond length {self.length}")


@dataclass(frozen=True)
class KVSizes:
    """S_kv per served token and fixed, at the modeled length (S_kv(l) = fixed + per_token*l)."""

    fixed: int
    per_served_token: float

    @classmethod
    def of(cls, cost: CostModel, tokens_per_served: float) -> KVSizes:
        kv = cost.model.kv
        return cls(round(kv.fixed_bytes), kv.bytes_per_token * tokens_per_served)

    def tokens(self, count: int) -> int:
        """Bytes of the full-attention KV of `count` served tokens."""
        return round(self.per_served_token * count)

    def bytes(self, length: int) -> int:
        return self.fixed + self.tokens(length)


@dataclass
class _Run:
    cache: VirtualCache
    generated: int
    limit: int
    prompt: int  # served tokens in the cache when it joined
    reported: int = 1  # tokens handed out so far (the first came with the prefill)


class _Members:
    """Who is in a modeled batch, by request id (the two batches' common ground)."""

    _runs: Mapping[str, object]
    _slots: int
    steps: int
    tokens: int
    joined: int
    left: int

    def context(self) -> int:
        """Served tokens in the members' caches (each batch counts them its own way)."""
        raise NotImplementedError

    def statistics(self) -> DecodeBatchStatistics:
        return DecodeBatchStatistics(members=len(self._runs), slots=self._slots,
                                     steps=self.steps, tokens=self.tokens, joined=self.joined,
                                     left=self.left, tokens_in_cache=self.context())

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._runs

    def request_ids(self) -> list[str]:
        return list(self._runs)

    def _check_new(self, request_id: str) -> None:
        if request_id in self._runs:
            raise ModelError(f"request {request_id!r} is already in the batch")


class ModeledBatch(_Members):
    """Continuous batching as counts: who is in, how far each has got (module docstring)."""

    def __init__(self, slots: int, flush: int | None = None,
                 tokens_per_served: float = 1.0) -> None:
        self._slots = slots
        self._flush = flush or 1 << 62
        self._per_served = tokens_per_served
        self._runs: dict[str, _Run] = {}
        self.steps = self.tokens = self.joined = self.left = 0

    def join(self, request_id: str, cache: VirtualCache, next_token: int,
             params: SamplingParams) -> None:
        self._check_new(request_id)
        self._runs[request_id] = _Run(cache, 1, params.max_new_tokens, cache.length)
        self._slots = max(self._slots, len(self._runs))
        self.joined += 1

    def leave(self, request_id: str) -> VirtualCache:
        self.left += 1
        return self._runs.pop(request_id).cache

    def context(self) -> int:
        """Served tokens in the members' caches (what the worker's statistics report)."""
        return sum(run.cache.length for run in self._runs.values())

    def modeled_context(self) -> int:
        """Modeled tokens a step reads: each prompt at the modeled scale, each generated
        token once (module docstring)."""
        return round(sum(run.prompt * self._per_served + run.generated
                         for run in self._runs.values()))

    def steps_to_next_event(self) -> int:
        """Steps until a member finishes or makes its second token (handed out on its own)."""
        return min(run.limit - run.generated if run.generated > 1 else 1
                   for run in self._runs.values())

    def advance(self, steps: int) -> StepResult:
        """Every member makes `steps` tokens; a member's second token is handed out at once,
        the later ones `flush` at a time once that many are due, and all of them when it
        reaches its limit (then it leaves with its cache)."""
        events, finished, flush = [], {}, self._flush
        self.tokens += steps * len(self._runs)
        for rid, run in list(self._runs.items()):
            run.generated += steps
            run.cache.length += steps
            done = run.generated >= run.limit
            if run.reported == 1 and not done:
                # The second token on its own: the client's time to second token.
                events.append(TokenEvent(rid, MODELED_TOKEN, 1, None, 1))
                run.reported = 2
            end = run.generated if done else run.reported + (
                run.generated - run.reported) // flush * flush
            for index in range(run.reported, end, flush):
                count = min(flush, end - index)
                last = done and index + count == end
                events.append(TokenEvent(rid, MODELED_TOKEN, index,
                                         "length" if last else None, count))
            run.reported = end
            if done:
                finished[rid] = self._runs.pop(rid).cache
        self.steps += steps
        return StepResult(tuple(events), finished)  # type: ignore[arg-type]

    def check_integrity(self) -> None:
        for rid, run in self._runs.items():
            if not 1 <= run.generated < run.limit:
                raise ModelError(f"{rid!r} has made {run.generated} of {run.limit} tokens")
            run.cache.check_integrity()


@dataclass
class _Counted:
    cache: VirtualCache
    base: int  # the batch's step count when this member had made 0 tokens
    limit: int
    prompt: int  # served tokens in the cache when it joined
    order: int  # join order: events go out in it, as the reference's dict order has them
    fresh: bool = True  # only the first token handed out (it came with the prefill)


class CountingBatch(_Members):
    """`ModeledBatch` where nothing is flushed between a member's second and last token and a
    served token stands for a whole number of modeled ones (what the simulation runs): a step
    costs the same whatever the batch's size. Each member's progress is the batch's step
    count less its own start, its finishing step waits in a heap, and the contexts are kept
    as sums; a member's cache length is brought up to date when it leaves or finishes, or
    when `check_integrity` looks. Same results as `ModeledBatch`, event for event and in the
    same order (tests/test_sim_engine.py), the modeled context to the bit: whole-number
    products and sums below 2**53 are exact in floating point, so the reference's float sum
    equals these integer sums."""

    def __init__(self, slots: int, tokens_per_served: int) -> None:
        self._slots = slots
        self._per_served = tokens_per_served
        self._runs: dict[str, _Counted] = {}
        self._fresh: dict[str, _Counted] = {}  # joined, second token not yet made
        self._ends: list[tuple[int, int, str]] = []  # (finishing step, order, id); lazy
        self._order = itertools.count()
        self._prompts = self._bases = 0  # sums over the members
        self.steps = self.tokens = self.joined = self.left = 0

    def join(self, request_id: str, cache: VirtualCache, next_token: int,
             params: SamplingParams) -> None:
        self._check_new(request_id)
        run = _Counted(cache, self.steps - 1, params.max_new_tokens, cache.length,
                       next(self._order))
        self._runs[request_id] = self._fresh[request_id] = run
        heapq.heappush(self._ends, (run.base + run.limit, run.order, request_id))
        self._prompts += run.prompt
        self._bases += run.base
        self._slots = max(self._slots, len(self._runs))
        self.joined += 1

    def leave(self, request_id: str) -> VirtualCache:
        self.left += 1
        return self._remove(request_id)

    def context(self) -> int:
        """Served tokens in the members' caches (each its prompt and generated tokens less the
        first, which the cache does not hold yet)."""
        return self._prompts + self._generated() - len(self._runs)

    def modeled_context(self) -> int:
        return self._prompts * self._per_served + self._generated()

    def steps_to_next_event(self) -> int:
        if self._fresh:
            return 1
        return self._next_end() - self.steps

    def advance(self, steps: int) -> StepResult:
        self.tokens += steps * len(self._runs)
        self.steps += steps
        due = dict(self._fresh)
        while self._ends and self._ends[0][0] <= self.steps:
            _, order, rid = heapq.heappop(self._ends)
            run = self._runs.get(rid)
            if run is not None and run.order == order:
                due[rid] = run
        events, finished = [], {}
        for rid, run in sorted(due.items(), key=lambda item: item[1].order):
            generated = self.steps - run.base
            if generated < run.limit:
                events.append(TokenEvent(rid, MODELED_TOKEN, 1, None, 1))
                run.fresh = False
                del self._fresh[rid]
                continue
            first = 1 if run.fresh else 2
            if generated > first:
                events.append(TokenEvent(rid, MODELED_TOKEN, first, "length", generated - first))
            finished[rid] = self._remove(rid)
        return StepResult(tuple(events), finished)  # type: ignore[arg-type]

    def check_integrity(self) -> None:
        for rid, run in self._runs.items():
            generated = self.steps - run.base
            if not 1 <= generated < run.limit:
                raise ModelError(f"{rid!r} has made {generated} of {run.limit} tokens")
            if run.fresh != (rid in self._fresh) or run.fresh != (generated == 1):
                raise ModelError(f"{rid!r} is {'' if run.fresh else 'not '}fresh at "
                                 f"{generated} tokens")
            run.cache.length = run.prompt + generated - 1
            run.cache.check_integrity()
        if self._prompts != sum(r.prompt for r in self._runs.values()) or (
                self._bases != sum(r.base for r in self._runs.values())):
            raise ModelError("the batch's sums are out of step with its members")

    def _generated(self) -> int:
        return len(self._runs) * self.steps - self._bases

    def _next_end(self) -> int:
        ends, runs = self._ends, self._runs
        while True:
            end, order, rid = ends[0]
            run = runs.get(rid)
            if run is not None and run.order == order:
                return end
            heapq.heappop(ends)

    def _remove(self, request_id: str) -> VirtualCache:
        run = self._runs.pop(request_id)
        self._fresh.pop(request_id, None)
        self._prompts -= run.prompt
        self._bases -= run.base
        run.cache.length = run.prompt + self.steps - run.base - 1
        return run.cache


class ModeledEngine:
    """The simulation's engine (module docstring): `decode_cost` times the decode steps.

    An unpaced decode profile (`cpu`) makes compute free: every step takes no time, so the
    workers above answer as fast as their own code allows (benchmarks/bench_router.py
    measures the router against such workers). `flush` is the batch's (`ModeledBatch`;
    None: each request's tokens at its end); with `flush=1` each token is its own event, as
    the real batch makes them, however many steps one call takes (`max_steps`)."""

    def __init__(self, decode_cost: CostModel, tokens_per_served: float, *,
                 cfg: ModeledConfig | None = None, max_steps: int = 64,
                 flush: int | None = None) -> None:
        if not tokens_per_served > 0 or max_steps < 1 or (flush is not None and flush < 1):
            raise ModelError(f"tokens_per_served must be > 0, max_steps and flush >= 1, got "
                             f"{tokens_per_served}, {max_steps} and {flush}")
        self._cfg = cfg or ModeledConfig()
        self._cost = decode_cost
        self._per_served = tokens_per_served
        self.sizes = KVSizes.of(decode_cost, tokens_per_served)
        self.max_steps = max_steps
        self.flush = flush

    @property
    def cfg(self) -> ModeledConfig:
        return self._cfg

    @property
    def dtype_name(self) -> str:
        return "bfloat16"

    @property
    def paces_decode(self) -> bool:
        return True

    def release_memory(self) -> None:
        """Sizes, not tensors: nothing to give back."""

    def empty_cache(self) -> VirtualCache:
        return VirtualCache(self._cfg, self.sizes)

    def kv_bytes(self, length: int, start: int, dtype: str) -> int:
        return self.sizes.fixed + self.sizes.tokens(length - start)

    def piece_bytes(self, layer: int, start: int, end: int) -> int:
        """A full-attention piece carries its tokens' KV; a state piece its share of fixed."""
        if self._cfg.layer_kinds[layer] == "mla":
            return self.sizes.tokens(end - start)
        share, extra = divmod(self.sizes.fixed, self._cfg.linear_layers)
        return share + (extra if layer == 0 else 0)

    def compute_prefill(self, job: PrefillJob, emit: Emit, snapshot_every: int) -> int:
        """No compute: each planned piece, sized, in the live plan's order; the cache grows to
        the prompt with its snapshots. The time is the prefill pacing's (the live class)."""
        cfg, rid = self._cfg, job.request.request_id
        for index, ((_, end), pieces) in enumerate(zip(job.chunks, job.plan, strict=True)):
            for spec in pieces:
                emit(index * cfg.n_layers + spec.layer, KVChunk(
                    request_id=rid, layer=spec.layer, start=spec.start, data=memoryview(b""),
                    nbytes=self.piece_bytes(spec.layer, spec.start, end)))
        cache = job.cache
        for length in block_boundaries(job.reused, job.length, cfg.block_size, snapshot_every):
            cache.length = length
            cache.add_snapshot(StateSnapshot(length, ()))
        cache.length = job.length
        return MODELED_TOKEN

    def new_batch(self, slots: int) -> ModeledBatch | CountingBatch:
        """`CountingBatch` where it applies (nothing flushed, a whole number of modeled tokens
        per served one: the simulation's runs), else `ModeledBatch`, the general form."""
        if self.flush is None and float(self._per_served).is_integer():
            return CountingBatch(slots, int(self._per_served))
        return ModeledBatch(slots, self.flush, self._per_served)

    def info(self, source: str = "modeled") -> ModelInfo:
        """What the workers report of their model (the router checks block and vocab size)."""
        cfg = self._cfg
        return ModelInfo(family=cfg.family, size=cfg.size, config_hash=cfg.config_hash(),
                         dtype=self.dtype_name, vocab_size=cfg.vocab_size,
                         block_size=cfg.block_size, eos_id=cfg.eos_id, source=source)

    async def step(self, batch: ModeledBatch | CountingBatch, interrupt: native.Alarm,
                   ) -> StepResult:
        """Up to `max_steps` steps at this batch's step time; a join (the worker wakes
        `interrupt`) cuts the run at the step in progress, so the newcomer joins at the next
        step boundary."""
        step_s = self._cost.decode_step_time(len(batch), batch.modeled_context())
        steps = min(self.max_steps, batch.steps_to_next_event())
        if not self._cost.profile.paced:
            # Free compute (class docstring): the steps are done at once.
            await native.checkpoint()
            return batch.advance(steps)
        if not step_s > 0:
            raise ModelError(f"decode profile {self._cost.profile.name!r} must model step times")
        # The loop's own clock and sleeps (mesh.native): a step is on every request's path.
        # On the simulation's clock the alarm parks the loop in the clock's own heap: no
        # cancel scope and no event per step. A join's wake moves the alarm to the end of the
        # step in progress (`cut`), where the loop wakes once. The times are anyio's to the
        # bit: the end of a cut run is the join's instant plus the rest of its step, as a
        # sleep from the join would reach it.
        start = native.clock()()
        done = [steps]

        def cut(now: float) -> float:
            done[0] = min(steps, max(1, math.ceil((now - start) / step_s - 1e-9)))
            return now + (start + done[0] * step_s - now)

        await interrupt.sleep_until(start + steps * step_s, woken=cut)
        return batch.advance(done[0])

    async def import_kv(self, opening: KVOpen, base: Any,
                        pieces: Mapping[tuple[int, int], bytes | memoryview]) -> VirtualCache:
        """The receiver's cache of the stream's tokens: `base`'s prefix plus what the stream
        brought (a decode worker's prompt, or a prefix pulled to a prefill worker)."""
        return VirtualCache(self._cfg, self.sizes, opening.end)

    async def export_kv(self, request_id: str, cache: VirtualCache,
                        plan: Sequence[PieceSpec]) -> list[KVChunk]:
        """A held prefix's planned pieces, sized and with no bytes, as `compute_prefill`
        emits them: a pushed prefix crosses the link at its modeled S_kv."""
        return [KVChunk(request_id=request_id, layer=p.layer, start=p.start,
                        data=memoryview(b""), nbytes=self.piece_bytes(p.layer, p.start, p.end))
                for p in plan]


class ModeledTokenizer:
    """The router's tokenizer in the simulation: prompts arrive as token ids, and each modeled
    output token reads as one character (the router times the first non-empty token)."""

    def __init__(self, cfg: ModeledConfig) -> None:
        self._cfg = cfg

    @property
    def eot_id(self) -> int:
        return self._cfg.eos_id

    @property
    def vocab_size(self) -> int:
        return self._cfg.vocab_size

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        # Modeled output tokens are never end-of-text.
        return "." * len(ids)
