"""Tests for netem.link_metrics: the LinkCollector reads ProxyStatistics at every scrape."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from netem.link_metrics import LinkCollector
from netem.params import LinkParams
from netem.proxy import LinkProxy, Route
from netem.shaper import Direction, LinkShaper


def test_collector_reads_statistics_per_direction_and_per_link() -> None:
    now = [0.0]
    shaper = LinkShaper(LinkParams(delay_s=0.005), lambda: now[0], random.Random(0))
    proxy = LinkProxy([Route(9001, 9002)], shaper)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LinkCollector(proxy.statistics, "wan"))
    egress = {"link": "wan", "direction": "egress"}
    assert registry.get_sample_value("prfaas_link_bytes_out_total", egress) == 0.0
    shaper.passthrough(shaper.open_flow(Direction.EGRESS), 1234)
    assert registry.get_sample_value("prfaas_link_bytes_out_total", egress) == 1234.0
    ingress = egress | {"direction": "ingress"}
    assert registry.get_sample_value("prfaas_link_bytes_out_total", ingress) == 0.0
    assert registry.get_sample_value("prfaas_link_delay_seconds", {"link": "wan"}) == 0.005
    assert registry.get_sample_value("prfaas_link_up", {"link": "wan"}) == 1.0
    names = {metric.name for metric in registry.collect()}
    assert all(name.startswith("prfaas_link_") for name in names)
    assert len(names) == 8 + 11


def test_rates_are_in_bytes_per_second_as_prometheus_names_its_base_unit() -> None:
    now = [0.0]
    shaper = LinkShaper(LinkParams(bandwidth_bps=200e6), lambda: now[0], random.Random(0))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LinkCollector(LinkProxy([Route(9001, 9002)], shaper).statistics, "wan"))
    assert registry.get_sample_value("prfaas_link_bandwidth_bytes_per_second",
                                     {"link": "wan"}) == 25e6
    names = {metric.name for metric in registry.collect()}
    assert not [name for name in names if "bits" in name]
