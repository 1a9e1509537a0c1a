"""The link's Prometheus metrics: `LinkCollector` turns `ProxyStatistics` into families.

Every family is named `prfaas_link_<name>` and labelled with the link's name; per-direction
families carry `direction` ("egress" or "ingress") too. Values are read at every scrape. Rates
are in bytes per second, Prometheus's base unit (`promtool check metrics` refuses bits): the
link's bandwidth_bps / 8.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from netem.proxy import ProxyStatistics

# DirectionStatistics field -> (metric name after "prfaas_link_", kind, factor): bit rates are
# exposed as byte rates.
_DIRECTION_METRICS = {
    "bytes_in": ("bytes_in", "counter", 1.0),
    "bytes_out": ("bytes_out", "counter", 1.0),
    "bytes_dropped": ("bytes_dropped", "counter", 1.0),
    "queued_bytes": ("queued_bytes", "gauge", 1.0),
    "throughput_bps": ("throughput_bytes_per_second", "gauge", 1 / 8),
    "utilisation": ("utilisation_ratio", "gauge", 1.0),
    "stalls": ("stalls", "counter", 1.0),
    "stall_s": ("stall_seconds", "counter", 1.0),
}


def _link_values(stats: ProxyStatistics) -> list[tuple[str, str, float]]:
    params = stats.link.params
    return [
        ("up", "gauge", float(params.up)),
        ("bandwidth_bytes_per_second", "gauge", (params.bandwidth_bps or 0.0) / 8),
        ("delay_seconds", "gauge", params.delay_s),
        ("jitter_seconds", "gauge", params.jitter_s),
        ("loss_ratio", "gauge", params.loss_rate),
        ("outages", "counter", stats.link.outages),
        ("down_seconds", "counter", stats.link.down_s),
        ("connections_open", "gauge", stats.connections_open),
        ("connections", "counter", stats.connections_total),
        ("upstream_failures", "counter", stats.upstream_failures),
        ("connection_errors", "counter", stats.connection_errors),
    ]


def _family(name: str, kind: str, labels: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    full = f"prfaas_link_{name}"
    doc = f"Link {name.replace('_', ' ')} (netem.proxy.ProxyStatistics)."
    if kind == "counter":
        return CounterMetricFamily(full, doc, labels=labels)
    return GaugeMetricFamily(full, doc, labels=labels)


class LinkCollector(Collector):
    """Prometheus view of `ProxyStatistics`, read at every scrape (nothing cached)."""

    def __init__(self, statistics: Callable[[], ProxyStatistics], link: str) -> None:
        self._statistics = statistics
        self._link = link

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        for field, (name, kind, factor) in _DIRECTION_METRICS.items():
            family = _family(name, kind, ["link", "direction"])
            for direction in ("egress", "ingress"):
                value = getattr(getattr(stats.link, direction), field)
                family.add_metric([self._link, direction], float(value) * factor)
            yield family
        for name, kind, value in _link_values(stats):
            family = _family(name, kind, ["link"])
            family.add_metric([self._link], float(value))
            yield family
