"""Tables of a policy comparison (benchmarks/compare_policies.py): one per metric, per worker
and per prefill cluster, from each run's summary (plain dicts, as its JSON line carries them).

Each run's dict holds the bench's numbers (`summarise_run`'s keys), its deployment and shape
("deployment", "shape", "stages"), each worker's role ("roles"), the router's sampled state
("router") and each worker's counters ("worker_counters"); a run that failed holds "error".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


ROWS: tuple[tuple[str, str, int, bool], ...] = (
    # (label, key, digits, ratio against the baseline)
    ("deployment", "deployment", 0, False),
    ("shape N_prfaas / N_p / N_d", "shape", 0, False),
    ("  PrfaaS prefill workers", "stages.prfaas", 0, False),
    ("  PD prefill workers", "stages.pd_prefill", 0, False),
    ("  PD decode workers", "stages.pd_decode", 0, False),
    ("completed / failed", "", 0, False),
    ("TTFT mean (ms)", "ttft_mean_ms", 0, True), ("TTFT p50 (ms)", "ttft_p50_ms", 0, True),
    ("TTFT p90 (ms)", "ttft_p90_ms", 0, True), ("TTFT p99 (ms)", "ttft_p99_ms", 0, True),
    ("TPOT mean (ms)", "tpot_mean_ms", 1, True), ("TPOT p90 (ms)", "tpot_p90_ms", 1, True),
    ("ITL p50 (ms)", "itl_p50_ms", 1, True), ("ITL p90 (ms)", "itl_p90_ms", 1, True),
    ("throughput (req/s)", "req_per_s", 3, True),
    ("output throughput (tok/s)", "output_tok_per_s", 2, True),
    ("goodput, chosen SLO (req/s)", "goodput_req_per_s", 3, True),
    ("goodput, TPOT <= 25 ms (req/s)", "goodput_paper_slo_req_per_s", 3, True),
    ("offload fraction", "offload_fraction", 3, False),
    ("egress (GB)", "egress_gb", 4, False), ("egress mean (Gbps)", "egress_gbps", 4, False),
    ("t first -> last (tokens)", "", 0, False), ("duration (s)", "duration_s", 1, False),
    ("host load (1-min avg at end)", "host_load_1m", 1, False),
)


def _cell(result: dict[str, Any], label: str, key: str, digits: int) -> str:
    if key in ("deployment", "shape"):
        return str(result.get(key, "-"))
    if key.startswith("stages."):
        return str(result.get("stages", {}).get(key.removeprefix("stages."), "-"))
    if "error" in result:
        return "error"
    if label.startswith("completed"):
        return f"{result['completed']} / {result['failed']}"
    if label.startswith("t first"):
        router = result["router"]
        return f"{_fmt(router['t_first'], 0)} -> {_fmt(router['t_last'], 0)}"
    return _fmt(result.get(key), digits)


def _ratio(result: dict[str, Any], base: dict[str, Any], key: str) -> str:
    value, ref = result.get(key), base.get(key)
    if not isinstance(value, int | float) or not isinstance(ref, int | float) or ref == 0:
        return ""
    return f" ({value / ref:.2f}x)"


def format_comparison(results: dict[str, dict[str, Any]], baseline: str) -> str:
    """One column per run, one row per metric of ROWS; ratios against the `baseline` run."""
    names = list(results)
    base = results.get(baseline, {})
    header = f"{'metric':<32}" + "".join(f"{n:>24}" for n in names)
    lines = [header, "-" * len(header)]
    for label, key, digits, ratio in ROWS:
        cells = []
        for name in names:
            cell = _cell(results[name], label, key, digits)
            if ratio and name != baseline and "error" not in results[name]:
                cell += _ratio(results[name], base, key)
            cells.append(f"{cell:>24}")
        lines.append(f"{label:<32}" + "".join(cells))
    lines += [f"{n}: {r['error']}" for n, r in results.items() if "error" in r]
    return "\n".join(lines)


def _rows(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain table: text columns left-aligned, the others right-aligned."""
    cells = [[_fmt(v, 2 if isinstance(v, float) and abs(v) < 100 else 0) for v in row]
             for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) + 2 for i in range(len(header))]
    text = [i for i, v in enumerate(rows[0] if rows else header) if isinstance(v, str)]
    return "\n".join("".join(c.ljust(w) if i in text else c.rjust(w)
                              for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                      for row in cells)


def format_workers(results: dict[str, dict[str, Any]]) -> str:
    """Per worker: mean/max queue and streams at the router, prefills, KV sent, decode batch."""
    rows = []
    for policy, r in ((p, r) for p, r in results.items() if "error" not in r):
        for name, c in r["worker_counters"].items():
            q = r["router"]["workers"].get(name, {})
            batch = c["decode_tokens"] / c["decode_steps"] if c["decode_steps"] else None
            # Busy wall time per prefill: the sampled mean of running jobs over the run.
            busy = (q.get("running_mean", 0.0) * (r["duration_s"] or 0.0) / c["prefill_jobs"]
                    if c["prefill_jobs"] else None)
            seen = q.get("roles", [])
            rows.append([policy, name, r["roles"].get(name),
                         " -> ".join(seen) if len(seen) > 1 else "",
                         q.get("queue_mean"), q.get("queue_max"), q.get("running_mean"),
                         int(c["prefill_jobs"]), busy, c["prefill_kv_bytes_sent"] / 1e6, batch])
    return _rows(["policy", "worker", "cluster, role, profile", "roles at the router",
                  "queue mean", "max", "running", "prefills", "busy s/prefill", "KV MB sent",
                  "decode batch"], rows)


def format_clusters(results: dict[str, dict[str, Any]]) -> str:
    """Where each policy prefilled: requests, their mean prompt length and mean TTFT."""
    rows = [[policy, cluster, c["requests"], c["prompt_tokens_mean"], c["ttft_mean_ms"]]
            for policy, r in results.items() for cluster, c in r.get("by_cluster", {}).items()]
    return _rows(["policy", "prefill cluster", "requests", "prompt tokens", "TTFT mean ms"], rows)
