"""The request cache: block storage, rings, snapshots, prefix reuse, accounting, integrity."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.model.cache import CacheError, RequestCache, TokenKV, WindowKV
from services.model.config import FAMILIES, ModelConfig, family_config, kv_bytes
from services.model.generate import block_boundaries, prefill
from services.model.model import HybridLM, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def sharp(family: str) -> ModelConfig:
    return msgspec.structs.replace(family_config(family, "tiny"), init_std=0.1)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> HybridLM:
    return build_model(sharp(request.param), seed=2)


def test_token_kv_grows_in_blocks_and_slices() -> None:
    kv = TokenKV.empty([(2, 4), (2, 4)], 64, torch.float32, torch.device("cpu"))
    data = torch.arange(2 * 70 * 4, dtype=torch.float32).view(2, 70, 4)
    kv.append([data[:, :65], -data[:, :65]])
    assert (kv.length, kv.capacity) == (65, 128)
    kv.reserve(129)
    assert kv.capacity == 192
    kv.append([data[:, 65:], -data[:, 65:]])
    assert torch.equal(kv.views()[0], data) and torch.equal(kv.views()[1], -data)
    assert torch.equal(kv.token_range(3, 9)[0], data[:, 3:9])
    short = kv.truncated(10)
    assert short.length == 10 and torch.equal(short.views()[0], data[:, :10])
    with pytest.raises(CacheError, match="token range"):
        kv.token_range(5, 71)


def test_window_ring_roundtrip() -> None:
    window = 8
    k = torch.randn(1, 8, 2, 3)
    ring = WindowKV.from_chronological(k, -k, end=13, window=window)
    # Tokens 5..12 live in slots 5, 6, 7, 0, 1, 2, 3, 4.
    assert torch.equal(ring.k[:, 5:], k[:, :3]) and torch.equal(ring.k[:, :5], k[:, 3:])
    back_k, back_v = ring.chronological(13)
    assert torch.equal(back_k, k) and torch.equal(back_v, -k)
    young = WindowKV.from_chronological(k[:, :5], k[:, :5], end=5, window=window)
    assert torch.equal(young.chronological(5)[0], k[:, :5])
    assert not young.k[:, 5:].any()


@pytest.mark.parametrize("prefix_len", [64, 100, 1])
def test_prefix_reuse_equals_prefill_from_nothing(model: HybridLM, prefix_len: int) -> None:
    ids = tokens(230, seed=prefix_len)
    first = prefill(model, ids[:prefix_len])
    resumed = prefill(model, ids[prefix_len:], first.cache.resume_point(prefix_len),
                      all_logits=True)
    scratch = prefill(model, ids, all_logits=True)
    assert resumed.all_logits is not None and scratch.all_logits is not None
    torch.testing.assert_close(resumed.all_logits, scratch.all_logits[prefix_len:],
                               atol=1e-4, rtol=0)
    assert torch.equal(resumed.all_logits.argmax(-1), scratch.all_logits[prefix_len:].argmax(-1))
    assert first.cache.length == prefix_len  # resume_point copied, the original is intact
    resumed.cache.check_integrity()


def test_resume_from_snapshot_of_longer_prompt(model: HybridLM) -> None:
    long_ids, other = tokens(300, seed=7), tokens(90, seed=8)
    block = model.cfg.block_size
    cuts = block_boundaries(0, 300, block)
    assert cuts == [64, 128, 192, 256]
    long = prefill(model, long_ids, snapshot_at=cuts)
    long.cache.check_integrity()
    assert long.cache.statistics().snapshot_lengths == (64, 128, 192, 256)
    for cut in (128, 256):
        new_ids = torch.cat((long_ids[:cut], other))
        resumed = prefill(model, other, long.cache.resume_point(cut), all_logits=True)
        scratch = prefill(model, new_ids, all_logits=True)
        assert resumed.all_logits is not None and scratch.all_logits is not None
        torch.testing.assert_close(resumed.all_logits, scratch.all_logits[cut:],
                                   atol=1e-4, rtol=0)


def test_snapshots_from_an_unaligned_resume(model: HybridLM) -> None:
    ids = tokens(260, seed=9)
    head = prefill(model, ids[:100])
    tail = prefill(model, ids[100:], head.cache, snapshot_at=[128, 192, 256])
    direct = prefill(model, ids[:192])
    snap_cache = tail.cache.resume_point(192)
    more = tokens(20, seed=10)
    a = prefill(model, more, snap_cache, all_logits=True).all_logits
    b = prefill(model, more, direct.cache, all_logits=True).all_logits
    assert a is not None and b is not None
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_resume_point_and_snapshot_errors(model: HybridLM) -> None:
    result = prefill(model, tokens(130, seed=1), snapshot_at=[64])
    with pytest.raises(CacheError, match="snapshot"):
        result.cache.resume_point(128)
    with pytest.raises(CacheError, match="snapshot_at"):
        prefill(model, tokens(10, seed=2), snapshot_at=[100])
    with pytest.raises(CacheError, match="snapshot_at"):
        prefill(model, tokens(100, seed=2), snapshot_at=[96])


def test_statistics_and_accounting(model: HybridLM) -> None:
    cache = prefill(model, tokens(65, seed=4)).cache
    stats = cache.statistics()
    assert stats.length == 65 and stats.full_blocks == 1
    assert stats.payload_bytes == kv_bytes(model.cfg, 65)
    assert stats.allocated_bytes >= stats.payload_bytes
    assert stats.snapshot_lengths == () and stats.snapshot_bytes == 0


def test_check_integrity_catches_corruption(model: HybridLM) -> None:
    cache = prefill(model, tokens(40, seed=5)).cache
    cache.check_integrity()
    broken = cache.clone()
    broken.length += 1
    with pytest.raises(CacheError):
        broken.check_integrity()
    swapped = cache.clone()
    swapped.layers.reverse()
    if model.cfg.layer_kinds != tuple(reversed(model.cfg.layer_kinds)):
        with pytest.raises(CacheError):
            swapped.check_integrity()


def test_empty_cache_prefill_rejects_foreign_cache(model: HybridLM) -> None:
    other_cfg = msgspec.structs.replace(model.cfg, window=64)
    with pytest.raises(CacheError, match="config"):
        prefill(model, tokens(5, seed=1), RequestCache.empty(other_cfg))
