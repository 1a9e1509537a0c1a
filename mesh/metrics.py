"""Prometheus exposure of `statistics()` structs: `/metrics` on every service.

`register_statistics(registry, "prfaas_node", node.statistics)` adds a collector that, at each
scrape, calls the source and turns every numeric field of the struct into a metric:

* a field named in the struct's `counters` ClassVar becomes a counter (`..._total`), any other
  number (or bool) a gauge;
* a nested struct adds its field name to the metric name (`prefix_mailbox_depth`);
* a sequence of structs becomes labelled samples of one metric, each element labelled by its
  string fields (`prefix_connections_bytes_in{peer="decode-0"}`);
* string fields of the top struct become labels of all its samples (e.g. `name`).

`register_process(registry)` adds the process's own metrics, as prometheus_client's default
registry has them: CPU seconds, resident and virtual memory, open and maximum file descriptors,
start time (`process_*`, read from /proc at each scrape), the garbage collector's counts
(`python_gc_*`) and `python_info`; a service's registry is its own, not the default one, so each
service registers them where it builds its registry.

`metrics_app(registry)` is the ASGI app to mount at `/metrics` (Starlette `Mount`, or served
alone); `render(registry)` gives the text exposition for tests and plain handlers.
`MergedCollector` exposes several owners' families of one name as one family (one process
holding what several services observe, as the simulation does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    make_asgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mesh.errors import ConfigError

Labels = tuple[tuple[str, str], ...]


@dataclass
class _Family:
    counter: bool
    doc: str
    samples: list[tuple[Labels, float]] = field(default_factory=list)


def _string_labels(struct: msgspec.Struct) -> Labels:
    fields = msgspec.structs.asdict(struct)
    return tuple((k, v) for k, v in fields.items() if isinstance(v, str))


def flatten(
    struct: msgspec.Struct, prefix: str, labels: Labels = ()
) -> Iterator[tuple[str, bool, str, Labels, float]]:
    """(metric name, is counter, doc, labels, value) for every number in `struct`."""
    counters: frozenset[str] = getattr(type(struct), "counters", frozenset())
    for name, value in msgspec.structs.asdict(struct).items():
        metric = f"{prefix}_{name}"
        doc = f"{type(struct).__name__}.{name}"
        if isinstance(value, bool | int | float):
            yield metric, name in counters, doc, labels, float(value)
        elif isinstance(value, msgspec.Struct):
            yield from flatten(value, metric, labels)
        elif isinstance(value, tuple | list):
            for element in value:
                if isinstance(element, msgspec.Struct):
                    yield from flatten(element, metric, labels + _string_labels(element))


class StatisticsCollector:
    """A prometheus collector reading one statistics source at each scrape."""

    def __init__(
        self,
        prefix: str,
        source: Callable[[], msgspec.Struct],
        labels: Mapping[str, str] | None = None,
    ) -> None:
        if not prefix.isidentifier():
            raise ConfigError(f"prefix must be a metric-name identifier, got {prefix!r}")
        self.prefix = prefix
        self.source = source
        self.labels: Labels = tuple((labels or {}).items())

    def collect(self) -> Iterator[Metric]:
        struct = self.source()
        families: dict[str, _Family] = {}
        for name, counter, doc, labels, value in flatten(
            struct, self.prefix, self.labels + _string_labels(struct)
        ):
            family = families.setdefault(name, _Family(counter, doc))
            family.samples.append((labels, value))
        for name, family in families.items():
            yield _build(name, family)

    def describe(self) -> list[Metric]:
        # Metric names depend on the data (sequences may be empty): skip registry checks.
        return []


def _build(name: str, family: _Family) -> Metric:
    label_names = [k for k, _ in family.samples[0][0]]
    metric: CounterMetricFamily | GaugeMetricFamily
    if family.counter:
        metric = CounterMetricFamily(name, family.doc, labels=label_names)
    else:
        metric = GaugeMetricFamily(name, family.doc, labels=label_names)
    for labels, value in family.samples:
        metric.add_metric([v for _, v in labels], value)
    return metric


def register_statistics(
    registry: CollectorRegistry,
    prefix: str,
    source: Callable[[], msgspec.Struct],
    labels: Mapping[str, str] | None = None,
) -> StatisticsCollector:
    """Exposes `source()` (e.g. `node.statistics`) on `registry` under `prefix`."""
    collector = StatisticsCollector(prefix, source, labels)
    registry.register(collector)
    return collector


def register_process(registry: CollectorRegistry) -> None:
    """Adds the process's CPU, memory, file descriptors, GC counts and Python version to
    `registry` (module docstring)."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)


class MergedCollector:
    """The families of several collectors, one per name: samples of equal names are joined
    (the owners must tell theirs apart by a label, else the exposition repeats a series)."""

    def __init__(self, sources: Iterable[Collector]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for source in self.sources:
            for family in source.collect():
                first = merged.get(family.name)
                merged[family.name] = family if first is None else _joined(first, family)
        yield from merged.values()

    def describe(self) -> list[Metric]:
        # The names depend on the sources' data: skip the registry's duplicate checks.
        return []


def _joined(first: Metric, second: Metric) -> Metric:
    """A new family with both families' samples (the sources' own are left as they were)."""
    joined = Metric(first.name, first.documentation, first.type, first.unit)
    joined.samples = [*first.samples, *second.samples]
    return joined


def metrics_app(registry: CollectorRegistry) -> Any:
    """The ASGI app serving `registry` in Prometheus text format (mount it at /metrics)."""
    return with_lifespan(make_asgi_app(registry=registry))


def with_lifespan(app: Any) -> Any:
    """`app`, answering the ASGI lifespan protocol itself (it has nothing to start or stop).

    prometheus_client's app fails lifespan scopes, and hypercorn then warns on every start
    ("ASGI Framework Lifespan error, continuing without Lifespan support")."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    return wrapped


def render(registry: CollectorRegistry) -> str:
    """The text exposition of `registry`, as a scrape would see it."""
    return generate_latest(registry).decode("utf-8")
