"""causal_attention_rows: the row-block causal attention bf16 prefill takes on CPUs with
AVX512-BF16 but no AMX, against the fp32 reference, and when causal_attention takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.model import attention
from services.model.attention import (
    causal_attention,
    causal_attention_reference,
    causal_attention_rows,
    rows_kernel_applies,
)


def _inputs(t: int, length: int, hq: int, hkv: int, dtype: torch.dtype,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as the layers make them: [B, T, H, D] memory seen as [B, H, T, D].
    q = torch.randn(2, t, hq, 32, generator=gen).transpose(1, 2) * 2
    k = torch.randn(2, length, hkv, 32, generator=gen).transpose(1, 2) * 2
    v = torch.randn(2, length, hkv, 32, generator=gen).transpose(1, 2)
    return q.to(dtype), k.to(dtype), v.to(dtype)


SHAPES = [(40, 40, 4, 2), (1, 1, 2, 2), (37, 100, 4, 1), (33, 33, 6, 6), (64, 64, 3, 3),
          (17, 90, 6, 2)]


@pytest.mark.parametrize(("t", "length", "hq", "hkv"), SHAPES)
def test_rows_kernel_matches_reference_in_fp32(t: int, length: int, hq: int, hkv: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 16 rows: every shape above spans several, with a partial last one.
    monkeypatch.setattr(attention, "_ROWS", 16)
    q, k, v = _inputs(t, length, hq, hkv, torch.float32, seed=t + length)
    torch.testing.assert_close(causal_attention_rows(q, k, v),
                               causal_attention_reference(q, k, v))


@pytest.mark.parametrize(("t", "length", "hq", "hkv"), SHAPES)
def test_rows_kernel_in_bf16_is_as_close_as_the_flash_kernel(
        t: int, length: int, hq: int, hkv: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_ROWS", 16)
    q, k, v = _inputs(t, length, hq, hkv, torch.bfloat16, seed=t * length)
    exact = causal_attention_reference(q.float(), k.float(), v.float())
    rows = causal_attention_rows(q, k, v)
    assert rows.dtype == torch.bfloat16
    # The stated bf16 tolerance: P and the output rounded to bf16 (8 significant bits).
    torch.testing.assert_close(rows.float(), exact, atol=2e-2, rtol=1.6e-2)
    mask = torch.arange(length)[None, :] <= torch.arange(length - t, length)[:, None]
    flash = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
    # Mean error within 1.5x of torch's kernel on the same bf16 inputs.
    assert (rows.float() - exact).abs().mean() <= 1.5 * (flash.float() - exact).abs().mean()


def test_rows_kernel_result_is_a_view_of_token_major_memory() -> None:
    q, k, v = _inputs(20, 20, 4, 2, torch.bfloat16)
    o = causal_attention_rows(q, k, v)
    assert o.shape == (2, 4, 20, 32)
    assert o.transpose(1, 2).is_contiguous()  # [B, T, H, D]: heads merge without a copy


def test_rows_kernel_applies_to_bf16_inference_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_rows_kernel_host", lambda: True)
    q, k, v = _inputs(8, 8, 2, 2, torch.bfloat16)
    assert rows_kernel_applies(q, k, v)
    assert not rows_kernel_applies(q.float(), k.float(), v.float())
    assert not rows_kernel_applies(q.requires_grad_(), k, v)
    with torch.no_grad():
        assert rows_kernel_applies(q, k, v)
    monkeypatch.setattr(attention, "_rows_kernel_host", lambda: False)
    assert not rows_kernel_applies(q.detach(), k, v)


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx512_bf16", "avx512f"}, True),            # AVX512-BF16 without AMX: MKL's bf16 path
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, False),  # AMX: the flash kernel's own path
    ({"avx2"}, False),                             # no native bf16: the model serves fp32
])
def test_rows_kernel_host_rule(flags: set[str], expected: bool,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(attention, "cpu_has_native_bf16",
                        lambda: bool({"avx512_bf16", "amx_bf16"} & flags))
    assert attention._rows_kernel_host.__wrapped__() == (expected and attention._onednn_linear())


def test_causal_attention_takes_the_rows_kernel_where_it_applies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _inputs(24, 30, 4, 2, torch.bfloat16)
    monkeypatch.setattr(attention, "_rows_kernel_host", lambda: True)
    torch.testing.assert_close(causal_attention(q, k, v), causal_attention_rows(q, k, v),
                               atol=0, rtol=0)
    monkeypatch.setattr(attention, "_rows_kernel_host", lambda: False)
    sdpa = causal_attention(q, k, v)
    torch.testing.assert_close(sdpa.float(), causal_attention_rows(q, k, v).float(),
                               atol=2e-2, rtol=1.6e-2)


def test_rows_kernel_without_onednn_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where torch lacks oneDNN's linear the scores come from a plain matmul: same maths.
    monkeypatch.setattr(attention, "_onednn_linear", lambda: False)
    monkeypatch.setattr(attention, "_ROWS", 16)
    q, k, v = _inputs(37, 100, 4, 1, torch.float32, seed=5)
    torch.testing.assert_close(causal_attention_rows(q, k, v),
                               causal_attention_reference(q, k, v))
