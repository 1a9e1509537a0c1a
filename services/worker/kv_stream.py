"""The KV stream between a prefill and a decode worker: which pieces go, in what order, when,
on which lane, and how the receiving side puts them back together.

The prefill worker computes the uncached suffix in chunks of tokens (chunked prefill) and, as
each layer of each chunk finishes, exports one piece (services.model.export): the
full-attention KV of the chunk's new tokens that the decode side lacks, and, in the last chunk
only, each linear or window layer's fixed-size state at the prompt's end. `release` deals the
pieces to the lanes in turn as they come, in emulated mode once the modeled hardware has
finished their layer (`step_ends`). Chunks keep the last piece small, so little is left to send
once the compute is done: with transfer as long as compute, the time to "KV fully received"
is about (1 + tail) / 2 of compute-then-transfer, tail being the states' and the last chunk's
share of the bytes (layer-wise streaming alone leaves a whole full-attention layer, often the
largest, for the end).

The decode side's `KVInbox` (services.worker.kv_inbox) collects the pieces of all lanes of a
request in a `KVAssembly` (checking the stream is for its model before any piece), then
`import_pieces` joins each layer's consecutive full-attention pieces (checksums checked first)
and rebuilds the cache with the model's `KVImporter` on top of the KV it already holds.
"""

from __future__ import annotations

import itertools
import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import NamedTuple

import anyio
import msgspec
import torch

from mesh.mailbox import Mailbox
from services.contract.errors import DataPathError, KVTransferError
from services.contract.messages import KVChunk, KVClose
from services.model.cache import RequestCache, torch_dtype
from services.model.config import (
    FULL_ATTENTION_KINDS,
    ModelConfig,
    ModelError,
    kv_bytes,
    kv_layout,
)
from services.model.export import KVImporter, KVImportError, KVPiece, TensorSpec

log = logging.getLogger(__name__)


class PieceSpec(NamedTuple):
    """One piece: a layer's full-attention tokens [start, end), or its state (start == end)."""

    layer: int
    start: int
    end: int


def chunk_bounds(reused: int, length: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Token ranges of the computed suffix [reused, length), cut at multiples of
    chunk_tokens (0: one chunk)."""
    if chunk_tokens <= 0:
        return [(reused, length)]
    cuts = list(range((reused // chunk_tokens + 1) * chunk_tokens, length, chunk_tokens))
    edges = [reused, *cuts, length]
    return list(pairwise(edges))


def stream_plan(cfg: ModelConfig, chunks: list[tuple[int, int]],
                sent_from: int) -> list[list[PieceSpec]]:
    """Per chunk, the pieces exported as its layers finish, in order.

    The first chunk's full-attention pieces start at `sent_from` (the decode side holds the
    tokens before it; the prefill side may hold more than it computes), later chunks at
    their own start; states go once, in the last chunk."""
    length = chunks[-1][1]
    plan: list[list[PieceSpec]] = []
    for index, (start, end) in enumerate(chunks):
        low = sent_from if index == 0 else max(sent_from, start)
        pieces = []
        for layer, kind in enumerate(cfg.layer_kinds):
            if kind in FULL_ATTENTION_KINDS:
                if end > low:
                    pieces.append(PieceSpec(layer, low, end))
            elif end == length:
                pieces.append(PieceSpec(layer, length, length))
        plan.append(pieces)
    return plan


def step_ends(chunks: list[tuple[int, int]], n_layers: int,
              prefill_time: Callable[[int, int], float]) -> list[float]:
    """When each (chunk, layer) step of a paced prefill ends, in modeled seconds from its
    start: step k = chunk * n_layers + layer; a piece may leave once its step has ended.

    `prefill_time(new, cached)` is the modeled time of the whole suffix (CostModel): its
    length-dependent part is charged per chunk (a later chunk attends to a longer prefix),
    the fixed part spread evenly over the new tokens, each chunk's time evenly over layers."""
    reused, length = chunks[0][0], chunks[-1][1]
    fixed = prefill_time(0, reused)
    new = max(1, length - reused)

    def until(token: int) -> float:
        done = token - reused
        return prefill_time(done, reused) - fixed + fixed * done / new

    ends: list[float] = []
    for start, end in chunks:
        low, high = until(start), until(end)
        ends.extend(low + (high - low) * (layer + 1) / n_layers for layer in range(n_layers))
    return ends


def lane_of(sequence: int, lanes: int) -> int:
    """Pieces are dealt to lanes in turn, in the order they are produced."""
    return sequence % lanes


