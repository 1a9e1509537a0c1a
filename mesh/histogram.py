"""A Prometheus histogram by label values, cheap enough for a per-token hot path.

`Histogram(name, doc, labels, buckets)` is owned by the object that observes it; `labels(...)`
gives one series, looked up once and kept by the caller; `series.observe(value, count)` adds
`count` observations of `value` (one bisect and two additions: prometheus_client's own
histogram takes a lock and scans its buckets in turn, per observation). It is a collector:
register it in a service's registry, or merge several owners' (mesh.metrics.MergedCollector).
Observed from one thread, the event loop's, as every owner in the mesh is.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import cast

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from mesh.errors import ConfigError

# How prometheus_client writes a bound (le="0.025", "1.0", "+Inf"); it ships no annotation.
_format_bound = cast(Callable[[float], str], floatToGoString)


class HistogramSeries:
    """The counts of one label set: `counts[i]` of values in (bounds[i-1], bounds[i]], the
    last of those above every bound (+Inf)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (a bucket's bound is inclusive: le)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    """Series of one histogram, by label values (module docstring)."""

    def __init__(self, name: str, doc: str, labels: Sequence[str],
                 buckets: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or list(bounds) != sorted(set(bounds)) or bounds[-1] == float("inf"):
            raise ConfigError(f"histogram {name}: buckets must be finite and increasing, got "
                              f"{list(buckets)!r}")
        self.name, self.doc, self.label_names = name, doc, tuple(labels)
        self.bounds = bounds
        self._series: dict[tuple[str, ...], HistogramSeries] = {}

    def labels(self, *values: str) -> HistogramSeries:
        """The series of these label values (made on first use)."""
        if len(values) != len(self.label_names):
            raise ConfigError(f"histogram {self.name} takes labels {self.label_names}, got "
                              f"{values!r}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = HistogramSeries(self.bounds)
        return series

    def items(self) -> list[tuple[tuple[str, ...], HistogramSeries]]:
        """Every series observed so far, by its label values."""
        return list(self._series.items())

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.label_names))
        les = [*(_format_bound(b) for b in self.bounds), "+Inf"]
        for values, series in self._series.items():
            cumulative = list(accumulate(series.counts))
            family.add_metric(list(values), list(zip(les, cumulative, strict=True)),
                              series.sum)
        yield family

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.doc, labels=list(self.label_names))]
