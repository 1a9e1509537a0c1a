"""The wire format of KV pieces: export a request cache per layer, import it elsewhere.

A piece is one layer's part of a request's cache: the full-attention KV of tokens
[start, end), or a linear layer's state and conv tail at `end`, or a window layer's last
min(end, W) tokens at `end`. Encoded as: 4-byte big-endian header length, the msgpack
`KVPieceHeader` (family, config hash, dtype, layer, kind, token range, tensor specs, payload
length, crc32), then the raw tensor bytes. A prefill worker streams pieces layer by layer
(`export_layer` from a prefill's on_layer hook); a decode worker feeds them to a
`KVImporter`, optionally on top of a cache that already holds [0, start) - "only what the
decode side lacks". Payload bytes of a whole export equal `kv_bytes(cfg, length, dtype)`
exactly. The header names the model's dtype (linear states are fp32 in either); an importer
refuses a piece of another dtype with `KVDtypeError` rather than converting it. A layer's
pieces over consecutive token ranges join into one (`merge_pieces`) before they are imported.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import msgspec
import torch
from torch import Tensor

from services.model.cache import (
    LayerCache,
    LinearState,
    RequestCache,
    TokenKV,
    WindowKV,
    dtype_name,
    empty_layer,
    token_shapes,
    torch_dtype,
)
from services.model.config import (
    DTYPE_BYTES,
    FULL_ATTENTION_KINDS,
    LINEAR_KINDS,
    ModelConfig,
    ModelError,
)

PieceKind = Literal["full_attn", "linear_state", "window"]
_LENGTH = struct.Struct(">I")


class KVImportError(ModelError, ValueError):
    """An imported piece does not fit: names the field and both values."""

    def __init__(self, field: str, expected: object, got: object, layer: int | None = None):
        where = "" if layer is None else f" (layer {layer})"
        super().__init__(f"KV import{where}: {field} expected {expected!r}, got {got!r}")
        self.field, self.expected, self.got = field, expected, got


class KVDtypeError(KVImportError):
    """A piece was exported in another dtype than the importer serves. Pieces are never
    converted: a bf16 piece widened to fp32 (or fp32 narrowed) would decode differently from
    the prefill side's own cache, and the byte accounting S_kv(l) would no longer hold."""

    def __init__(self, expected: str, got: str, layer: int | None = None) -> None:
        ModelError.__init__(
            self, f"KV import{'' if layer is None else f' (layer {layer})'}: the piece is "
            f"{got} but this importer serves {expected}; prefill and decode workers must run "
            f"the model in the same dtype")
        self.field, self.expected, self.got = "dtype", expected, got


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise KVImportError("tensor dtype", tuple(DTYPE_BYTES), self.dtype)
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


class KVPieceHeader(msgspec.Struct, frozen=True):
    family: str
    config_hash: str
    dtype: str
    layer: int
    kind: PieceKind
    start: int
    end: int
    tensors: tuple[TensorSpec, ...]
    payload_bytes: int
    checksum: int


@dataclass(frozen=True)
class KVPiece:
    header: KVPieceHeader
    payload: bytes | bytearray

    def header_bytes(self) -> bytes:
        """The frame up to the payload: senders may write it and the payload separately."""
        head = msgspec.msgpack.encode(self.header)
        return _LENGTH.pack(len(head)) + head

    def to_bytes(self) -> bytes:
        return self.header_bytes() + self.payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> KVPiece:
        view = memoryview(data)
        if len(view) < _LENGTH.size:
            raise KVImportError("frame length", f">= {_LENGTH.size} bytes", len(view))
        (head_len,) = _LENGTH.unpack_from(view)
        try:
            header = msgspec.msgpack.decode(view[_LENGTH.size : _LENGTH.size + head_len],
                                            type=KVPieceHeader)
        except msgspec.DecodeError as exc:
            raise KVImportError("header", "a KVPieceHeader", str(exc)) from exc
        # One copy into a writable buffer the tensors can then view without copying again.
        return cls(header, bytearray(view[_LENGTH.size + head_len :]))


def piece_kind(layer_kind: str) -> PieceKind:
    if layer_kind in FULL_ATTENTION_KINDS:
        return "full_attn"
    return "linear_state" if layer_kind in LINEAR_KINDS else "window"


def _pack(tensors: list[Tensor]) -> bytearray:
    """The tensors' raw bytes back to back, copied once into a fresh buffer."""
    flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    payload = bytearray(sum(f.numel() for f in flats))
    if payload:
        out = torch.frombuffer(payload, dtype=torch.uint8)
        offset = 0
        for flat in flats:
            out[offset : offset + flat.numel()] = flat
            offset += flat.numel()
    return payload


