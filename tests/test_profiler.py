"""The engine profiler: which points it times, on the worker's own code paths, and how."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mesh.errors import ConfigError
from services.model.config import family_config
from services.model.model import build_model
from services.worker.engine import ModelEngine
from services.worker.profiler import DecodePoint, EngineProfiler, PrefillPoint, ProfilerConfig

SMALL = ProfilerConfig(lengths=(40, 130), chunk_tokens=(64, 0), batches=(1, 3),
                       contexts=(20, 70), repeats=3)


@pytest.fixture(scope="module")
def engine() -> ModelEngine:
    return ModelEngine(build_model(family_config("kimi-linear", "tiny"), seed=0))


class SteppingClock:
    """Each call returns the next of `ticks`: timings become exact and known."""

    def __init__(self, ticks: list[float]) -> None:
        self._ticks: Iterator[float] = iter(ticks)

    def __call__(self) -> float:
        return next(self._ticks)


def test_every_point_of_the_grid_is_timed_in_order(engine: ModelEngine) -> None:
    points = list(EngineProfiler(engine, SMALL).points())
    assert len(points) == SMALL.steps() == 8
    prefill = [p for p in points if isinstance(p, PrefillPoint)]
    decode = [p for p in points if isinstance(p, DecodePoint)]
    assert [(p.chunk_tokens, p.length) for p in prefill] == [
        (64, 40), (64, 130), (0, 40), (0, 130)]
    assert [(p.context, p.batch) for p in decode] == [(20, 1), (20, 3), (70, 1), (70, 3)]
    assert all(p.seconds > 0 and p.spread >= 0 for p in points)


def test_a_point_is_the_median_of_its_repeats(engine: ModelEngine) -> None:
    # Three timed runs of 0.2, 0.5 and 0.3 s (begin, end pairs): median 0.3, spread 1.0.
    clock = SteppingClock([0.0, 9.9, 10.0, 10.2, 20.0, 20.5, 30.0, 30.3])
    point = EngineProfiler(engine, SMALL, clock).prefill_point(130, 64)
    assert point == PrefillPoint(130, 64, pytest.approx(0.3), pytest.approx(1.0))  # type: ignore[arg-type]
    clock = SteppingClock([0.0, 0.04, 1.0, 1.01, 2.0, 2.03])
    step = EngineProfiler(engine, SMALL, clock).decode_point(3, 20)
    assert step == DecodePoint(3, 20, pytest.approx(0.03), pytest.approx(1.0))  # type: ignore[arg-type]


def test_the_decode_batch_holds_the_asked_sequences(engine: ModelEngine) -> None:
    batch = EngineProfiler(engine, SMALL)._batch_of(3, 70)
    assert len(batch) == 3
    assert batch.statistics().tokens_in_cache == 3 * 70


def test_the_prefill_job_is_the_workers_plan(engine: ModelEngine) -> None:
    job = EngineProfiler(engine, SMALL)._job(list(range(1, 131)), 64)
    assert job.chunks == [(0, 64), (64, 128), (128, 130)]
    # Every chunk exports its full-attention pieces; the states go in the last.
    assert len(job.plan) == 3 and job.pieces > 3


def test_bad_grids_are_refused(engine: ModelEngine) -> None:
    with pytest.raises(ConfigError, match="lengths"):
        ProfilerConfig(lengths=())
    with pytest.raises(ConfigError, match="chunk_tokens"):
        ProfilerConfig(chunk_tokens=(-64,))
    with pytest.raises(ConfigError, match="repeats"):
        ProfilerConfig(repeats=0)
    with pytest.raises(ConfigError, match="multiple of the block size"):
        EngineProfiler(engine, SMALL).prefill_point(100, 50)
