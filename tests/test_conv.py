"""Tests for services.model.conv: the short causal depthwise convolution and its tail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from services.model.config import ModelError
from services.model.conv import (
    ConvError,
    causal_conv1d,
    causal_conv1d_reference,
    causal_conv1d_step,
)

TOL = 1e-6


def make_inputs(
    t: int, *, b: int = 2, c: int = 12, k: int = 4, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, c, generator=gen)
    weight = torch.randn(c, k, generator=gen)
    tail = torch.randn(b, k - 1, c, generator=gen)
    return x, weight, tail


def max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 63])
def test_fast_equals_reference(t: int, with_tail: bool) -> None:
    x, weight, tail = make_inputs(t, seed=t)
    tail_arg = tail if with_tail else None
    y_ref, tail_ref = causal_conv1d_reference(x, weight, tail_arg)
    y, new_tail = causal_conv1d(x, weight, tail_arg)
    assert y.shape == x.shape and new_tail.shape == (2, 3, 12)
    assert max_err(y, y_ref) <= TOL
    assert torch.equal(new_tail, tail_ref)


@pytest.mark.parametrize(("b", "c", "t"), [(3, 70, 33), (1, 1, 5), (2, 130, 1)])
def test_odd_sizes(b: int, c: int, t: int) -> None:
    x, weight, tail = make_inputs(t, b=b, c=c, seed=c)
    y_ref, tail_ref = causal_conv1d_reference(x, weight, tail)
    y, new_tail = causal_conv1d(x, weight, tail)
    assert y.is_contiguous() and y.shape == (b, t, c)
    assert max_err(y, y_ref) <= TOL
    assert torch.equal(new_tail, tail_ref)


def test_empty_input_keeps_tail() -> None:
    x, weight, tail = make_inputs(0)
    y, new_tail = causal_conv1d(x, weight, tail)
    y_ref, tail_ref = causal_conv1d_reference(x, weight, tail)
    assert y.shape == y_ref.shape == (2, 0, 12)
    assert torch.equal(new_tail, tail) and torch.equal(tail_ref, tail)


def test_matches_torch_conv1d_with_left_padding() -> None:
    # The textbook form: depthwise conv1d over the input padded on the left by K-1 zeros.
    x, weight, _ = make_inputs(40)
    expected = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight[:, None, :], groups=12)
    y, _ = causal_conv1d(x, weight, None)
    assert max_err(y, expected.transpose(1, 2)) <= TOL


@pytest.mark.parametrize("split", [0, 1, 2, 3, 5, 20])
def test_split_and_carry_equals_one_pass(split: int) -> None:
    x, weight, tail = make_inputs(21, seed=1)
    y_all, tail_all = causal_conv1d(x, weight, tail)
    y1, tail1 = causal_conv1d(x[:, :split], weight, tail)
    y2, tail2 = causal_conv1d(x[:, split:], weight, tail1)
    assert max_err(torch.cat((y1, y2), dim=1), y_all) <= TOL
    assert torch.equal(tail2, tail_all)


def test_short_input_keeps_part_of_old_tail() -> None:
    x, weight, tail = make_inputs(2, seed=2)
    _, new_tail = causal_conv1d(x, weight, tail)
    assert torch.equal(new_tail[:, 0], tail[:, 2])
    assert torch.equal(new_tail[:, 1:], x)


def test_steps_equal_one_pass() -> None:
    x, weight, tail = make_inputs(9, seed=3)
    y_all, tail_all = causal_conv1d(x, weight, tail)
    window = tail
    for t in range(9):
        y, window = causal_conv1d_step(x[:, t], weight, window)
        assert max_err(y, y_all[:, t]) <= TOL
    assert torch.equal(window, tail_all)


def test_tail_is_a_copy() -> None:
    x, weight, tail = make_inputs(6, seed=4)
    _, new_tail = causal_conv1d(x, weight, tail)
    new_tail.zero_()
    assert x.abs().sum() > 0


@pytest.mark.parametrize("k", [1, 2, 7])
def test_other_kernel_sizes(k: int) -> None:
    x, weight, tail = make_inputs(5, k=k, seed=5)
    y_ref, tail_ref = causal_conv1d_reference(x, weight, tail)
    y, new_tail = causal_conv1d(x, weight, tail)
    assert max_err(y, y_ref) <= TOL
    assert torch.equal(new_tail, tail_ref) and new_tail.shape == (2, k - 1, 12)


def test_bfloat16_accumulates_in_fp32() -> None:
    x, weight, tail = make_inputs(30, seed=6)
    y32, _ = causal_conv1d(x.bfloat16().float(), weight, tail.bfloat16().float())
    y16, tail16 = causal_conv1d(x.bfloat16(), weight, tail.bfloat16())
    assert y16.dtype == torch.bfloat16 and tail16.dtype == torch.bfloat16
    # One final rounding only: within half a bf16 ulp of the fp32 result.
    assert ((y16.float() - y32).abs() <= y32.abs() * 2**-8 + 1e-6).all()


def test_bfloat16_weights_run_natively_with_one_rounding() -> None:
    """bf16 inputs and bf16 weights (the serving case) take oneDNN's bf16 kernel: equal to the
    fp32 convolution of the same values within half a bf16 ulp, and to the token loop."""
    x, weight, tail = make_inputs(300, seed=7)
    x16, w16, tail16 = x.bfloat16(), weight.bfloat16(), tail.bfloat16()
    y32, _ = causal_conv1d(x16.float(), w16.float(), tail16.float())
    y16, new_tail = causal_conv1d(x16, w16, tail16)
    assert y16.dtype == torch.bfloat16 and new_tail.dtype == torch.bfloat16
    assert ((y16.float() - y32).abs() <= y32.abs() * 2**-8 + 1e-6).all()
    y_ref, tail_ref = causal_conv1d_reference(x16, w16, tail16)
    assert ((y16.float() - y_ref.float()).abs() <= y32.abs() * 2**-7 + 1e-6).all()
    assert torch.equal(new_tail, tail_ref)


def test_shape_errors_name_the_parameter() -> None:
    assert issubclass(ConvError, ModelError) and issubclass(ConvError, ValueError)
    x, weight, tail = make_inputs(5)
    with pytest.raises(ConvError, match="weight"):
        causal_conv1d(x, weight[:5], tail)
    with pytest.raises(ConvError, match="tail"):
        causal_conv1d(x, weight, tail[:, :2])
    with pytest.raises(ConvError, match="x must"):
        causal_conv1d(x[0], weight, tail)
    with pytest.raises(ConvError, match="step"):
        causal_conv1d_step(x, weight, tail)
