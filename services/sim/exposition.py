"""A simulated run's metrics as Prometheus text, written beside its report.

The world composes the live services, so the same collectors observe it as on a live mesh:
the router's statistics and request histograms (services/router/scheduler.py and
request_metrics.py), each worker's KV-transfer histograms (services/worker/decode.py) and
statistics, under the same names, types and labels. `world_metrics` reads them at the end of
a run into one exposition (each worker's samples told apart by their `service` label, as on
the live mesh); the report keeps it as `metrics-<run>.prom`, what one scrape of the whole mesh
would have returned after the simulated hour (docs/observability.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from mesh.metrics import MergedCollector, StatisticsCollector, render
from services.router.scheduler import SchedulerCollector

if TYPE_CHECKING:
    from services.sim.world import SimWorld


def world_metrics(world: SimWorld) -> str:
    """The text exposition of every collector the world's services would serve."""
    sources: list[Collector] = [SchedulerCollector(world.scheduler), world.scheduler.metrics]
    for name, worker in world.workers.items():
        sources.append(worker.kv_metrics)
        for prefix, statistics in (("prefill", worker.prefill.statistics),
                                   ("decode", worker.decode.statistics)):
            sources.append(StatisticsCollector(f"prfaas_{prefix}", statistics,
                                               {"service": name}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedCollector(sources))
    return render(registry)


def write_metrics(out: Path, texts: Mapping[str, str]) -> list[Path]:
    """metrics-<run>.prom for each run that has its metrics."""
    paths = []
    for run, text in texts.items():
        if text:
            path = out / f"metrics-{run}.prom"
            path.write_text(text, encoding="utf-8")
            paths.append(path)
    return paths
