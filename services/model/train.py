"""Training the small hybrid model on Tiny Shakespeare, and the shipped checkpoint's format.

`prfaas train` runs `train_main`: AdamW, linear warmup then cosine decay, gradient clipping,
fixed seed, on CPU within a time budget. The corpus is split by characters: the first 90% trains,
the last 10% validates. The best validation state is saved as safetensors with its metadata
(config, hashes, losses) in the file header, so `load_checkpoint` needs nothing else.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from services.model.config import ModelConfig, ModelError, family_config
from services.model.model import build_model, cast_model, count_params
from services.model.tokenizer import (
    ASSETS_DIR,
    TokenizerLike,
    default_corpus_path,
    load_default,
)

DEFAULT_CHECKPOINT = ASSETS_DIR / "kimi-linear.safetensors"
META_KEY = "prfaas"
MAX_CHECKPOINT_BYTES = 20 * 1024 * 1024
INT8 = "int8-rowwise"
SCALE_SUFFIX = ".qscale"
# Smaller tensors (norms, conv taps, decay parameters) stay fp32: they are cheap and sensitive.
QUANT_MIN_NUMEL = 65536


class CheckpointError(ModelError, ValueError):
    """A checkpoint file is missing, malformed or does not match the model code."""


class TrainConfig(msgspec.Struct, frozen=True):
    family: str = "kimi-linear"
    size: str = "default"
    time_budget_s: float = 35 * 60.0
    # 0 means "as many as the time budget allows"; then the LR schedule follows elapsed time.
    max_steps: int = 0
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    # Periodic validation reads this many tokens from the start of the held-out text; the
    # recorded loss is always measured on all of it.
    eval_tokens: int = 8192
    log_every: int = 10
    seed: int = 0
    bf16: bool = True
    val_fraction: float = 0.1


class CheckpointMeta(msgspec.Struct, frozen=True):
    family: str
    size: str
    config: str  # ModelConfig as JSON
    config_hash: str
    tokenizer_hash: str
    params: int
    steps: int
    tokens_seen: int
    train_seconds: float
    train_loss: float
    val_loss_per_token: float
    chars_per_token: float
    val_nats_per_char: float
    weights_dtype: str
    seed: int


class CorpusSplit(NamedTuple):
    train_ids: torch.Tensor  # [N_train] long
    val_ids: torch.Tensor  # [N_val] long
    val_chars: int


def split_corpus(text: str, tokenizer: TokenizerLike, val_fraction: float) -> CorpusSplit:
    """Split by characters (validation = the last fraction) and encode each side separately."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    cut = int(len(text) * (1.0 - val_fraction))
    train_ids = torch.tensor(tokenizer.encode(text[:cut]), dtype=torch.long)
    val_ids = torch.tensor(tokenizer.encode(text[cut:]), dtype=torch.long)
    return CorpusSplit(train_ids, val_ids, len(text) - cut)


