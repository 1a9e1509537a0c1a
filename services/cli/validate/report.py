"""The report of `prfaas validate-sim`: the tables, the CDF plots, the records, the summary and
the JSON line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from matplotlib.figure import Figure

from services.cli.validate.compare import METRICS
from services.cli.validate.config import (
    DEPLOYMENT,
    ROUTES,
    Outcome,
    Row,
    compared,
    deployment_name,
    slug,
)
from services.cli.validate.evaluate import Validation
from services.sim.report import markdown_table

# Vidur's reported error against the real engine (its paper): the goal to state against.
VIDUR_GOAL = 0.09
ACCEPT = 0.15


def plot_cdfs(out: Path, row: Row, live: Sequence[Outcome], sim: Sequence[Outcome]) -> Path:
    """TTFT and TPOT CDFs of one load, live beside simulated."""
    fig = Figure(figsize=(9, 3.6))
    panels = (("TTFT (s)", "ttft_s", 1.0), ("TPOT (ms)", "tpot_s", 1e3))
    for ax, (label, field, scale) in zip(fig.subplots(1, 2), panels, strict=True):
        for name, outcomes in (("live", live), ("sim", sim)):
            values = sorted(getattr(o, field) * scale for o in outcomes if o.ok)
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set(xlabel=label, ylabel="share of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"load {row.load}: {row.rate:.2f} req/s, {row.requests} requests")
    fig.tight_layout()
    path = out / f"cdf_{slug(row.load)}.png"
    fig.savefig(path, dpi=110)
    return path


def table(rows: Sequence[Row]) -> str:
    header = ["load", "req/s", "requests", "metric", "live", "sim", "error", "live spread"]
    lines = []
    for row in rows:
        for key in METRICS:
            scale, unit = (1e3, " ms") if key.startswith("tpot") else (1.0, "")
            spread = f"{row.live_spread[key]:.1%}" if key in row.live_spread else "-"
            lines.append([f"{row.load} {row.route}".strip(), f"{row.rate:.2f}", row.requests,
                          key, f"{row.live[key] * scale:.3f}{unit}",
                          f"{row.sim[key] * scale:.3f}{unit}", f"{row.errors[key]:+.1%}",
                          spread])
    return markdown_table(header, lines)


def parts_table(parts: dict[str, dict[str, float]]) -> str:
    header = ["load", "live TTFT", "queue", "prefill compute", "profile's prefill",
              "in-situ block's", "engine alone", "rest (dispatch, link, import, first token)"]
    return markdown_table(header, [[load, *(f"{p.get(k, 0.0) * 1e3:.1f} ms" for k in (
        "ttft", "queue", "compute", "profile", "in-situ", "engine", "rest"))]
        for load, p in parts.items()])


def errors_line(row: Row) -> dict[str, float]:
    """A row's signed errors under the JSON line's keys (`ttft_p50_err`, ...)."""
    return {f"{k}_err": round(row.errors[k], 4) for k in METRICS}


def bench_rows(rows: Sequence[Row], replay: Sequence[Row] = (),
               deployment: str = DEPLOYMENT, routes: Sequence[Row] = ()) -> list[dict[str, Any]]:
    """The JSON line's rows of one deployment: per load, every signed error (predicted), the
    live side's own spread (null with one run per load), the replay's errors and each
    route's errors with its request count (`route_rows`; empty: none)."""
    replayed = {r.load: errors_line(r) for r in replay}
    return [{
        "deployment": deployment, "load": r.load, "requests": r.requests, **errors_line(r),
        "live_spread": ({k: round(v, 4) for k, v in r.live_spread.items()}
                        if r.live_spread else None),
        "replay": replayed.get(r.load),
        "routes": {x.route: {"requests": x.requests, **errors_line(x)}
                   for x in routes if x.load == r.load}} for r in rows]


def bench_line(rows: Sequence[Row], replay: Sequence[Row] = (),
               deployment: str = DEPLOYMENT, routes: Sequence[Row] = ()) -> str:
    """The run's last line for one deployment (`bench_rows`)."""
    return lines_of(bench_rows(rows, replay, deployment, routes))


def lines_of(rows: Sequence[dict[str, Any]]) -> str:
    """The run's last line over the rows of every deployment run."""
    return json.dumps({"bench": "validate-sim", "rows": list(rows)})


def result_rows(result: Validation) -> list[dict[str, Any]]:
    """`bench_rows` of a whole run of one deployment."""
    return bench_rows(result.rows, result.replay, deployment_name(result.config),
                      result.routes)


