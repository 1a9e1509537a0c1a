"""`prfaas bench`: drive the router's OpenAI API with a workload and report the metrics.

Examples:
    prfaas bench --workload lognormal --num-requests 200 --request-rate 2
    prfaas bench --workload trace --use-trace-timestamps --speedup 20 --num-requests 500
    prfaas bench --workload agent --num-requests 20 --turns 5 --goodput ttft:2000 tpot:100
    prfaas bench --link-url http://127.0.0.1:8474      # adds the PrfaaS egress to the report
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from fractions import Fraction
from pathlib import Path

import anyio
import httpx
import msgspec

from services.bench.arrivals import gamma_arrivals, trace_arrivals
from services.bench.client import ClientConfig, run_benchmark
from services.bench.errors import BenchError
from services.bench.report import BenchReport, format_table, write_json, write_plots
from services.bench.stats import BenchSummary, SLOs, summarise
from services.bench.workloads import (
    AgentShape,
    Scaling,
    Session,
    WordSource,
    agent_sessions,
    lognormal_sessions,
    trace_sessions,
)
from services.data import trace_path
from services.paper.workload import load_trace

DEFAULT_TRACE = trace_path()
_GOODPUT_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


def _fraction(text: str) -> float:
    """A number or a fraction such as 1/64."""
    try:
        return float(Fraction(text))
    except (ValueError, ZeroDivisionError) as exc:
        raise argparse.ArgumentTypeError(f"not a number or fraction: {text!r}") from exc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prfaas bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--url", default="http://127.0.0.1:8000", help="router base URL (default: %(default)s)")
    add("--endpoint", choices=["completions", "chat"], default="completions",
        help="/v1/completions (prompt text) or /v1/chat/completions (default: %(default)s)")
    add("--model", default="prfaas", help="model name sent in requests (default: %(default)s)")
    add("--workload", choices=["lognormal", "trace", "agent"], default="lognormal",
        help="paper log-normal lengths, Mooncake trace replay, or multi-turn agent sessions")
    add("--num-requests", type=int, default=100,
        help="requests (agent: sessions; trace: the first N records) (default: %(default)s)")
    add("--request-rate", type=float, default=1.0,
        help="mean arrivals per second, inf: all at once (default: %(default)s)")
    add("--burstiness", type=float, default=1.0,
        help="gamma shape of the gaps: 1 Poisson, <1 burstier (default: %(default)s)")
    add("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (JSONL)")
    add("--use-trace-timestamps", action="store_true",
        help="replay the trace's own arrival times instead of --request-rate")
    add("--speedup", type=float, default=1.0, help="divide trace timestamps by this")
    add("--scale", type=_fraction, default=1 / 64,
        help="served tokens per paper/trace token, e.g. 1/64 (default: 1/64)")
    add("--max-context", type=int, default=2048,
        help="prompt + output tokens cap of the served model (default: %(default)s)")
    add("--output-len", type=int, default=None,
        help="output tokens before scaling (default: 1024; trace: its own; agent: 256)")
    add("--tokens-per-word", type=float, default=1.6,
        help="tokenizer tokens per corpus word, for text synthesis (default: %(default)s)")
    add("--corpus", type=Path, default=None, help="word source (default: the training corpus)")
    add("--seed", type=int, default=0, help="seed for lengths, arrivals and text")
    add("--turns", type=int, default=4, help="agent: turns per session (default: %(default)s)")
    add("--first-tokens", type=float, default=8192.0, help="agent: mean first prompt tokens")
    add("--turn-tokens", type=float, default=1024.0, help="agent: mean new tokens per turn")
    add("--think-s", type=float, default=1.0, help="agent: pause between turns (s)")
    add("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    add("--ignore-eos", action="store_true", help="send ignore_eos (exactly max_tokens out)")
    add("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    add("--goodput", nargs="+", default=[], metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:50 e2el:10000 (milliseconds)")
    add("--link-url", default=None, help="link control API; egress from GET /link before/after")
    add("--out-dir", type=Path, default=Path("bench-results"),
        help="where bench.json and the PNG plots go (default: %(default)s)")
    add("--no-files", action="store_true", help="write no JSON or plots")
    add("--json", action="store_true", help="also print the summary as one JSON line")
    add("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_goodput(items: list[str]) -> SLOs:
    values: dict[str, float] = {}
    for item in items:
        key, _, number = item.partition(":")
        if key not in _GOODPUT_KEYS:
            raise BenchError(f"--goodput keys are ttft, tpot, e2el; got {item!r}")
        try:
            values[_GOODPUT_KEYS[key]] = float(number)
        except ValueError as exc:
            raise BenchError(f"--goodput {key} needs milliseconds, got {number!r}") from exc
    return SLOs(**values)


def _arrivals(args: argparse.Namespace, n: int, rng: random.Random) -> list[float]:
    return gamma_arrivals(n, args.request_rate, args.burstiness, rng)


def build_sessions(args: argparse.Namespace) -> list[Session]:
    if args.num_requests < 1:
        raise BenchError(f"--num-requests must be >= 1, got {args.num_requests}")
    rng = random.Random(args.seed)
    words = WordSource.from_file(args.corpus) if args.corpus else WordSource.default()
    scaling = Scaling(scale=args.scale, max_context=args.max_context,
                      tokens_per_word=args.tokens_per_word)
    n = args.num_requests
    if args.workload == "trace":
        records = load_trace(args.trace, limit=n)
        arrivals = (trace_arrivals([r.timestamp for r in records], args.speedup)
                    if args.use_trace_timestamps else _arrivals(args, len(records), rng))
        return trace_sessions(records, arrivals, words=words, scaling=scaling,
                              output_len=args.output_len, seed=args.seed)
    if args.workload == "agent":
        shape = AgentShape(turns=args.turns, first_tokens=args.first_tokens,
                           turn_tokens=args.turn_tokens, think_s=args.think_s,
                           output_len=args.output_len or 256)
        return agent_sessions(_arrivals(args, n, rng), rng=rng, words=words, scaling=scaling,
                              shape=shape, seed=args.seed)
    return lognormal_sessions(_arrivals(args, n, rng), rng=rng, words=words, scaling=scaling,
                              output_len=args.output_len or 1024, seed=args.seed)


def egress_bytes_of(body: object) -> int | None:
    """statistics.link.egress.bytes_out of the link's GET /link answer, if present."""
    for key in ("statistics", "link", "egress", "bytes_out"):
        if not isinstance(body, dict):
            return None
        body = body.get(key)
    return body if isinstance(body, int) else None


