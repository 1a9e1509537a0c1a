"""The bench report: a table for the terminal, a JSON file, and PNG plots.

Plots use matplotlib's object API (`Figure` + `savefig`, the Agg canvas), not pyplot, so no
global backend or figure registry is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from services.bench.stats import BenchSummary, Distribution, RequestResult

_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
_COLOURS = {"prfaas": "tab:orange", "pd": "tab:blue"}


def _row(label: str, value: str) -> str:
    return f"{label:<40}{value:>16}"


def _number(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _distribution_rows(name: str, dist: Distribution | None) -> list[str]:
    if dist is None:
        return [_row(f"{name} (ms)", "-")]
    return [_row(f"mean {name} (ms)", _number(dist.mean)),
            _row(f"median {name} (ms)", _number(dist.p50)),
            _row(f"P90 {name} (ms)", _number(dist.p90)),
            _row(f"P99 {name} (ms)", _number(dist.p99))]


def _slo_text(summary: BenchSummary) -> str:
    slos = summary.slos
    parts = [f"{name} <= {value:g} ms" for name, value in
             (("TTFT", slos.ttft_ms), ("TPOT", slos.tpot_ms), ("E2EL", slos.e2el_ms))
             if value is not None]
    return ", ".join(parts)


def format_table(summary: BenchSummary, title: str = "prfaas bench") -> str:
    """vLLM-style result table."""
    rule = "=" * 56
    lines = [f"{f' {title} ':=^56}",
             _row("successful requests", str(summary.completed)),
             _row("failed requests", str(summary.failed)),
             _row("benchmark duration (s)", _number(summary.duration_s)),
             _row("request throughput (req/s)", _number(summary.request_throughput, "{:.3f}")),
             _row("input token throughput (tok/s)", _number(summary.input_throughput)),
             _row("output token throughput (tok/s)", _number(summary.output_throughput))]
    if summary.goodput is not None:
        lines += [f"SLOs: {_slo_text(summary)}",
                  _row("goodput (req/s)", _number(summary.goodput, "{:.3f}")),
                  _row("requests meeting every SLO", str(summary.good_requests))]
    for key, name in _METRICS:
        lines += [f"{f' {name} ':-^56}", *_distribution_rows(name, getattr(summary, key))]
    lines += [f"{' placement ':-^56}",
              _row("offloaded to PrfaaS", _number(summary.offload_fraction, "{:.1%}")),
              _row("requests per cluster", ", ".join(
                  f"{k} {v}" for k, v in summary.clusters.items()) or "-"),
              _row("requests without a reported cluster", str(summary.unreported)),
              _row("cached prompt tokens (reported)", str(summary.cached_tokens)),
              _row("PrfaaS egress (Gbps)", _number(summary.egress_gbps, "{:.4f}")),
              _row("token chunks without text", str(summary.empty_chunks)),
              rule]
    return "\n".join(lines)


class BenchReport(msgspec.Struct, frozen=True):
    """What the JSON file holds: the options, the summary and every request."""

    options: dict[str, object]
    summary: BenchSummary
    requests: list[RequestResult]


def write_json(path: Path, report: BenchReport) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1))
    return path


def _cdf(ax: Axes, values: Sequence[float], label: str) -> None:
    ordered = sorted(values)
    n = len(ordered)
    ax.step([v * 1000.0 for v in ordered], [(i + 1) / n for i in range(n)], where="post",
            label=label)


def _cdf_plot(path: Path, series: dict[str, list[float]], xlabel: str, title: str) -> Path:
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    for label, values in series.items():
        if values:
            _cdf(ax, values, label)
    ax.set(xlabel=xlabel, ylabel="fraction of requests", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    if any(series.values()):
        ax.legend()
    fig.savefig(path, dpi=100)
    return path


def _timeline(path: Path, results: Sequence[RequestResult]) -> Path:
    fig = Figure(figsize=(8.0, 4.0))
    ax = fig.add_subplot()
    done = [r for r in results if r.ok and r.ttft_s is not None]
    for cluster in sorted({r.cluster or "unreported" for r in done}):
        mine = [r for r in done if (r.cluster or "unreported") == cluster]
        ax.scatter([r.start_s for r in mine], [(r.ttft_s or 0.0) * 1000.0 for r in mine], s=12,
                   label=cluster, color=_COLOURS.get(cluster, "tab:gray"))
    ax.set(xlabel="request sent (s since start)", ylabel="TTFT (ms)",
           title="TTFT over the run, by prefill cluster")
    ax.grid(alpha=0.3)
    if done:
        ax.legend()
    fig.savefig(path, dpi=100)
    return path


def write_plots(directory: Path, results: Sequence[RequestResult]) -> list[Path]:
    """ttft.png (CDF per cluster), itl.png (CDF), timeline.png (TTFT over time)."""
    directory.mkdir(parents=True, exist_ok=True)
    done = [r for r in results if r.ok and r.ttft_s is not None]
    by_cluster: dict[str, list[float]] = {}
    for r in done:
        by_cluster.setdefault(r.cluster or "unreported", []).append(r.ttft_s or 0.0)
    itl = [gap for r in done for gap in r.itl_s]
    return [
        _cdf_plot(directory / "ttft.png", dict(sorted(by_cluster.items())), "TTFT (ms)",
                  "TTFT distribution"),
        _cdf_plot(directory / "itl.png", {"all requests": itl}, "inter-token latency (ms)",
                  "ITL distribution"),
        _timeline(directory / "timeline.png", results),
    ]
