"""Where the simulations of a search run: in this process, or as Ray tasks.

Both pools offer the same two calls: `map` (the map-like callable the capacity search takes,
services/sim/capacity.py's `RunMap`, results in order) and `unordered` (jobs as they finish,
at most one per CPU in flight, so "running" means running). `RayPool` starts one Ray
instance for its lifetime: a local one on this machine by default (every core, a small object
store: the jobs return kilobytes), or joins a cluster at `address` (`ray://HOST:PORT`, or any
address `ray.init` takes) and ships the project's packages to it. Ray takes seconds to start
and holds memory while it runs: open one pool per search and close it at the end. Both run
their jobs in processes started with JOB_ENV, so a job's result is the same in either.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from types import TracebackType
from typing import Any, Self, TypeVar

T = TypeVar("T")
R = TypeVar("R")
Started = Callable[[int], None]
# The object store holds only the jobs' arguments and results (kilobytes each).
OBJECT_STORE_BYTES = 100 * 1024 * 1024


# Every job process alike: one OpenMP thread (jobs share the CPUs) and one string-hash seed.
# A run's result depends on neither (tests/test_sim.py runs one under two hash seeds); the
# PrfaaS-PD saturation once blamed on the hash seed (3.2181 against 3.2258 req/s) was trio's
# scheduling order at the run's stop (services/sim/clock.py, `settle`).
JOB_ENV = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


class _JobEnv:
    """JOB_ENV in this process's environment while a pool lives, for the processes it starts
    (a spawned process and Ray's workers take the environment they start with)."""

    def __init__(self) -> None:
        self._before = {key: os.environ.get(key) for key in JOB_ENV}
        os.environ.update(JOB_ENV)

    def restore(self) -> None:
        for key, value in self._before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _Pool:
    """What both pools share: JOB_ENV while they live; closed on leaving a `with` block."""

    def __init__(self) -> None:
        self._env = _JobEnv()

    def close(self) -> None:
        self._env.restore()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _ignore(index: int) -> None:
    """The default `started`: nothing to show."""


class SerialPool(_Pool):
    """Every job one after the other in one process started for them, with JOB_ENV as Ray's
    workers have it: the reference Ray is tested against."""

    address = "serial"
    cpus = 1

    def __init__(self) -> None:
        super().__init__()
        self._executor = ProcessPoolExecutor(max_workers=1,
                                             mp_context=multiprocessing.get_context("spawn"))

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        return [self._executor.submit(fn, item).result() for item in items]

    def unordered(self, jobs: Sequence[Callable[[], R]],
                  started: Started = _ignore) -> Iterator[tuple[int, R]]:
        for index, job in enumerate(jobs):
            started(index)
            yield index, self._executor.submit(job).result()

    def close(self) -> None:
        self._executor.shutdown(cancel_futures=True)
        super().close()


def _call(job: Callable[[], Any]) -> Any:
    """A Ray task: one job (a simulation or a seed's capacity search)."""
    return job()


class RayPool(_Pool):
    """Each job a Ray task on a local instance (`address` None) or a Ray cluster."""

    def __init__(self, address: str | None = None, cpus: int | None = None) -> None:
        import ray

        import mesh
        import netem
        import services

        self._ray = ray
        super().__init__()
        if address:
            # The cluster's workers import the project from what the driver ships.
            ray.init(address=address, logging_level=logging.WARNING,
                     runtime_env={"py_modules": [mesh, netem, services], "env_vars": JOB_ENV})
        else:
            # Ray starts its workers at nice 15; on a shared machine they would then get
            # a fraction of the CPU a serial run in this process gets.
            ray.init(address="local", num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES,
                     include_dashboard=False, logging_level=logging.WARNING,
                     _system_config={"worker_niceness": 0})
        self.address = address or "local"
        resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        self.cpus = max(1, int(resources.get("CPU", 1)))
        self._task = ray.remote(num_cpus=1, max_retries=0)(_call)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        refs = [self._task.remote(partial(fn, item)) for item in items]
        results: list[R] = self._ray.get(refs)
        return results

    def unordered(self, jobs: Sequence[Callable[[], R]],
                  started: Started = _ignore) -> Iterator[tuple[int, R]]:
        pending: dict[Any, int] = {}
        queue = iter(enumerate(jobs))
        while True:
            while len(pending) < self.cpus and (nxt := next(queue, None)) is not None:
                index, job = nxt
                pending[self._task.remote(job)] = index
                started(index)
            if not pending:
                return
            [ready], _ = self._ray.wait(list(pending), num_returns=1)
            yield pending.pop(ready), self._ray.get(ready)

    def close(self) -> None:
        self._ray.shutdown()
        super().close()
