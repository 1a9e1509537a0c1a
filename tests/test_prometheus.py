"""A real Prometheus (Debian's `prometheus` package, `make test` installs it) scraping a running
default mesh through the configuration `prfaas prometheus-config` writes.

The default topology (services/cli/topology.toml) with every port moved to a free one and one
torch thread per worker, its services as `prfaas serve` children on 127.0.0.1 (live mode);
Prometheus scrapes every second while the bench client (services/bench) streams a workload.
Then: `histogram_quantile(0.9, ...)` over the router's TTFT histogram agrees with the P90 the
bench client measured within the bucket resolution (the router's clock starts after the HTTP
request is parsed, the client's before it is sent: a few milliseconds apart); every request
and KV-transfer histogram has observations; `promtool check metrics` passes on every service's
/metrics, each with the process's own metrics, and every family scraped is named in
docs/observability.md (by name, or a statistics struct's by prefix). Then a decode worker is
killed, and the alert rules the configuration loads (services/cli/prometheus_rules.py) have
its worker-down and service-down alerts pending within seconds (their `for` is a minute: not
waited for). A machine without the binaries fails the test rather than skipping it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import tomllib
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.topology import load_topology, topology_toml
from services.bench.cli import bench_main
from services.cli.launch import launch
from services.cli.prometheus_config import prometheus_config_main, scrape_targets
from services.cli.serve import DEFAULT_TOPOLOGY_PATH
from services.service import SECONDS_BUCKETS
from tests.ports import distinct_ports, free_ports
from tests.test_observability_docs import documented, exposed_name

pytestmark = pytest.mark.slow

PORT_OPTIONS = ("http_port", "metrics_port", "control_port")
HISTOGRAMS = ("prfaas_time_to_first_token_seconds", "prfaas_inter_token_latency_seconds",
              "prfaas_request_duration_seconds", "prfaas_request_queue_seconds",
              "prfaas_request_time_per_output_token_seconds", "prfaas_request_prompt_tokens",
              "prfaas_request_generation_tokens", "prfaas_kv_transfer_seconds",
              "prfaas_kv_transfer_bytes")
REQUESTS = 40
KILLED = "pd-decode-1"  # the worker the test kills to see its alerts
DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "prfaas-mesh.json"


def default_mesh(path: Path) -> list[str]:
    """Writes the default topology with free ports to `path`; the services to start."""
    data = tomllib.loads(DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8"))
    data["services"] = [s for s in data["services"] if s["kind"] != "echo"]
    for service in data["services"]:
        options = service.setdefault("options", {})
        # A link proxies a port per worker each way: its base gets a span of free ports.
        service["port"], options["proxy_base_port"] = free_ports(2) if service["kind"] == \
            "link" else (distinct_ports(1)[0], None)
        if options["proxy_base_port"] is None:
            del options["proxy_base_port"]
        for key in PORT_OPTIONS:
            if key in options:
                options[key] = distinct_ports(1)[0]
    for cluster in data["clusters"]:
        cluster["options"]["threads"] = 1
    path.write_text(topology_toml(data), encoding="utf-8")
    order = ("cachedir", "link", "prefill", "decode", "router", "ui")
    return [s["name"] for kind in order for s in data["services"] if s["kind"] == kind]


class Prometheus:
    """A Prometheus server on 127.0.0.1 and its HTTP query API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, promql: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql},
                             timeout=10.0)
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()["data"]["result"]
        return result

    def value(self, promql: str) -> float | None:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, promql: str, wanted: float, timeout_s: float) -> float | None:
        """The query's value once it reaches `wanted`, or the last value after timeout_s."""
        deadline = time.monotonic() + timeout_s
        value = self.value(promql)
        while (value is None or value < wanted) and time.monotonic() < deadline:
            time.sleep(0.5)
            value = self.value(promql)
        return value


