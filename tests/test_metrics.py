"""Metrics: statistics structs become Prometheus families, served by an ASGI app."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from mesh.errors import ConfigError
from mesh.events import EventBus
from mesh.histogram import Histogram
from mesh.metrics import (
    MergedCollector,
    flatten,
    metrics_app,
    register_process,
    register_statistics,
    render,
)


class Link(msgspec.Struct, frozen=True):
    peer: str
    bytes_in: int


class Queue(msgspec.Struct, frozen=True):
    depth: int


class Stats(msgspec.Struct, frozen=True):
    counters: ClassVar[frozenset[str]] = frozenset({"sent"})

    name: str
    sent: int
    busy: bool
    load: float
    queue: Queue
    links: tuple[Link, ...]
    notes: dict[str, int] = {}


STATS = Stats("node-a", 12, True, 0.25, Queue(3), (Link("b", 100), Link("c", 7)))


def test_flatten_names_kinds_and_labels() -> None:
    rows = {(name, labels): (counter, value)
            for name, counter, _, labels, value in flatten(STATS, "x")}
    assert rows == {
        ("x_sent", ()): (True, 12.0),
        ("x_busy", ()): (False, 1.0),
        ("x_load", ()): (False, 0.25),
        ("x_queue_depth", ()): (False, 3.0),
        ("x_links_bytes_in", (("peer", "b"),)): (False, 100.0),
        ("x_links_bytes_in", (("peer", "c"),)): (False, 7.0),
    }


def test_registry_text_reflects_the_source_at_each_scrape() -> None:
    registry = CollectorRegistry()
    current = [STATS]
    register_statistics(registry, "mesh_node", lambda: current[0], {"service": "svc"})
    text = render(registry)
    assert "# TYPE mesh_node_sent_total counter" in text
    assert 'mesh_node_sent_total{name="node-a",service="svc"} 12.0' in text
    assert 'mesh_node_links_bytes_in{name="node-a",peer="c",service="svc"} 7.0' in text
    current[0] = msgspec.structs.replace(STATS, sent=13)
    assert 'mesh_node_sent_total{name="node-a",service="svc"} 13.0' in render(registry)


def test_event_bus_statistics_register_as_counters() -> None:
    registry = CollectorRegistry()
    bus: EventBus[int] = EventBus()
    register_statistics(registry, "bus", bus.statistics)
    bus.subscribe(maxlen=1)
    bus.publish(1)
    bus.publish(2)
    assert "bus_dropped_total 1.0" in render(registry)
    assert "bus_subscribers 1.0" in render(registry)


def test_bad_prefix_is_refused() -> None:
    with pytest.raises(ConfigError, match="'mesh-node'"):
        register_statistics(CollectorRegistry(), "mesh-node", lambda: STATS)


@pytest.mark.trio
async def test_asgi_app_serves_metrics() -> None:
    registry = CollectorRegistry()
    register_statistics(registry, "mesh_node", lambda: STATS)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/metrics", "query_string": b"",
             "headers": [(b"accept", b"text/plain")]}
    await metrics_app(registry)(scope, receive, send)
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert 'mesh_node_queue_depth{name="node-a"} 3.0' in body


def test_the_process_metrics_read_this_process_in_each_registry_that_asks() -> None:
    first, second = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    register_process(first)
    register_process(second)
    rss = first.get_sample_value("process_resident_memory_bytes")
    assert rss is not None and rss > 1e6
    assert (first.get_sample_value("process_open_fds") or 0) >= 3
    assert first.get_sample_value("process_cpu_seconds_total") is not None
    assert first.get_sample_value("python_gc_collections_total", {"generation": "0"}) is not None
    assert second.get_sample_value("process_max_fds") == first.get_sample_value(
        "process_max_fds")
    assert "python_info{" in render(second)


def test_merged_collector_joins_families_of_one_name_and_leaves_the_sources_alone() -> None:
    a, b = Histogram("demo_seconds", "demo", ["service"], [1.0]), \
        Histogram("demo_seconds", "demo", ["service"], [1.0])
    a.labels("w0").observe(0.5)
    b.labels("w1").observe(2.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedCollector([a, b]))
    text = render(registry)
    assert text.count("# TYPE demo_seconds histogram") == 1
    assert 'demo_seconds_bucket{le="1.0",service="w0"} 1.0' in text
    assert 'demo_seconds_bucket{le="1.0",service="w1"} 0.0' in text
    assert [len(family.samples) for family in a.collect()] == [4]
