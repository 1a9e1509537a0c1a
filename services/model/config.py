"""Model configurations: the four hybrid families, their sizes, and KV byte accounting.

Families (docs/paper-notes.md section 6; docs/architecture.md section 5):
- `kimi-linear`: KDA : MLA (NoPE) = 3 : 1.
- `mimo`: sliding-window attention (window 128, learnable sinks) : GQA = 5 : 1.
- `qwen-next`: Gated DeltaNet : gated GQA = 3 : 1.
- `dense`: GQA in every layer, the baseline whose KV grows in every layer.

Kept free of torch so the router, planner and cost model can size KV caches cheaply:
S_kv(l) = fixed + per_token * l (`kv_bytes`, `kv_bytes_split`).
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

LayerKind = Literal["kda", "gdn", "mla", "gqa", "swa"]
DTypeName = Literal["float32", "bfloat16"]

FULL_ATTENTION_KINDS: frozenset[str] = frozenset({"mla", "gqa"})
LINEAR_KINDS: frozenset[str] = frozenset({"kda", "gdn"})
WINDOW_KINDS: frozenset[str] = frozenset({"swa"})
FAMILIES: tuple[str, ...] = ("kimi-linear", "mimo", "qwen-next", "dense")
SIZES: tuple[str, ...] = ("default", "tiny")
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}
# Linear-attention recurrent states stay fp32 whatever the model dtype (the kernels' contract).
STATE_BYTES = 4


class ModelError(Exception):
    """Root of the model engine's errors."""


class ModelConfigError(ModelError, ValueError):
    """A model configuration value is invalid or unknown."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything that fixes a model's shapes; its hash guards KV import across processes."""

    family: str
    size: str
    vocab_size: int
    d_model: int
    layer_kinds: tuple[LayerKind, ...]
    # Attention layers (MLA, GQA, SWA): query heads, key-value heads, head dimension.
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    # Linear-attention layers (KDA, Gated DeltaNet): Dk = Dv = linear_head_dim.
    linear_heads: int
    linear_head_dim: int
    conv_size: int = 4
    # MLA: the cached latent per token; the low-rank gates of KDA use gate_rank.
    kv_lora_rank: int = 128
    gate_rank: int = 64
    window: int = 128
    swa_sinks: bool = True
    attn_output_gate: bool = False
    rope_theta: float = 10000.0
    # Full-attention KV lives in blocks of this many tokens; equal to the delta-rule chunk
    # size so the chunked kernel's per-chunk states are the block-boundary snapshots.
    block_size: int = 64
    norm_eps: float = 1e-6
    init_std: float = 0.02
    eos_id: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    def config_hash(self) -> str:
        """A stable 16-hex-digit hash of every field (sorted JSON, blake2b)."""
        encoded = msgspec.json.encode(self, order="sorted")
        return hashlib.blake2b(encoded, digest_size=8).hexdigest()


def _validate(cfg: ModelConfig) -> None:
    positive = {
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "ffn_hidden": cfg.ffn_hidden,
        "linear_heads": cfg.linear_heads,
        "linear_head_dim": cfg.linear_head_dim,
        "conv_size": cfg.conv_size,
        "kv_lora_rank": cfg.kv_lora_rank,
        "gate_rank": cfg.gate_rank,
        "window": cfg.window,
        "block_size": cfg.block_size,
    }
    for name, value in positive.items():
        if value < 1:
            raise ModelConfigError(f"{name} must be >= 1, got {value}")
    if not cfg.layer_kinds:
        raise ModelConfigError("layer_kinds must name at least one layer, got ()")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ModelConfigError(
            f"n_heads ({cfg.n_heads}) must be a multiple of n_kv_heads ({cfg.n_kv_heads})"
        )
    if cfg.head_dim % 2:
        raise ModelConfigError(f"head_dim must be even for RoPE, got {cfg.head_dim}")
    if cfg.block_size & (cfg.block_size - 1):
        raise ModelConfigError(f"block_size must be a power of two, got {cfg.block_size}")
    if not 0 <= cfg.eos_id < cfg.vocab_size:
        raise ModelConfigError(f"eos_id must be in [0, vocab_size), got {cfg.eos_id}")


