"""KV export/import: byte accounting, incremental export, validation, and a real second process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from services.model.batch import DecodeBatch
from services.model.cache import LinearState, RequestCache, TokenKV, WindowKV
from services.model.config import FAMILIES, kv_bytes, kv_bytes_split
from services.model.export import (
    KVDtypeError,
    KVImporter,
    KVImportError,
    KVPiece,
    export_cache,
    export_layer,
    import_cache,
)
from services.model.generate import generate, prefill
from services.model.kv_replay import ReplayJob, ReplayResult
from services.model.model import HybridLM, build_model
from services.model.sampling import SamplingParams
from tests.tiny_models import sharp, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> HybridLM:
    return build_model(sharp(request.param), seed=6)


def payload(pieces: list[KVPiece]) -> int:
    return sum(len(p.payload) for p in pieces)


def assert_same_cache(a: RequestCache, b: RequestCache, kv_from: int = 0) -> None:
    """Equal bit for bit (full-attention KV only from token `kv_from` on)."""
    assert a.length == b.length
    for x, y in zip(a.layers, b.layers, strict=True):
        if isinstance(x, TokenKV) and isinstance(y, TokenKV):
            assert all(torch.equal(p[:, kv_from:], q[:, kv_from:])
                       for p, q in zip(x.views(), y.views(), strict=True))
        elif isinstance(x, LinearState) and isinstance(y, LinearState):
            assert torch.equal(x.state, y.state) and torch.equal(x.conv_tail, y.conv_tail)
        elif isinstance(x, WindowKV) and isinstance(y, WindowKV):
            assert torch.equal(x.chronological(a.length)[0], y.chronological(b.length)[0])
            assert torch.equal(x.chronological(a.length)[1], y.chronological(b.length)[1])
        else:
            raise AssertionError(f"layer types differ: {type(x)} vs {type(y)}")


def test_export_bytes_equal_the_formula(model: HybridLM) -> None:
    cfg = model.cfg
    fixed, per_token = kv_bytes_split(cfg)
    ids = tokens(300, seed=1)
    cache = RequestCache.empty(cfg)
    for length in (1, 63, 64, 65, 300):
        prefill(model, ids[cache.length : length], cache)
        pieces = export_cache(cache)
        assert payload(pieces) == kv_bytes(cfg, length) == cache.payload_bytes()
        if length >= cfg.window:
            assert payload(pieces) == fixed + per_token * length
        # Headers are small next to the payload and each frame decodes back to itself.
        frames = [p.to_bytes() for p in pieces]
        assert all(len(f) - len(p.payload) < 400 for f, p in zip(frames, pieces, strict=True))
        assert [KVPiece.from_bytes(f) for f in frames] == pieces


@pytest.mark.parametrize("held_blocks", [1, 3])
def test_incremental_export_carries_only_what_is_missing(model: HybridLM,
                                                         held_blocks: int) -> None:
    cfg = model.cfg
    fixed, per_token = kv_bytes_split(cfg)
    ids = tokens(300, seed=2)
    decode_side = prefill(model, ids[: held_blocks * 64]).cache  # holds n whole blocks
    full = prefill(model, ids).cache
    pieces = export_cache(full, start=held_blocks * 64)
    assert payload(pieces) == (300 - held_blocks * 64) * per_token + fixed
    rebuilt = import_cache(cfg, [p.to_bytes() for p in pieces], base=decode_side)
    # The held prefix comes from the decode side's own cache, the rest from the export.
    assert_same_cache(rebuilt, full, kv_from=held_blocks * 64)
    for i, layer in enumerate(rebuilt.layers):
        if isinstance(layer, TokenKV):
            held = decode_side.token_kv(i).views()[0]
            assert torch.equal(layer.views()[0][:, : held_blocks * 64], held)
    assert_same_cache(import_cache(cfg, export_cache(full)), full)


def test_layerwise_streaming_during_prefill(model: HybridLM) -> None:
    ids = tokens(150, seed=3)
    cache = RequestCache.empty(model.cfg)
    importer = KVImporter(model.cfg)
    # Each layer's piece is exported as soon as the layer finishes, in layer order.
    result = prefill(model, ids, cache,
                     on_layer=lambda i: importer.add(export_layer(cache, i, 0, 150).to_bytes()))
    assert importer.statistics().missing_layers == ()
    assert importer.statistics().payload_bytes == kv_bytes(model.cfg, 150)
    assert_same_cache(importer.finish(), result.cache)


def test_import_validation_names_the_field(model: HybridLM) -> None:
    cfg = model.cfg
    cache = prefill(model, tokens(70, seed=4)).cache
    pieces = export_cache(cache)

    def rejects(field: str, piece: KVPiece | bytes, **kwargs: object) -> None:
        importer = KVImporter(**{"cfg": cfg, **kwargs})  # type: ignore[arg-type]
        with pytest.raises(KVImportError) as info:
            importer.add(piece)
        assert info.value.field == field

    header = pieces[0].header
    changes: list[tuple[str, dict[str, object]]] = [
        ("family", {"family": "other"}), ("config_hash", {"config_hash": "x"}),
        ("dtype", {"dtype": "bfloat16"}), ("layer", {"layer": 99}),
        ("checksum", {"checksum": header.checksum ^ 1}),
    ]
    for field, change in changes:
        bad = KVPiece(msgspec.structs.replace(header, **change), pieces[0].payload)
        rejects(field, bad)
    flipped = bytearray(pieces[0].payload)
    flipped[0] ^= 0xFF
    rejects("checksum", KVPiece(header, bytes(flipped)))
    rejects("tensors", KVPiece(msgspec.structs.replace(
        header, tensors=header.tensors[:1]), pieces[0].payload))
    rejects("dtype", pieces[0], dtype="bfloat16")
    with pytest.raises(KVDtypeError, match="piece is float32 but this importer serves bfloat16"):
        KVImporter(cfg, "bfloat16").add(pieces[0].to_bytes())
    with pytest.raises(KVImportError, match="base cache"):
        KVImporter(cfg, "bfloat16", base=cache)
    importer = KVImporter(cfg)
    importer.add(pieces[0])
    with pytest.raises(KVImportError, match="each layer once"):
        importer.add(pieces[0])
    with pytest.raises(KVImportError, match="missing"):
        importer.finish()
    # A full-attention range starting beyond what the decode side holds is refused.
    attn = next(i for i, k in enumerate(cfg.layer_kinds) if k in ("mla", "gqa"))
    with pytest.raises(KVImportError) as info:
        KVImporter(cfg).add(export_cache(cache, start=64)[attn])
    assert info.value.field == "start"


def test_bfloat16_roundtrip_and_snapshot_trim() -> None:
    cfg = sharp("qwen-next")
    model = build_model(cfg, seed=8, dtype="bfloat16")
    result = prefill(model, tokens(140, seed=5), snapshot_at=[64, 128])
    cache = result.cache
    pieces = export_cache(cache)
    assert payload(pieces) == kv_bytes(cfg, 140, "bfloat16") < kv_bytes(cfg, 140)
    rebuilt = import_cache(cfg, [p.to_bytes() for p in pieces], "bfloat16")
    assert_same_cache(rebuilt, cache)
    assert rebuilt.dtype == torch.bfloat16
    cache.discard_snapshots(keep=[128])
    assert cache.statistics().snapshot_lengths == (128,)
    # bf16 decode runs on the imported cache exactly as on the original.
    params = SamplingParams(max_new_tokens=6, stop_on_eos=False)
    outputs = []
    for start in (cache, rebuilt):
        batch = DecodeBatch(model)
        batch.join("r", start, int(result.logits.argmax()), params)
        outputs.append([e.token for _ in range(5) for e in batch.step().events])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_here_decode_in_another_process(tmp_path: Path, dtype: str) -> None:
    """Greedy, 64 tokens, all four families: export, import in a subprocess, decode; the
    same dtype on both sides gives the same tokens bit for bit."""
    jobs, expected = [], []
    for i, family in enumerate(FAMILIES):
        model = build_model(sharp(family), seed=7, dtype=dtype)
        prompt = tokens(90 + 37 * i, seed=i)
        expected.append(generate(model, prompt, 64, stop_on_eos=False).tokens)
        first = prefill(model, prompt)
        pieces = [p.to_bytes() for p in export_cache(first.cache)]
        params = SamplingParams(max_new_tokens=64, stop_on_eos=False)
        jobs.append(ReplayJob(model.cfg, 7, dtype, pieces, int(first.logits.argmax()),
                              params))
    jobs_file, results_file = tmp_path / "jobs.msgpack", tmp_path / "results.msgpack"
    jobs_file.write_bytes(msgspec.msgpack.encode(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "services.model.kv_replay", str(jobs_file),
                    str(results_file)], cwd=ROOT, env=env, check=True, timeout=100)
    results = msgspec.msgpack.decode(results_file.read_bytes(), type=list[ReplayResult])
    assert [r.tokens for r in results] == expected
    assert all(len(r.tokens) == 64 and r.finish_reason == "length" for r in results)
