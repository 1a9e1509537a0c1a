"""The shipped Grafana dashboard (docs/grafana/prfaas-mesh.json) without a Prometheus: the
panels an operator of the mesh looks for are there (migrations, workers up, the link, each
service's process), and every metric its queries read is one docs/observability.md lists, by
its current name. (Each query evaluated on a live Prometheus: tests/test_prometheus.py.)"""

from __future__ import annotations

import json
import re

from services.router.request_metrics import TPOT_ALIAS
from tests.test_observability_docs import documented
from tests.test_prometheus import DASHBOARD

HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def panels() -> dict[str, list[str]]:
    """Each panel's title and its queries."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return {panel["title"]: [target["expr"] for target in panel["targets"]]
            for panel in board["panels"]}


def metrics_read(exprs: list[str]) -> set[str]:
    """The metric families the queries select (a histogram's by its family name)."""
    return {HISTOGRAM_SERIES.sub("", name) for expr in exprs
            for name in re.findall(r"\b((?:prfaas|process)_[a-z_]+)", expr)}


def test_the_dashboard_has_the_operators_panels() -> None:
    read = {title: metrics_read(exprs) for title, exprs in panels().items()}
    wanted = ("prfaas_router_migrations_total", "prfaas_router_worker_up", "prfaas_link_up",
              "prfaas_link_utilisation_ratio", "prfaas_link_queued_bytes",
              "process_resident_memory_bytes", "process_cpu_seconds_total",
              "prfaas_router_requests_total", "prfaas_time_to_first_token_seconds",
              "prfaas_request_time_per_output_token_seconds")
    assert [m for m in wanted if not any(m in names for names in read.values())] == []


def test_every_metric_the_dashboard_reads_is_documented_by_its_current_name() -> None:
    names, _ = documented()
    read = set().union(*(metrics_read(exprs) for exprs in panels().values()))
    assert TPOT_ALIAS not in read
    assert sorted(read - {HISTOGRAM_SERIES.sub("", n) for n in names}) == []
