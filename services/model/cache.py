"""One request's KV cache: block-level full-attention KV plus request-level layer states.

Paper section 3.2 (docs/paper-notes.md 2.2): full-attention KV grows with length and is reusable by
prefix; linear-attention states (recurrent state + conv tails) and sliding-window K/V are
fixed in size and reusable only at exactly the length they were taken. So a `RequestCache`
holds, per layer, one of:

- `TokenKV` (MLA, GQA): per-token tensors in whole blocks of `block_size` tokens;
- `LinearState` (KDA, Gated DeltaNet): the fp32 state [1, H, Dk, Dv] and the conv tail;
- `WindowKV` (SWA): a ring of the last W tokens' K/V (token p lives in slot p % W);

and `StateSnapshot`s of the request-level parts at block-aligned lengths, so a longer prompt
can resume from a cached prefix: the full-attention KV of the prefix is a prefix of the
longer cache, and the snapshot supplies the states at exactly that length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
from torch import Tensor

from services.model.config import (
    FULL_ATTENTION_KINDS,
    LINEAR_KINDS,
    ModelConfig,
    ModelError,
    kv_bytes,
)

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CacheError(ModelError, ValueError):
    """A cache operation got an impossible length, shape or resume point."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise CacheError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {name!r}")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise CacheError(f"dtype must be float32 or bfloat16, got {dtype}")


