"""The model's linear layer: the packed-weight path against `F.linear`, bit for bit."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from services.model.config import family_config
from services.model.linear import Linear, WeightPack, packing_available
from services.model.model import build_model

needs_packing = pytest.mark.skipif(
    not packing_available(), reason="oneDNN with native bf16 (the packed path) not on this CPU")


def layer(in_features: int = 96, out_features: int = 160, bias: bool = False) -> Linear:
    torch.manual_seed(0)
    return Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 32, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows: int, bias: bool) -> None:
    lin = layer(bias=bias)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        out = lin(x)
    assert lin.pack._packed is not None, "the packed path was not taken"
    assert torch.equal(out, F.linear(x, lin.weight, lin.bias))


@needs_packing
def test_packed_takes_batched_and_strided_inputs() -> None:
    lin = layer()
    x3 = torch.randn(4, 7, 96, dtype=torch.bfloat16)
    strided = torch.randn(96, 9, dtype=torch.bfloat16).t()  # [9, 96], not contiguous
    with torch.inference_mode():
        assert torch.equal(lin(x3), F.linear(x3, lin.weight))
        assert torch.equal(lin(strided), F.linear(strided, lin.weight))


@needs_packing
def test_a_changed_weight_is_packed_again() -> None:
    lin = layer()
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        before = lin(x)
        lin.weight.add_(0.5)  # in place: same storage, new version
        assert torch.equal(lin(x), F.linear(x, lin.weight))
        lin.load_state_dict({"weight": torch.randn(160, 96, dtype=torch.bfloat16)})
        after = lin(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, F.linear(x, lin.weight))


def test_autograd_and_float32_take_f_linear() -> None:
    lin = Linear(96, 160, bias=False)
    x = torch.randn(3, 96)
    with torch.no_grad():
        lin(x)
    assert lin.pack._packed is None  # fp32: never packed
    lin = lin.to(torch.bfloat16)
    x = torch.randn(3, 96, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().sum().backward()
    assert lin.pack._packed is None
    assert lin.weight.grad is not None and x.grad is not None


@needs_packing
def test_copies_of_a_used_model_start_without_the_pack() -> None:
    model = build_model(family_config("kimi-linear", "tiny"), dtype="bfloat16")
    ids = torch.randint(1, model.cfg.vocab_size, (1, 9))
    with torch.no_grad():
        logits = model(ids)
    assert model.logits_pack._packed is not None
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.logits_pack._packed is None
        with torch.no_grad():
            assert torch.equal(twin(ids), logits)


def test_a_pack_pickles_empty() -> None:
    pack = WeightPack()
    assert pickle.loads(pickle.dumps(pack))._packed is None


@needs_packing
def test_packing_is_off_when_torchs_private_ops_fail_or_disagree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    check = packing_available.__wrapped__  # the check itself, not its cached answer
    assert check()

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", broken)
    assert not check()

    def wrong(x: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.zeros(x.shape[0], 24, dtype=x.dtype)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", wrong)
    assert not check()
