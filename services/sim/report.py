"""A scenario's report folder: summary.json, records.jsonl, table.md and PNG plots.

Plots use matplotlib's object API on the Agg canvas (no display): the TTFT CDF per run, t
and link egress over time, queue depths over time. The summary is written with sorted keys
and rounded floats, so the same seed gives the same file byte for byte.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from matplotlib.figure import Figure

from services.paper.case_study import TABLE6
from services.sim.capacity import Slo
from services.sim.exposition import write_metrics
from services.sim.run import STAGES, Record, SimResult


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats rounded (NaN and inf as None: JSON has neither), through dicts and lists."""
    if isinstance(value, float):
        return None if not math.isfinite(value) else round(value, digits)
    if isinstance(value, Mapping):
        return {str(k): rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def write_summary(out: Path, summary: Mapping[str, Any]) -> Path:
    path = out / "summary.json"
    path.write_text(json.dumps(rounded(summary), indent=2, sort_keys=True) + "\n",
                    encoding="utf-8")
    return path


def write_records(out: Path, runs: Mapping[str, SimResult]) -> Path:
    """One JSON line per request, tagged with the run it belongs to; and each run's metrics
    as a scrape would read them (metrics-<run>.prom, services/sim/exposition.py)."""
    write_metrics(out, {name: result.metrics for name, result in runs.items()})
    path = out / "records.jsonl"
    encoder = msgspec.json.Encoder()
    with path.open("wb") as f:
        for name, result in runs.items():
            for record in result.records:
                f.write(encoder.encode({"run": name, **msgspec.structs.asdict(record)}))
                f.write(b"\n")
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return "-" if not math.isfinite(value) else f"{value:,.3g}" if abs(value) < 1000 \
                else f"{value:,.0f}"
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_ttft_cdf(out: Path, runs: Mapping[str, Sequence[Record]], name: str = "ttft_cdf.png",
                  ) -> Path:
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for label, records in runs.items():
        values = sorted(r.ttft_s for r in records if r.ok)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.set(xlabel="TTFT (s)", ylabel="share of requests", title="TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out / name)


def plot_time_series(out: Path, runs: Mapping[str, SimResult], name: str = "timeline.png",
                     spans: Sequence[tuple[float, float]] = ()) -> Path:
    """t, link egress and queue depths over virtual time, one line per run."""
    fig = Figure(figsize=(8, 8))
    axes = fig.subplots(3, 1, sharex=True)
    for label, result in runs.items():
        at = [s.at / 60 for s in result.samples]
        axes[0].plot(at, [s.threshold if s.threshold is not None else math.nan
                          for s in result.samples], label=label)
        axes[1].plot(at, [s.egress_bps / 1e9 for s in result.samples], label=label)
        axes[2].plot(at, [s.queue_prfaas + s.queue_pd + s.decode_waiting
                          for s in result.samples], label=label)
    for ax, title in zip(axes, ("t (served tokens)", "link egress (Gbit/s)",
                                "queued requests (prefill + decode)"), strict=True):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        for low, high in spans:
            ax.axvspan(low / 60, high / 60, color="orange", alpha=0.15)
    axes[0].legend()
    axes[2].set_xlabel("virtual time (min)")
    return _save(fig, out / name)


def interval(mean: float, ci: Sequence[float]) -> str:
    """A mean and its 95% interval as one table cell."""
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.3g} [{ci[0]:.3g}, {ci[1]:.3g}]" if all(map(math.isfinite, ci)) \
        else f"{mean:.3g}"


def _rho_cell(rho: Mapping[str, float]) -> str:
    return " / ".join(f"{rho[stage]:.2f}" if stage in rho else "-" for stage in STAGES)


def paper_report(out: Path, outcome: Any, virtual_s: float, wall_s: float) -> dict[str, Any]:
    """summary.json, table.md, records and plots of the `paper` scenario."""
    from services.sim.capacity import ratio_interval

    deployments = {name: msgspec.structs.asdict(s) for name, s in outcome.summaries.items()}
    homogeneous = outcome.capacities["homogeneous"]
    ratios = {name: ratio_interval(cap, homogeneous)
              for name, cap in outcome.capacities.items()}
    saturation_ratios = {name: ratio_interval(cap, homogeneous, saturation=True)
                         for name, cap in outcome.capacities.items()}
    summary = {"scenario": "paper", "deployments": deployments,
               "common_rate_rps": outcome.common_rate, "paper_table6": msgspec.to_builtins(TABLE6),
               "ratio_over_homogeneous": {name: {"mean": mean, "ci": list(ci)}
                                          for name, (mean, ci) in ratios.items()},
               "saturation_ratio_over_homogeneous": {
                   name: {"mean": mean, "ci": list(ci)}
                   for name, (mean, ci) in saturation_ratios.items()},
               "slo": msgspec.structs.asdict(homogeneous.slo),
               "resolution_rps": homogeneous.resolution_rps,
               "virtual_s": virtual_s, "wall_s": wall_s}
    capacity_rows, latency_rows = [], []
    for name, s in outcome.summaries.items():
        paper = TABLE6[name]
        capacity_rows.append([
            name, s.instances, interval(s.saturation_rps, s.saturation_rps_ci),
            interval(s.capacity_rps, s.capacity_rps_ci), s.planner_lambda_rps,
            paper.lambda_max, interval(*saturation_ratios[name]),
            interval(*ratios[name]), paper.ratio, _rho_cell(s.rho)])
        latency_rows.append([
            name, s.ttft_mean_s, paper.ttft_mean_s, s.ttft_p90_s, paper.ttft_p90_s,
            s.ttst_mean_s, s.offload_share, s.planner_offload_share, s.egress_mean_gbps,
            s.egress_peak_gbps, s.tpot_mean_ms])
    seeds = len(outcome.capacities["homogeneous"].seeds)
    table = markdown_table(
        ["deployment", "P/P/D", "saturation (req/s) [95%]", "SLO capacity (req/s) [95%]",
         "planner Lambda", "paper Lambda", "x homog., saturation [95%]",
         "x homog., SLO capacity [95%]", "paper x",
         "rho at capacity (" + " / ".join(STAGES) + ")"], capacity_rows)
    table += (f"\nMeans over {seeds} seeds with 95% t intervals; SLO: "
              f"{homogeneous.slo.text()}; resolution {homogeneous.resolution_rps:g} req/s.\n\n")
    table += markdown_table(
        ["deployment", f"TTFT mean @{outcome.common_rate} (s)", "paper", "TTFT P90", "paper",
         "2nd token mean", "offload", "planner p", "egress mean (Gbps)", "peak",
         "TPOT (ms)"], latency_rows)
    (out / "table.md").write_text(table, encoding="utf-8")
    write_records(out, outcome.runs)
    plot_ttft_cdf(out, {n: r.records for n, r in outcome.runs.items()})
    plot_time_series(out, outcome.runs)
    return summary


def bandwidth_report(out: Path, outcome: Any, wall_s: float) -> dict[str, Any]:
    """The bandwidth-bound check: measured capacity against the planner's Lambda_max."""
    cap, plan = outcome.capacity, outcome.plan
    d = outcome.deployment
    error = cap.saturation_rps / plan.lambda_max - 1
    summary = {"scenario": "bandwidth-bound", "bandwidth_gbps": d.bandwidth_bps / 1e9,
               "instances": f"{d.n_prfaas}/{d.n_pd_prefill}/{d.n_decode}",
               "planner_t": plan.t, "planner_lambda_rps": plan.lambda_max,
               "planner_bound": plan.bound, "planner_prfaas_limit": plan.prfaas_limit,
               "planner_p": plan.p, "theta_prfaas_compute_rps": outcome.compute_rps,
               "theta_prfaas_bandwidth_rps": outcome.bandwidth_rps,
               "capacity": msgspec.to_builtins(cap) | {"per_seed": [
                   {"seed": seed.seed, "saturation_rps": seed.saturation_rps,
                    "capacity_rps": seed.capacity_rps} for seed in cap.per_seed]},
               "saturation_vs_planner": error, "within_10pct": abs(error) <= 0.10,
               "capacity_vs_planner": cap.capacity_rps / plan.lambda_max - 1,
               "virtual_s": sum(p.virtual_s for s in cap.per_seed for p in s.points),
               "wall_s": wall_s}
    rows = [[f"{d.bandwidth_bps / 1e9:g}", summary["instances"], plan.t, plan.lambda_max,
             f"{outcome.compute_rps:.3g} / {outcome.bandwidth_rps:.3g}",
             interval(cap.saturation_rps, cap.saturation_rps_ci),
             interval(cap.capacity_rps, cap.capacity_rps_ci), f"{100 * error:+.1f}%",
             _rho_cell(cap.rho)]]
    table = markdown_table(
        ["link (Gbps)", "P/P/D", "planner t", "planner Lambda",
         "Theta_prfaas compute / bandwidth", "saturation [95%]", "SLO capacity [95%]",
         "saturation vs planner", "rho at capacity (" + " / ".join(STAGES) + ")"], rows)
    (out / "table.md").write_text(table, encoding="utf-8")
    return summary


def dip_report(out: Path, outcome: Any, virtual_s: float, wall_s: float) -> dict[str, Any]:
    """Before, during and after the dip per policy: P90 TTFT, SLO attainment, t."""
    low, high = outcome.dip
    periods = {"before": (0.0, low), "during": (low, high), "after": (high, math.inf)}
    runs: dict[str, Any] = {}
    rows = []
    for policy, result in outcome.runs.items():
        per: dict[str, Any] = {}
        for period, (a, b) in periods.items():
            records = [r for r in result.records if a <= r.arrival_s < b]
            per[period] = {"requests": len(records), "ttft_p90_s": _p90(records),
                           "slo_attainment": slo_attainment(records)}
            rows.append([policy, period, len(records), per[period]["ttft_p90_s"],
                         per[period]["slo_attainment"]])
        per["threshold_start"], per["recovery_s"] = recovery(result, high)
        runs[policy] = per
    summary = {"scenario": "bandwidth-dip", "dip_s": [low, high], "policies": runs,
               "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S},
               "virtual_s": virtual_s, "wall_s": wall_s}
    table = markdown_table(["policy", "period", "requests", "TTFT P90 (s)", "SLO attainment"],
                           rows)
    (out / "table.md").write_text(table, encoding="utf-8")
    write_records(out, outcome.runs)
    plot_time_series(out, outcome.runs, spans=[outcome.dip])
    plot_ttft_cdf(out, {n: r.records for n, r in outcome.runs.items()})
    return summary


def trace_report(out: Path, runs: Mapping[str, SimResult], virtual_s: float, wall_s: float,
                 ) -> dict[str, Any]:
    no_cache = runs["prfaas (no cache)"].link_bytes
    policies, rows = {}, []
    for name, result in runs.items():
        done = [r for r in result.records if r.ok]
        hit = sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_tokens for r in done))
        mean, p90 = _mean(done), _p90(done)
        policies[name] = {"requests": len(done), "cache_hit_share": hit,
                          "link_bytes": result.link_bytes, "link_bytes_vs_no_cache":
                          result.link_bytes / no_cache if no_cache else math.nan,
                          "offload_share": sum(r.cluster == "prfaas" for r in done) /
                          max(1, len(done)), "ttft_mean_s": mean, "ttft_p90_s": p90}
        rows.append([name, len(done), hit, result.link_bytes / 1e9,
                     policies[name]["link_bytes_vs_no_cache"], policies[name]["offload_share"],
                     mean, p90])
    summary = {"scenario": "trace", "policies": policies, "virtual_s": virtual_s,
               "wall_s": wall_s}
    (out / "table.md").write_text(markdown_table(
        ["policy", "requests", "cache hit share", "link GB", "vs no cache", "offload",
         "TTFT mean (s)", "TTFT P90 (s)"], rows), encoding="utf-8")
    write_records(out, runs)
    plot_ttft_cdf(out, {n: r.records for n, r in runs.items()})
    return summary


