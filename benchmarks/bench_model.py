"""Model benchmark: prefill and decode throughput of every family beside this host's matmul rate,
and the KV cache size S_kv of hybrid against dense models.

    .venv/bin/python benchmarks/bench_model.py [--quick] [--dtype float32|bfloat16] [--profile]

Random weights at the default size (the speed does not depend on training). Prefill goes
through `generate.prefill` (the serving path: cache writes, last-token logits); decode through
`DecodeBatch.step` with B requests at the same context. The baseline is `torch.mm(out=)` on
square matrices measured in the same run (median of several samples after a >2 s warm-up, the
host is noisy: docs/engineering-notes.md G12).

Prefill FLOPs of a T-token sequence, counted analytically (elementwise work, norms, convs and
softmax ignored; attention counted over the causal half only):

    F(T) = 2 * P_lin * T + 2 * V * C                      every nn.Linear once per token; the
                                                          tied head for the last token only
         + sum over full layers (MLA, GQA):  2 * H * 2D * T (T + 1) / 2       QK^T and PV
         + sum over window layers (SWA):     2 * H * 2D * sum_t min(t + 1, W + 1)
         + sum over linear layers (KDA, GDN): H_l * T * (8 d^2 + 10 C d + C^2)

The chunked delta rule (chunk C, head dim d) costs per token and head: 8 d^2 for the four
state products (Q S, K S, the W S correction, the K^T U state update), 10 C d for the five
intra-chunk C x C x d products (K K^T, Q K^T, the W and U solves, P U) and about C^2 for the
triangular inverse. The achieved fraction is F(T) / time / the matmul rate in the model's dtype,
the rate sampled (0.3 s) right before each prefill, since the host's speed swings by 2x.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.model.batch import DecodeBatch  # noqa: E402
from services.model.config import FAMILIES, ModelConfig, family_config, kv_bytes  # noqa: E402
from services.model.generate import prefill  # noqa: E402
from services.model.model import HybridLM, build_model  # noqa: E402
from services.model.sampling import SamplingParams  # noqa: E402
from services.model.train import DEFAULT_CHECKPOINT, read_meta  # noqa: E402

SKV_LENGTHS = {"1k": 1024, "8k": 8192, "32k": 32768}
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 512


def median_rate(run: Callable[[], None], work: float, samples: int, min_s: float) -> float:
    """Median of `samples` rates (work per second); each sample repeats run() for >= min_s."""
    rates = []
    for _ in range(samples):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_s or count == 0:
            run()
            count += 1
        rates.append(work * count / elapsed)
    return statistics.median(rates)


def matmul_runner(n: int, dtype: torch.dtype) -> Callable[[], None]:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)

    def run() -> None:
        torch.mm(a, b, out=out)

    return run


def matmul_gflops(n: int, dtype: torch.dtype, warmup_s: float, samples: int) -> float:
    run = matmul_runner(n, dtype)
    deadline = time.perf_counter() + warmup_s
    while time.perf_counter() < deadline:
        run()
    return median_rate(run, 2.0 * n**3 / 1e9, samples, 0.25)


def linear_params(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def linear_state_flops(cfg: ModelConfig) -> int:
    d, c = cfg.linear_head_dim, cfg.block_size
    return cfg.linear_heads * (8 * d * d + 10 * c * d + c * c)


def prefill_flops(cfg: ModelConfig, p_lin: int, t: int) -> float:
    """F(T) of the module docstring."""
    flops = 2.0 * p_lin * t + 2.0 * cfg.vocab_size * cfg.d_model
    pair = 2.0 * cfg.n_heads * 2 * cfg.head_dim  # QK^T plus PV per (query, key) pair
    window_pairs = sum(min(i + 1, cfg.window + 1) for i in range(t))
    for kind in cfg.layer_kinds:
        if kind in ("mla", "gqa"):
            flops += pair * t * (t + 1) / 2
        elif kind == "swa":
            flops += pair * window_pairs
        else:
            flops += t * linear_state_flops(cfg)
    return flops


def prefill_paired(model: HybridLM, t: int, flops: float, repeats: int,
                   matmul_sample: Callable[[], float]) -> tuple[float, float]:
    """(tokens/s, fraction of the matmul rate), medians over `repeats` samples; each sample is
    one prefill right after a fresh matmul sample, so both see the same host conditions."""
    ids = torch.randint(1, model.cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(t))
    prefill(model, ids[: min(t, 1024)])  # warm caches, allocator and kernels
    rates, fractions = [], []
    for _ in range(repeats):
        peak = matmul_sample()
        start = time.perf_counter()
        prefill(model, ids)
        elapsed = time.perf_counter() - start
        rates.append(t / elapsed)
        fractions.append(flops / elapsed / 1e9 / peak)
    return statistics.median(rates), statistics.median(fractions)


def decode_batch(model: HybridLM, batch: int, context: int) -> DecodeBatch:
    """B requests, each holding `context` prompt tokens, joined into one running batch."""
    ids = torch.randint(1, model.cfg.vocab_size, (context,), generator=torch.Generator())
    base = prefill(model, ids).cache
    params = SamplingParams(max_new_tokens=1 << 30, stop_on_eos=False, seed=0)
    running = DecodeBatch(model, slots=batch)
    for i in range(batch):
        running.join(f"r{i}", base.clone(keep_snapshots=False), 1, params)
    return running


def decode_rates(model: HybridLM, steps: int, repeats: int) -> dict[int, float]:
    """Decode tokens/s per batch size; the batch sizes take turns, so host noise hits each."""
    batches = {b: decode_batch(model, b, DECODE_CONTEXT) for b in DECODE_BATCHES}
    for running in batches.values():
        for _ in range(2):
            running.step()
    samples: dict[int, list[float]] = {b: [] for b in DECODE_BATCHES}
    for _ in range(repeats):
        for b, running in batches.items():
            start = time.perf_counter()
            for _ in range(steps):
                running.step()
            samples[b].append(b * steps / (time.perf_counter() - start))
    return {b: statistics.median(rates) for b, rates in samples.items()}


def skv_table(dtype: str) -> dict[str, dict[str, int]]:
    return {
        family: {k: kv_bytes(family_config(family), n, dtype) for k, n in SKV_LENGTHS.items()}
        for family in FAMILIES
    }


def print_skv(table: dict[str, dict[str, int]], dtype: str) -> None:
    print(f"\nS_kv per request ({dtype}; MiB), and dense / family")
    print(f"{'family':12s}" + "".join(f"{k:>10s}{'ratio':>8s}" for k in SKV_LENGTHS))
    for family, row in table.items():
        cells = "".join(
            f"{row[k] / 2**20:10.2f}{table['dense'][k] / row[k]:8.1f}" for k in SKV_LENGTHS
        )
        print(f"{family:12s}{cells}")


def shipped_val_nats_per_char() -> float | None:
    return read_meta(DEFAULT_CHECKPOINT).val_nats_per_char if DEFAULT_CHECKPOINT.is_file() else None


def profile_kimi(model: HybridLM, t: int) -> None:
    """Top operators of one kimi-linear prefill and one batch-32 decode step."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(1, model.cfg.vocab_size, (t,))
    running = decode_batch(model, 32, DECODE_CONTEXT)
    for name, run in (("prefill", lambda: prefill(model, ids)), ("decode b32", running.step)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        print(f"\nprofile: kimi-linear {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def run_family(family: str, dtype: str, lengths: list[int], repeats: int, steps: int,
               matmul_sample: Callable[[], float]) -> dict[str, float]:
    cfg = family_config(family)
    model = build_model(cfg, seed=0, dtype=dtype)
    p_lin = linear_params(model)
    row: dict[str, float] = {}
    with torch.inference_mode():
        for t in lengths:
            flops = prefill_flops(cfg, p_lin, t)
            row[f"prefill_{t}"], row[f"frac_{t}"] = prefill_paired(
                model, t, flops, repeats, matmul_sample)
        for b, rate in decode_rates(model, steps, repeats).items():
            row[f"decode_{b}"] = rate
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no 16K prefill")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--profile", action="store_true", help="profile kimi-linear at 4K")
    args = parser.parse_args()
    torch.manual_seed(0)
    samples = 3 if args.quick else 5
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model dtype {args.dtype}")
    rates: dict[str, float] = {}
    for i, (n, dt) in enumerate((n, dt) for dt in ("float32", "bfloat16") for n in (1024, 2048)):
        rates[f"{dt}_{n}"] = matmul_gflops(n, getattr(torch, dt), 2.5 if i == 0 else 0.5, samples)
    print("matmul GFLOP/s (torch.mm, out=): " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
    size = max((1024, 2048), key=lambda n: rates[f"{args.dtype}_{n}"])
    runner = matmul_runner(size, getattr(torch, args.dtype))

    def matmul_sample() -> float:
        return median_rate(runner, 2.0 * size**3 / 1e9, 1, 0.3)

    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    repeats, steps = (2, 8) if args.quick else (3, 16)
    rows = {
        f: run_family(f, args.dtype, lengths, repeats, steps, matmul_sample)
        for f in args.families
    }
    print(f"\nprefill tokens/s (fraction of a {size}^2 {args.dtype} matmul sampled just before)")
    print(f"{'family':12s}" + "".join(f"{t:>16d}" for t in lengths)
          + "".join(f"{'decode b' + str(b):>12s}" for b in DECODE_BATCHES) + f"{'b32/b1':>8s}")
    for family, row in rows.items():
        pre = "".join(f"{row[f'prefill_{t}']:9.0f} ({row[f'frac_{t}']:.0%})" for t in lengths)
        dec = "".join(f"{row[f'decode_{b}']:12.1f}" for b in DECODE_BATCHES)
        print(f"{family:12s}{pre}{dec}{row['decode_32'] / row['decode_1']:8.1f}")
    table = skv_table(args.dtype)
    print_skv(table, args.dtype)
    kimi = rows.get("kimi-linear")
    if args.profile:
        profile_kimi(build_model(family_config("kimi-linear"), dtype=args.dtype), 4096)
    print(json.dumps({
        "bench": "model",
        "prefill_4k_fraction_of_matmul": None if kimi is None else round(kimi["frac_4096"], 3),
        "decode_b32_over_b1": None if kimi is None else round(
            kimi["decode_32"] / kimi["decode_1"], 2),
        "skv_bytes": table,
        "val_nats_per_char": shipped_val_nats_per_char(),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
