"""Model benchmark: prefill and decode throughput of every family beside this host's matmul rate,
and the KV cache size S_kv of hybrid against dense models.

    .venv/bin/python benchmarks/bench_model.py [--quick] [--dtype auto|float32|bfloat16]
                                               [--families F ...] [--profile]

Random weights at the default size (the matmuls do not depend on training; the delta rule's
split path for steep decays does, a little: docs/engineering-notes.md G15), in the serving
dtype (`--dtype auto`: bfloat16 where the CPU has native bf16, see services/model/precision.py).
Prefill goes through `generate.prefill` (the serving path: cache writes, last-token logits);
decode through `DecodeBatch.step` with B requests at the same context. The baseline is
`torch.mm(out=)` on square matrices measured in the same run (median of several samples after
a >2 s warm-up, the host is noisy: docs/engineering-notes.md G12). Every prefill and decode
figure is the median of >= 5 samples taken in turn (prefill lengths, then the batch sizes of
decode, round after round), so host noise hits each; `[min, max]` spreads come with them.

The shipped checkpoint's validation loss is measured again (not read from its metadata): on
the last 100,000 characters of the corpus (inside the held-out 10% the checkpoint never
trained on), in the bench dtype and in fp32.

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
Decode FLOPs per token at context L (every weight once, the tied head, MLA in its absorbed
form over the latents, the recurrent state products):

    F_dec(L) = 2 * P_lin + 2 * V * C + sum over full layers: 4 * H * X * L   (X = r for MLA,
               the head dim for GQA) + window layers: 4 * H * D * min(L, W) + linear: 6 H d^2

The model runs with the glibc allocator settings the serving processes get
(mesh/allocator.py; the process restarts itself with them when they are not set): without
them every block of 128 KiB and up is a fresh mmap, and a 4K prefill ran at 8,241 tokens/s
against 10,742 with them in the same hour (kimi-linear, bf16, an Intel host with AMX).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mesh.allocator import allocator_env, has_allocator_env  # noqa: E402
from services.model.batch import DecodeBatch  # noqa: E402
from services.model.config import FAMILIES, ModelConfig, family_config, kv_bytes  # noqa: E402
from services.model.generate import prefill  # noqa: E402
from services.model.held_out import held_out_nats_per_char, held_out_slice  # noqa: E402
from services.model.model import HybridLM, build_model  # noqa: E402
from services.model.precision import resolve_dtype  # noqa: E402
from services.model.sampling import SamplingParams  # noqa: E402
from services.model.tokenizer import default_corpus_path, load_default  # noqa: E402
from services.model.train import DEFAULT_CHECKPOINT, load_checkpoint, read_meta  # noqa: E402

SKV_LENGTHS = {"1k": 1024, "8k": 8192, "32k": 32768}
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 512
Sampler = Callable[[], tuple[float, float]]  # (matmul GFLOP/s in the model dtype, in bf16)


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


def summary(values: list[float]) -> tuple[float, list[float]]:
    """(median, [min, max])."""
    return statistics.median(values), [min(values), max(values)]


def decode_flops(cfg: ModelConfig, p_lin: int, context: int) -> float:
    """F_dec(L) of the module docstring: one decode token at context L."""
    flops = 2.0 * p_lin + 2.0 * cfg.vocab_size * cfg.d_model
    for kind in cfg.layer_kinds:
        if kind == "mla":
            flops += 4.0 * cfg.n_heads * cfg.kv_lora_rank * context
        elif kind == "gqa":
            flops += 4.0 * cfg.n_heads * cfg.head_dim * context
        elif kind == "swa":
            flops += 4.0 * cfg.n_heads * cfg.head_dim * min(context, cfg.window)
        else:
            flops += 6.0 * cfg.linear_heads * cfg.linear_head_dim**2
    return flops


def prefill_rounds(model: HybridLM, lengths: list[int], p_lin: int, repeats: int,
                   matmul_sample: Sampler) -> dict[str, object]:
    """Per length: tokens/s and fractions of the matmul rate (model dtype, bf16), medians of
    `repeats` rounds over all lengths in turn; each prefill right after a fresh matmul sample,
    so both see the same host conditions."""
    cfg = model.cfg
    ids = torch.randint(1, cfg.vocab_size, (max(lengths),),
                        generator=torch.Generator().manual_seed(0))
    prefill(model, ids[: min(lengths)])  # warm caches, allocator and kernels
    samples: dict[int, list[tuple[float, float, float]]] = {t: [] for t in lengths}
    for _ in range(repeats):
        for t in lengths:
            peak, peak_bf16 = matmul_sample()
            start = time.perf_counter()
            prefill(model, ids[:t])
            elapsed = time.perf_counter() - start
            gflops = prefill_flops(cfg, p_lin, t) / elapsed / 1e9
            samples[t].append((t / elapsed, gflops / peak, gflops / peak_bf16))
    row: dict[str, object] = {}
    for t, runs in samples.items():
        row[f"prefill_{t}"], row[f"prefill_{t}_spread"] = summary([r[0] for r in runs])
        row[f"frac_{t}"] = statistics.median(r[1] for r in runs)
        row[f"frac_bf16_{t}"] = statistics.median(r[2] for r in runs)
    return row


def decode_batch(model: HybridLM, batch: int, context: int) -> DecodeBatch:
    """B requests, each holding `context` prompt tokens, joined into one running batch."""
    ids = torch.randint(1, model.cfg.vocab_size, (context,), generator=torch.Generator())
    base = prefill(model, ids).cache
    params = SamplingParams(max_new_tokens=1 << 30, stop_on_eos=False, seed=0)
    running = DecodeBatch(model, slots=batch)
    for i in range(batch):
        running.join(f"r{i}", base.clone(keep_snapshots=False), 1, params)
    return running


def decode_rounds(model: HybridLM, p_lin: int, steps: int, repeats: int,
                  matmul_sample: Sampler) -> dict[str, object]:
    """Decode tokens/s per batch size and b32/b1, medians of `repeats` rounds in which the
    batch sizes take turns (the ratio is taken within each round); b32's fraction of the
    matmul rate sampled just after it."""
    batches = {b: decode_batch(model, b, DECODE_CONTEXT) for b in DECODE_BATCHES}
    for running in batches.values():
        for _ in range(2):
            running.step()
    rates: dict[int, list[float]] = {b: [] for b in DECODE_BATCHES}
    fractions = []
    flops = decode_flops(model.cfg, p_lin, DECODE_CONTEXT + steps // 2)
    for _ in range(repeats):
        for b, running in batches.items():
            start = time.perf_counter()
            for _ in range(steps):
                running.step()
            rates[b].append(b * steps / (time.perf_counter() - start))
            if b == DECODE_BATCHES[-1]:
                # Sampled just after, not before: the sample's matrices would push the model's
                # weights out of the cache, and the timed steps would pay the bench's own
                # pollution (a serving decode loop runs step after step on warm weights).
                fractions.append(rates[b][-1] * flops / 1e9 / matmul_sample()[0])
    row: dict[str, object] = {}
    for b, values in rates.items():
        row[f"decode_{b}"], row[f"decode_{b}_spread"] = summary(values)
    row["b32_over_b1"], row["b32_over_b1_spread"] = summary(
        [x / y for x, y in zip(rates[32], rates[1], strict=True)])
    row["decode_32_frac"] = statistics.median(fractions)
    return row


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


def shipped_val_nats_per_char(dtypes: list[str]) -> dict[str, float | None]:
    """The checkpoint's loss per character, measured on the last 100,000 characters of the
    corpus (services/model/held_out.py) in each dtype; "stored" is what its metadata says
    (None without the files)."""
    corpus = default_corpus_path()
    if not DEFAULT_CHECKPOINT.is_file() or not corpus.is_file():
        return {"stored": None, **{d: None for d in dtypes}}
    text = held_out_slice(corpus.read_text(encoding="utf-8"))
    out: dict[str, float | None] = {"stored": read_meta(DEFAULT_CHECKPOINT).val_nats_per_char}
    for dtype in dtypes:
        model = load_checkpoint(dtype=dtype)[0]
        out[dtype] = round(held_out_nats_per_char(model, text, load_default()), 4)
    return out


def profile_kimi(model: HybridLM, t: int) -> None:
    """Top operators of one kimi-linear prefill and one batch-32 decode step."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(1, model.cfg.vocab_size, (t,))
    running = decode_batch(model, 32, DECODE_CONTEXT)
    for name, run in (("prefill", lambda: prefill(model, ids)), ("decode b32", running.step)):
        # Warm as the timed rounds are: a cold decode step grows every request's KV buffer
        # (fill_ and copy_ that steady decoding never pays).
        for _ in range(2):
            run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        print(f"\nprofile: kimi-linear {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def run_family(family: str, dtype: str, lengths: list[int], repeats: int, steps: int,
               matmul_sample: Sampler) -> dict[str, object]:
    cfg = family_config(family)
    model = build_model(cfg, seed=0, dtype=dtype)
    p_lin = linear_params(model)
    with torch.inference_mode():
        row = prefill_rounds(model, lengths, p_lin, repeats, matmul_sample)
        row.update(decode_rounds(model, p_lin, steps, repeats, matmul_sample))
    return row


