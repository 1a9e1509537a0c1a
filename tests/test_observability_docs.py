"""docs/observability.md names every metric the services export by name: the router's, the
workers' KV transfers, the link's and the process's families are each in a table of its
"The metrics" section, and each name in those tables is still exported. (The families the
services derive from their `statistics()` structs are named there by prefix;
tests/test_prometheus.py checks the scraped mesh against both.)"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from router_fakes import fake_mesh

from mesh.metrics import register_process
from netem.link_metrics import LinkCollector
from netem.params import LinkParams
from netem.proxy import LinkProxy, Route
from netem.shaper import LinkShaper
from services.router.request_metrics import RequestMetrics
from services.router.scheduler import SchedulerCollector
from services.worker.kv_metrics import KVTransferMetrics

DOCS = Path(__file__).resolve().parent.parent / "docs" / "observability.md"
# Exported where no collector of its own is built: the worker's constant model info
# (services/service.py serve_metrics, prometheus_client's Info).
ELSEWHERE = {"prfaas_model_info"}


def documented() -> tuple[set[str], set[str]]:
    """The metric names in the tables of "The metrics", and the `prefix_*` families named
    in its text."""
    section = DOCS.read_text(encoding="utf-8").split("## The metrics", 1)[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    names = {name for cell in rows for name in re.findall(r"`([a-z_]+)`", cell)}
    prefixes = set(re.findall(r"`(prfaas_[a-z_]+_)\*`", section))
    return names, prefixes


def exposed_name(family: Metric) -> str:
    """The name a scrape shows: a counter's with `_total`."""
    return f"{family.name}_total" if family.type == "counter" else family.name


def names_of(families: Iterable[Metric]) -> set[str]:
    return {exposed_name(family) for family in families}


def process_families() -> set[str]:
    registry = CollectorRegistry(auto_describe=False)
    register_process(registry)
    return names_of(registry.collect())


def link_families() -> set[str]:
    shaper = LinkShaper(LinkParams(), lambda: 0.0, random.Random(0))
    return names_of(LinkCollector(LinkProxy([Route(9001, 9002)], shaper).statistics,
                                  "wan").collect())


@pytest.mark.trio
async def test_every_named_metric_is_in_the_docs_tables_and_every_listed_one_exported(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh("prfaas", {"threshold": 100.0}) as mesh:
        router = names_of(SchedulerCollector(mesh.scheduler).collect())
    exported = (router | names_of(RequestMetrics().collect()) | link_families() |
                names_of(KVTransferMetrics("w").collect()) | process_families())
    names, prefixes = documented()
    assert sorted(exported - names) == []
    assert sorted(names - exported - ELSEWHERE) == []
    assert {"prfaas_node_", "prfaas_decode_", "prfaas_ui_hub_"} <= prefixes