async def _read_egress(link_url: str | None) -> tuple[int | None, str]:
    """(egress bytes so far, "") or (None, why not)."""
    if link_url is None:
        return None, ""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            response = await client.get(link_url.rstrip("/") + "/link")
        response.raise_for_status()
        value = egress_bytes_of(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        return None, f"link {link_url}: {type(exc).__name__}: {exc}"
    return value, "" if value is not None else f"link {link_url}: no statistics.link.egress"


async def _run(sessions: list[Session], config: ClientConfig, args: argparse.Namespace,
               slos: SLOs) -> tuple[BenchSummary, BenchReport]:
    before, why = await _read_egress(args.link_url)
    run = await run_benchmark(sessions, config, progress=not args.no_progress)
    after, why_after = await _read_egress(args.link_url)
    for problem in {why, why_after} - {""}:
        print(f"prfaas bench: egress unavailable: {problem}", file=sys.stderr)
    egress = after - before if before is not None and after is not None else None
    summary = summarise(run.results, run.duration_s, slos, egress)
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return summary, BenchReport(options, summary, run.results)


def bench_main(argv: list[str] | None = None) -> int:
    """Run the bench; 0 if any request completed, 1 if none did, 2 on bad options."""
    args = _parser().parse_args(argv)
    try:
        slos = parse_goodput(args.goodput)
        config = ClientConfig(base_url=args.url, endpoint=args.endpoint, model=args.model,
                              timeout_s=args.timeout, max_concurrency=args.max_concurrency,
                              ignore_eos=args.ignore_eos)
        sessions = build_sessions(args)
    except (ValueError, OSError) as exc:
        # BenchError names the option; TraceFormatError (a ValueError) the file and line.
        print(f"prfaas bench: {exc}", file=sys.stderr)
        return 2
    summary, report = anyio.run(_run, sessions, config, args, slos)
    print(format_table(summary))
    errors = sorted({r.error for r in report.requests if not r.ok})
    if errors:
        print(f"prfaas bench: {summary.failed} failed; first error: {errors[0]}", file=sys.stderr)
    if not args.no_files:
        paths = [write_json(args.out_dir / "bench.json", report),
                 *write_plots(args.out_dir, report.requests)]
        print("wrote " + ", ".join(str(p) for p in paths))
    if args.json:
        print(json.dumps(msgspec.to_builtins(summary)))
    return 0 if summary.completed else 1
