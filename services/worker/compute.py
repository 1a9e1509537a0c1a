"""The prefill worker's compute side: where the model runs, and the loop that computes a job's
uncached suffix chunk by chunk while releasing each finished layer's piece to the upload lanes.

The compute runs through a `ComputeRunner` (a worker thread live, so the loop keeps sending).
As each layer of a chunk finishes, its piece - the full-attention KV the decode worker lacks
(tokens from `decode_has_tokens` on), or in the last chunk the fixed-size state at the new end
(services.worker.kv_stream) - goes to the loop, which deals it to the next lane: transfer overlaps
compute (paper section 3.3).

Emulated mode (CostModel, Pacer): the real compute runs ahead, and each piece is released
when the modeled hardware finishes its (chunk, layer) step (`kv_stream.step_ends`, stretched
by the time scale), never earlier; the compute ends at the last step's modeled end. These
waits are sleeps on the loop's clock: they hold neither the compute nor the senders, and on a
virtual clock (`InlineRunner`) a run is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol, TypeVar

import anyio

from mesh.mailbox import Mailbox
from services.contract.messages import KVChunk, KVClose
from services.worker.engine import Engine, Pacing, PrefillJob
from services.worker.kv_stream import Computed, release, step_ends

LaneItem = KVChunk | KVClose
T = TypeVar("T")


class ComputeRunner(Protocol):
    """Where the model compute runs, and how it hands a piece back to the event loop."""

    async def run(self, compute: Callable[[], T]) -> T: ...

    def to_loop(self, call: Callable[[], object]) -> None: ...


class ThreadRunner:
    """The live default: compute in a worker thread, pieces handed over to the loop."""

    async def run(self, compute: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(compute)

    def to_loop(self, call: Callable[[], object]) -> None:
        anyio.from_thread.run_sync(call)


class InlineRunner:
    """Compute on the event loop itself, blocking it: on a virtual clock (trio's MockClock)
    the compute then takes no time and only the pacing does, so runs are deterministic.
    Tests and simulation only."""

    async def run(self, compute: Callable[[], T]) -> T:
        return compute()

    def to_loop(self, call: Callable[[], object]) -> None:
        call()


class PrefillCompute:
    """Computes one job at a time on `model` through `runner`, paced when `pacing` is given."""

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
        start = anyio.current_time()
        computed = Mailbox[Computed](job.pieces + 1)
        first: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._compute_task, job, computed, first)
            ends = self._step_ends(job, start)
            try:
                compute_end = await release(computed, lanes, ends, hold=not job.request.overlap)
            except BaseException:
                job.cancelled = True
                raise
            if first:  # else the compute failed, and the task group raises its error
                lanes[0].put_nowait(KVClose(request_id=job.request.request_id,
                                            first_token=first[0],
                                            first_logprob=job.first_logprob))
                for lane in lanes:
                    lane.end()
        return first[0], compute_end

    async def _compute_task(self, job: PrefillJob, computed: Mailbox[Computed],
                            first: list[int]) -> None:
        def emit(step: int, chunk: KVChunk) -> None:
            if not job.cancelled:
                self._runner.to_loop(partial(computed.put_nowait, (step, chunk)))

        try:
            began = anyio.current_time()
            first.append(await self._runner.run(partial(self._compute, job, emit)))
            if self._pacing is not None:
                modeled = self._pacing.prefill_time(job.length - job.reused, job.reused)
                self._pacing.pacer.remaining(anyio.current_time() - began, modeled)
        finally:
            computed.end()

    def _compute(self, job: PrefillJob, emit: Callable[[int, KVChunk], None]) -> int:
        """Through the runner: the engine prefills the suffix chunk by chunk, emitting each
        piece as its layer finishes; returns the first token."""
        return self.engine.compute_prefill(job, emit, self._snapshot_every)

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
