"""Tests for services.model.delta_rule: chunked and step kernels against the token loop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from services.model import delta_rule
from services.model.config import ModelError
from services.model.decay_products import decayed_products_channel, split_products
from services.model.delta_rule import (
    DeltaRuleError,
    delta_rule_chunked,
    delta_rule_reference,
    delta_rule_step,
    delta_rule_step_,
)
from services.model.triangular import unit_lower_inverse

TOL = 1e-5


class Inputs(NamedTuple):
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    state: Tensor | None


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny per-token ops only lose from a second thread on the shared two-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_inputs(
    t: int,
    *,
    gate: str = "channel",
    with_state: bool = False,
    decay: float = 0.5,
    b: int = 2,
    h: int = 2,
    dk: int = 32,
    dv: int = 24,
    seed: int = 0,
) -> Inputs:
    """Realistic inputs: L2-normalised q, k; g = -softplus(randn) * decay <= 0; beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen)
    width = dk if gate == "channel" else 1
    g = -F.softplus(torch.randn(b, h, t, width, generator=gen)) * decay
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen) if with_state else None
    return Inputs(q, k, v, g, beta, state)


def max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def piece(x: Inputs, start: int, stop: int, state: Tensor | None) -> Inputs:
    q, k, v, g, beta = (y[:, :, start:stop] for y in x[:5])
    return Inputs(q, k, v, g, beta, state)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("gate", ["channel", "scalar"])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 1000])
def test_chunked_equals_reference(t: int, gate: str, with_state: bool) -> None:
    x = make_inputs(t, gate=gate, with_state=with_state, seed=t)
    o_ref, s_ref = delta_rule_reference(*x)
    o, s = delta_rule_chunked(*x)
    assert o.shape == (2, 2, t, 24) and s.shape == (2, 2, 32, 24)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert max_err(o, o_ref) <= TOL
    assert max_err(s, s_ref) <= TOL


@pytest.mark.parametrize("gate", ["channel", "scalar"])
@pytest.mark.parametrize("decay", [8.0, 60.0])
def test_chunked_strong_decay(gate: str, decay: float) -> None:
    # A chunk here decays by far more than e^-160: the exact (secondary chunking) path.
    x = make_inputs(150, gate=gate, with_state=True, decay=decay, seed=3)
    o_ref, s_ref = delta_rule_reference(*x)
    o, s = delta_rule_chunked(*x)
    assert torch.isfinite(o).all()
    assert max_err(o, o_ref) <= TOL
    assert max_err(s, s_ref) <= TOL


def test_chunked_mixed_steep_and_gentle_chunks() -> None:
    x = make_inputs(256, with_state=True, decay=0.3, seed=4)
    # Chunk 1 decays steeply in one token, chunk 2 steeply everywhere, others gently.
    g = x.g.clone()
    g[:, :, 70, :5] = -200.0
    g[:, :, 128:192] *= 40.0
    x = x._replace(g=g)
    o_ref, s_ref = delta_rule_reference(*x)
    o, s = delta_rule_chunked(*x)
    assert max_err(o, o_ref) <= TOL
    assert max_err(s, s_ref) <= TOL


@pytest.mark.parametrize("matmul_dtype", [torch.float32, torch.bfloat16])
def test_chunk_groups_equal_one_group(monkeypatch: pytest.MonkeyPatch,
                                      matmul_dtype: torch.dtype) -> None:
    # 5 chunks x 4 heads = 20 blocks, some decaying steeply, in groups of 3 (the last one
    # short) against all at once: the same numbers, bit for bit, and the reference's.
    x = make_inputs(300, with_state=True, decay=0.3, seed=4)
    g = x.g.clone()
    g[:, :, 70, :5] = -200.0
    g[:, :, 128:192] *= 40.0
    x = x._replace(g=g)
    whole = delta_rule_chunked(*x, return_chunk_states=True, matmul_dtype=matmul_dtype)
    monkeypatch.setattr(delta_rule, "_GROUP_BYTES", 3 * 64 * 64 * 4)
    grouped = delta_rule_chunked(*x, return_chunk_states=True, matmul_dtype=matmul_dtype)
    for a, b in zip(whole, grouped, strict=True):
        assert torch.equal(a, b)
    if matmul_dtype == torch.float32:
        o_ref, s_ref = delta_rule_reference(*x)
        assert max_err(grouped[0], o_ref) <= TOL and max_err(grouped[1], s_ref) <= TOL