def accepted(row: Row, bound: float = ACCEPT) -> bool:
    """The issue's acceptance for one load: TTFT p50 and p90 and TPOT p50 within `bound`."""
    return all(abs(row.errors[k]) <= bound for k in ("ttft_p50", "ttft_p90", "tpot_p50"))


def unmodelled_text(result: Validation) -> str:
    """The unmodelled TTFT added: overall, and each route's where it has its own."""
    routes = {ROUTES.get(k, k): v for k, v in result.unmodelled_routes.items() if k}
    return f"{result.unmodelled_s * 1e3:.1f} ms" + "".join(
        f", {name} {seconds * 1e3:.1f} ms" for name, seconds in routes.items())


def write_report(out: Path, result: Validation, machine: str) -> str:
    """DIR/summary.json, table.md, records.jsonl and the CDF plots; the table's text."""
    out.mkdir(parents=True, exist_ok=True)
    for row in result.rows:
        sides = result.records[row.load]
        plot_cdfs(out, row, compared(sides["live"]), compared(sides["sim"]))
    with (out / "records.jsonl").open("wb") as file:
        for load, sides in result.records.items():
            for side, outcomes in sides.items():
                for o in outcomes:
                    record = {"load": load, "side": side, **msgspec.to_builtins(o)}
                    file.write(msgspec.json.encode(record) + b"\n")
    config = result.config
    text = "\n".join([
        f"Deployment {deployment_name(config)}: one PrfaaS prefill, {config.pd_prefill} PD "
        f"prefill and one decode worker, prfaas policy at t = {config.threshold} tokens, "
        f"link {config.bandwidth_bps / 1e6:g} Mbit/s and {config.delay_s * 1e3:g} ms.", "",
        f"Live capacity {result.live_capacity_rps:.2f} req/s (simulated "
        f"{result.sim_capacity_rps:.2f}); {machine}; {result.wall_s:.0f} s in all; load "
        f"average as each phase began: " + ", ".join(
            f"{k} {v}" for k, v in result.load_averages.items()) + ".", "",
        "Predicted: every load simulated with the profile measured before the loads "
        "(profile-in-situ.toml), and the TTFT the simulation does not time (dispatch, KV "
        f"import, the first token's way back: {unmodelled_text(result)}, measured on "
        "the in-situ probes) added to each request; nothing measured during a load reaches "
        "its simulation.", "",
        table(result.rows),
        "What the live TTFT is made of (means, the load's own requests):", "",
        parts_table(result.parts),
        "Acceptance (|error| <= 15% on TTFT p50, p90 and TPOT p50, light and 60% load, "
        "predicted): " + ", ".join(
            f"{r.load} {'pass' if accepted(r) else 'FAIL'}" for r in result.rows) +
        f"; Vidur's goal: {VIDUR_GOAL:.0%}.", ""])
    if result.routes:
        text += ("\nPredicted, per route: each side's requests split by where its own router "
                 "prefilled them (local: the PD prefill worker; offloaded: the PrfaaS one, its "
                 f"KV over the link).\n\n{table(result.routes)}")
    if result.calibrated:
        text += ("\nDiagnostic, calibrated on the load itself (not a prediction): each load "
                 "simulated with the prefill fit of the probes that rode in it and its decode "
                 "steps times the decode worker's own step speed during the load over during "
                 "the in-situ probes (" + ", ".join(
                     f"{k} {v:.3f}" for k, v in result.decode_drift.items()) +
                 "). Predicted minus calibrated is the host's drift between the profile and "
                 f"the load; what calibrated leaves is modelling.\n\n{table(result.calibrated)}")
    if result.replay:
        text += ("\nReplay (a separate figure, not a prediction): each load simulated with "
                 "its own requests' measured compute, the prefill worker's reported compute "
                 "fitted per length and the decode steps scaled as the calibrated rows': the "
                 "simulation's queueing, batching and transfer judged alone.\n\n"
                 f"{table(result.replay)}")
    if result.engine_alone:
        text += (f"\nDiagnostic, the engine's profile alone ({result.config.profile}, no "
                 f"in-situ probes):\n\n{table(result.engine_alone)}")
    (out / "table.md").write_text(text)
    summary = _summary(result)
    summary["machine"] = machine
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return text


def _summary(result: Validation) -> dict[str, Any]:
    fields = msgspec.structs.asdict(result)
    del fields["records"]
    built: dict[str, Any] = msgspec.to_builtins(fields)
    return built
