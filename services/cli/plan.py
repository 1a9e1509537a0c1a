"""`prfaas plan`: the planner's command, printing our Table 6 beside the paper's.

The paper's figures are Table 6 and sections 4.2-4.3 of arXiv 2604.15039 v2, as
services/paper/case_study.py states them; each of ours is printed with its relative error
(or, with --json, as the agreed JSON object).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import msgspec

from services.paper.case_study import DEPLOYMENTS, TABLE6, PaperShape
from services.paper.planner import OperatingPoint, PlanResult, Scenario, solve_scenario
from services.paper.workload import (
    EmpiricalLengths,
    LengthDistribution,
    incremental_lengths,
    load_trace,
)

_ROWS = (
    ("t", "threshold t (tokens)", "{:.0f}"), ("theta_prfaas", "Theta_prfaas (req/s)", "{:.3f}"),
    ("theta_pd_p", "Theta_pd-p (req/s)", "{:.3f}"), ("theta_pd_d", "Theta_pd-d (req/s)", "{:.3f}"),
    ("lambda_max", "Lambda_max (req/s)", "{:.3f}"), ("ratio", "vs homogeneous", "{:.3f}"),
    ("p", "offloaded share p", "{:.3f}"), ("l_short", "l_short (tokens)", "{:.0f}"),
    ("l_long", "l_long (tokens)", "{:.0f}"), ("egress_gbps", "mean egress (Gbps)", "{:.2f}"),
)


def _metrics(point: OperatingPoint, baseline: float) -> dict[str, float | None]:
    """The table's values; None where a stage or a side of t does not exist."""
    return {"t": point.t, "theta_prfaas": point.theta_prfaas if point.n_prfaas else None,
            "theta_pd_p": point.theta_pd_p if point.n_p else None,
            "theta_pd_d": point.theta_pd_d, "lambda_max": point.lambda_max,
            "ratio": point.lambda_max / baseline, "p": point.p,
            "l_short": point.l_short if point.p < 1 else None,
            "l_long": point.l_long if point.p > 0 else None, "egress_gbps": point.egress_bps / 1e9}


def _shape_text(point: OperatingPoint) -> str:
    return PaperShape(point.n_prfaas, point.n_p, point.n_d).text()


def _fmt(fmt: str, value: float | None) -> str:
    return "-" if value is None else fmt.format(value)


def _rel_err(ours: float | None, paper: float | None) -> str:
    if ours is None or paper is None:
        return ""
    if paper == 0:
        return f"{ours - paper:+.3f} abs"
    return f"{(ours - paper) / paper * 100:+.1f} %"


def format_table(result: PlanResult) -> str:
    """Each row of Table 6 with the paper's figure and our relative error beside it."""
    baseline = result.homogeneous.lambda_max
    lines = [f"{'metric':<24}{'ours':>12}{'paper':>12}{'rel. err':>12}"]
    for name in DEPLOYMENTS:
        point, row = result.point(name), TABLE6[name]
        paper = msgspec.structs.asdict(row)
        ours = _metrics(point, baseline)
        limit = f"; PrfaaS {point.prfaas_limit}-bound" if point.prfaas_limit else ""
        lines += ["", f"[{name}]  binding stage: {point.bound}{limit}",
                  f"{'N_prfaas / N_p / N_d':<24}{_shape_text(point):>12}{row.shape.text():>12}"]
        for key, label, fmt in _ROWS:
            ref = paper.get(key)
            lines.append(f"{label:<24}{_fmt(fmt, ours[key]):>12}{_fmt(fmt, ref):>12}"
                         f"{_rel_err(ours[key], ref):>12}".rstrip())
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    defaults = Scenario()
    parser = argparse.ArgumentParser(
        prog="prfaas plan", description="The paper's throughput model (Eqs. 1-8) and grid "
        "search; prints Table 6 (PrfaaS-PD, homogeneous PD, naive heterogeneous) beside the paper.")
    parser.add_argument("--scenario", choices=["paper"], default="paper",
                        help="deployment and workload to start from (default: paper)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    for flag, kind, value, text in (
        ("--bandwidth-gbps", float, defaults.bandwidth_gbps, "PrfaaS egress B_out"),
        ("--n-prfaas", int, defaults.n_prfaas, "PrfaaS prefill instances"),
        ("--n-pd", int, defaults.n_pd, "PD cluster instances (N_p + N_d)"),
        ("--n-homogeneous", int, defaults.n_homogeneous, "instances of the homogeneous baseline"),
        ("--output-len", int, defaults.output_len, "output tokens L_out"),
        ("--mu", float, defaults.mu, "log-normal mu of the input length"),
        ("--sigma", float, defaults.sigma, "log-normal sigma"),
        ("--min-len", float, defaults.min_len, "truncation lower bound (tokens)"),
        ("--max-len", float, defaults.max_len, "truncation upper bound (tokens)"),
        ("--prfaas-profile", str, defaults.prfaas_profile, "hardware profile name or path"),
        ("--pd-profile", str, defaults.pd_profile, "hardware profile name or path"),
    ):
        parser.add_argument(flag, type=kind, default=value, help=f"{text} (default: {value})")
    parser.add_argument("--samples", type=int, default=0,
                        help="use N seeded samples of the log-normal (the empirical path)")
    parser.add_argument("--seed", type=int, default=0, help="seed for --samples (default: 0)")
    parser.add_argument("--trace", default="", help="use the incremental lengths of a Mooncake "
                        "trace (JSONL) under one global prefix cache instead")
    return parser


def _lengths(args: argparse.Namespace, scenario: Scenario) -> LengthDistribution:
    if args.trace:
        return EmpiricalLengths.from_samples(incremental_lengths(load_trace(args.trace)))
    if args.samples > 0:
        rng = random.Random(args.seed)
        return EmpiricalLengths.from_samples(scenario.distribution().samples(rng, args.samples))
    return scenario.distribution()


def plan_main(argv: list[str] | None = None) -> int:
    """`prfaas plan`: solve the scenario and print the table (or JSON)."""
    args = _parser().parse_args(argv)
    scenario = Scenario(
        prfaas_profile=args.prfaas_profile, pd_profile=args.pd_profile,
        n_prfaas=args.n_prfaas, n_pd=args.n_pd, n_homogeneous=args.n_homogeneous,
        bandwidth_gbps=args.bandwidth_gbps, output_len=args.output_len, mu=args.mu,
        sigma=args.sigma, min_len=args.min_len, max_len=args.max_len)
    try:
        result = solve_scenario(scenario, _lengths(args, scenario))
    except (ValueError, OSError) as exc:
        # ProfileError and TraceFormatError are ValueErrors; all name the bad value.
        print(f"prfaas plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(msgspec.to_builtins(result)))
    else:
        print(format_table(result))
    return 0
