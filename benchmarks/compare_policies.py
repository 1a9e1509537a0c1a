"""Routing policies compared end to end on deployments of equal hardware, as in the paper.

Paper Table 6 compares PrfaaS-PD (4 PrfaaS / 3 PD prefill / 5 PD decode) with a homogeneous
PD cluster (every prefill instance in the PD cluster) and a naive heterogeneous one (every
prefill on PrfaaS, every PD instance decodes). Each policy runs on its deployment of the
default mesh (services/cli/topology.toml), drawn by services/cli/deployment.py: homogeneous
on `homogeneous` (the PrfaaS workers move into the PD cluster as PD prefill workers, keeping
their hardware profile), naive-hetero on `naive` (the PD prefill workers decode), the others
(prfaas-dynamic, prfaas, dynamo) on `prfaas-pd` (the topology as it is). Same workers, same
profiles, only roles and clusters move; the table's first rows state each shape.

Each deployment runs as `prfaas serve` processes on free ports (its generated topology is
written to the log directory), workers in emulated mode as in the Procfile, the router's
`policy` set and, for the router and every cluster, `scale` equal to the bench's (so t is the
paper's threshold in served tokens and workers pace at the paper length); a fresh mesh per
policy, so every run starts with empty caches. `prfaas bench` sends the same seeded
log-normal workload to each. Beside the bench's numbers: the router's GET /admin/state once
a second (t, each worker's queue and role) and each worker's /metrics at the end (prefills,
KV bytes sent, decode steps), which say where the bottleneck is. docs/policies.md reads them.

    .venv/bin/python benchmarks/compare_policies.py [--quick] [--policies a,b] [--log-dir DIR]

It prints one comparison table (ratios against homogeneous, the baseline run first; the
tables are services/bench/comparison.py's), then per worker and per cluster, and ends with
one JSON line {"bench": "policies", "shapes": {policy: "N_prfaas / N_p / N_d"},
"homogeneous": ..., "naive-hetero": ..., "prfaas-dynamic": ...}, keyed by the policies'
names. Logs of every service are kept under the log directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import msgspec

from mesh.allocator import allocator_env
from mesh.errors import MeshError
from mesh.ports import free_ports
from mesh.topology import Topology
from services.bench.cli import bench_main, parse_goodput
from services.bench.comparison import format_clusters, format_comparison, format_workers
from services.bench.report import BenchReport
from services.bench.stats import RequestResult, SLOs, meets_slos
from services.cli.deployment import (
    Shape,
    deploy,
    shape_of,
    topology_text,
    workers,
)
from services.cli.launch import launch
from services.cli.serve import default_topology
from services.contract.errors import DataPathError
from services.paper.case_study import DECODE_STEP_S, deployment_for
from services.service import link_service_of

POLICIES = ("homogeneous", "naive-hetero", "prfaas-dynamic")
BASELINE = "homogeneous"
# The paper's decode SLO (section 4.1): TPOT at most one decode step.
PAPER_SLO = SLOs(tpot_ms=1e3 * DECODE_STEP_S)


def bench_args(args: argparse.Namespace) -> list[str]:
    """The `prfaas bench` options every policy runs with (exactly `max_tokens` out)."""
    return ["--workload", "lognormal", "--num-requests", str(args.num_requests),
            "--request-rate", str(args.request_rate), "--seed", str(args.seed),
            "--scale", args.scale, "--output-len", str(args.output_len),
            "--max-context", str(args.max_context), "--timeout", str(args.timeout),
            "--ignore-eos", "--no-progress"]


@dataclass(frozen=True)
class MeshPorts:
    http: int
    link_control: int
    metrics: dict[str, int]  # worker name -> its /metrics port


@dataclass(frozen=True)
class MeshPlan:
    """One policy's mesh: its deployment's topology on free ports, as text and as parsed."""

    topology: Topology
    text: str
    ports: MeshPorts
    deployment: str

    @property
    def shape(self) -> Shape:
        return shape_of(self.topology)


def _proxy_ports(topology: Topology, link_service: str) -> int:
    """Ports a link service proxies on: one per worker of each cluster of its links."""
    clusters = {end for link in topology.links
                if link_service_of(topology, link).name == link_service
                for end in (link.a, link.b)}
    return max(1, sum(1 for s in workers(topology) if s.cluster in clusters))


def mesh_topology(policy: str, scale: float) -> MeshPlan:
    """`policy`'s deployment (services/cli/deployment.py) of the default topology on a block
    of free ports; the router set to `policy`, router and workers to `scale`."""
    deployment = deployment_for(policy)
    base = deploy(default_topology(), deployment)
    data: dict[str, Any] = msgspec.to_builtins(base)
    services = data["services"]
    wanted = [(s, key) for s in services for key in sorted(s["options"]) if key.endswith("_port")]
    width = {s["name"]: _proxy_ports(base, s["name"]) for s in services if s["kind"] == "link"}
    port = free_ports(1, span=len(services) + len(wanted) + sum(width.values()))[0]
    for service in services:
        service["port"], port = port, port + 1
    for service, key in wanted:
        service["options"][key] = port
        port += width[service["name"]] if key == "proxy_base_port" else 1
    # Emulated workers pace each request at its paper length: served / the cluster's scale.
    for cluster in data["clusters"]:
        cluster["options"]["scale"] = scale
    router = next(s for s in services if s["kind"] == "router")
    router["options"].update(policy=policy, scale=scale)
    topology = msgspec.convert(data, Topology)
    link = next(s for s in services if s["kind"] == "link")
    metrics = {s.name: int(s.options["metrics_port"]) for s in workers(topology)
               if "metrics_port" in s.options}
    ports = MeshPorts(router["options"]["http_port"], link["options"]["control_port"], metrics)
    return MeshPlan(topology, topology_text(topology), ports, deployment)


def worker_roles(topology: Topology) -> dict[str, str]:
    """Per worker: its cluster kind, role and hardware profile, e.g. "pd prefill h200"."""
    return {s.name: f"{topology.cluster_kind(s)} {s.kind} "
                    f"{topology.options_of(s).get('profile', '?')}"
            for s in workers(topology)}


class StatePoller:
    """Samples the router's GET /admin/state once a second in a thread, while running."""

    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url, self.interval_s = url, interval_s
        self.samples: list[dict[str, Any]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.wait(self.interval_s):
                try:
                    self.samples.append(client.get(self.url).raise_for_status().json())
                except (httpx.HTTPError, ValueError):
                    self.errors += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[StatePoller]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        """t first/last/min/max (tokens); per worker the mean and max queue and running and
        the roles the router showed it in, in order (a conversion: decode, draining, prefill)."""
        ts = [s["threshold"] for s in self.samples if isinstance(s.get("threshold"), int | float)]
        per_worker: dict[str, dict[str, list[Any]]] = {}
        for sample in self.samples:
            for w in sample.get("workers", []):
                entry = per_worker.setdefault(w["name"], {"queue": [], "running": [], "roles": []})
                entry["queue"].append(w["queue"])
                entry["running"].append(w["running"])
                if entry["roles"][-1:] != [w["role"]]:
                    entry["roles"].append(w["role"])
        queues = {name: {"queue_mean": _mean(v["queue"]), "queue_max": max(v["queue"]),
                         "running_mean": _mean(v["running"]), "roles": v["roles"]}
                  for name, v in per_worker.items()}
        t = (ts[0], ts[-1], min(ts), max(ts)) if ts else (None,) * 4
        return {**dict(zip(("t_first", "t_last", "t_min", "t_max"), t, strict=True)),
                "state_samples": len(self.samples), "state_errors": self.errors,
                "workers": queues}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def scrape_metrics(port: int) -> dict[str, float]:
    """Every sample of a worker's /metrics, summed over labels per metric name."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).raise_for_status().text
    values: dict[str, float] = {}
    for line in (x for x in text.splitlines() if x and not x.startswith("#")):
        name, _, number = line.rpartition(" ")
        key = name.split("{", 1)[0]
        values[key] = values.get(key, 0.0) + float(number)
    return values


COUNTERS = ("prefill_jobs", "prefill_computed_tokens", "prefill_reused_tokens",
            "prefill_kv_bytes_sent", "decode_steps", "decode_tokens")


def worker_counters(ports: MeshPorts) -> dict[str, dict[str, float]]:
    """Per worker: prefill jobs, computed and reused tokens, KV bytes sent; decode steps."""
    scraped = {name: scrape_metrics(port) for name, port in ports.metrics.items()}
    return {name: {c: m.get(f"prfaas_{c}_total", 0.0) for c in COUNTERS}
            for name, m in scraped.items()}


def _dist(dist: Any, *keys: str) -> dict[str, float | None]:
    return {k: None if dist is None else getattr(dist, k) for k in keys}


def summarise_run(report: BenchReport, slos: SLOs) -> dict[str, Any]:
    """The comparison's numbers of one bench report (times in ms, egress in GB and Gbps)."""
    s = report.summary
    requests = report.requests
    duration = s.duration_s or math.inf

    def goodput(limits: SLOs) -> float:
        return sum(meets_slos(r, limits) for r in requests) / duration

    return {
        "completed": s.completed, "failed": s.failed, "duration_s": s.duration_s,
        **{f"ttft_{k}_ms": v for k, v in _dist(s.ttft, "mean", "p50", "p90", "p99").items()},
        **{f"tpot_{k}_ms": v for k, v in _dist(s.tpot, "mean", "p50", "p90").items()},
        **{f"itl_{k}_ms": v for k, v in _dist(s.itl, "p50", "p90").items()},
        "req_per_s": s.request_throughput, "output_tok_per_s": s.output_throughput,
        "input_tok_per_s": s.input_throughput, "goodput_req_per_s": goodput(slos),
        "goodput_paper_slo_req_per_s": goodput(PAPER_SLO),
        "offload_fraction": s.offload_fraction, "clusters": s.clusters,
        "cached_tokens": s.cached_tokens,
        "egress_gb": None if s.egress_bytes is None else s.egress_bytes / 1e9,
        "egress_gbps": s.egress_gbps,
        "errors": sorted({r.error for r in requests if not r.ok})[:3],
        "by_cluster": by_cluster(requests),
    }


def by_cluster(requests: Sequence[RequestResult]) -> dict[str, dict[str, float]]:
    """Per cluster that prefilled: completed requests, mean prompt tokens, mean TTFT (ms)."""
    groups: dict[str, list[RequestResult]] = {}
    for r in requests:
        if r.ok and r.cluster is not None and r.ttft_s is not None:
            groups.setdefault(r.cluster, []).append(r)
    return {name: {"requests": len(rs), "prompt_tokens_mean": _mean([r.prompt_tokens for r in rs]),
                   "ttft_mean_ms": 1000.0 * _mean([r.ttft_s or 0.0 for r in rs])}
            for name, rs in sorted(groups.items())}


def run_policy(policy: str, args: argparse.Namespace, slos: SLOs,
               log_dir: Path) -> dict[str, Any]:
    """One fresh mesh of `policy`'s deployment, one bench run; the numbers, or {"error": why}.
    Either way with the deployment, its shape and each worker's role and profile."""
    log_dir.mkdir(parents=True, exist_ok=True)
    plan = mesh_topology(policy, float(Fraction(args.scale)))
    shape = plan.shape
    facts = {"deployment": plan.deployment, "shape": shape.text(), "stages": shape.stages(),
             "roles": worker_roles(plan.topology)}
    topology = log_dir / "topology.toml"
    topology.write_text(plan.text, encoding="utf-8")
    spec = plan.topology
    infra = [s.name for s in spec.services if s.kind in ("cachedir", "link")]
    names = [s.name for s in workers(spec)]
    backend = ["--backend", args.backend]
    emulated = ["--mode", "emulated", "--time-scale", str(args.time_scale), *backend]
    try:
        with launch(topology, infra, extra_args=backend, log_dir=log_dir), \
                launch(topology, names, extra_args=emulated, log_dir=log_dir,
                       ready_timeout=args.ready_timeout), \
                launch(topology, ["router"], extra_args=backend, log_dir=log_dir):
            return {**facts, **_bench(policy, bench_args(args), plan.ports, slos, log_dir)}
    except (DataPathError, MeshError, OSError, httpx.HTTPError, msgspec.DecodeError) as exc:
        # A policy that fails is reported in the table and the JSON; the others still run.
        return {**facts, "error": f"{type(exc).__name__}: {exc}"}


def _bench(policy: str, workload: list[str], ports: MeshPorts, slos: SLOs,
           log_dir: Path) -> dict[str, Any]:
    out_dir = log_dir / "bench"
    argv = [*workload, "--url", f"http://127.0.0.1:{ports.http}",
            "--link-url", f"http://127.0.0.1:{ports.link_control}", "--out-dir", str(out_dir)]
    poller = StatePoller(f"http://127.0.0.1:{ports.http}/admin/state")
    with open(log_dir / "bench.out", "w") as sink, contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink), poller.running():
        code = bench_main(argv)
    report = msgspec.json.decode((out_dir / "bench.json").read_bytes(), type=BenchReport)
    result = summarise_run(report, slos)
    # The host is shared: its load average says how much of the 2 cores the mesh really had.
    result.update(policy=policy, bench_exit=code, router=poller.summary(),
                  worker_counters=worker_counters(ports), host_load_1m=os.getloadavg()[0])
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = p.add_argument
    add("--quick", action="store_true", help="8 requests at 1 req/s, 8 output tokens")
    add("--policies", default=",".join(POLICIES), help="comma-separated (default: all three)")
    add("--num-requests", type=int, default=40)
    add("--request-rate", type=float, default=0.8)
    add("--seed", type=int, default=1)
    add("--scale", default="1/64", help="served tokens per paper token (bench and router)")
    add("--output-len", type=int, default=1024, help="output tokens before scaling")
    add("--max-context", type=int, default=2048)
    add("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    add("--goodput", nargs="+", default=["ttft:5000", "tpot:50"], metavar="KEY:MS",
        help="the chosen SLO (default: ttft:5000 tpot:50; docs/policies.md says why)")
    add("--backend", default="asyncio", choices=["asyncio", "uvloop"])
    add("--time-scale", type=float, default=1.0, help="emulated workers' wall s per modeled s")
    add("--ready-timeout", type=float, default=180.0, help="workers' model load (s)")
    add("--log-dir", type=Path, default=None, help="default: a new temporary directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.num_requests, args.request_rate, args.output_len = 8, 1.0, 512
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    slos = parse_goodput(args.goodput)
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="compare-policies-"))
    print(f"prfaas bench {' '.join(bench_args(args))}; chosen SLO {' '.join(args.goodput)}; "
          f"backend {args.backend}; time scale {args.time_scale}; logs {log_root}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for policy in sorted(policies, key=lambda p: p != BASELINE):
        results[policy] = run_policy(policy, args, slos, log_root / policy)
        print(f"{policy}: {'error' if 'error' in results[policy] else 'done'}", flush=True)
    print(format_comparison(results, BASELINE))
    print(format_workers(results))
    print(format_clusters(results))
    shapes = {p: r.get("shape") for p, r in results.items()}
    print(json.dumps({"bench": "policies", "shapes": shapes,
                      **{p: results.get(p) for p in POLICIES}}))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    os.environ.update(allocator_env(os.environ))
    sys.exit(main())
