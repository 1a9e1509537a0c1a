"""The KV stream format: chunking, the piece plan, merging consecutive pieces, assembly."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.contract.errors import KVTransferError
from services.contract.messages import KVChunk, KVOpen
from services.model.cache import RequestCache
from services.model.config import family_config
from services.model.export import (
    KVImportError,
    KVPiece,
    export_cache,
    export_layer,
    merge_pieces,
)
from services.model.generate import prefill
from services.model.model import build_model
from services.worker.engine import PieceSpec, import_pieces
from services.worker.kv_in import KVAssembly
from services.worker.kv_out import chunk_bounds, lane_of, stream_plan
from services.worker.request_checks import out_of_range, out_of_range_reference


def tokens(n: int) -> list[int]:
    return [(i * 7) % 500 + 1 for i in range(n)]


def test_chunk_bounds_cut_at_multiples_of_the_chunk() -> None:
    assert chunk_bounds(0, 150, 64) == [(0, 64), (64, 128), (128, 150)]
    assert chunk_bounds(64, 200, 128) == [(64, 128), (128, 200)]
    assert chunk_bounds(128, 300, 512) == [(128, 300)]
    assert chunk_bounds(0, 128, 64) == [(0, 64), (64, 128)]
    assert chunk_bounds(0, 300, 0) == [(0, 300)]


def test_stream_plan_sends_states_once_and_only_missing_tokens() -> None:
    cfg = family_config("kimi-linear", "tiny")  # kda, kda, kda, mla
    states = [PieceSpec(i, 150, 150) for i in range(3)]
    assert stream_plan(cfg, [(0, 64), (64, 128), (128, 150)], 0) == [
        [PieceSpec(3, 0, 64)], [PieceSpec(3, 64, 128)], [*states, PieceSpec(3, 128, 150)]]
    assert stream_plan(cfg, [(64, 128), (128, 150)], 128) == [
        [], [*states, PieceSpec(3, 128, 150)]]
    # The prefill side resumed further than the decode side holds: send from what it holds.
    assert stream_plan(cfg, [(128, 150)], 64) == [[*states, PieceSpec(3, 64, 150)]]
    assert [lane_of(i, 3) for i in range(5)] == [0, 1, 2, 0, 1]


def test_merged_pieces_equal_one_export_of_the_whole_range() -> None:
    cfg = family_config("qwen-next", "default")  # GQA with 2 KV heads: [2, n, 64] tensors
    cache = RequestCache.empty(cfg)
    layer = cfg.layer_kinds.index("gqa")
    generator = torch.Generator().manual_seed(0)
    kv = cache.token_kv(layer)
    kv.append([torch.randn(b.shape[0], 150, b.shape[2], generator=generator)
               for b in kv.buffers])
    cache.length = 150
    parts = [export_layer(cache, layer, a, b) for a, b in ((0, 64), (64, 128), (128, 150))]
    merged = merge_pieces(parts)
    whole = export_layer(cache, layer, 0, 150)
    assert merged.header == whole.header
    assert merged.payload == whole.payload


def test_merge_refuses_corrupt_or_gapped_pieces() -> None:
    model = build_model(family_config("kimi-linear", "tiny"), seed=0)
    cache = prefill(model, tokens(150)).cache
    a, b, c = (export_layer(cache, 3, x, y) for x, y in ((0, 64), (64, 128), (128, 150)))
    corrupt = KVPiece(b.header, bytes([b.payload[0] ^ 1]) + b.payload[1:])
    with pytest.raises(KVImportError, match="checksum"):
        merge_pieces([a, corrupt, c])
    with pytest.raises(KVImportError, match="start expected 64, got 128"):
        merge_pieces([a, c])


def test_import_of_chunked_pieces_equals_the_cache() -> None:
    model = build_model(family_config("kimi-linear", "tiny"), seed=0)
    cache = prefill(model, tokens(150)).cache
    pieces = {(3, x): export_layer(cache, 3, x, y).to_bytes()
              for x, y in ((0, 64), (64, 128), (128, 150))}
    pieces.update({(i, 150): export_layer(cache, i).to_bytes() for i in range(3)})
    rebuilt = import_pieces(model.cfg, "float32", None, pieces)
    whole = import_pieces(model.cfg, "float32", None,
                          {(i, 0): p.to_bytes() for i, p in enumerate(export_cache(cache))})
    assert rebuilt.length == whole.length == 150
    torch.testing.assert_close(rebuilt.token_kv(3).views()[0], whole.token_kv(3).views()[0])
    del pieces[(3, 64)]
    with pytest.raises(KVTransferError, match="KV rejected"):
        import_pieces(model.cfg, "float32", None, pieces)


def opening(lane: int, **change: object) -> KVOpen:
    base = KVOpen(request_id="r", family="f", config_hash="h", dtype="float32", start=0,
                  end=10, pieces=1, lane=lane, lanes=2)
    return msgspec.structs.replace(base, **change)


@pytest.mark.trio
async def test_assembly_is_ready_when_every_lane_closed_and_the_first_token_known() -> None:
    assembly = KVAssembly("r", 0.0)
    assembly.open_lane(opening(0))
    assembly.add(KVChunk(request_id="r", layer=0, start=0, data=b"x"))
    with pytest.raises(KVTransferError, match="arrived twice"):
        assembly.add(KVChunk(request_id="r", layer=0, start=0, data=b"x"))
    with pytest.raises(KVTransferError, match="end=11, an earlier lane said 10"):
        assembly.open_lane(opening(1, end=11))
    with pytest.raises(KVTransferError, match="must be a new lane in \\[0, 2\\), got 0"):
        assembly.open_lane(opening(0))
    assembly.open_lane(opening(1))
    assembly.close_lane(0)
    assembly.close_lane(1)
    assert not assembly.ready
    assembly.first_token = 5
    assert assembly.ready and assembly.finished
    assembly.fail(KVTransferError("late"))
    assert assembly.failure is not None


@pytest.mark.trio
async def test_a_small_piece_does_not_keep_the_large_read_it_came_in_alive() -> None:
    read = bytes(1 << 20)
    assembly = KVAssembly("r", 0.0)
    assembly.add(KVChunk(request_id="r", layer=0, data=memoryview(read)[:100]))
    assembly.add(KVChunk(request_id="r", layer=1, data=memoryview(read)[:900_000]))
    small, large = assembly.pieces[0, 0], assembly.pieces[1, 0]
    assert small.obj is not read and bytes(small) == read[:100]
    assert large.obj is read  # most of its buffer: kept as it came, no copy
    assert assembly.nbytes == 900_100


@pytest.mark.parametrize("tokens", [[], [0, 5, 9], [3, 10, 2], [-1, 4], [4, 9, 12, -3], [10]])
def test_out_of_range_names_the_first_bad_id_as_a_scan_does(tokens: list[int]) -> None:
    expected = next((t for t in tokens if not 0 <= t < 10), None)
    assert out_of_range(tokens, 10) == expected


# Ids around the fast path's edges: 0, the vocab, 2**31 and 2**32 (C int and unsigned int).
_EDGES = [0, 1, 9, 10, 11, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, -1, -(2**31), -(2**33)]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.one_of(st.sampled_from(_EDGES), st.integers(-20, 2**33)), max_size=40),
       vocab=st.sampled_from([1, 10, 2**31, 2**32, 2**32 + 1, 2**40]))
def test_out_of_range_equals_its_reference(tokens: list[int], vocab: int) -> None:
    assert out_of_range(tokens, vocab) == out_of_range_reference(tokens, vocab)
    assert out_of_range(tuple(tokens), vocab) == out_of_range_reference(tokens, vocab)