def burst_report(out: Path, result: SimResult, conversions: Sequence[tuple[float, str]],
                 virtual_s: float, wall_s: float) -> dict[str, Any]:
    done = [r for r in result.records if r.ok]
    summary = {"scenario": "burst", "requests": len(done), "conversions": len(conversions),
               "conversion_times_s": [[round(at, 1), what] for at, what in conversions],
               "ttft_mean_s": _mean(done), "ttft_p90_s": _p90(done),
               "slo_attainment": slo_attainment(done), "virtual_s": virtual_s,
               "wall_s": wall_s}
    rows = [[f"{at / 60:.1f}", what] for at, what in conversions] or [["-", "no conversion"]]
    (out / "table.md").write_text(markdown_table(["minute", "conversion"], rows),
                                  encoding="utf-8")
    write_records(out, {"burst": result})
    plot_time_series(out, {"burst": result})
    return summary


# The SLO a request must meet to count as attained (paper section 4.1: its decode SLO;
# a TTFT bound is ours: the paper gives none).
SLO_TTFT_S = 10.0
SLO_TPOT_S = Slo().tpot_s


def slo_attainment(records: Sequence[Record]) -> float:
    if not records:
        return math.nan
    met = sum(r.ok and r.ttft_s <= SLO_TTFT_S and r.tpot_s <= SLO_TPOT_S for r in records)
    return met / len(records)


def _mean(records: Sequence[Record]) -> float:
    values = [r.ttft_s for r in records if r.ok]
    return sum(values) / len(values) if values else math.nan


def _p90(records: Sequence[Record]) -> float:
    values = sorted(r.ttft_s for r in records if r.ok)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else math.nan


def recovery(result: SimResult, after: float) -> tuple[float | None, float | None]:
    """t before the dip, and how long after `after` t comes back within 10% of it."""
    before = [s.threshold for s in result.samples if s.at < after and s.threshold is not None]
    start = before[0] if before else None
    if start is None:
        return None, None
    for sample in result.samples:
        if sample.at >= after and sample.threshold is not None and \
                abs(sample.threshold - start) <= 0.1 * start:
            return start, sample.at - after
    return start, None
