"""`prfaas profile`: time the real model on this machine and write a measured hardware profile.

    prfaas profile                                  the shipped model, 1 thread, default grid
    prfaas profile --name xeon-spr-1t --threads 1   named profile, written to the profiles dir
    prfaas profile --quick --out /tmp/p.toml        a short grid (a smoke check)

The engine the workers run (services/worker/profiler.py) is timed on prefill over prompt lengths at
each chunk size, and on decode steps over batch sizes and tokens per sequence. Prefill is fitted as
c0 + c1 l + c2 l^2 + per_chunk ceil(l / chunk) at the first chunk size (the one a deployment should
run with; the last term is each forward pass's fixed cost), decode as fixed + per sequence * batch
+ per token * context; the TOML (the format the simulation and emulated mode read,
services/paper/hardware.py) carries the points, the chunk size, each fit's largest relative error
and `source.kind = "measured"`. Beside it goes the model's KV-size profile (`<family>-<size>` in
the same folder), from the model's cache layout.
Prints a table of every point with the fit's error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no stubs

from mesh.errors import ConfigError
from services.bench.host import load_average, machine_line
from services.model.cache import dtype_name
from services.model.config import ModelConfig, family_config, kv_bytes
from services.model.model import HybridLM, build_model
from services.paper.hardware import (
    MIB,
    PROFILE_DIR,
    LinearDecode,
    ModelSpec,
    ProfileSpec,
    QuadraticPrefill,
    relative_errors,
)
from services.worker.engine import ModelEngine
from services.worker.profiler import DecodePoint, EngineProfiler, PrefillPoint, ProfilerConfig
from services.worker.service import checkpoint_path

QUICK = ProfilerConfig(lengths=(64, 128, 256, 512), chunk_tokens=(128,), batches=(1, 4, 8),
                       contexts=(128, 512), repeats=2)
KV_LENGTHS = (1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class Fits:
    """A measurement's fits and their per-point relative errors (fitted / measured - 1)."""

    prefill: QuadraticPrefill
    prefill_errors: list[float]
    decode: LinearDecode
    decode_errors: list[float]


def fit(prefill: Sequence[PrefillPoint], decode: Sequence[DecodePoint], chunk: int) -> Fits:
    """Prefill fitted at chunk size `chunk`, decode over every point."""
    chosen = [p for p in prefill if p.chunk_tokens == chunk]
    pre = QuadraticPrefill.fit([p.length for p in chosen], [p.seconds for p in chosen],
                               chunk)
    dec = LinearDecode.fit([p.batch for p in decode], [p.context for p in decode],
                           [p.seconds for p in decode])
    return Fits(pre, relative_errors([pre(p.length) for p in chosen],
                                     [p.seconds for p in chosen]),
                dec, relative_errors([dec(p.batch, p.batch * p.context) for p in decode],
                                     [p.seconds for p in decode]))


