"""`prfaas prometheus-config`: a Prometheus configuration that scrapes every service of a
topology (docs/observability.md).

    prfaas prometheus-config                               the default mesh, to stdout
    prfaas prometheus-config --topology FILE --out prometheus.yml --interval 5s --ttft-slo 10

One job per service kind (`prfaas-router`, `prfaas-prefill`, `prfaas-decode`, ...), one target
per `/metrics` a service serves: the router's and the dashboard's on their HTTP port, the
link's on its control port, every other service's on options.metrics_port (a service without
one is named in a comment, not scraped). Each target is labelled with its `service` name and,
in a cluster, its `cluster`. The services label their own samples with `service` too (the
same name) and the router's request histograms with the `cluster` that prefilled, so the
scraped labels are honoured: a target label never renames them to `exported_*`.
With `--out`, the alert rules (services/cli/prometheus_rules.py) are written beside the
configuration as prfaas-alerts.yml, which it loads; to stdout only the configuration goes,
without rules (docs/prometheus/prfaas-alerts.yml is that file with the default TTFT SLO).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from mesh.errors import MeshError
from mesh.topology import ServiceSpec, Topology, load_topology
from services.cli.prometheus_rules import (
    DEFAULT_TTFT_SLO_S,
    RULES_FILE,
    alert_rules,
    rules_yaml,
)
from services.cli.serve import DEFAULT_TOPOLOGY_PATH
from services.router.config import router_config
from services.service import http_dial_host

DEFAULT_INTERVAL = "5s"


class Target(msgspec.Struct, frozen=True):
    """One /metrics endpoint: the job (service kind) it belongs to and how to reach it."""

    job: str
    service: str
    cluster: str
    address: str  # host:port


def _endpoints(spec: ServiceSpec) -> list[str]:
    """host:port of each /metrics the service serves (services/service.py serve_metrics,
    services/router/openai.py, netem/control.py, ui/app.py)."""
    options = spec.options
    found = []
    if spec.kind == "router":
        found.append(f"{http_dial_host(spec)}:{router_config(options).http_port}")
    elif spec.kind == "link":
        found.append(f"{spec.host}:{options.get('control_port', 8474)}")
    elif spec.kind == "ui":
        found.append(f"{http_dial_host(spec)}:{options.get('http_port', 8080)}")
    if options.get("metrics_port"):
        found.append(f"{spec.host}:{options['metrics_port']}")
    return found


def scrape_targets(topology: Topology) -> tuple[list[Target], list[str]]:
    """Every /metrics of `topology`, in file order; the services that serve none."""
    targets, silent = [], []
    for spec in topology.services:
        endpoints = _endpoints(spec)
        if not endpoints:
            silent.append(spec.name)
        targets += [Target(f"prfaas-{spec.kind}", spec.name, spec.cluster, address)
                    for address in endpoints]
    return targets, silent


def prometheus_yaml(targets: list[Target], silent: list[str], interval: str,
                    source: str, rules: str | None = None) -> str:
    """The configuration file (YAML; strings written as JSON strings, which YAML reads),
    loading the rule file `rules` (a path relative to the configuration's folder) if any."""
    q = json.dumps
    lines = [f"# Prometheus scrape configuration of the PrfaaS mesh in {source},",
             "# written by `prfaas prometheus-config` (docs/observability.md).",
             *(f"# {name}: no /metrics to scrape" for name in silent),
             "global:", f"  scrape_interval: {interval}", f"  evaluation_interval: {interval}",
             *([f"rule_files: [{q(rules)}]"] if rules else
               ["# No alert rules: `prfaas prometheus-config --out FILE` writes them too."]),
             "scrape_configs:"]
    for job in dict.fromkeys(t.job for t in targets):
        lines += [f"  - job_name: {q(job)}", "    honor_labels: true",
                  "    metrics_path: /metrics", "    static_configs:"]
        for target in (t for t in targets if t.job == job):
            labels = {"service": target.service} | (
                {"cluster": target.cluster} if target.cluster else {})
            lines += [f"      - targets: [{q(target.address)}]",
                      "        labels: {" + ", ".join(f"{k}: {q(v)}" for k, v in labels.items())
                      + "}"]
    return "\n".join(lines) + "\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prfaas prometheus-config",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, help="topology TOML (default: embedded)")
    parser.add_argument("--out", type=Path, help="write here (default: stdout)")
    parser.add_argument("--interval", default=DEFAULT_INTERVAL,
                        help="scrape and evaluation interval, a Prometheus duration "
                             f"(default {DEFAULT_INTERVAL})")
    parser.add_argument("--ttft-slo", type=float, default=DEFAULT_TTFT_SLO_S,
                        help="seconds: the P90 TTFT alert's bound (default "
                             f"{DEFAULT_TTFT_SLO_S:g})")
    return parser.parse_args(argv)


def prometheus_config_main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        text = DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8")
        topology = load_topology(args.topology, text)
    except (MeshError, OSError) as exc:
        print(f"prfaas prometheus-config: {exc}", file=sys.stderr)
        return 2
    source = str(args.topology) if args.topology else "the default topology"
    targets, silent = scrape_targets(topology)
    if args.out is None:
        sys.stdout.write(prometheus_yaml(targets, silent, args.interval, source))
    else:
        rules = args.out.parent / RULES_FILE
        config = prometheus_yaml(targets, silent, args.interval, source, RULES_FILE)
        args.out.write_text(config, encoding="utf-8")
        rules.write_text(rules_yaml(alert_rules(args.ttft_slo)), encoding="utf-8")
        print(f"wrote {args.out} and {rules}", file=sys.stderr)
    return 0
