"""Where the simulations of a search run: in this process, or as Ray tasks.

Both pools offer the same two calls: `map` (the map-like callable the capacity search takes,
services/sim/capacity.py's `RunMap`, results in order) and `unordered` (jobs as they finish,
at most one per CPU in flight, so "running" means running). `RayPool` starts one Ray
instance for its lifetime: a local one on this machine by default (every core, a small object
store: the jobs return kilobytes), or joins a cluster at `address` (`ray://HOST:PORT`, or any
address `ray.init` takes) and ships the project's packages to it. Ray takes seconds to start
and holds memory while it runs: open one pool per search and close it at the end.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")
Started = Callable[[int], None]
# The object store holds only the jobs' arguments and results (kilobytes each).
OBJECT_STORE_BYTES = 100 * 1024 * 1024


def one_thread() -> None:
    """Set up a fresh job process as Ray sets up its workers: one OpenMP thread (torch reads
    it when first imported, which comes after this: this module imports no torch)."""
    os.environ["OMP_NUM_THREADS"] = "1"


def _ignore(index: int) -> None:
    """The default `started`: nothing to show."""


class SerialPool:
    """Every job one after the other, each in a process of its own that runs nothing else (as
    `RayPool` runs them): the reference Ray is tested against. A job's result must depend on
    its arguments alone, and a simulation run is not the same after other runs in the same
    process, nor on one torch thread and on two (PrfaaS-PD's saturation, seed 1 of
    paper-equal-cost: 2.9507 req/s as a process's second run, 2.9580 as its first)."""

    address = "serial"
    cpus = 1

    def __init__(self) -> None:
        self._executor = ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"),
            initializer=one_thread, max_tasks_per_child=1)

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        return [self._executor.submit(fn, item).result() for item in items]

    def unordered(self, jobs: Sequence[Callable[[], R]],
                  started: Started = _ignore) -> Iterator[tuple[int, R]]:
        for index, job in enumerate(jobs):
            started(index)
            yield index, self._executor.submit(job).result()

    def close(self) -> None:
        self._executor.shutdown(cancel_futures=True)

    def __enter__(self) -> SerialPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _call(job: Callable[[], Any]) -> Any:
    """A Ray task: one job (a simulation or a seed's capacity search)."""
    return job()


class RayPool:
    """Each job a Ray task on a local instance (`address` None) or a Ray cluster."""

    def __init__(self, address: str | None = None, cpus: int | None = None) -> None:
        import ray

        import mesh
        import netem
        import services

        self._ray = ray
        if address:
            # The cluster's workers import the project from what the driver ships.
            ray.init(address=address, logging_level=logging.WARNING,
                     runtime_env={"py_modules": [mesh, netem, services]})
        else:
            # Ray starts its workers at nice 15; on a shared machine they would then get
            # a fraction of the CPU a serial run in this process gets.
            ray.init(address="local", num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES,
                     include_dashboard=False, logging_level=logging.WARNING,
                     _system_config={"worker_niceness": 0})
        self.address = address or "local"
        resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        self.cpus = max(1, int(resources.get("CPU", 1)))
        # A worker process per task (Ray's workers run with OMP_NUM_THREADS=1): see SerialPool.
        self._task = ray.remote(num_cpus=1, max_retries=0, max_calls=1)(_call)

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

    def __enter__(self) -> RayPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