class TokenKV:
    """Per-token tensors of one full-attention layer, stored in whole blocks.

    Each buffer is [A, capacity, X] with the token axis in the middle (GQA: K and V as
    [H_kv, cap, D]; MLA: the latent as [1, cap, r]), so `views()` feed attention directly.
    """

    def __init__(self, buffers: list[Tensor], length: int, block_size: int) -> None:
        self.buffers = buffers
        self.length = length
        self.block_size = block_size

    @classmethod
    def empty(cls, shapes: Sequence[tuple[int, int]], block_size: int,
              dtype: torch.dtype, device: torch.device) -> TokenKV:
        buffers = [torch.zeros(a, block_size, x, dtype=dtype, device=device) for a, x in shapes]
        return cls(buffers, 0, block_size)

    @property
    def capacity(self) -> int:
        return self.buffers[0].shape[1]

    def views(self) -> list[Tensor]:
        """[A, length, X] views of every buffer."""
        return [b[:, : self.length] for b in self.buffers]

    def reserve(self, length: int) -> None:
        """Grow so `length` tokens fit: to whole blocks, by at least a quarter (amortised
        appends without doubling the memory of a long prompt's cache on its first decode)."""
        if length <= self.capacity:
            return
        current = self.capacity // self.block_size
        blocks = max(-(-length // self.block_size), current + max(1, current // 4))
        new_cap = blocks * self.block_size
        grown = []
        for b in self.buffers:
            fresh = b.new_zeros(b.shape[0], new_cap, b.shape[2])
            fresh[:, : self.length] = b[:, : self.length]
            grown.append(fresh)
        self.buffers = grown

    def append(self, new: Sequence[Tensor]) -> None:
        """new: one [A, n, X] tensor per buffer."""
        n = new[0].shape[1]
        self.reserve(self.length + n)
        for b, x in zip(self.buffers, new, strict=True):
            b[:, self.length : self.length + n] = x
        self.length += n

    def token_range(self, start: int, end: int) -> list[Tensor]:
        if not 0 <= start <= end <= self.length:
            raise CacheError(f"token range [{start}, {end}) must lie in [0, {self.length}]")
        return [b[:, start:end].contiguous() for b in self.buffers]

    def truncated(self, length: int) -> TokenKV:
        """A copy holding only the first `length` tokens."""
        if not 0 <= length <= self.length:
            raise CacheError(f"length must be in [0, {self.length}], got {length}")
        out = TokenKV([b[:, :1].new_zeros(b.shape[0], self.block_size, b.shape[2])
                       for b in self.buffers], 0, self.block_size)
        out.append([b[:, :length] for b in self.buffers])
        return out

    def clone(self) -> TokenKV:
        return self.truncated(self.length)


@dataclass
class LinearState:
    """Recurrent state [B, H, Dk, Dv] fp32 and the last conv_size - 1 conv inputs [B, K-1, C].

    B is 1 for a request; a decode batch holds one with B = its size whose rows are the
    members' own tensors (the members' attributes are views into it).
    """

    state: Tensor
    conv_tail: Tensor

    def clone(self) -> LinearState:
        return LinearState(self.state.clone(), self.conv_tail.clone())


@dataclass
class WindowKV:
    """Ring buffers k, v [B, W, H_kv, D]: the K/V of token p lives in slot p % W."""

    k: Tensor
    v: Tensor

    @property
    def window(self) -> int:
        return self.k.shape[1]

    def clone(self) -> WindowKV:
        return WindowKV(self.k.clone(), self.v.clone())

    def chronological(self, length: int) -> tuple[Tensor, Tensor]:
        """The last min(length, W) tokens' K, V in order: [B, n, H_kv, D] each."""
        n = min(length, self.window)
        slots = torch.arange(length - n, length, device=self.k.device) % self.window
        return self.k[:, slots], self.v[:, slots]

    @classmethod
    def from_chronological(cls, k: Tensor, v: Tensor, end: int, window: int) -> WindowKV:
        """Ring of the tokens k, v [B, n, H_kv, D] that end at position `end` (n <= W)."""
        n = k.shape[1]
        ring_k = k.new_zeros(k.shape[0], window, *k.shape[2:])
        ring_v = v.new_zeros(v.shape[0], window, *v.shape[2:])
        slots = torch.arange(end - n, end, device=k.device) % window
        ring_k[:, slots] = k
        ring_v[:, slots] = v
        return cls(ring_k, ring_v)


LayerCache = TokenKV | LinearState | WindowKV
RequestState = LinearState | WindowKV | None


@dataclass(frozen=True)
class StateSnapshot:
    """The request-level layer states at a block-aligned `length` (None for full attention)."""

    length: int
    layers: tuple[RequestState, ...]

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearState):
                total += _nbytes(layer.state) + _nbytes(layer.conv_tail)
            elif isinstance(layer, WindowKV):
                total += _nbytes(layer.k) + _nbytes(layer.v)
        return total


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class CacheStatistics(msgspec.Struct, frozen=True):
    length: int
    full_blocks: int
    payload_bytes: int
    allocated_bytes: int
    snapshot_lengths: tuple[int, ...]
    snapshot_bytes: int


def token_shapes(cfg: ModelConfig, kind: str) -> list[tuple[int, int]]:
    """[A, X] of each per-token buffer of a full-attention layer."""
    if kind == "mla":
        return [(1, cfg.kv_lora_rank)]
    return [(cfg.n_kv_heads, cfg.head_dim), (cfg.n_kv_heads, cfg.head_dim)]


def empty_layer(cfg: ModelConfig, kind: str, dtype: torch.dtype,
                device: torch.device) -> LayerCache:
    if kind in FULL_ATTENTION_KINDS:
        return TokenKV.empty(token_shapes(cfg, kind), cfg.block_size, dtype, device)
    if kind in LINEAR_KINDS:
        h, d = cfg.linear_heads, cfg.linear_head_dim
        state = torch.zeros(1, h, d, d, dtype=torch.float32, device=device)
        tail = torch.zeros(1, cfg.conv_size - 1, 3 * h * d, dtype=dtype, device=device)
        return LinearState(state, tail)
    shape = (1, cfg.window, cfg.n_kv_heads, cfg.head_dim)
    zeros = torch.zeros(shape, dtype=dtype, device=device)
    return WindowKV(zeros, zeros.clone())


class RequestCache:
    """All layers' cache of one request at `length` tokens, plus its state snapshots."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layers: list[LayerCache],
                 length: int = 0) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.layers = layers
        self.length = length
        self.snapshots: dict[int, StateSnapshot] = {}

    @classmethod
    def empty(cls, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> RequestCache:
        dev = torch.device(device)
        layers = [empty_layer(cfg, kind, dtype, dev) for kind in cfg.layer_kinds]
        return cls(cfg, dtype, layers)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def token_kv(self, index: int) -> TokenKV:
        layer = self.layers[index]
        if not isinstance(layer, TokenKV):
            raise CacheError(f"layer {index} ({self.cfg.layer_kinds[index]}) has no token KV")
        return layer

    def request_states(self) -> tuple[RequestState, ...]:
        return tuple(None if isinstance(x, TokenKV) else x for x in self.layers)

    def clone(self, keep_snapshots: bool = True) -> RequestCache:
        out = RequestCache(self.cfg, self.dtype, [x.clone() for x in self.layers], self.length)
        if keep_snapshots:
            out.snapshots = dict(self.snapshots)
        return out

    def resume_point(self, length: int) -> RequestCache:
        """A fresh cache at `length`: this one (cloned) or a block-aligned snapshot of it."""
        if length == self.length:
            return self.clone(keep_snapshots=False)
        snapshot = self.snapshots.get(length)
        if snapshot is None:
            raise CacheError(
                f"length {length} is neither the cache length ({self.length}) nor a snapshot "
                f"(have {sorted(self.snapshots)})"
            )
        return self.from_snapshot(snapshot)

    def from_snapshot(self, snapshot: StateSnapshot) -> RequestCache:
        layers: list[LayerCache] = []
        for layer, state in zip(self.layers, snapshot.layers, strict=True):
            if isinstance(layer, TokenKV):
                layers.append(layer.truncated(snapshot.length))
            elif state is None:
                raise CacheError(f"snapshot at {snapshot.length} lacks a request-level state")
            else:
                layers.append(state.clone())
        return RequestCache(self.cfg, self.dtype, layers, snapshot.length)

    def add_snapshot(self, snapshot: StateSnapshot) -> None:
        if snapshot.length % self.cfg.block_size or not 0 < snapshot.length <= self.length:
            raise CacheError(
                f"snapshot length must be block-aligned in (0, {self.length}], "
                f"got {snapshot.length}"
            )
        self.snapshots[snapshot.length] = snapshot

    def discard_snapshots(self, keep: Sequence[int] = ()) -> None:
        """Drop every snapshot except those at the lengths in `keep` (they cost memory)."""
        self.snapshots = {n: s for n, s in self.snapshots.items() if n in keep}

    def payload_bytes(self) -> int:
        """S_kv(length): what a full export of this cache carries."""
        return kv_bytes(self.cfg, self.length, self.dtype_name)

    def held_bytes(self) -> int:
        """What keeping this cache holds: its allocated and its snapshots' bytes (the
        prefix store's charge for it)."""
        stats = self.statistics()
        return stats.allocated_bytes + stats.snapshot_bytes

    def statistics(self) -> CacheStatistics:
        allocated = 0
        for layer in self.layers:
            if isinstance(layer, TokenKV):
                allocated += sum(_nbytes(b) for b in layer.buffers)
            elif isinstance(layer, LinearState):
                allocated += _nbytes(layer.state) + _nbytes(layer.conv_tail)
            else:
                allocated += _nbytes(layer.k) + _nbytes(layer.v)
        snaps = self.snapshots.values()
        return CacheStatistics(
            length=self.length,
            full_blocks=self.length // self.cfg.block_size,
            payload_bytes=self.payload_bytes(),
            allocated_bytes=allocated,
            snapshot_lengths=tuple(sorted(self.snapshots)),
            snapshot_bytes=sum(s.nbytes() for s in snaps),
        )

    def check_integrity(self) -> None:
        cfg = self.cfg
        if len(self.layers) != cfg.n_layers:
            raise CacheError(f"cache has {len(self.layers)} layers, config has {cfg.n_layers}")
        for i, (kind, layer) in enumerate(zip(cfg.layer_kinds, self.layers, strict=True)):
            _check_layer(cfg, i, kind, layer, self.length, self.dtype)
        for length, snap in self.snapshots.items():
            if snap.length != length or length % cfg.block_size or length > self.length:
                raise CacheError(f"snapshot keyed {length} has length {snap.length}")


def _check_layer(cfg: ModelConfig, index: int, kind: str, layer: LayerCache, length: int,
                 dtype: torch.dtype) -> None:
    where = f"layer {index} ({kind})"
    if kind in FULL_ATTENTION_KINDS:
        if not isinstance(layer, TokenKV) or layer.length != length:
            raise CacheError(f"{where}: expected TokenKV of length {length}, got {layer!r}")
        for (a, x), b in zip(token_shapes(cfg, kind), layer.buffers, strict=True):
            if (b.shape[0], b.shape[2]) != (a, x) or b.shape[1] % cfg.block_size:
                raise CacheError(f"{where}: buffer shape {tuple(b.shape)}")
        return
    if kind in LINEAR_KINDS:
        h, d = cfg.linear_heads, cfg.linear_head_dim
        if not isinstance(layer, LinearState) or tuple(layer.state.shape) != (1, h, d, d):
            raise CacheError(f"{where}: expected a LinearState [1, {h}, {d}, {d}]")
        if tuple(layer.conv_tail.shape) != (1, cfg.conv_size - 1, 3 * h * d):
            raise CacheError(f"{where}: conv tail shape {tuple(layer.conv_tail.shape)}")
        return
    shape = (1, cfg.window, cfg.n_kv_heads, cfg.head_dim)
    if not isinstance(layer, WindowKV) or tuple(layer.k.shape) != shape:
        raise CacheError(f"{where}: expected a WindowKV of shape {shape}")
    if layer.k.dtype != dtype or layer.v.shape != layer.k.shape:
        raise CacheError(f"{where}: window dtype {layer.k.dtype} or v shape mismatch")
