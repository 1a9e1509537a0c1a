"""A simulated run's metrics (services/sim/exposition.py): the live collectors observe the
simulation, so every request and KV-transfer histogram is populated under its live name, the
file passes `promtool check metrics`, and the report folder keeps it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.sim import report
from services.sim.run import run_virtual
from services.sim.workload import lognormal
from services.sim.world import Deployment
from tests.test_prometheus import HISTOGRAMS, PROMTOOL

pytestmark = pytest.mark.slow

SMALL = Deployment(name="small", n_prfaas=1, n_pd_prefill=1, n_decode=2,
                   policy_options={"threshold": 19400 / 8, "prefix_rule": "scarce"})


def test_a_simulated_run_exposes_every_histogram_under_its_live_name(tmp_path: Path) -> None:
    result, _ = run_virtual(SMALL, lognormal(0.5, 60, SMALL.scale, seed=5))
    done = [r for r in result.records if r.ok]
    families = {f.name: f for f in text_string_to_metric_families(result.metrics)}
    counts = {name: sum(s.value for s in families[name].samples if s.name == f"{name}_count")
              for name in HISTOGRAMS}
    assert counts["prfaas_request_duration_seconds"] == len(done) > 10
    assert counts["prfaas_time_to_first_token_seconds"] == len(done)
    assert all(count > 0 for count in counts.values()), counts
    # One KV transfer per request, each observed by the decode worker that imported it.
    transfers = families["prfaas_kv_transfer_seconds"].samples
    assert sum(s.value for s in transfers if s.name.endswith("_count")) == len(done)
    assert {s.labels["service"] for s in transfers} <= {"pd-decode-0", "pd-decode-1"}
    assert {s.labels["link"] for s in transfers} == {"link-0", "local"}
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=result.metrics,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    report.write_records(tmp_path, {"prfaas": result})
    assert (tmp_path / "metrics-prfaas.prom").read_text(encoding="utf-8") == result.metrics
