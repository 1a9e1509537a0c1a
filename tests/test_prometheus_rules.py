"""The alert rules: the shipped file is what the CLI writes and Prometheus's checker accepts
it; `promtool test rules` sees each rule fire on series made to break it, and stay quiet on
healthy ones. (A rule firing against a running mesh: tests/test_prometheus.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from services.cli.prometheus_rules import RULES_FILE, alert_rules, rules_yaml
from tests.test_prometheus import PROMTOOL

SHIPPED = Path(__file__).resolve().parent.parent / "docs" / "prometheus" / RULES_FILE


def test_the_shipped_rules_are_the_generated_ones_and_pass_promtool() -> None:
    assert SHIPPED.read_text(encoding="utf-8") == rules_yaml(alert_rules())
    check = subprocess.run([PROMTOOL, "check", "rules", str(SHIPPED)], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in check.stdout


def test_the_ttft_bound_is_the_one_given() -> None:
    (rule,) = [r for r in alert_rules(2.5) if r.name == "PrfaasTtftP90OverSlo"]
    assert rule.expr.endswith("> 2.5") and "2.5 s" in rule.summary


def _case(series: dict[str, str], eval_min: int, alert: str,
          expected: list[tuple[dict[str, str], str]]) -> dict[str, object]:
    """A promtool test: `series` (selector: values each minute), then `alert`'s firing alerts
    at `eval_min` minutes: their labels (severity added) and summaries."""
    return {"interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{"eval_time": f"{eval_min}m", "alertname": alert, "exp_alerts": [
                {"exp_labels": labels, "exp_annotations": {"summary": summary}}
                for labels, summary in expected]}]}


def _histogram(name: str, labels: str, buckets: dict[str, str]) -> dict[str, str]:
    return {f'{name}_bucket{{{labels}, le="{le}"}}': values for le, values in buckets.items()}


# Each rule, on series that break it beside series that do not (a healthy cluster, worker,
# service, direction), past its `for`.
CASES = [
    _case(_histogram("prfaas_time_to_first_token_seconds", 'cluster="prfaas"',
                     {"5.0": "0x20", "20.0": "0+10x20", "+Inf": "0+10x20"}) |
          _histogram("prfaas_time_to_first_token_seconds", 'cluster="pd"',
                     {"1.0": "0+10x20", "+Inf": "0+10x20"}),
          12, "PrfaasTtftP90OverSlo",
          [({"severity": "warning", "cluster": "prfaas"},
            "P90 TTFT of prefill cluster prfaas is over 10 s: 18.5s")]),
    _case({'prfaas_router_worker_up{worker="pd-decode-0", role="decode"}': "1 1 0x10",
           'prfaas_router_worker_up{worker="pd-decode-1", role="decode"}': "1x12"},
          5, "PrfaasWorkerDown",
          [({"severity": "critical", "worker": "pd-decode-0", "role": "decode"},
            "Worker pd-decode-0 (decode) does not answer the router's status polls")]),
    _case({'up{job="prfaas-decode", service="pd-decode-0"}': "1 0x10",
           'up{job="prfaas-router", service="router"}': "1x10",
           'up{job="other", service="x"}': "0x10"},
          5, "PrfaasServiceDown",
          [({"severity": "critical", "job": "prfaas-decode", "service": "pd-decode-0"},
            "Prometheus cannot scrape pd-decode-0 (prfaas-decode)")]),
    _case({'prfaas_router_migrations_total{reason="decode_lost"}': "0+1x20",
           'prfaas_router_migrations_total{reason="kv_cut"}': "0x20",
           'prfaas_router_requests_total{outcome="admitted"}': "0+10x20",
           'prfaas_router_requests_total{outcome="completed", finish_reason="stop"}': "0+9x20"},
          15, "PrfaasMigrationsRising",
          [({"severity": "warning"}, "10% of requests migrated after their data path broke "
            "(prfaas_router_migrations_total by reason says which part)")]),
    _case({'prfaas_link_up{link="wan"}': "1 0x10", 'prfaas_link_up{link="lan"}': "1x10"},
          5, "PrfaasLinkDown", [({"severity": "critical", "link": "wan"}, "Link wan is down")]),
    _case({'prfaas_link_utilisation_ratio{link="wan", direction="egress"}': "0.95x20",
           'prfaas_link_utilisation_ratio{link="wan", direction="ingress"}': "0.99x20",
           'prfaas_link_utilisation_ratio{link="lan", direction="egress"}': "0.5x20"},
          15, "PrfaasLinkSaturated",
          [({"severity": "warning", "link": "wan", "direction": "egress"},
            "Link wan egress runs at 95% of its capacity")]),
    # 100 fast transfers a minute for 80 minutes, then 10 slow ones a minute; prefix pulls
    # (not compared) slow throughout.
    _case(_histogram("prfaas_kv_transfer_seconds", 'link="wan", kind="full"',
                     {"0.1": "0+100x80 8000x40", "10.0": "0+100x80 8010+10x40",
                      "+Inf": "0+100x80 8010+10x40"}) |
          _histogram("prfaas_kv_transfer_seconds", 'link="wan", kind="prefix"',
                     {"0.1": "0x120", "10.0": "0+100x120", "+Inf": "0+100x120"}),
          100, "PrfaasKvTransferSlower",
          [({"severity": "warning", "link": "wan", "kind": "full"},
            "P90 full KV transfer time on wan is over 2x that of the hour before")]),
]


def test_each_rule_fires_on_the_failure_it_watches_and_not_on_the_healthy(
        tmp_path: Path) -> None:
    tests = tmp_path / "rules-test.yml"
    tests.write_text(json.dumps({"rule_files": [str(SHIPPED)], "evaluation_interval": "1m",
                                 "tests": CASES}), encoding="utf-8")
    check = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert {rule.name for rule in alert_rules()} == {
        case["alert_rule_test"][0]["alertname"] for case in CASES}  # type: ignore[index]
