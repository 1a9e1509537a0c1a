"""The model engine's configs, attention kernels against their references, and the LM."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.model.attention import (
    causal_attention,
    causal_attention_reference,
    padded_decode_attention,
    ragged_decode_attention,
    ragged_decode_attention_reference,
    sliding_window_attention,
    sliding_window_attention_reference,
    window_decode_attention,
)
from services.model.config import (
    FAMILIES,
    ModelConfig,
    ModelConfigError,
    family_config,
    kv_bytes,
    kv_bytes_split,
    prefill_flops,
)
from services.model.generate import prefill
from services.model.model import HybridLM, build_model, count_params
from services.model.norm import RMSNorm, rms_norm_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def sharp(family: str) -> ModelConfig:
    """Tiny config with a larger init so logits are decisive and errors would show."""
    return msgspec.structs.replace(family_config(family, "tiny"), init_std=0.1)


def test_config_hash_is_stable_and_field_sensitive() -> None:
    cfg = family_config("kimi-linear")
    again = msgspec.json.decode(msgspec.json.encode(cfg), type=ModelConfig)
    assert again == cfg
    assert again.config_hash() == cfg.config_hash()
    assert len(cfg.config_hash()) == 16
    assert msgspec.structs.replace(cfg, window=64).config_hash() != cfg.config_hash()
    hashes = {family_config(f, s).config_hash() for f in FAMILIES for s in ("default", "tiny")}
    assert len(hashes) == 8


@pytest.mark.parametrize(
    ("family", "pattern"),
    [("kimi-linear", ("kda", "kda", "kda", "mla")),
     ("mimo", ("swa",) * 5 + ("gqa",)),
     ("qwen-next", ("gdn", "gdn", "gdn", "gqa")),
     ("dense", ("gqa",) * 4)],
)
def test_family_layer_ratios(family: str, pattern: tuple[str, ...]) -> None:
    assert family_config(family, "tiny").layer_kinds == pattern
    assert family_config(family).layer_kinds == pattern * 2
    assert family_config(family).attn_output_gate == (family == "qwen-next")


def test_config_errors_name_the_parameter() -> None:
    with pytest.raises(ModelConfigError, match="family"):
        family_config("llama")
    with pytest.raises(ModelConfigError, match="size"):
        family_config("dense", size="huge")
    with pytest.raises(ModelConfigError, match="n_kv_heads"):
        msgspec.structs.replace(family_config("dense"), n_kv_heads=4)
    with pytest.raises(ModelConfigError, match="block_size"):
        msgspec.structs.replace(family_config("dense"), block_size=48)


def test_default_sizes_param_counts() -> None:
    counts = {f: count_params(HybridLM(family_config(f))) for f in FAMILIES}
    assert all(3_000_000 < n < 22_000_000 for n in counts.values()), counts


def test_kv_bytes_split_per_family() -> None:
    # fp32, default sizes: full attention per token; linear states + full windows fixed.
    assert kv_bytes_split(family_config("dense")) == (0, 8 * 2 * 2 * 64 * 4)
    assert kv_bytes_split(family_config("kimi-linear"))[1] == 2 * 128 * 4
    linear = 6 * 64 * 64 * 4 + 3 * 3 * 6 * 64 * 4
    assert kv_bytes_split(family_config("qwen-next")) == (6 * linear, 2 * 2 * 2 * 64 * 4)
    mimo = family_config("mimo")
    fixed, per_token = kv_bytes_split(mimo)
    assert fixed == 10 * 128 * 2 * 2 * 64 * 4
    assert kv_bytes(mimo, 300) == fixed + per_token * 300
    assert kv_bytes(mimo, 100) == fixed - 28 * 10 * 2 * 2 * 64 * 4 + per_token * 100
    assert kv_bytes_split(mimo, "bfloat16") == (fixed // 2, per_token // 2)


@pytest.mark.parametrize(("t", "length", "hq", "hkv"), [(63, 63, 4, 2), (1, 1, 2, 2),
                                                          (37, 100, 4, 1), (1, 70, 4, 2)])
def test_causal_attention_matches_reference(t: int, length: int, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(t * length)
    q = torch.randn(2, hq, t, 16, generator=gen)
    k = torch.randn(2, hkv, length, 16, generator=gen)
    v = torch.randn(2, hkv, length, 16, generator=gen)
    torch.testing.assert_close(causal_attention(q, k, v), causal_attention_reference(q, k, v))


@pytest.mark.parametrize(("t", "prefix", "window"), [(63, 0, 16), (1, 0, 16), (100, 16, 16),
                                                      (5, 7, 16), (300, 128, 128), (40, 3, 8)])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_sliding_window_matches_reference(t: int, prefix: int, window: int,
                                          with_sinks: bool) -> None:
    gen = torch.Generator().manual_seed(t + prefix)
    q = torch.randn(2, t, 4, 8, generator=gen)
    k = torch.randn(2, prefix + t, 2, 8, generator=gen)
    v = torch.randn(2, prefix + t, 2, 8, generator=gen)
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    fast = sliding_window_attention(q, k, v, window, sinks)
    torch.testing.assert_close(fast, sliding_window_attention_reference(q, k, v, window, sinks))


def test_sinks_take_probability_mass() -> None:
    q, k, v = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.ones(1, 4, 2, 8)
    # Equal scores over n keys plus a sink logit 0: each output is n / (n + 1).
    out = sliding_window_attention(q, k, v, 16, torch.zeros(2))
    expected = torch.tensor([1, 2, 3, 4]) / torch.tensor([2, 3, 4, 5])
    torch.testing.assert_close(out[0, :, 0, 0], expected.float())


def test_window_decode_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    window, positions = 8, [3, 8, 20]
    outs = []
    for i, pos in enumerate(positions):
        # Keys of tokens max(0, pos - W) .. pos in order; the ring holds all but the last.
        n = min(pos, window)
        k = torch.randn(1, n + 1, 2, 8, generator=gen)
        v = torch.randn(1, n + 1, 2, 8, generator=gen)
        q = torch.randn(1, 1, 4, 8, generator=gen)
        sinks = torch.randn(4, generator=gen)
        ring_k = torch.zeros(1, window, 2, 8)
        ring_v = torch.zeros(1, window, 2, 8)
        slots = torch.arange(pos - n, pos) % window
        ring_k[:, slots], ring_v[:, slots] = k[:, :n], v[:, :n]
        got = window_decode_attention(q[:, 0], ring_k, ring_v, k[:, n], v[:, n],
                                      torch.tensor([pos]), sinks)
        want = sliding_window_attention_reference(q, k, v, window, sinks)[:, 0]
        outs.append((got, want, i))
    for got, want, _ in outs:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_forward(family: str) -> None:
    model = build_model(sharp(family), seed=1)
    ids = torch.randint(1, 512, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids[None])[0]
    result = prefill(model, ids, all_logits=True)
    assert result.all_logits is not None
    assert full.abs().max() > 1.0  # the check below is not vacuous
    torch.testing.assert_close(result.all_logits, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_reaches_every_parameter(family: str) -> None:
    model = build_model(family_config(family, "tiny"), seed=0).train()
    ids = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    assert logits.shape == (2, 70, 512)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 512),
                                             ids[:, 1:].reshape(-1))
    torch.autograd.backward(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


def test_same_seed_same_weights_bf16_runs() -> None:
    cfg = family_config("kimi-linear", "tiny")
    a, b = build_model(cfg, seed=5), build_model(cfg, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.embed.weight, build_model(cfg, seed=6).embed.weight)
    half = build_model(cfg, seed=5, dtype="bfloat16")
    ids = torch.arange(1, 80)
    with torch.no_grad():
        ref = a(ids[None])[0, -1]
    out = prefill(half, ids).logits
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.nn.functional.cosine_similarity(out, ref, dim=0) > 0.99


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_flops_counts_the_real_weights(family: str) -> None:
    cfg = family_config(family, "tiny")
    model = build_model(cfg)
    weights = sum(p.numel() for n, p in model.named_parameters()
                  if p.dim() == 2 and not n.startswith("embed") and "conv_weight" not in n)
    head = 2 * cfg.vocab_size * cfg.d_model
    # Differences in T cancel the head; the rest grows by 2 x weights per token plus mixing.
    per_token = prefill_flops(cfg, 2) - prefill_flops(cfg, 1)
    assert per_token >= 2 * weights
    assert prefill_flops(cfg, 1) > head + 2 * weights
    # Attention work grows with the prefix for full attention only (MLA also re-expands).
    grows = prefill_flops(cfg, 10, prefix=500) > prefill_flops(cfg, 10, prefix=200)
    assert grows == any(k in ("mla", "gqa") for k in cfg.layer_kinds)


def test_window_pairs_count() -> None:
    from services.model.config import _window_pairs

    for prefix, n, window in [(0, 10, 4), (3, 10, 4), (7, 3, 4), (0, 1, 128), (100, 300, 128)]:
        assert _window_pairs(prefix, n, window) == sum(
            min(p, window) + 1 for p in range(prefix, prefix + n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_reference(dtype: torch.dtype) -> None:
    """The fused kernel against the six-step fp32 formula, rounded once: equal in both dtypes,
    gradients included (training goes through the same module)."""
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(96)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=gen)
    norm = norm.to(dtype)
    x = (torch.randn(3, 17, 96, generator=gen) * 4).to(dtype).requires_grad_()
    fast, ref = norm(x), rms_norm_reference(x, norm.weight, norm.eps)
    assert fast.dtype == dtype and torch.equal(fast, ref)
    grads = [torch.autograd.grad(y.float().square().sum(), x)[0] for y in (fast, ref)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5)


@pytest.mark.parametrize(("hq", "hkv", "shared"), [(4, 2, False), (6, 1, True), (2, 2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_decode_attention_matches_reference(hq: int, hkv: int, shared: bool,
                                                   dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    lengths = [1, 37, 64, 5]
    q = torch.randn(len(lengths), hq, 16, generator=gen).to(dtype)
    keys = [torch.randn(hkv, n, 16, generator=gen).to(dtype) for n in lengths]
    values = None if shared else [torch.randn(hkv, n, 16, generator=gen).to(dtype)
                                  for n in lengths]
    got = ragged_decode_attention(q, keys, values, scale=0.3)
    want = ragged_decode_attention_reference(q, keys, values, scale=0.3)
    assert got.dtype == dtype and got.shape == (4, hq, 16)
    torch.testing.assert_close(got, want)
    # Padding is invisible: a request alone gives its row of the batch.
    alone = ragged_decode_attention(q[1:2], keys[1:2], None if values is None else values[1:2],
                                    scale=0.3)
    torch.testing.assert_close(alone[0], got[1])


@pytest.mark.parametrize(("hq", "hkv", "shared"), [(4, 2, False), (6, 1, True)])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_padded_decode_attention_matches_reference(hq: int, hkv: int, shared: bool,
                                                   dtype: torch.dtype, tol: float) -> None:
    """bf16: scores are rounded once to bf16 (q.k of std ~2.5 here, so about 1e-2 absolute)
    and the output once more; the outputs (std ~0.3) stay within 2e-2 of the fp32 reference."""
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    lengths = [1, 37, 64, 5]
    q = torch.randn(len(lengths), hq, 16, generator=gen).to(dtype)
    # Rows longer than any request, past each length filled with large finite junk (a batch
    # row keeps what an earlier member left there): it must be masked out.
    k = (100 * torch.randn(len(lengths), hkv, 80, 16, generator=gen)).to(dtype)
    v = k if shared else (100 * torch.randn(len(lengths), hkv, 80, 16, generator=gen)).to(dtype)
    for i, n in enumerate(lengths):
        k[i, :, :n] = torch.randn(hkv, n, 16, generator=gen).to(dtype)
        if not shared:
            v[i, :, :n] = torch.randn(hkv, n, 16, generator=gen).to(dtype)
    got = padded_decode_attention(q, k, None if shared else v, torch.tensor(lengths), scale=0.6)
    want = ragged_decode_attention_reference(
        q.float(), [k[i, :, :n].float() for i, n in enumerate(lengths)],
        None if shared else [v[i, :, :n].float() for i, n in enumerate(lengths)], scale=0.6)
    assert got.dtype == dtype and got.shape == (4, hq, 16)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
