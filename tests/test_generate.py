"""Generation: cached decode vs full recompute, continuous batching vs one at a time, sampling."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.model.batch import SHRINK_FLOOR_BLOCKS, DecodeBatch
from services.model.cache import CacheError, LinearState, RequestCache, TokenKV, WindowKV
from services.model.config import FAMILIES
from services.model.generate import generate, prefill
from services.model.model import BatchLayerState, HybridLM, build_model
from services.model.sampling import RequestSampler, SamplingError, SamplingParams, top_p_filter
from tests.tiny_models import sharp, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> HybridLM:
    return build_model(sharp(request.param), seed=3)


def test_cached_decode_equals_full_recompute(model: HybridLM) -> None:
    # 120 prompt + 40 decoded tokens cross the 128-token window and two 64-token blocks.
    prompt = tokens(120, seed=1)
    first = prefill(model, prompt)
    params = SamplingParams(max_new_tokens=41, stop_on_eos=False)
    batch = DecodeBatch(model)
    token = int(first.logits.argmax())
    batch.join("r", first.cache, token, params)
    seq, step_logits = [token], []
    while len(batch):
        step = batch.step(return_logits=True)
        assert step.logits is not None
        step_logits.append(step.logits[0])
        seq.append(step.events[0].token)
    assert len(seq) == 41
    with torch.no_grad():
        full = model(torch.cat((prompt, torch.tensor(seq[:-1])))[None])[0]
    torch.testing.assert_close(torch.stack(step_logits), full[120:], atol=1e-4, rtol=0)
    assert seq[1:] == full[120:].argmax(-1).tolist()


def test_batched_decode_equals_each_alone(model: HybridLM) -> None:
    lengths = [5, 64, 65, 100, 129, 30, 1, 77]
    prompts = [tokens(n, seed=10 + i) for i, n in enumerate(lengths)]
    budgets = [12, 20, 7, 16, 20, 9, 14, 18]
    alone = [generate(model, p, b, stop_on_eos=False).tokens
             for p, b in zip(prompts, budgets, strict=True)]
    batch = DecodeBatch(model, slots=2)
    got: dict[str, list[int]] = {}
    waiting = list(range(8))
    step_no = 0
    capacities = []
    while waiting or len(batch):
        # Two requests join every other step; others leave when their budget runs out.
        if step_no % 2 == 0:
            for i in waiting[:2]:
                first = prefill(model, prompts[i])
                token = int(first.logits.argmax())
                got[str(i)] = [token]
                params = SamplingParams(max_new_tokens=budgets[i], stop_on_eos=False)
                batch.join(str(i), first.cache, token, params)
            waiting = waiting[2:]
        for event in batch.step().events:
            got[event.request_id].append(event.token)
        batch.check_integrity()
        capacities.append(batch.statistics().token_capacity)
        step_no += 1
    assert [got[str(i)] for i in range(8)] == alone
    stats = batch.statistics()
    assert (stats.joined, stats.left, stats.members) == (8, 8, 0)
    assert stats.slots >= 2 and stats.tokens == sum(budgets) - 8
    # The rows grew in whole blocks past the longest member (129 + 20 tokens).
    assert all(c % 64 == 0 for c in capacities) and max(capacities) >= 149


def test_rows_shrink_when_the_long_member_leaves(model: HybridLM) -> None:
    batch = DecodeBatch(model, slots=2)
    params = SamplingParams(max_new_tokens=50, stop_on_eos=False)
    for name, n in (("long", 700), ("short", 30)):
        result = prefill(model, tokens(n, seed=n))
        batch.join(name, result.cache, int(result.logits.argmax()), params)
    batch.step()
    assert batch.statistics().token_capacity >= 702
    batch.leave("long")
    batch.check_integrity()
    assert batch.statistics().token_capacity == SHRINK_FLOOR_BLOCKS * 64
    # The short one decodes on as it would alone.
    alone = generate(model, tokens(30, seed=30), 6, stop_on_eos=False).tokens
    out = [event.token for _ in range(4) for event in batch.step().events]
    assert out == alone[2:6]


def test_leave_midway_returns_a_working_cache(model: HybridLM) -> None:
    prompts = [tokens(n, seed=n) for n in (40, 70, 90)]
    batch = DecodeBatch(model, slots=4)
    params = SamplingParams(max_new_tokens=50, stop_on_eos=False)
    for i, p in enumerate(prompts):
        result = prefill(model, p)
        batch.join(str(i), result.cache, int(result.logits.argmax()), params)
    for _ in range(3):
        batch.step()
    cache = batch.leave("0")
    assert cache.length == 43 and batch.request_ids() == ["2", "1"]
    cache.check_integrity()
    batch.check_integrity()
    for _ in range(2):
        batch.step()
    # The departed cache was copied out: the batch's steps did not touch it.
    assert cache.length == 43
    cache.check_integrity()
    with pytest.raises(CacheError, match="not in the batch"):
        batch.leave("0")


def test_join_rejects_bad_requests(model: HybridLM) -> None:
    result = prefill(model, tokens(10, seed=1))
    batch = DecodeBatch(model)
    params = SamplingParams(max_new_tokens=5)
    batch.join("a", result.cache, 3, params)
    with pytest.raises(CacheError, match="already in the batch"):
        batch.join("a", result.cache.clone(), 3, params)
    with pytest.raises(CacheError, match="finished"):
        batch.join("b", result.cache.clone(), model.cfg.eos_id, params)
    with pytest.raises(CacheError, match="next_token"):
        batch.join("c", result.cache.clone(), 10_000, params)


def test_generate_stops_on_eos_and_length() -> None:
    base = build_model(sharp("dense"), seed=4)
    prompt = tokens(20, seed=2)
    long = generate(base, prompt, 12, stop_on_eos=True)
    assert long.finish_reason == "length" and len(long.tokens) == 12
    assert long.cache.length == 20 + 11
    # Same weights (eos_id does not change initialisation), eos = the 4th generated token.
    cfg = msgspec.structs.replace(base.cfg, eos_id=long.tokens[3])
    stopper = build_model(cfg, seed=4)
    stopped = generate(stopper, prompt, 12)
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == long.tokens[: long.tokens.index(long.tokens[3]) + 1]


def test_sampling_is_seeded_per_request_and_batch_independent() -> None:
    model = build_model(sharp("kimi-linear"), seed=5)
    prompt = tokens(30, seed=3)
    kwargs = {"temperature": 1.0, "top_p": 0.9, "stop_on_eos": False}
    a = generate(model, prompt, 16, seed=7, **kwargs).tokens  # type: ignore[arg-type]
    b = generate(model, prompt, 16, seed=7, **kwargs).tokens  # type: ignore[arg-type]
    c = generate(model, prompt, 16, seed=8, **kwargs).tokens  # type: ignore[arg-type]
    assert a == b and a != c
    # In a batch with another request, the same seed draws the same tokens.
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7,
                            stop_on_eos=False)
    batch = DecodeBatch(model)
    first = prefill(model, prompt)
    batch.join("x", first.cache, RequestSampler(params).sample(first.logits, 0), params)
    other = prefill(model, tokens(50, seed=4))
    batch.join("y", other.cache, 1, msgspec.structs.replace(params, seed=99))
    seq = [a[0]]
    while "x" in batch:
        seq += [e.token for e in batch.step().events if e.request_id == "x"]
    assert seq == a


def test_top_p_filter_and_param_checks() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([0.625, 0.375, 0, 0]))
    torch.testing.assert_close(top_p_filter(probs, 0.1), torch.tensor([1.0, 0, 0, 0]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(SamplingError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def per_request_states(caches: list[RequestCache]) -> list[BatchLayerState]:
    """The reference decode states: the requests' own TokenKVs (attended one by one in
    fp32) and their linear/window states stacked into new batched tensors."""
    states: list[BatchLayerState] = []
    for layer in range(caches[0].cfg.n_layers):
        parts = [c.layers[layer] for c in caches]
        if isinstance(parts[0], TokenKV):
            states.append([p for p in parts if isinstance(p, TokenKV)])
        elif isinstance(parts[0], LinearState):
            lin = [p for p in parts if isinstance(p, LinearState)]
            states.append(LinearState(torch.cat([p.state for p in lin]),
                                      torch.cat([p.conv_tail for p in lin])))
        else:
            win = [p for p in parts if isinstance(p, WindowKV)]
            states.append(WindowKV(torch.cat([p.k for p in win]), torch.cat([p.v for p in win])))
    return states


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 0.1)])
def test_batch_step_equals_the_per_request_reference(family: str, dtype: str,
                                                     tol: float) -> None:
    """DecodeBatch's padded full-attention rows and bf16 attention matmuls against the
    per-request fp32 attention path, three steps of requests of different lengths. bf16:
    logits (|max| 3 to 6 here) within 0.1; every step's argmax equal."""
    model = build_model(sharp(family), seed=4, dtype=dtype)
    prompts = [tokens(n, seed=40 + n) for n in (70, 5, 129, 33)]
    batch = DecodeBatch(model, slots=2)
    params = SamplingParams(max_new_tokens=10, stop_on_eos=False)
    caches, next_ids = [], []
    for i, p in enumerate(prompts):
        first = prefill(model, p)
        caches.append(first.cache.clone())
        next_ids.append(int(first.logits.argmax()))
        batch.join(str(i), first.cache, next_ids[-1], params)
    states = per_request_states(caches)
    for _ in range(3):
        got = batch.step(return_logits=True).logits
        positions = torch.tensor([c.length for c in caches])
        with torch.no_grad():
            want = model.logits(model.decode_hidden(torch.tensor(next_ids), states, positions))
        assert got is not None and want.abs().max() > 2.0
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        next_ids = want.argmax(-1).tolist()
        for c in caches:
            c.length += 1