def _toml(value: object) -> str:
    """A TOML value for the profile's few shapes (JSON's strings and numbers are TOML's)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def _table(name: str, fields: dict[str, object]) -> list[str]:
    head = [f"[{name}]"] if name else []
    return head + [f"{key} = {_toml(value)}" for key, value in fields.items()]


def _header(points: Sequence[PrefillPoint], decode: Sequence[DecodePoint], fits: Fits,
            chunk: int) -> list[str]:
    pre, dec = fits.prefill, fits.decode
    lines = ["# Measured by `prfaas profile` (services/cli/profile.py); medians of repeated runs.",
             f"# Prefill at chunk {chunk}: T(l) = {pre.c0:.6g} + {pre.c1:.6g} l + {pre.c2:.6g} "
             f"l^2{f' + {pre.per_chunk:.6g} ceil(l / {pre.chunk})' if pre.chunk else ''} s",
             f"# Decode step: {dec.fixed_s:.6g} + {dec.per_sequence_s:.6g} batch + "
             f"{dec.per_token_s:.6g} context s (context: tokens the batch holds)",
             "# Prefill points (length, chunk, seconds, repeat spread, fit error):"]
    errors = iter(fits.prefill_errors)
    for p in points:
        err = f"{next(errors):+.1%}" if p.chunk_tokens == chunk else "not fitted"
        lines.append(f"#   {p.length:6d} {p.chunk_tokens:5d} {p.seconds:.5f} s "
                     f"{p.spread:5.1%} {err}")
    lines.append("# Decode points (batch, tokens per sequence, seconds, spread, fit error):")
    for d, e in zip(decode, fits.decode_errors, strict=True):
        lines.append(f"#   {d.batch:4d} {d.context:6d} {d.seconds:.5f} s {d.spread:5.1%} "
                     f"{e:+.1%}")
    return lines


def profile_toml(name: str, where: str, points: Sequence[PrefillPoint],
                 decode: Sequence[DecodePoint], chunk: int) -> str:
    """The hardware profile's text; it reads back as a ProfileSpec (checked by the caller)."""
    fits = fit(points, decode, chunk)
    chosen = [p for p in points if p.chunk_tokens == chunk]
    detail = f"prfaas profile, {where}"
    bs_max = max(d.batch for d in decode)
    reference = sorted(d.context for d in decode)[len(decode) // 2]
    top = _table("", {
        "name": name, "description": f"measured on this machine: {where}",
        "gpus_per_instance": 0, "paced": True, "sources": [detail]})
    prefill = _table("prefill", {
        "fit": "quadratic", "lengths": [float(p.length) for p in chosen],
        "seconds": [round(p.seconds, 6) for p in chosen],
        "source": {"kind": "measured", "detail": detail}, "chunk_tokens": chunk,
        "fit_error": round(max(map(abs, fits.prefill_errors)), 4)})
    dec = _table("decode", {
        "bs_max": bs_max, "step_s": round(fits.decode(bs_max, bs_max * reference), 6),
        "reference_context": reference, "hbm_bytes_per_s": 0.0,
        "source": {"kind": "measured", "detail": detail}, "fit": "linear",
        "batches": [d.batch for d in decode], "contexts": [d.context for d in decode],
        "seconds": [round(d.seconds, 6) for d in decode],
        "fit_error": round(max(map(abs, fits.decode_errors)), 4)})
    return "\n".join([*_header(points, decode, fits, chunk), *top, "", *prefill, "",
                      "# hbm_bytes_per_s is unused by a linear (measured) decode fit.", *dec,
                      ""])


def model_toml(cfg: ModelConfig, dtype: str) -> str:
    """The model's KV-size profile: the bytes its cache holds, from its layout (exact)."""
    name = f"{cfg.family}-{cfg.size}"
    detail = f"services.model.config.kv_bytes of {name} ({dtype}): the cache layout, counted"
    return "\n".join([
        f"# The KV cache of the served model {name}, written by `prfaas profile`.",
        *_table("", {"name": name, "description": f"the served {name} model ({dtype})",
                     "sources": [detail], "kv_lengths": [float(n) for n in KV_LENGTHS],
                     "kv_mib": [kv_bytes(cfg, n, dtype) / MIB for n in KV_LENGTHS],
                     "source": {"kind": "measured", "detail": detail}}), ""])


def _load(family: str, size: str, checkpoint: str) -> tuple[HybridLM, str]:
    path = checkpoint_path(checkpoint, family, size)
    if path is None:
        return build_model(family_config(family, size), seed=0), "random-init seed 0"
    from services.model.train import load_checkpoint

    model, _, _ = load_checkpoint(path)
    assert isinstance(model, HybridLM)
    return model, f"weights {path.name}"


def _parse(argv: list[str]) -> argparse.Namespace:
    lines = (__doc__ or "").splitlines()
    parser = argparse.ArgumentParser(prog="prfaas profile", description=lines[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(lines[2:]))
    parser.add_argument("--name", help="profile name (default: HOST-cpu-Nt)")
    parser.add_argument("--out", type=Path,
                        help=f"the TOML to write (default: {PROFILE_DIR}/NAME.toml)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, as the workers' `threads` option (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--family", default="kimi-linear")
    parser.add_argument("--size", default="default")
    parser.add_argument("--checkpoint", default="auto",
                        help='"auto" (the shipped weights), "none" (random init) or a path')
    defaults = ProfilerConfig()
    for flag, value in (("lengths", defaults.lengths), ("chunk-tokens", defaults.chunk_tokens),
                        ("batches", defaults.batches), ("contexts", defaults.contexts)):
        parser.add_argument(f"--{flag}", type=_ints, default=value,
                            help=f"comma-separated (default {','.join(map(str, value))})")
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--snapshot-every", type=int, default=defaults.snapshot_every,
                        help="state snapshot every N blocks, as the workers' option")
    parser.add_argument("--quick", action="store_true", help="a short grid: a smoke check")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from exc


def _config(args: argparse.Namespace) -> ProfilerConfig:
    if args.quick:
        return QUICK
    return ProfilerConfig(lengths=args.lengths, chunk_tokens=args.chunk_tokens,
                          batches=args.batches, contexts=args.contexts, repeats=args.repeats,
                          snapshot_every=args.snapshot_every)


def measure(profiler: EngineProfiler, progress: bool,
            ) -> tuple[list[PrefillPoint], list[DecodePoint]]:
    prefill: list[PrefillPoint] = []
    decode: list[DecodePoint] = []
    with tqdm(total=profiler.config.steps(), desc="profile", unit="point", file=sys.stderr,
              disable=not progress) as bar:
        for point in profiler.points():
            if isinstance(point, PrefillPoint):
                prefill.append(point)
            else:
                decode.append(point)
            bar.set_postfix_str(_label(point))
            bar.update()
    return prefill, decode


def _label(point: PrefillPoint | DecodePoint) -> str:
    if isinstance(point, PrefillPoint):
        return f"prefill {point.length} @ chunk {point.chunk_tokens}: {point.seconds:.3f} s"
    return f"decode batch {point.batch} x {point.context}: {point.seconds * 1e3:.1f} ms"


def write_profile(path: Path, text: str, kind: type[ProfileSpec] | type[ModelSpec]) -> None:
    """Writes `text` after checking it reads back as `kind` (the loaders' own format)."""
    msgspec.toml.decode(text.encode(), type=kind)
    path.write_text(text)


def profile_main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.device == "cuda":
        # The workers' engine keeps its caches on the CPU (services/worker/engine.py): a CUDA
        # profile would time what no worker runs.
        print("prfaas profile: --device cuda: the workers' engine runs on the CPU only; "
              "nothing to profile on CUDA", file=sys.stderr)
        return 2
    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"prfaas profile: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, weights = _load(args.family, args.size, args.checkpoint)
    name = args.name or f"{socket.gethostname()}-cpu-{args.threads}t"
    out = args.out or PROFILE_DIR / f"{name}.toml"
    where = (f"{machine_line(args.threads)}; {args.family}/{args.size} {dtype_name(model.dtype)}, "
             f"{weights}; {datetime.date.today().isoformat()}; median of {config.repeats}; "
             f"load average {load_average():.2f} at the start")
    prefill, decode = measure(EngineProfiler(ModelEngine(model), config), not args.no_progress)
    text = profile_toml(name, where, prefill, decode, config.chunk_tokens[0])
    write_profile(out, text, ProfileSpec)
    model_path = out.parent / f"{model.cfg.family}-{model.cfg.size}.toml"
    write_profile(model_path, model_toml(model.cfg, dtype_name(model.dtype)), ModelSpec)
    print("\n".join(line[2:] for line in text.splitlines() if line.startswith("# ")))
    print(f"wrote {out} and {model_path}")
    return 0
