"""The mesh's Prometheus alert rules (docs/observability.md), written beside the scrape
configuration by `prfaas prometheus-config` and shipped as docs/prometheus/prfaas-alerts.yml.

Each rule watches one failure an operator acts on: the P90 TTFT of a prefill cluster over
the SLO, a worker or a scraped service down, requests migrating (their data path broke), a
link down or its egress saturated, KV transfers slower than they were. The thresholds are
stated here once; the TTFT SLO is a parameter (`--ttft-slo`), as the paper states none.
"""

from __future__ import annotations

import json

import msgspec

RULES_FILE = "prfaas-alerts.yml"
# The TTFT bound of the P90 alert when none is given: the paper states no TTFT SLO; 10 s is
# the bound the simulation's reports count attainment against.
DEFAULT_TTFT_SLO_S = 10.0
# A link busier than this share of its capacity, for `for`, is saturated: the offload policy
# is meant to keep PrfaaS egress well below it (the paper's mean is about 13%).
LINK_SATURATED_RATIO = 0.9
# Migrations per admitted request over 10 minutes past which the data path is unhealthy.
MIGRATION_SHARE = 0.01
# KV transfers are slower than they were when their P90 over 10 minutes is this many times the
# P90 of the hour before.
KV_TRANSFER_SLOWDOWN = 2.0


class AlertRule(msgspec.Struct, frozen=True):
    """One alerting rule: pending while `expr` has results, firing once they last `hold`."""

    name: str
    expr: str
    hold: str  # Prometheus's `for`
    severity: str
    summary: str


def alert_rules(ttft_slo_s: float = DEFAULT_TTFT_SLO_S) -> list[AlertRule]:
    """The rules, with the P90 TTFT bound `ttft_slo_s`."""
    ttft = ("histogram_quantile(0.9, sum by (le, cluster) "
            "(rate(prfaas_time_to_first_token_seconds_bucket[5m])))")
    kv_p90 = ("histogram_quantile(0.9, sum by (le, link, kind) "
              "(rate(prfaas_kv_transfer_seconds_bucket{{kind!=\"prefix\"}}[{window}]{offset})))")
    return [
        AlertRule("PrfaasTtftP90OverSlo", f"{ttft} > {ttft_slo_s:g}", "5m", "warning",
                  f"P90 TTFT of prefill cluster {{{{ $labels.cluster }}}} is over "
                  f"{ttft_slo_s:g} s: {{{{ $value | humanizeDuration }}}}"),
        AlertRule("PrfaasWorkerDown", "prfaas_router_worker_up == 0", "1m", "critical",
                  "Worker {{ $labels.worker }} ({{ $labels.role }}) does not answer the "
                  "router's status polls"),
        AlertRule("PrfaasServiceDown", 'up{job=~"prfaas-.+"} == 0', "1m", "critical",
                  "Prometheus cannot scrape {{ $labels.service }} ({{ $labels.job }})"),
        AlertRule("PrfaasMigrationsRising",
                  "sum(rate(prfaas_router_migrations_total[10m])) / "
                  'sum(rate(prfaas_router_requests_total{outcome="admitted"}[10m])) > '
                  f"{MIGRATION_SHARE:g}", "5m", "warning",
                  "{{ $value | humanizePercentage }} of requests migrated after their data "
                  "path broke (prfaas_router_migrations_total by reason says which part)"),
        AlertRule("PrfaasLinkDown", "prfaas_link_up == 0", "1m", "critical",
                  "Link {{ $labels.link }} is down"),
        AlertRule("PrfaasLinkSaturated",
                  'avg_over_time(prfaas_link_utilisation_ratio{direction="egress"}[5m]) > '
                  f"{LINK_SATURATED_RATIO:g}", "5m", "warning",
                  "Link {{ $labels.link }} egress runs at {{ $value | humanizePercentage }} "
                  "of its capacity"),
        AlertRule("PrfaasKvTransferSlower",
                  kv_p90.format(window="10m", offset="") + f" > {KV_TRANSFER_SLOWDOWN:g} * " +
                  kv_p90.format(window="1h", offset=" offset 10m"), "10m", "warning",
                  "P90 {{ $labels.kind }} KV transfer time on {{ $labels.link }} is over "
                  f"{KV_TRANSFER_SLOWDOWN:g}x that of the hour before"),
    ]


def rules_yaml(rules: list[AlertRule]) -> str:
    """The rules file (YAML; strings written as JSON strings, which YAML reads)."""
    q = json.dumps
    lines = ["# Alert rules of the PrfaaS mesh, written by `prfaas prometheus-config`",
             "# (services/cli/prometheus_rules.py, docs/observability.md).",
             "groups:", "  - name: prfaas", "    rules:"]
    for rule in rules:
        lines += [f"      - alert: {rule.name}", f"        expr: {q(rule.expr)}",
                  f"        for: {rule.hold}", f"        labels: {{severity: {rule.severity}}}",
                  f"        annotations: {{summary: {q(rule.summary)}}}"]
    return "\n".join(lines) + "\n"