def _pattern(family: str, n_groups: int) -> tuple[LayerKind, ...]:
    groups: dict[str, tuple[LayerKind, ...]] = {
        "kimi-linear": ("kda", "kda", "kda", "mla"),
        "mimo": ("swa", "swa", "swa", "swa", "swa", "gqa"),
        "qwen-next": ("gdn", "gdn", "gdn", "gqa"),
        "dense": ("gqa", "gqa", "gqa", "gqa"),
    }
    return groups[family] * n_groups


def family_config(name: str, size: str = "default") -> ModelConfig:
    """The config of family `name` ("kimi-linear", "mimo", "qwen-next", "dense") at `size`.

    default: d_model 384, head dim 64, 8 layers (mimo 12 = 2 x (5 + 1)), 15-21 M params.
    tiny: d_model 64, 4 layers (mimo 6), vocab 512: for tests.
    """
    if name not in FAMILIES:
        raise ModelConfigError(f"family must be one of {FAMILIES}, got {name!r}")
    if size not in SIZES:
        raise ModelConfigError(f"size must be one of {SIZES}, got {size!r}")
    n_groups = 2 if size == "default" else 1
    common: dict[str, object] = {
        "family": name,
        "size": size,
        "layer_kinds": _pattern(name, n_groups),
        "attn_output_gate": name == "qwen-next",
        "swa_sinks": True,
    }
    if size == "default":
        dims: dict[str, object] = {
            "vocab_size": 4096, "d_model": 384, "n_heads": 6, "n_kv_heads": 2, "head_dim": 64,
            "ffn_hidden": 1024, "linear_heads": 6, "linear_head_dim": 64,
            "kv_lora_rank": 128, "gate_rank": 64,
        }
    else:
        dims = {
            "vocab_size": 512, "d_model": 64, "n_heads": 2, "n_kv_heads": 1, "head_dim": 32,
            "ffn_hidden": 176, "linear_heads": 2, "linear_head_dim": 32,
            "kv_lora_rank": 32, "gate_rank": 16,
        }
    return msgspec.convert({**common, **dims}, ModelConfig)


class KVLayout(msgspec.Struct, frozen=True):
    """Payload bytes of one request's cache per layer kind (see `kv_bytes`)."""

    fixed: int
    per_token: int
    window_per_token: int
    window: int


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ModelConfigError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def layer_token_bytes(cfg: ModelConfig, kind: str, dtype: str = "float32") -> int:
    """Bytes per token of a full-attention layer (MLA: the latent; GQA: K and V) or of a
    window layer's slots (K and V); 0 for linear layers."""
    elt = _dtype_bytes(dtype)
    if kind == "mla":
        return cfg.kv_lora_rank * elt
    if kind in ("gqa", "swa"):
        return 2 * cfg.n_kv_heads * cfg.head_dim * elt
    return 0


def linear_state_bytes(cfg: ModelConfig, dtype: str = "float32") -> int:
    """One linear layer's request state: the fp32 recurrent state plus the conv tails."""
    h, d = cfg.linear_heads, cfg.linear_head_dim
    conv_channels = 3 * h * d
    return h * d * d * STATE_BYTES + (cfg.conv_size - 1) * conv_channels * _dtype_bytes(dtype)


def kv_layout(cfg: ModelConfig, dtype: str = "float32") -> KVLayout:
    fixed = per_token = window_per_token = 0
    for kind in cfg.layer_kinds:
        if kind in FULL_ATTENTION_KINDS:
            per_token += layer_token_bytes(cfg, kind, dtype)
        elif kind in LINEAR_KINDS:
            fixed += linear_state_bytes(cfg, dtype)
        else:
            window_per_token += layer_token_bytes(cfg, kind, dtype)
    fixed += window_per_token * cfg.window
    return KVLayout(fixed, per_token, window_per_token, cfg.window)


