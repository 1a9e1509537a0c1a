"""The hybrid LM: embeddings, pre-norm blocks (mixer + SwiGLU), final norm, tied head.

Three entry points share every layer:
- `forward(ids)`: training and the full-recompute reference, no cache;
- `prefill_hidden(ids, cache, ...)`: one request's new tokens against its `RequestCache`,
  layer by layer (a hook sees each finished layer, for layer-wise KV streaming), taking
  state snapshots at the requested block boundaries;
- `decode_hidden(ids, states, positions)`: one token for each of B requests, batched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from services.model.cache import (
    CacheError,
    LayerCache,
    LinearState,
    RequestCache,
    StateSnapshot,
    TokenKV,
    WindowKV,
    torch_dtype,
)
from services.model.config import ModelConfig, ModelConfigError
from services.model.ffn import SwiGLU
from services.model.gated_deltanet import GatedDeltaNet
from services.model.gqa import GQA
from services.model.kda import KDA
from services.model.linear import WeightPack
from services.model.mla import MLA
from services.model.norm import RMSNorm
from services.model.padded_kv import PaddedKV
from services.model.precision import resolve_dtype
from services.model.swa import SlidingWindowAttention

Mixer = KDA | GatedDeltaNet | MLA | GQA | SlidingWindowAttention
# One decode-batch entry per layer: the members' TokenKVs (the per-request reference path) or
# their PaddedKV, or a batched state.
BatchLayerState = list[TokenKV] | PaddedKV | LinearState | WindowKV
LayerHook = Callable[[int], None]


def make_mixer(cfg: ModelConfig, kind: str) -> Mixer:
    mixers: dict[str, type[Mixer]] = {
        "kda": KDA, "gdn": GatedDeltaNet, "mla": MLA, "gqa": GQA, "swa": SlidingWindowAttention,
    }
    if kind not in mixers:
        raise ModelConfigError(f"layer kind must be one of {tuple(mixers)}, got {kind!r}")
    return mixers[kind](cfg)


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = make_mixer(cfg, kind)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: Tensor, cache: LayerCache | None = None, pos0: int = 0,
                snapshot_at: Sequence[int] = ()) -> tuple[Tensor, Sequence[object]]:
        mixed, snaps = self.mixer(self.mixer_norm(x), cache, pos0, snapshot_at)
        x = x + mixed
        return x + self.ffn(self.ffn_norm(x)), snaps

    def decode(self, x: Tensor, state: BatchLayerState, positions: Tensor) -> Tensor:
        h = self.mixer_norm(x)
        mixer = self.mixer
        if isinstance(mixer, KDA | GatedDeltaNet) and isinstance(state, LinearState):
            mixed = mixer.decode(h, state)
        elif isinstance(mixer, SlidingWindowAttention) and isinstance(state, WindowKV):
            mixed = mixer.decode(h, state, positions)
        elif isinstance(mixer, MLA) and isinstance(state, list | PaddedKV):
            mixed = mixer.decode(h, state)
        elif isinstance(mixer, GQA) and isinstance(state, list | PaddedKV):
            mixed = mixer.decode(h, state, positions)
        else:
            raise CacheError(f"{self.kind} layer cannot decode with {type(state).__name__}")
        x = x + mixed
        out: Tensor = x + self.ffn(self.ffn_norm(x))
        return out


class HybridLM(nn.Module):
    """The language model of one family (see `family_config`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, kind) for kind in cfg.layer_kinds)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.logits_pack = WeightPack()  # the tied embedding's, as a linear layer's weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def layers(self) -> list[Block]:
        return [b for b in self.blocks if isinstance(b, Block)]

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., C] -> logits [..., V] (fp32) through the tied embedding."""
        return self.logits_pack.linear(self.final_norm(hidden), self.embed.weight).float()

    def forward(self, ids: Tensor) -> Tensor:
        """ids [B, T] -> logits [B, T, V]: training and the full-recompute reference."""
        x = self.embed(ids)
        for block in self.layers():
            x, _ = block(x)
        return self.logits(x)

    def prefill_hidden(self, ids: Tensor, cache: RequestCache,
                       snapshot_at: Sequence[int] = (),
                       on_layer: LayerHook | None = None) -> Tensor:
        """ids [T] new tokens after cache.length; extends `cache` in place -> hidden [T, C].

        snapshot_at: block-aligned lengths in (cache.length, cache.length + T] whose
        request-level states are kept as snapshots. on_layer(i) runs once layer i is done
        (its part of the cache then covers the new tokens).
        """
        pos0, t = cache.length, ids.shape[0]
        _check_snapshots(snapshot_at, pos0, t, self.cfg.block_size)
        x: Tensor = self.embed(ids[None])  # [1, T, C]
        per_layer: list[Sequence[object]] = []
        for i, (block, layer) in enumerate(zip(self.layers(), cache.layers, strict=True)):
            x, snaps = block(x, layer, pos0, snapshot_at)
            per_layer.append(snaps)
            if on_layer is not None:
                on_layer(i)
        cache.length = pos0 + t
        for j, n in enumerate(snapshot_at):
            states = tuple(_as_state(snaps[j]) for snaps in per_layer)
            cache.add_snapshot(StateSnapshot(n, states))
        return x[0]

    def decode_hidden(self, ids: Tensor, states: Sequence[BatchLayerState],
                      positions: Tensor) -> Tensor:
        """ids [B] at `positions` [B] -> hidden [B, C]; `states` (one per layer) advance."""
        x: Tensor = self.embed(ids[:, None])  # [B, 1, C]
        for block, state in zip(self.layers(), states, strict=True):
            x = block.decode(x, state, positions)
        return x[:, 0]


def _as_state(snap: object) -> LinearState | WindowKV | None:
    if snap is None or isinstance(snap, LinearState | WindowKV):
        return snap
    raise CacheError(f"unexpected snapshot part {type(snap).__name__}")


def _check_snapshots(snapshot_at: Sequence[int], pos0: int, t: int, block: int) -> None:
    if t < 1:
        raise CacheError(f"prefill needs at least one token, got {t}")
    for n in snapshot_at:
        if n % block or not pos0 < n <= pos0 + t:
            raise CacheError(
                f"snapshot_at entries must be multiples of {block} in ({pos0}, {pos0 + t}], "
                f"got {n}"
            )


def init_weights(model: HybridLM, generator: torch.Generator) -> None:
    """Normal(0, init_std) for matrices, residual outputs scaled by 1/sqrt(2 L), conv
    weights uniform(+-1/sqrt(K)), decay parameters as the layers define."""
    cfg = model.cfg
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("conv_weight"):
                bound = cfg.conv_size**-0.5
                param.uniform_(-bound, bound, generator=generator)
            elif param.dim() >= 2:
                std = residual_std if name.endswith(("o_proj.weight", "down.weight")) else (
                    cfg.init_std)
                param.normal_(0.0, std, generator=generator)
        for module in model.modules():
            if isinstance(module, KDA | GatedDeltaNet):
                module.init_special(generator)


def build_model(cfg: ModelConfig, seed: int = 0, dtype: str = "float32") -> HybridLM:
    """A randomly initialised model; the same (cfg, seed) gives the same weights anywhere.

    dtype: "float32", "bfloat16" or "auto" (`precision.serving_dtype` of the CPU, where the
    engine runs). Weights are drawn in fp32 and then cast, so every dtype starts from the
    same values.
    """
    model = HybridLM(cfg)
    init_weights(model, torch.Generator().manual_seed(seed))
    return cast_model(model, dtype)


def cast_model(model: HybridLM, dtype: str) -> HybridLM:
    """The model in serving form: eval mode, weights in `dtype` ("auto" resolved)."""
    return model.to(torch_dtype(resolve_dtype(dtype))).eval()


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
