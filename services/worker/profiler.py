"""Timing the real engine on this machine: the measurements behind a measured hardware profile.

Vidur's way of earning a simulator's trust: time the engine the live workers run, on the device
they run on, and give the simulation those times. `EngineProfiler` times the worker's own code
paths on a `ModelEngine`, one thread of work at a time, as a worker does:

- prefill: `ModelEngine.compute_prefill` on a planned job (the worker's chunk bounds and stream
  plan, state snapshots every `snapshot_every` blocks, each layer's KV piece exported), for
  each prompt length and chunk size; the pieces go nowhere, their export is timed;
- decode: `DecodeBatch.step` (what the decode worker runs per step, sampling included) on a
  batch of `batch` sequences of `context` tokens each.

Each point is the median of `repeats` timings after a warm-up: on a shared machine the median
resists another process's burst better than the mean, and the warm-up keeps torch's first-call
costs out. `prfaas profile` (services/cli/profile.py) fits these points and writes the TOML.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from itertools import product

import msgspec

from mesh.errors import ConfigError
from services.contract.messages import KVChunk, PrefillRequest
from services.contract.sampling import Sampling
from services.model.batch import DecodeBatch
from services.model.cache import RequestCache
from services.model.sampling import SamplingParams
from services.worker.engine import ModelEngine, PrefillJob
from services.worker.kv_out import chunk_bounds, stream_plan
from services.worker.request_checks import sampling_params

Clock = Callable[[], float]


class ProfilerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What to time: prompt lengths at each chunk size; decode batch sizes at each context."""

    lengths: tuple[int, ...] = (64, 128, 256, 384, 512, 768, 1024)
    chunk_tokens: tuple[int, ...] = (128, 0)  # 0: the whole prompt in one chunk
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (128, 512, 1024)  # tokens held per sequence
    repeats: int = 5
    snapshot_every: int = 1  # the worker's default
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("lengths", "batches", "contexts"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ConfigError(f"{name} must be a non-empty list of counts >= 1, got {values}")
        if not self.chunk_tokens or min(self.chunk_tokens) < 0:
            raise ConfigError(f"chunk_tokens must be non-empty, each >= 0, got "
                              f"{self.chunk_tokens}")
        if self.repeats < 1 or self.snapshot_every < 1:
            raise ConfigError(f"repeats and snapshot_every must be >= 1, got {self.repeats} "
                              f"and {self.snapshot_every}")

    def steps(self) -> int:
        """Points to time, for a progress bar."""
        return (len(self.lengths) * len(self.chunk_tokens)
                + len(self.batches) * len(self.contexts))


class PrefillPoint(msgspec.Struct, frozen=True):
    length: int
    chunk_tokens: int
    seconds: float  # median
    spread: float  # (max - min) / median of the repeats


class DecodePoint(msgspec.Struct, frozen=True):
    batch: int
    context: int  # tokens per sequence
    seconds: float  # median step
    spread: float


Point = PrefillPoint | DecodePoint


def _median_and_spread(times: list[float]) -> tuple[float, float]:
    middle = statistics.median(times)
    return middle, (max(times) - min(times)) / middle


class EngineProfiler:
    """Times `engine` (module docstring); `clock` is injectable for tests."""

    def __init__(self, engine: ModelEngine, config: ProfilerConfig,
                 clock: Clock = time.perf_counter) -> None:
        self.engine = engine
        self.config = config
        self._clock = clock
        self._rng = random.Random(config.seed)

    def points(self) -> Iterator[Point]:
        """Every point of the config, prefill first, one at a time (a caller shows progress)."""
        cfg = self.config
        for chunk, length in product(cfg.chunk_tokens, cfg.lengths):
            yield self.prefill_point(length, chunk)
        for context, batch in product(cfg.contexts, cfg.batches):
            yield self.decode_point(batch, context)

    def prefill_point(self, length: int, chunk_tokens: int) -> PrefillPoint:
        block = self.engine.cfg.block_size
        if chunk_tokens % block:
            raise ConfigError(f"chunk_tokens must be a multiple of the block size {block}, "
                              f"got {chunk_tokens}")
        prompt = self._prompt(length)
        self._prefill_once(prompt, chunk_tokens)  # warm-up
        times = [self._prefill_once(prompt, chunk_tokens) for _ in range(self.config.repeats)]
        return PrefillPoint(length, chunk_tokens, *_median_and_spread(times))

    def decode_point(self, batch: int, context: int) -> DecodePoint:
        decoding = self._batch_of(batch, context)
        # The worker's own calls (no_grad inside, as the worker runs them).
        decoding.step()  # warm-up
        times = []
        for _ in range(self.config.repeats):
            began = self._clock()
            decoding.step()
            times.append(self._clock() - began)
        return DecodePoint(batch, context, *_median_and_spread(times))

    def _prompt(self, length: int) -> list[int]:
        # Fresh token ids per prompt: nothing the engine could reuse.
        return [self._rng.randrange(1, self.engine.cfg.vocab_size) for _ in range(length)]

    def _prefill_once(self, prompt: list[int], chunk_tokens: int) -> float:
        job = self._job(prompt, chunk_tokens)
        began = self._clock()
        self.engine.compute_prefill(job, _discard, self.config.snapshot_every)
        return self._clock() - began

    def _job(self, prompt: list[int], chunk_tokens: int) -> PrefillJob:
        """The job a prefill worker plans for `prompt` with nothing cached (PrefillWorker._plan)."""
        request = PrefillRequest(request_id="profile", prompt=prompt, decode_worker="none",
                                 sampling=Sampling(max_tokens=1, stop_on_eos=False))
        chunks = chunk_bounds(0, len(prompt), chunk_tokens)
        return PrefillJob(request, [], self.engine.empty_cache(), 0,
                          sampling_params(request.sampling), 1, chunks,
                          stream_plan(self.engine.cfg, chunks, 0))

    def _batch_of(self, batch: int, context: int) -> DecodeBatch:
        """`batch` sequences of `context` tokens each (one prefill, cloned), ready to step."""
        job = self._job(self._prompt(context), 0)
        first = self.engine.compute_prefill(job, _discard, self.config.snapshot_every)
        cache: RequestCache = job.cache
        decoding = self.engine.new_batch(batch)
        # Enough tokens that nobody finishes while being timed.
        params = SamplingParams(max_new_tokens=self.config.repeats + 2, stop_on_eos=False)
        for index in range(batch):
            decoding.join(f"profile-{index}", cache.clone(keep_snapshots=False), first, params)
        return decoding


def _discard(step: int, chunk: KVChunk) -> None:
    """The pieces are exported (that is timed) and dropped: no stream to send them on."""