def test_scalar_gate_equals_expanded_channel_gate() -> None:
    x = make_inputs(100, gate="scalar", with_state=True, seed=5)
    expanded = x._replace(g=x.g.expand(-1, -1, -1, 32).contiguous())
    o_s, s_s = delta_rule_chunked(*x)
    o_c, s_c = delta_rule_chunked(*expanded)
    assert max_err(o_s, o_c) <= TOL
    assert max_err(s_s, s_c) <= TOL


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 128])
def test_other_chunk_sizes(chunk_size: int) -> None:
    x = make_inputs(77, with_state=True, seed=6)
    o_ref, s_ref = delta_rule_reference(*x)
    o, s = delta_rule_chunked(*x, chunk_size=chunk_size)
    assert max_err(o, o_ref) <= TOL
    assert max_err(s, s_ref) <= TOL


def test_reference_matches_paper_equation_in_float64() -> None:
    # S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T; o_t = S_t^T q_t / sqrt(Dk).
    x = make_inputs(9, with_state=True, b=1, h=1, dk=6, dv=5, seed=7)
    q, k, v, g, beta = (y[0, 0].double() for y in x[:5])
    assert x.state is not None
    s = x.state[0, 0].double()
    outputs = []
    for t in range(9):
        kt = k[t][:, None]
        s = (torch.eye(6, dtype=torch.float64) - beta[t] * kt @ kt.T) @ torch.diag(g[t].exp()) @ s
        s = s + beta[t] * kt @ v[t][None, :]
        outputs.append(s.T @ q[t] * 6**-0.5)
    o_ref, s_ref = delta_rule_reference(*x)
    assert max_err(o_ref[0, 0], torch.stack(outputs)) <= 1e-6
    assert max_err(s_ref[0, 0], s) <= 1e-6


@pytest.mark.parametrize("gate", ["channel", "scalar"])
def test_step_by_step_equals_reference(gate: str) -> None:
    x = make_inputs(37, gate=gate, with_state=True, seed=8)
    o_ref, s_ref = delta_rule_reference(*x)
    state = x.state
    for t in range(37):
        o, state = delta_rule_step(*piece(x, t, t + 1, state))
        assert o.shape == (2, 2, 1, 24)
        assert max_err(o, o_ref[:, :, t : t + 1]) <= TOL
    assert state is not None and max_err(state, s_ref) <= TOL