def _layer_tensors(layer: LayerCache, start: int, end: int) -> list[tuple[str, Tensor]]:
    if isinstance(layer, TokenKV):
        names = ["latent"] if len(layer.buffers) == 1 else ["k", "v"]
        return list(zip(names, layer.token_range(start, end), strict=True))
    if isinstance(layer, LinearState):
        return [("state", layer.state), ("conv_tail", layer.conv_tail)]
    k, v = layer.chronological(end)
    return [("k", k), ("v", v)]


def export_layer(cache: RequestCache, layer: int, start: int = 0,
                 end: int | None = None) -> KVPiece:
    """One layer's piece: full-attention tokens [start, end) or the state at `end`.

    end defaults to cache.length; during a prefill's on_layer hook pass the new length.
    """
    end = cache.length if end is None else end
    kind = piece_kind(cache.cfg.layer_kinds[layer])
    if kind != "full_attn":
        start = end
    parts = _layer_tensors(cache.layers[layer], start, end)
    payload = _pack([t for _, t in parts])
    header = KVPieceHeader(
        family=cache.cfg.family, config_hash=cache.cfg.config_hash(), dtype=cache.dtype_name,
        layer=layer, kind=kind, start=start, end=end,
        tensors=tuple(TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in parts),
        payload_bytes=len(payload), checksum=zlib.crc32(payload),
    )
    return KVPiece(header, payload)


def export_cache(cache: RequestCache, start: int = 0) -> list[KVPiece]:
    """Every layer's piece: full-attention KV of [start, length) plus the states at length."""
    return [export_layer(cache, i, start) for i in range(cache.cfg.n_layers)]


def expected_specs(cfg: ModelConfig, dtype: str, layer: int, start: int,
                   end: int) -> tuple[TensorSpec, ...]:
    """The tensors a valid piece of `layer` for tokens [start, end) must carry."""
    kind = cfg.layer_kinds[layer]
    if kind in FULL_ATTENTION_KINDS:
        names = ["latent"] if kind == "mla" else ["k", "v"]
        return tuple(TensorSpec(n, dtype, (a, end - start, x))
                     for n, (a, x) in zip(names, token_shapes(cfg, kind), strict=True))
    if kind in LINEAR_KINDS:
        h, d = cfg.linear_heads, cfg.linear_head_dim
        return (TensorSpec("state", "float32", (1, h, d, d)),
                TensorSpec("conv_tail", dtype, (1, cfg.conv_size - 1, 3 * h * d)))
    shape = (1, min(end, cfg.window), cfg.n_kv_heads, cfg.head_dim)
    return (TensorSpec("k", dtype, shape), TensorSpec("v", dtype, shape))


def _decode_tensors(piece: KVPiece) -> list[Tensor]:
    """Views of the payload as the header's tensors (the importer copies them into place)."""
    out, offset = [], 0
    buffer = piece.payload if isinstance(piece.payload, bytearray) else bytearray(piece.payload)
    raw = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else (
        torch.empty(0, dtype=torch.uint8))
    for spec in piece.header.tensors:
        size = spec.nbytes()
        chunk = raw[offset : offset + size]
        out.append(chunk.view(torch_dtype(spec.dtype)).reshape(spec.shape))
        offset += size
    return out


def merge_pieces(pieces: list[KVPiece]) -> KVPiece:
    """One full-attention piece from several of one layer over consecutive token ranges
    (each piece's checksum is checked before its bytes are trusted)."""
    for piece in pieces:
        if zlib.crc32(piece.payload) != piece.header.checksum:
            raise KVImportError("checksum", piece.header.checksum, zlib.crc32(piece.payload),
                                piece.header.layer)
    for a, b in pairwise(p.header for p in pieces):
        if (b.start, b.layer, b.kind) != (a.end, a.layer, "full_attn") or b.kind != a.kind:
            raise KVImportError("start", a.end, b.start, b.layer)
    parts = [_decode_tensors(p) for p in pieces]
    joined = [torch.cat(group, dim=1) for group in zip(*parts, strict=True)]  # [A, n, X] each
    payload = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                       for t in joined)
    first, last = pieces[0].header, pieces[-1].header
    specs = tuple(TensorSpec(s.name, s.dtype, tuple(t.shape))
                  for s, t in zip(first.tensors, joined, strict=True))
    header = msgspec.structs.replace(first, end=last.end, tensors=specs,
                                     payload_bytes=len(payload), checksum=zlib.crc32(payload))
    return KVPiece(header, payload)



class KVImporterStatistics(msgspec.Struct, frozen=True):
    pieces: int
    payload_bytes: int
    missing_layers: tuple[int, ...]