def sample_batch(
    ids: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of seq_len + 1 tokens: inputs and next-token targets, both [B, T]."""
    if ids.numel() <= seq_len + 1:
        raise ValueError(f"seq_len={seq_len} needs more than {ids.numel()} tokens")
    starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=gen)
    offsets = torch.arange(seq_len + 1)
    windows = ids[starts[:, None] + offsets[None, :]]  # [B, T+1]
    return windows[:, :-1], windows[:, 1:]


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, then cosine to lr * min_lr_ratio as progress -> 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def autocast(enabled: bool) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> torch.Tensor:
    with autocast(bf16):
        logits = model(x)  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: nn.Module, ids: torch.Tensor, seq_len: int, batch: int = 8,
             bf16: bool = False, stride: int = 1) -> float:
    """Mean next-token loss (nats) over consecutive, non-overlapping windows of ids (every
    `stride`-th of them: a sample spread over the whole text)."""
    n_windows = (ids.numel() - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"evaluate needs more than seq_len={seq_len} tokens, got {ids.numel()}")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    windows = range(0, n_windows, stride)
    for first in range(0, len(windows), batch):
        rows = windows[first : first + batch]
        x = torch.stack([ids[r * seq_len : (r + 1) * seq_len] for r in rows])  # [B, T]
        y = torch.stack([ids[r * seq_len + 1 : (r + 1) * seq_len + 1] for r in rows])  # [B, T]
        total += batch_loss(model, x, y, bf16).item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / count


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Decay matrices only; norms, biases and per-head scalars train without weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=False)


class TrainResult(NamedTuple):
    state: dict[str, torch.Tensor]
    steps: int
    tokens_seen: int
    seconds: float
    train_loss: float
    val_loss: float


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_loop(
    model: nn.Module, data: CorpusSplit, cfg: TrainConfig, log: bool = True
) -> TrainResult:
    """The main loop, told as steps: sample, forward/backward, clip, step; evaluate periodically
    and keep the state with the best validation loss."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg)
    model.train()
    start = time.perf_counter()
    best = TrainResult(clone_state(model), 0, 0, 0.0, math.inf, math.inf)
    smooth = math.nan
    step = 0
    while True:
        elapsed = time.perf_counter() - start
        done = step >= cfg.max_steps if cfg.max_steps else elapsed >= cfg.time_budget_s
        if step > 0 and (done or step % cfg.eval_every == 0):
            # 1. Validation on the whole held-out text; keep the best state seen.
            val = evaluate(model, data.val_ids[: cfg.eval_tokens + 1], cfg.seq_len, bf16=cfg.bf16)
            if log:
                print(f"step {step:6d} | val loss {val:.4f} | train loss {smooth:.4f}", flush=True)
            if val < best.val_loss:
                tokens = step * cfg.batch_size * cfg.seq_len
                best = TrainResult(clone_state(model), step, tokens, elapsed, smooth, val)
        if done:
            return best
        progress = step / cfg.max_steps if cfg.max_steps else elapsed / cfg.time_budget_s
        # 2. One optimiser step on a random batch.
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step, progress)
        x, y = sample_batch(data.train_ids, cfg.batch_size, cfg.seq_len, gen)
        loss = batch_loss(model, x, y, cfg.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        smooth = loss.item() if math.isnan(smooth) else 0.95 * smooth + 0.05 * loss.item()
        step += 1
        if log and step % cfg.log_every == 0:
            print_progress(cfg, step, elapsed, smooth, opt.param_groups[0]["lr"])


def print_progress(cfg: TrainConfig, step: int, elapsed: float, loss: float, lr: float) -> None:
    tok_s = step * cfg.batch_size * cfg.seq_len / max(elapsed, 1e-9)
    left = (cfg.max_steps - step) * elapsed / step if cfg.max_steps else cfg.time_budget_s - elapsed
    print(
        f"step {step:6d} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:7.0f} tok/s "
        f"| {elapsed / 60:5.1f} min | ETA {max(left, 0.0) / 60:5.1f} min",
        flush=True,
    )


def encode_weights(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Tensors as stored: all in float32/bfloat16, or "int8-rowwise": large matrices as int8
    with one fp32 scale per row (absmax / 127), everything small kept fp32."""
    if dtype != INT8:
        return {k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tensor.dim() < 2 or tensor.numel() < QUANT_MIN_NUMEL:
            out[name] = tensor.float().contiguous()
            continue
        rows = tensor.float().reshape(tensor.shape[0], -1)  # [R, N]
        scale = rows.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [R]
        out[name] = torch.round(rows / scale[:, None]).to(torch.int8).reshape(tensor.shape)
        out[name + SCALE_SUFFIX] = scale
    return out


def decode_weights(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 state dict back from `encode_weights`' output (any of its formats)."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = stored.get(name + SCALE_SUFFIX)
        if scale is None:
            state[name] = tensor.float()
        else:
            rows = tensor.float().reshape(tensor.shape[0], -1) * scale[:, None]
            state[name] = rows.reshape(tensor.shape)
    return state


def save_checkpoint(path: Path, state: dict[str, torch.Tensor], meta: CheckpointMeta) -> int:
    """Write weights (in meta.weights_dtype) with the metadata in the safetensors header."""
    tensors = encode_weights(state, meta.weights_dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={META_KEY: msgspec.json.encode(meta).decode()})
    # safetensors creates the file owner-only; the checkpoint is a shared, committed asset.
    path.chmod(0o644)
    return path.stat().st_size


def read_meta(path: Path) -> CheckpointMeta:
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    if META_KEY not in header:
        raise CheckpointError(f"checkpoint path={str(path)!r} has no {META_KEY!r} metadata")
    return msgspec.json.decode(header[META_KEY], type=CheckpointMeta)


def load_checkpoint(
    path: Path | None = None, dtype: str = "float32",
) -> tuple[nn.Module, ModelConfig, CheckpointMeta]:
    """Rebuild the model from the config stored in the checkpoint and load its weights, then
    cast them to `dtype` ("float32", "bfloat16" or "auto": see `precision.resolve_dtype`)."""
    path = DEFAULT_CHECKPOINT if path is None else path
    if not path.is_file():
        raise CheckpointError(f"checkpoint path={str(path)!r} is not a file")
    meta = read_meta(path)
    cfg = msgspec.json.decode(meta.config, type=ModelConfig)
    model = build_model(cfg, seed=meta.seed)
    with safe_open(str(path), framework="pt") as handle:
        stored = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    model.load_state_dict(decode_weights(stored), strict=True)
    return cast_model(model, dtype), cfg, meta


def checkpoint_is_current(meta: CheckpointMeta) -> bool:
    """True when today's model code builds the same config the checkpoint was trained with."""
    return family_config(meta.family, size=meta.size).config_hash() == meta.config_hash


def pick_weights_dtype(params: int) -> str:
    """The most precise storage that fits the size cap: fp32, bf16, else int8 per row."""
    room = MAX_CHECKPOINT_BYTES - 2**20  # header, scales and small fp32 tensors
    for dtype, width in (("float32", 4), ("bfloat16", 2)):
        if params * width <= room:
            return dtype
    return INT8


def run_training(cfg: TrainConfig, corpus: Path, out: Path) -> CheckpointMeta:
    """Train from scratch, save the best state to `out`, return its metadata.

    The recorded validation loss is measured again after the storage round trip (bf16 or int8
    weights), in fp32 without autocast: the number describes the shipped weights as served.
    """
    torch.manual_seed(cfg.seed)
    tokenizer = load_default()
    model_cfg = family_config(cfg.family, size=cfg.size)
    model = build_model(model_cfg, seed=cfg.seed)
    data = split_corpus(corpus.read_text(encoding="utf-8"), tokenizer, cfg.val_fraction)
    chars_per_token = data.val_chars / data.val_ids.numel()
    params = count_params(model)
    print(
        f"{cfg.family}/{cfg.size}: {params / 1e6:.2f} M params | train {data.train_ids.numel()} "
        f"tokens | val {data.val_ids.numel()} tokens ({chars_per_token:.3f} chars/token)",
        flush=True,
    )
    result = train_loop(model, data, cfg)
    dtype = pick_weights_dtype(params)
    model.load_state_dict(decode_weights(encode_weights(result.state, dtype)))
    val_loss = evaluate(model, data.val_ids, cfg.seq_len)
    print(f"val loss {result.val_loss:.4f} in training, {val_loss:.4f} as stored ({dtype})")
    meta = CheckpointMeta(
        family=cfg.family,
        size=cfg.size,
        config=msgspec.json.encode(model_cfg).decode(),
        config_hash=model_cfg.config_hash(),
        tokenizer_hash=tokenizer.content_hash,
        params=params,
        steps=result.steps,
        tokens_seen=result.tokens_seen,
        train_seconds=round(result.seconds, 1),
        train_loss=round(result.train_loss, 4),
        val_loss_per_token=round(val_loss, 4),
        chars_per_token=round(chars_per_token, 4),
        val_nats_per_char=round(val_loss / chars_per_token, 4),
        weights_dtype=dtype,
        seed=cfg.seed,
    )
    size = save_checkpoint(out, result.state, meta)
    out.with_suffix(".json").write_text(
        json.dumps(msgspec.to_builtins(meta), indent=2) + "\n", encoding="utf-8"
    )
    print(f"saved {out} ({size / 2**20:.1f} MiB): {msgspec.json.encode(meta).decode()}")
    return meta


def train_main(argv: list[str] | None = None) -> int:
    """`prfaas train`: train the default model on the local corpus and write the checkpoint."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="prfaas train",
        description="Train the small hybrid model on CPU and save a safetensors checkpoint.",
    )
    parser.add_argument("--family", default=defaults.family)
    parser.add_argument("--size", default=defaults.size, help="config size: default or tiny")
    parser.add_argument("--corpus", type=Path, default=default_corpus_path())
    parser.add_argument("--out", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--minutes", type=float, default=defaults.time_budget_s / 60)
    parser.add_argument("--max-steps", type=int, default=0, help="0: run for --minutes")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--fp32", action="store_true", help="disable bf16 autocast")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        family=args.family,
        size=args.size,
        time_budget_s=args.minutes * 60,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        eval_every=args.eval_every,
        seed=args.seed,
        bf16=not args.fp32,
    )
    meta = run_training(cfg, args.corpus, args.out)
    return 0 if math.isfinite(meta.val_loss_per_token) else 1