def kv_bytes_split(cfg: ModelConfig, dtype: str = "float32") -> tuple[int, int]:
    """(fixed, per_token) with S_kv(l) = fixed + per_token * l.

    `fixed` counts the linear layers' states and conv tails and every window layer's full
    window of W tokens. So the formula is exact for l >= W; for l < W a window layer holds
    only l tokens and S_kv(l) = fixed - (W - l) * window_per_token (what `kv_bytes` returns).
    """
    layout = kv_layout(cfg, dtype)
    return layout.fixed, layout.per_token


def kv_bytes(cfg: ModelConfig, length: int, dtype: str = "float32") -> int:
    """Exact payload bytes of one request's cache at `length` tokens (the export's size)."""
    if length < 0:
        raise ModelConfigError(f"length must be >= 0, got {length}")
    layout = kv_layout(cfg, dtype)
    missing_window = max(0, layout.window - length) * layout.window_per_token
    return layout.fixed - missing_window + layout.per_token * length


def _matmul_weights(cfg: ModelConfig, kind: str) -> int:
    """Weights one token passes through in a block of `kind` (mixer + FFN, no norms)."""
    c, hd = cfg.d_model, cfg.n_heads * cfg.head_dim
    ffn = 3 * c * cfg.ffn_hidden
    if kind in LINEAR_KINDS:
        inner = cfg.linear_heads * cfg.linear_head_dim
        if kind == "kda":
            gates = 2 * (c * cfg.gate_rank + cfg.gate_rank * inner)
        else:
            gates = c * cfg.linear_heads + c * inner
        return ffn + 3 * c * inner + c * cfg.linear_heads + gates + inner * c
    if kind == "mla":
        r = cfg.kv_lora_rank
        return ffn + c * hd + c * r + 2 * r * hd + hd * c
    kv = 2 * c * cfg.n_kv_heads * cfg.head_dim
    gate = c * hd if (kind == "gqa" and cfg.attn_output_gate) else 0
    return ffn + c * hd + kv + gate + hd * c


def prefill_flops(cfg: ModelConfig, n_tokens: int, prefix: int = 0) -> int:
    """Model FLOPs of a prefill of n_tokens after `prefix` cached ones (logits of the last
    token only), the figure prefill GFLOP/s is quoted against.

    Counted: 2 x weights per token for every projection and FFN; MLA also up-projects the
    prefix's latents; causal softmax attention 4 * Hq * d per (query, visible key) pair
    (a query at position p sees p + 1 keys, or min(p, W) + 1 in a window layer); the
    chunked delta rule 6 T d^2 + 3 T C d + T C^2 per head (Kimi Linear section 6.3, C =
    block size); the tied LM head once.
    """
    t, p, hd = n_tokens, prefix, cfg.n_heads * cfg.head_dim
    causal_pairs = t * p + t * (t + 1) // 2
    total = 2 * cfg.vocab_size * cfg.d_model
    for kind in cfg.layer_kinds:
        total += 2 * _matmul_weights(cfg, kind) * t
        if kind in FULL_ATTENTION_KINDS:
            total += 4 * hd * causal_pairs
        if kind == "mla":
            total += 2 * 2 * cfg.kv_lora_rank * hd * p
        if kind in WINDOW_KINDS:
            total += 4 * hd * _window_pairs(p, t, cfg.window)
        if kind in LINEAR_KINDS:
            d, chunk = cfg.linear_head_dim, cfg.block_size
            total += cfg.linear_heads * (6 * t * d * d + 3 * t * chunk * d + t * chunk * chunk)
    return total


def _window_pairs(prefix: int, n_tokens: int, window: int) -> int:
    """Sum over query positions p in [prefix, prefix + n) of min(p, W) + 1."""
    ramp_end = min(prefix + n_tokens, window)
    ramp = sum(range(prefix, ramp_end)) if ramp_end > prefix else 0
    flat = max(0, prefix + n_tokens - max(prefix, window)) * window
    return ramp + flat + n_tokens
