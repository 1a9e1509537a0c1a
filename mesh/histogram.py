"""A Prometheus histogram by label values, cheap enough for a per-token hot path.

`Histogram(name, doc, labels, buckets)` is owned by the object that observes it; `labels(...)`
gives one series, looked up once and kept by the caller; `series.observe(value, count)` adds
`count` observations of `value` (one bisect and two additions: prometheus_client's own
histogram takes a lock and scans its buckets in turn, per observation). It is a collector:
register it in a service's registry, or merge several owners' (mesh.metrics.MergedCollector).
`exposition()` writes its text directly, for a hot /metrics (the router's, scraped under load),
not through prometheus_client's writer, which formats every sample anew
(docs/engineering-notes.md 3d); tests hold it equal to the registry's text. Observed from one
thread, the event loop's, as every owner in the mesh is.
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


def _escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class HistogramSeries:
    """The counts of one label set: `counts[i]` of values in (bounds[i-1], bounds[i]], the
    last of those above every bound (+Inf)."""

    __slots__ = ("_lines", "bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...], lines: tuple[str, ...] = ()) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        # Each exposition line up to its value: every bucket's, then _count's and _sum's.
        self._lines = lines

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (a bucket's bound is inclusive: le)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def exposition(self) -> str:
        cumulative = list(accumulate(self.counts))
        values = [*cumulative, cumulative[-1], self.sum]
        return "".join(f"{line}{value}\n" for line, value in zip(self._lines, values,
                                                                 strict=True))


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
            series = self._series[values] = HistogramSeries(self.bounds, self._lines(values))
        return series

    def _lines(self, values: tuple[str, ...]) -> tuple[str, ...]:
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(self.label_names, values,
                                                                  strict=True))
        own = f"{{{labels}}}" if labels else ""
        sep = "," if labels else ""
        les = [*(_format_bound(b) for b in self.bounds), "+Inf"]
        return (*(f'{self.name}_bucket{{{labels}{sep}le="{le}"}} ' for le in les),
                f"{self.name}_count{own} ", f"{self.name}_sum{own} ")

    def exposition(self) -> str:
        """The text format of every series (what a registry holding only this writes)."""
        doc = self.doc.replace("\\", "\\\\").replace("\n", "\\n")
        head = f"# HELP {self.name} {doc}\n# TYPE {self.name} histogram\n"
        return head + "".join(series.exposition() for series in self._series.values())

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