@contextmanager
def prometheus_server(config: Path, root: Path) -> Iterator[Prometheus]:
    """`prometheus` with `config`, its data under `root`, until the block ends."""
    port = distinct_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    with (root / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30.0
        while not _answers(f"{url}/-/ready"):
            assert process.poll() is None, (root / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not get ready in 30 s"
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        process.terminate()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def bench(url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The bench client's summary of a short streamed workload against `url`."""
    code = bench_main(["--url", url, "--num-requests", str(REQUESTS), "--request-rate", "4",
                       "--scale", "1/64", "--output-len", "512", "--max-context", "1024",
                       "--no-files", "--no-progress", "--json", "--timeout", "60"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return summary


def dashboard_queries() -> list[str]:
    """The PromQL of every panel of the shipped Grafana dashboard."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def bucket_of(value: float) -> tuple[float, float]:
    """The (lower, upper] bounds of the TTFT bucket holding `value`."""
    i = bisect_left(SECONDS_BUCKETS, value)
    return (SECONDS_BUCKETS[i - 1] if i else 0.0), SECONDS_BUCKETS[i]


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)


PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


# 30-50 s alone on 2 vCPUs; a loaded host stretches the workload's TTFTs past the default 120 s.
@pytest.mark.timeout(300)
def test_prometheus_scrapes_the_mesh_and_its_ttft_p90_matches_the_bench_client(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topology = tmp_path / "topology.toml"
    names = default_mesh(topology)
    config = tmp_path / "prometheus.yml"
    assert prometheus_config_main(["--topology", str(topology), "--out", str(config),
                                   "--interval", "1s"]) == 0
    spec = tomllib.loads(topology.read_text())
    router = next(s for s in spec["services"] if s["kind"] == "router")
    url = f"http://127.0.0.1:{router['options']['http_port']}"
    with (launch(topology, names, log_dir=tmp_path) as children,
          prometheus_server(config, tmp_path) as prom):
        summary = bench(url, capsys)
        completed = summary["completed"]
        # On a loaded host a request may fail its data path (its error is the bench's to
        # report); the P90s compare the rest.
        assert completed >= REQUESTS * 3 // 4, summary
        # The router counts a first token of a request that failed after it too.
        count = "sum(prfaas_time_to_first_token_seconds_count)"
        assert (prom.wait_for(count, completed, timeout_s=20.0) or 0) >= completed
        p90 = prom.value("histogram_quantile(0.9, sum by (le) "
                         "(prfaas_time_to_first_token_seconds_bucket))")
        populated = {name: prom.value(f"sum({name}_count)") for name in HISTOGRAMS}
        texts = {t.service: httpx.get(f"http://{t.address}/metrics", timeout=10.0).text
                 for t in scrape_targets(load_topology(topology, ""))[0]}
        up = prom.query("up")
        # Every query of the shipped dashboard (docs/observability.md's too) is valid PromQL
        # on this server; over the last 30 s of scrapes each has an answer.
        panels = {expr: prom.query(expr.replace("$__rate_interval", "30s"))
                  for expr in dashboard_queries()}
        children[KILLED].kill()
        children[KILLED].wait(timeout=30)
        down = {name: f'ALERTS{{alertname="{name}",{label}="{KILLED}"}}' for name, label in
                (("PrfaasWorkerDown", "worker"), ("PrfaasServiceDown", "service"))}
        for query in down.values():
            prom.wait_for(f"count({query})", 1, timeout_s=30.0)
        alerts = {name: prom.query(query) for name, query in down.items()}
    client_p90 = summary["ttft"]["p90"] / 1000
    low, high = bucket_of(client_p90)
    assert p90 is not None and abs(p90 - client_p90) <= high - low, (p90, client_p90)
    assert all(count and count > 0 for count in populated.values()), populated
    assert {r["metric"]["service"] for r in up if r["value"][1] == "1"} == set(names)
    assert set(texts) == set(names)
    checks = {service: promtool_check(text) for service, text in texts.items()}
    assert {s: c.stdout + c.stderr for s, c in checks.items() if c.returncode} == {}
    assert [expr for expr, result in panels.items() if not result] == []
    assert [s for s, text in texts.items() if "\nprocess_resident_memory_bytes " not in text
            or "\nprocess_open_fds " not in text] == []
    names, prefixes = documented()
    scraped = {exposed_name(family) for text in texts.values()
               for family in text_string_to_metric_families(text)}
    assert sorted(n for n in scraped - names if not n.startswith(tuple(prefixes))) == []
    states = {name: [r["metric"]["alertstate"] for r in found] for name, found in alerts.items()}
    assert states == {"PrfaasWorkerDown": ["pending"], "PrfaasServiceDown": ["pending"]}
    print(json.dumps({"ttft_p90_promql_s": p90, "ttft_p90_bench_s": client_p90,
                      "bucket": [low, high], "requests": completed}))