def print_rows(rows: dict[str, dict[str, Any]], lengths: list[int], size: int,
               dtype: str) -> None:
    print(f"\nprefill tokens/s (fraction of a {size}^2 {dtype} matmul sampled just before), "
          "decode tokens/s; medians")
    print(f"{'family':12s}" + "".join(f"{t:>16d}" for t in lengths)
          + "".join(f"{'decode b' + str(b):>12s}" for b in DECODE_BATCHES) + f"{'b32/b1':>8s}")
    for family, row in rows.items():
        pre = "".join(f"{row[f'prefill_{t}']:9.0f} ({row[f'frac_{t}']:.0%})" for t in lengths)
        dec = "".join(f"{row[f'decode_{b}']:12.1f}" for b in DECODE_BATCHES)
        print(f"{family:12s}{pre}{dec}{row['b32_over_b1']:8.1f}")


def kimi_json(kimi: dict[str, Any] | None) -> dict[str, object]:
    def get(key: str, digits: int) -> object:
        if kimi is None:
            return None
        value = kimi[key]
        return [round(v, digits) for v in value] if isinstance(value, list) else round(
            value, digits)

    return {
        "prefill_4k_tokens_per_s": get("prefill_4096", 0),
        "prefill_4k_tokens_per_s_spread": get("prefill_4096_spread", 0),
        "prefill_4k_fraction_of_matmul": get("frac_4096", 3),
        "prefill_4k_fraction_of_matmul_bf16": get("frac_bf16_4096", 3),
        "decode_b32_tokens_per_s": get("decode_32", 1),
        "decode_b32_tokens_per_s_spread": get("decode_32_spread", 1),
        "decode_b1_tokens_per_s": get("decode_1", 1),
        "decode_b32_fraction_of_matmul": get("decode_32_frac", 4),
        "decode_b32_over_b1": get("b32_over_b1", 2),
        "decode_b32_over_b1_spread": get("b32_over_b1_spread", 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, no 16K prefill")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--profile", action="store_true", help="profile kimi-linear at 4K")
    args = parser.parse_args()
    if not has_allocator_env(os.environ):
        # glibc reads them at start-up only, so restart this process with them set.
        os.execve(sys.executable, [sys.executable, *sys.argv], allocator_env(os.environ))
    dtype = resolve_dtype(args.dtype)
    torch.manual_seed(0)
    samples = 3 if args.quick else 5
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model dtype {dtype}"
          f" ({args.dtype})")
    rates: dict[str, float] = {}
    for i, (n, dt) in enumerate((n, dt) for dt in ("float32", "bfloat16") for n in (1024, 2048)):
        rates[f"{dt}_{n}"] = matmul_gflops(n, getattr(torch, dt), 2.5 if i == 0 else 0.5, samples)
    print("matmul GFLOP/s (torch.mm, out=): " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
    size = max((1024, 2048), key=lambda n: rates[f"{dtype}_{n}"])
    size_bf16 = max((1024, 2048), key=lambda n: rates[f"bfloat16_{n}"])
    runner = matmul_runner(size, getattr(torch, dtype))
    runner_bf16 = matmul_runner(size_bf16, torch.bfloat16)

    def matmul_sample() -> tuple[float, float]:
        peak = median_rate(runner, 2.0 * size**3 / 1e9, 1, 0.3)
        if dtype == "bfloat16":
            return peak, peak
        return peak, median_rate(runner_bf16, 2.0 * size_bf16**3 / 1e9, 1, 0.3)

    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    steps = 8 if args.quick else 16
    rows = {f: run_family(f, dtype, lengths, samples, steps, matmul_sample)
            for f in args.families}
    print_rows(rows, lengths, size, dtype)
    table = skv_table(dtype)
    print_skv(table, dtype)
    if args.profile:
        with torch.inference_mode():
            profile_kimi(build_model(family_config("kimi-linear"), dtype=dtype), 4096)
    val = shipped_val_nats_per_char(sorted({dtype, "float32"}))
    measured, stored = val["float32"], val["stored"]
    drift = round(measured / stored - 1, 4) if measured and stored else None
    print(f"\nheld-out loss, last 100,000 corpus characters (measured): {val[dtype]} nats/char "
          f"in {dtype}, {measured} in float32; recorded at training: {stored} ({drift:+.2%})"
          if drift is not None else "\nheld-out loss: no shipped checkpoint or corpus")
    print(json.dumps({
        "bench": "model",
        "dtype": dtype,
        **kimi_json(rows.get("kimi-linear")),
        "skv_bytes": table,
        "val_nats_per_char": val[dtype],
        "val_nats_per_char_float32": val["float32"],
        "val_nats_per_char_stored": stored,
        "val_nats_per_char_float32_rel_to_stored": drift,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