Computed = tuple[int, KVChunk]  # (step, piece): step = chunk * n_layers + layer


async def release(pieces: Mailbox[Computed], lanes: Sequence[Mailbox[KVChunk | KVClose]],
                  ends: Sequence[float], *, hold: bool = False) -> float:
    """Deals each computed piece to the next lane once its step has ended (`ends`, on the
    loop's clock; none: at once), or holds them all until the compute is done (`hold`: the
    one-after-the-other baseline). Returns when the compute is done: the last piece in, and
    the last step ended. Pieces that are in together are passed on together: mailboxes hand
    over a backlog without a trip through the scheduler, so the lane sends them in one write
    (an anyio memory stream took a loop turn per piece, and the lane a write per piece)."""
    held: list[tuple[int, KVChunk]] = []
    sequence = itertools.count()
    async for step, chunk in pieces:
        if ends:
            await anyio.sleep_until(ends[step])
        lane = lane_of(next(sequence), len(lanes))
        if hold:
            held.append((lane, chunk))
        else:
            lanes[lane].put_nowait(chunk)
    if ends:
        await anyio.sleep_until(ends[-1])
    compute_end = anyio.current_time()
    for lane, chunk in held:
        lanes[lane].put_nowait(chunk)
    return compute_end


def expected_kv_bytes(cfg: ModelConfig, length: int, start: int, dtype: str) -> int:
    """Payload bytes of an export of tokens [start, length): full-attention KV of the new
    tokens plus every fixed-size state (the pieces' headers come on top)."""
    return kv_bytes(cfg, length, dtype) - kv_layout(cfg, dtype).per_token * start


def stream_failure(
    group: BaseExceptionGroup[BaseException], request_id: str, peer: str
) -> Exception | None:
    """The error that started a failed stream (lane errors over the broken-channel echoes);
    None when only cancellation is in the group (it must propagate as it is)."""
    errors = [e for e in leaves(group) if isinstance(e, Exception)]
    if not errors:
        return None
    primary = next((e for e in errors if not isinstance(e, anyio.BrokenResourceError)),
                   errors[0])
    if isinstance(primary, DataPathError):
        return primary
    return KVTransferError(f"KV stream of {request_id!r} to {peer!r} failed: "
                           f"{type(primary).__name__}: {primary}")


def leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions inside a (nested) exception group, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _tensors(piece: KVPiece) -> list[torch.Tensor]:
    raw = torch.frombuffer(bytearray(piece.payload), dtype=torch.uint8)
    out, offset = [], 0
    for spec in piece.header.tensors:
        size = spec.nbytes()
        out.append(raw[offset : offset + size].view(torch_dtype(spec.dtype)).reshape(spec.shape))
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
    parts = [_tensors(p) for p in pieces]
    joined = [torch.cat(group, dim=1) for group in zip(*parts, strict=True)]  # [A, n, X] each
    payload = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                       for t in joined)
    first, last = pieces[0].header, pieces[-1].header
    specs = tuple(TensorSpec(s.name, s.dtype, tuple(t.shape))
                  for s, t in zip(first.tensors, joined, strict=True))
    header = msgspec.structs.replace(first, end=last.end, tensors=specs,
                                     payload_bytes=len(payload), checksum=zlib.crc32(payload))
    return KVPiece(header, payload)


def import_pieces(cfg: ModelConfig, dtype: str, base: RequestCache | None,
                  pieces: Mapping[tuple[int, int], bytes | memoryview]) -> RequestCache:
    """The cache rebuilt from a stream's pieces (in a worker thread: it copies tensors);
    KVTransferError says which piece did not fit."""
    by_layer: dict[int, list[KVPiece]] = {}
    try:
        for layer, start in sorted(pieces):
            by_layer.setdefault(layer, []).append(KVPiece.from_bytes(pieces[layer, start]))
        importer = KVImporter(cfg, dtype, base)
        for group in by_layer.values():
            importer.add(group[0] if len(group) == 1 else merge_pieces(group))
        return importer.finish()
    except ModelError as exc:
        raise KVTransferError(f"KV rejected: {exc}") from exc


def out_of_range(tokens: Sequence[int], vocab: int) -> int | None:
    """The first token id outside [0, vocab), or None (min and max run in C: prompts of the
    paper's lengths are tens of thousands of ids)."""
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab):
        return None
    return next(t for t in tokens if not 0 <= t < vocab)