class KVImporter:
    """Rebuilds a request cache from pieces (any order, each layer once), optionally on top
    of `base`, a cache that already holds the full-attention KV of [0, start)."""

    def __init__(self, cfg: ModelConfig, dtype: str = "float32",
                 base: RequestCache | None = None) -> None:
        self.cfg, self.dtype, self.base = cfg, dtype, base
        self._hash = cfg.config_hash()
        self._parts: dict[int, list[Tensor]] = {}
        self._start: int | None = None
        self._end: int | None = None
        self._payload_bytes = 0
        if base is not None and (base.cfg != cfg or base.dtype_name != dtype):
            raise KVImportError("base cache config/dtype", (self._hash, dtype),
                                (base.cfg.config_hash(), base.dtype_name))

    def add(self, piece: KVPiece | bytes | bytearray | memoryview) -> None:
        if not isinstance(piece, KVPiece):
            piece = KVPiece.from_bytes(piece)
        self._validate(piece.header, piece.payload)
        self._parts[piece.header.layer] = _decode_tensors(piece)
        self._payload_bytes += len(piece.payload)

    def _validate(self, h: KVPieceHeader, payload: bytes | bytearray) -> None:
        cfg = self.cfg
        _expect("family", cfg.family, h.family)
        _expect("config_hash", self._hash, h.config_hash)
        if h.dtype != self.dtype:
            raise KVDtypeError(self.dtype, h.dtype, h.layer)
        if not 0 <= h.layer < cfg.n_layers:
            raise KVImportError("layer", f"in [0, {cfg.n_layers})", h.layer)
        if h.layer in self._parts:
            raise KVImportError("layer", "each layer once", h.layer, h.layer)
        _expect("kind", piece_kind(cfg.layer_kinds[h.layer]), h.kind, h.layer)
        self._check_range(h)
        specs = expected_specs(cfg, self.dtype, h.layer, h.start, h.end)
        _expect("tensors", specs, h.tensors, h.layer)
        _expect("payload_bytes", sum(s.nbytes() for s in specs), h.payload_bytes, h.layer)
        _expect("payload length", h.payload_bytes, len(payload), h.layer)
        _expect("checksum", h.checksum, zlib.crc32(payload), h.layer)

    def _check_range(self, h: KVPieceHeader) -> None:
        if self._end is None:
            self._end = h.end
        _expect("end", self._end, h.end, h.layer)
        if h.kind != "full_attn":
            _expect("start", h.end, h.start, h.layer)
            return
        if self._start is None:
            have = 0 if self.base is None else self.base.length
            if not 0 <= h.start <= min(have, h.end):
                raise KVImportError("start", f"in [0, {min(have, h.end)}] (tokens held)",
                                    h.start, h.layer)
            self._start = h.start
        _expect("start", self._start, h.start, h.layer)

    @property
    def missing_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.cfg.n_layers) if i not in self._parts)

    def statistics(self) -> KVImporterStatistics:
        return KVImporterStatistics(len(self._parts), self._payload_bytes, self.missing_layers)

    def finish(self) -> RequestCache:
        """The rebuilt cache at `end`; every layer must have arrived."""
        if self.missing_layers or self._end is None:
            raise KVImportError("layers", "all present", f"missing {list(self.missing_layers)}")
        start = self._start if self._start is not None else self._end
        dtype = torch_dtype(self.dtype)
        layers = [self._rebuild(i, kind, start, self._end, dtype)
                  for i, kind in enumerate(self.cfg.layer_kinds)]
        cache = RequestCache(self.cfg, dtype, layers, self._end)
        cache.check_integrity()
        return cache

    def _rebuild(self, index: int, kind: str, start: int, end: int,
                 dtype: torch.dtype) -> LayerCache:
        parts = self._parts[index]
        if kind in FULL_ATTENTION_KINDS:
            if self.base is None:
                kv = empty_layer(self.cfg, kind, dtype, torch.device("cpu"))
                assert isinstance(kv, TokenKV)
            else:
                kv = self.base.token_kv(index).truncated(start)
            kv.append(parts)
            return kv
        if kind in LINEAR_KINDS:
            return LinearState(parts[0].clone(), parts[1].clone())
        return WindowKV.from_chronological(parts[0], parts[1], end, self.cfg.window)


def _expect(field: str, expected: object, got: object, layer: int | None = None) -> None:
    if expected != got:
        raise KVImportError(field, expected, got, layer)


def import_cache(cfg: ModelConfig, pieces: Iterable[KVPiece | bytes], dtype: str = "float32",
                 base: RequestCache | None = None) -> RequestCache:
    """Rebuild a cache from all its pieces (see `KVImporter`)."""
    importer = KVImporter(cfg, dtype, base)
    for piece in pieces:
        importer.add(piece)
    return importer.finish()