@pytest.mark.parametrize("gate", ["channel", "scalar"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_step_equals_reference(gate: str, dtype: torch.dtype) -> None:
    x = make_inputs(37, gate=gate, with_state=True, seed=12)
    o_ref, s_ref = delta_rule_reference(*x)
    assert x.state is not None
    state = x.state.clone()
    for t in range(37):
        q, k, v, g, beta, _ = piece(x, t, t + 1, None)
        o = delta_rule_step_(q[:, :, 0], k[:, :, 0], v[:, :, 0].to(dtype), g[:, :, 0],
                             beta[:, :, 0], state)
        assert o.shape == (2, 2, 24) and o.dtype == dtype
        # bf16 only rounds the inputs v and the output; the state stays fp32.
        assert max_err(o.float(), o_ref[:, :, t]) <= (TOL if dtype == torch.float32 else 0.02)
    assert max_err(state, s_ref) <= (TOL if dtype == torch.float32 else 0.02)
    with pytest.raises(DeltaRuleError, match="contiguous fp32"):
        delta_rule_step_(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0],
                         state.bfloat16())


@pytest.mark.parametrize("gate", ["channel", "scalar"])
@pytest.mark.parametrize("split", [1, 50, 64, 100, 128, 199])
def test_split_and_carry_equals_one_pass(gate: str, split: int) -> None:
    x = make_inputs(200, gate=gate, seed=9)
    o_all, s_all = delta_rule_chunked(*x)
    o1, s1 = delta_rule_chunked(*piece(x, 0, split, None))
    o2, s2 = delta_rule_chunked(*piece(x, split, 200, s1))
    assert max_err(torch.cat((o1, o2), dim=2), o_all) <= TOL
    assert max_err(s2, s_all) <= TOL


def test_prefill_then_decode_equals_reference() -> None:
    x = make_inputs(70, seed=10)
    o_ref, s_ref = delta_rule_reference(*x)
    _, state = delta_rule_chunked(*piece(x, 0, 65, None))
    for t in range(65, 70):
        o, state = delta_rule_step(*piece(x, t, t + 1, state))
        assert max_err(o, o_ref[:, :, t : t + 1]) <= TOL
    assert max_err(state, s_ref) <= TOL


@pytest.mark.parametrize("t", [63, 64, 200])
def test_chunk_states_equal_reference_states_at_block_ends(t: int) -> None:
    x = make_inputs(t, with_state=True, seed=11)
    _, final, ends = delta_rule_chunked(*x, return_chunk_states=True)
    assert ends.shape == (2, 2, t // 64, 32, 24) and ends.dtype == torch.float32
    state = x.state
    for n in range(t // 64):
        _, state = delta_rule_reference(*piece(x, 64 * n, 64 * (n + 1), state))
        assert state is not None and max_err(ends[:, :, n], state) <= TOL
    if t % 64 == 0:
        assert torch.equal(ends[:, :, -1], final)


def test_bfloat16_inputs() -> None:
    x = make_inputs(80, with_state=True, seed=12)
    q, k, v, g, beta = (y.to(torch.bfloat16) for y in x[:5])
    low = Inputs(q, k, v, g, beta, x.state)
    o_ref, s_ref = delta_rule_reference(*low)
    o, s = delta_rule_chunked(*low)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    # Same bf16 inputs and fp32 maths on both sides: they differ by output rounding only.
    assert ((o.float() - o_ref.float()).abs() <= o_ref.float().abs() * 2**-7 + TOL).all()
    assert max_err(s, s_ref) <= TOL


@pytest.mark.parametrize("gate", ["channel", "scalar"])
def test_bfloat16_matmuls_stay_within_bf16_rounding_of_the_reference(gate: str) -> None:
    """The serving path's bf16 intra-chunk products (fp32 states, inverse and decayed
    products): outputs within 2% of the output scale and states within 2% of the state scale
    of the fp32 reference over four chunks; the fp32 default stays at TOL."""
    x = make_inputs(200, gate=gate, with_state=True, seed=21)
    q, k, v, g, beta = (y.to(torch.bfloat16) for y in x[:5])
    low = Inputs(q, k, v, g, beta, x.state)
    o_ref, s_ref = delta_rule_reference(*low)
    o, s = delta_rule_chunked(*low, matmul_dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert 0 < max_err(o.float(), o_ref.float()) <= 0.02 * float(o_ref.float().abs().max())
    assert 0 < max_err(s, s_ref) <= 0.02 * float(s_ref.abs().max())
    o32, s32 = delta_rule_chunked(*x, matmul_dtype=torch.float32)
    o32_ref, s32_ref = delta_rule_reference(*x)
    assert max_err(o32, o32_ref) <= TOL and max_err(s32, s32_ref) <= TOL


def test_non_contiguous_inputs() -> None:
    x = make_inputs(70, with_state=True, seed=16)
    # [B, T, H, D] projections viewed as [B, H, T, D], as layers produce them.
    q, k, v, g = (y.transpose(1, 2).contiguous().transpose(1, 2) for y in x[:4])
    assert not q.is_contiguous()
    o, s = delta_rule_chunked(q, k, v, g, x.beta, x.state)
    o_ref, s_ref = delta_rule_reference(*x)
    assert max_err(o, o_ref) <= TOL
    assert max_err(s, s_ref) <= TOL


def test_scale_argument_and_state_not_mutated() -> None:
    x = make_inputs(90, with_state=True, seed=13)
    assert x.state is not None
    before = x.state.clone()
    o_ref, _ = delta_rule_reference(*x, scale=0.3)
    o, _ = delta_rule_chunked(*x, scale=0.3)
    o_default, _ = delta_rule_chunked(*x)
    assert max_err(o, o_ref) <= TOL
    assert max_err(o, o_default) > 1e-3
    assert torch.equal(x.state, before)


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 140),
    dk=st.integers(1, 20),
    dv=st.integers(1, 20),
    gate=st.sampled_from(["channel", "scalar"]),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_reference_odd_shapes(
    b: int, h: int, t: int, dk: int, dv: int, gate: str, seed: int
) -> None:
    x = make_inputs(t, gate=gate, with_state=True, b=b, h=h, dk=dk, dv=dv, seed=seed)
    o_ref, s_ref = delta_rule_reference(*x)
    o, s = delta_rule_chunked(*x, chunk_size=32)
    assert max_err(o, o_ref) <= TOL
    assert max_err(s, s_ref) <= TOL


def brute_force_products(rows: Tensor, cols: Tensor, gcum: Tensor) -> Tensor:
    """[M, X, C, C] lower-triangular sum_d rows_i cols_j exp(G_i - G_j), in float64."""
    rows, cols, gcum = rows.double(), cols.double(), gcum.double()
    diff = (gcum[:, :, None] - gcum[:, None]).clamp(max=0.0)  # [M, C, C, D]
    out = torch.einsum("mxid,mjd,mijd->mxij", rows, cols, diff.exp())
    return out.tril()


@pytest.mark.parametrize("decay", [0.5, 5.0, 40.0])
def test_decayed_products_both_paths(decay: float) -> None:
    gen = torch.Generator().manual_seed(14)
    k = F.normalize(torch.randn(6, 64, 16, generator=gen), dim=-1)
    q = F.normalize(torch.randn(6, 64, 16, generator=gen), dim=-1)
    gcum = (-F.softplus(torch.randn(6, 64, 16, generator=gen)) * decay).cumsum(dim=1)
    rows = torch.stack((k, q), dim=1)
    expected = brute_force_products(rows, k, gcum)
    assert max_err(split_products(rows, k, gcum).tril(), expected) <= 1e-6
    assert max_err(decayed_products_channel(rows, k, gcum).tril(), expected) <= 1e-6


def testunit_lower_inverse() -> None:
    gen = torch.Generator().manual_seed(15)
    a = (torch.randn(5, 64, 64, generator=gen) * 0.2).tril(-1)
    t = unit_lower_inverse(a)
    eye = torch.eye(64).expand(5, 64, 64)
    assert max_err(t @ (eye + a), eye) <= 1e-5
    assert torch.equal(t, t.tril())
    # Only the strictly lower triangle is read: the kernel hands it a strided view whose
    # diagonal and upper part hold unmasked products, possibly inf.
    dirty = torch.stack((a + torch.full_like(a, float("inf")).triu(), a), dim=1)[:, 0]
    assert torch.equal(unit_lower_inverse(dirty), t)


def test_shape_errors_name_the_parameter() -> None:
    assert issubclass(DeltaRuleError, ModelError) and issubclass(DeltaRuleError, ValueError)
    x = make_inputs(10, with_state=True)
    with pytest.raises(DeltaRuleError, match="beta"):
        delta_rule_chunked(*x._replace(beta=x.beta[..., :5]))
    with pytest.raises(DeltaRuleError, match="g must"):
        delta_rule_reference(*x._replace(g=x.g[..., :3]))
    with pytest.raises(DeltaRuleError, match="state"):
        delta_rule_chunked(*x._replace(state=x.v))
    with pytest.raises(DeltaRuleError, match="chunk_size"):
        delta_rule_chunked(*x, chunk_size=48)
    with pytest.raises(DeltaRuleError, match="T == 1"):
        delta_rule_step(*x)


def test_chunked_kernel_refuses_to_track_gradients() -> None:
    """The serving kernel writes into preallocated buffers; training has its own kernel
    (delta_rule_trainable, whose gradients tests/test_train.py checks). Asked for a backward,
    it says so instead of returning a graph that is wrong."""
    x = make_inputs(70, with_state=True, seed=7)
    inputs = [y.clone().requires_grad_(True) for y in x[:5]]
    with pytest.raises(DeltaRuleError, match="delta_rule_trainable"):
        delta_rule_chunked(*inputs, x.state)
    with torch.no_grad():
        o, _ = delta_rule_chunked(*inputs, x.state)
    assert max_err(o, delta_rule_reference(*x)[0]) <= TOL
