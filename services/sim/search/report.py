"""A search's report beside its summary.json: a Markdown table and three plots.

- `table.md`: the SLO the capacities hold; every configuration (capacity with its interval,
  the P90 TTFT at it, cost, capacity per dollar, the planner's Lambda_max and t, frontier
  membership), the best per budget, the equal-cost gain beside the paper's.
- `frontier.png`: capacity against cost per hour, every configuration with its interval, the
  Pareto frontier joined.
- `capacity_vs_t.png`: capacity against the threshold t each PrfaaS-PD configuration ran at
  (the planner's t for the "planner" and "dynamic" candidates: the dynamic policy moves its
  own), the sim's and the planner's, one series per instance shape and bandwidth.
- `planner_vs_sim.png`: the sim's capacity against the planner's Lambda_max, y = x drawn.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib
import msgspec

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from services.sim.capacity import Slo
from services.sim.search.explorer import Entry, Summary


def _ci(entry: Entry) -> str:
    low, high = entry.capacity_rps_ci
    return f"{entry.capacity_rps:.2f} [{low:.2f}, {high:.2f}]"


def table(summary: Summary) -> str:
    on = set(summary.frontier)
    lines = [f"# Search `{summary.search}`", "", summary.description, "",
             "SLO: " + msgspec.convert(summary.slo, Slo).text() + ".", "",
             "| configuration | instances | policy | t (paper tokens) | Gbps | capacity req/s "
             "[95% CI] | P90 TTFT there (s) | planner req/s | sim / planner | $/h | "
             "req/s per $/h | frontier |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary.configurations:
        t = e.planner_t if e.planner_t is not None else "-"
        t_text = f"{t:.0f}" if isinstance(t, float) else str(t)
        ratio = e.capacity_rps / e.planner_lambda_rps if e.planner_lambda_rps else math.nan
        lines.append(f"| {e.key} | {e.instances} | {e.policy} | {t_text} | "
                     f"{e.bandwidth_gbps:g} | {_ci(e)} | {e.ttft_p90_s:.2f} | "
                     f"{e.planner_lambda_rps:.2f} | "
                     f"{ratio:.2f} | {e.cost_per_hour:g} | {e.capacity_per_dollar:.3f} | "
                     f"{'yes' if e.key in on else ''} |")
    lines += ["", "| budget $/h | best configuration | capacity req/s | its cost $/h |",
              "|---|---|---|---|"]
    lines += [f"| {b.budget_per_hour:g} | {b.key} | {b.capacity_rps:.2f} | "
              f"{b.cost_per_hour:g} |" for b in summary.best_per_budget]
    lines += ["", f"Best capacity per dollar: `{summary.best_per_dollar}`."]
    if summary.equal_cost is not None and summary.equal_cost_gain is not None:
        low, high = summary.equal_cost_gain_ci or (math.nan, math.nan)
        eq = summary.equal_cost
        lines += ["", f"Equal-cost gain at {eq.cost_per_hour:g} $/h ({eq.numerator} over "
                  f"{eq.denominator}): {summary.equal_cost_gain:+.1%} "
                  f"(95% CI {low:+.1%} to {high:+.1%}); the paper: about "
                  f"{eq.paper_gain:+.0%}."]
    lines += ["", f"Wall time {summary.wall_s:.0f} s on {summary.ray}; seeds {summary.seeds}."]
    timing = summary.against_serial
    if timing is not None:
        lines += ["", f"Against serial: {timing['serial_wall_s']:.0f} s serially, "
                  f"{timing['ray_wall_s']:.0f} s on Ray with {timing['ray_cpus']} CPUs "
                  f"(ratio {timing['ratio']:.2f}); same results: {timing['same_results']}; "
                  f"{timing['cpu']}, {timing['logical_cpus']} logical CPUs, 1-minute load "
                  f"before / between / after: {timing['load_1min_before_during_after']}."]
    return "\n".join(lines) + "\n"


def plot_frontier(out: Path, summary: Summary) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e in summary.configurations:
        low, high = e.capacity_rps_ci
        err = [[max(0.0, e.capacity_rps - low)], [max(0.0, high - e.capacity_rps)]] \
            if math.isfinite(low) else None
        ax.errorbar(e.cost_per_hour, e.capacity_rps, yerr=err, fmt="o", capsize=3,
                    label=e.key)
    by_key = {e.key: e for e in summary.configurations}
    front = [by_key[k] for k in summary.frontier]
    ax.plot([e.cost_per_hour for e in front], [e.capacity_rps for e in front], "k--",
            lw=1, label="frontier")
    ax.set(xlabel="cost per hour (H20 instance-hours)", ylabel="SLO capacity (req/s)",
           title=f"{summary.search}: capacity against cost")
    ax.legend(fontsize=7)
    _save(fig, out / "frontier.png")


def _save(fig: Figure, path: Path) -> None:
    """Writes `fig` to `path` as a PNG, laid out tight, and closes it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_capacity_vs_t(out: Path, summary: Summary) -> None:
    series: dict[str, list[Entry]] = defaultdict(list)
    for e in summary.configurations:
        if e.planner_t is not None:
            series[f"{e.instances} @ {e.bandwidth_gbps:g} Gbps"].append(e)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, entries in sorted(series.items()):
        entries.sort(key=lambda e: e.planner_t or 0.0)
        ts = [e.planner_t or 0.0 for e in entries]
        ax.plot(ts, [e.capacity_rps for e in entries], "o-", label=f"sim {label}")
        ax.plot(ts, [e.planner_lambda_rps for e in entries],
                "x:", label=f"planner {label}")
    ax.set(xlabel="threshold t (paper tokens)", ylabel="capacity (req/s)",
           title=f"{summary.search}: capacity against t")
    if series:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no PrfaaS-PD configuration in this search", ha="center",
                transform=ax.transAxes)
    _save(fig, out / "capacity_vs_t.png")


def plot_planner_vs_sim(out: Path, summary: Summary) -> None:
    fig, ax = plt.subplots(figsize=(5, 5))
    top = 0.0
    for e in summary.configurations:
        ax.plot(e.planner_lambda_rps, e.capacity_rps, "o", label=e.key)
        top = max(top, e.planner_lambda_rps, e.capacity_rps)
    ax.plot([0, 1.1 * top], [0, 1.1 * top], "k:", lw=1, label="sim = planner")
    ax.set(xlabel="planner's Lambda_max (req/s)", ylabel="sim's SLO capacity (req/s)",
           title=f"{summary.search}: planner against sim")
    ax.legend(fontsize=7)
    _save(fig, out / "planner_vs_sim.png")


def write_report(out: Path, summary: Summary) -> None:
    (out / "table.md").write_text(table(summary), encoding="utf-8")
    plot_frontier(out, summary)
    plot_capacity_vs_t(out, summary)
    plot_planner_vs_sim(out, summary)
