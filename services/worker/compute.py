"""Where a worker's model compute runs and how long emulated mode says it takes.

A `ComputeRunner` runs a prefill's compute: a worker thread live (`ThreadRunner`, so the loop
keeps sending), the loop itself on a virtual clock (`InlineRunner`); `piece_emitter` hands
each finished layer's piece back to the loop through it. `Pacing` holds emulated mode's
modeled times (a hardware profile's costs, stretched by the pacer's scale).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

import anyio

from mesh.native import soon_from_thread
from services.contract.messages import KVChunk
from services.paper.hardware import CostModel, Pacer
from services.worker.engine import Emit, PrefillJob

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


def piece_emitter(job: PrefillJob, runner: ComputeRunner,
                  put: Callable[[Computed], object]) -> Emit:
    """The `emit` a compute calls with each finished layer's piece: the piece handed to the
    loop's `put` through `runner`, unless the job was given up meanwhile."""
    def emit(step: int, chunk: KVChunk) -> None:
        if not job.cancelled:
            runner.to_loop(partial(put, (step, chunk)))
    return emit
