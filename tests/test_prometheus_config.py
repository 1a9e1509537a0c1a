"""`prfaas prometheus-config`: one target per /metrics of the topology, a job per service kind,
a file Prometheus's own checker accepts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mesh.topology import parse_topology
from services.cli.main import main
from services.cli.prometheus_config import Target, prometheus_yaml, scrape_targets
from services.cli.prometheus_rules import alert_rules, rules_yaml
from services.cli.serve import default_topology
from tests.test_prometheus import PROMTOOL


def test_every_metrics_endpoint_of_the_default_mesh_is_a_target_of_its_kinds_job() -> None:
    targets, silent = scrape_targets(default_topology())
    assert silent == ["echo"]
    by_service = {t.service: t for t in targets}
    assert by_service["router"] == Target("prfaas-router", "router", "", "127.0.0.1:8000")
    assert by_service["link-0"].address == "127.0.0.1:8474"
    assert by_service["ui"].address == "127.0.0.1:8080"
    assert by_service["cachedir"].address == "127.0.0.1:9101"
    assert by_service["pd-decode-1"] == Target("prfaas-decode", "pd-decode-1", "pd",
                                               "127.0.0.1:9131")
    assert sorted(t.service for t in targets if t.job == "prfaas-prefill") == [
        "pd-prefill-0", "pd-prefill-1", "prfaas-prefill-0"]


def test_the_written_file_passes_promtool(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prometheus.yml"
    assert main(["prometheus-config", "--out", str(out), "--interval", "15s"]) == 0
    text = out.read_text(encoding="utf-8")
    assert "scrape_interval: 15s" in text and "honor_labels: true" in text
    assert text.count("job_name:") == 6
    # The alert rules beside it, loaded by it: promtool checks them with the configuration.
    assert 'rule_files: ["prfaas-alerts.yml"]' in text
    assert (tmp_path / "prfaas-alerts.yml").read_text() == rules_yaml(alert_rules())
    check = subprocess.run([PROMTOOL, "check", "config", str(out)], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 7 rules found" in check.stdout


def test_the_ttft_slo_reaches_the_rules_and_stdout_gets_a_configuration_without_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prometheus.yml"
    assert main(["prometheus-config", "--out", str(out), "--ttft-slo", "2.5"]) == 0
    assert (tmp_path / "prfaas-alerts.yml").read_text() == rules_yaml(alert_rules(2.5))
    capsys.readouterr()
    assert main(["prometheus-config"]) == 0
    alone = tmp_path / "alone.yml"
    alone.write_text(capsys.readouterr().out, encoding="utf-8")
    assert "rule_files" not in alone.read_text()
    check = subprocess.run([PROMTOOL, "check", "config", str(alone)], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_label_value_is_quoted_as_yaml_reads_it() -> None:
    text = prometheus_yaml([Target("prfaas-router", 'a "b"', "", "h:1")], [], "5s", "x")
    assert '{service: "a \\"b\\""}' in text


def test_a_router_bound_to_every_address_is_scraped_at_its_host() -> None:
    topology = parse_topology('[[services]]\nname = "router"\nkind = "router"\nhost = "10.0.0.5"\n'
                              'port = 7100\noptions = { http_host = "0.0.0.0", http_port = 80 }\n')
    assert [t.address for t in scrape_targets(topology)[0]] == ["10.0.0.5:80"]
