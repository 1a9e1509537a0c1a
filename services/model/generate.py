"""Prefill and one-request generation on top of `HybridLM`, `RequestCache` and `DecodeBatch`.

`prefill` computes only the tokens after the cache's length (a cached prefix, or a block-
aligned snapshot via `RequestCache.resume_point`), optionally keeping snapshots and calling a
hook per finished layer. `generate` is the plain single-process reference: prefill, sample
the first token, then decode one token per step until end-of-text or the token limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.model.batch import DecodeBatch, finish_reason
from services.model.cache import CacheError, RequestCache
from services.model.model import HybridLM, LayerHook
from services.model.sampling import RequestSampler, SamplingParams


@dataclass(frozen=True)
class PrefillResult:
    cache: RequestCache
    # fp32 logits of the last token [V]; with all_logits, every new token's [T, V] too.
    logits: Tensor
    all_logits: Tensor | None = None


@dataclass(frozen=True)
class GenerateResult:
    tokens: list[int]
    finish_reason: str
    cache: RequestCache
    prompt_length: int


def block_boundaries(start: int, end: int, block: int, every: int = 1) -> list[int]:
    """Block-aligned lengths n with start < n <= end, every `every`-th block."""
    step = block * every
    first = (start // step + 1) * step
    return list(range(first, end + 1, step))


def _as_ids(ids: Sequence[int] | Tensor) -> Tensor:
    tensor = torch.as_tensor(ids, dtype=torch.long)
    if tensor.dim() != 1 or tensor.numel() < 1:
        raise CacheError(f"ids must be a non-empty 1-D sequence, got shape {tuple(tensor.shape)}")
    return tensor


@torch.no_grad()
def prefill(model: HybridLM, ids: Sequence[int] | Tensor, cache: RequestCache | None = None,
            *, snapshot_at: Sequence[int] = (), all_logits: bool = False,
            on_layer: LayerHook | None = None) -> PrefillResult:
    """Run the new tokens `ids` after `cache` (extended in place; a fresh one if None).

    snapshot_at: block-aligned lengths in (cache.length, cache.length + len(ids)] to keep
    state snapshots at (see `block_boundaries`). on_layer(i) fires as layer i completes.
    """
    tokens = _as_ids(ids)
    if cache is None:
        cache = RequestCache.empty(model.cfg, model.dtype)
    elif cache.cfg != model.cfg or cache.dtype != model.dtype:
        raise CacheError("cache config or dtype differs from the model's")
    if int(tokens.max()) >= model.cfg.vocab_size or int(tokens.min()) < 0:
        raise CacheError(f"token ids must be in [0, {model.cfg.vocab_size})")
    hidden = model.prefill_hidden(tokens, cache, snapshot_at, on_layer)  # [T, C]
    if all_logits:
        every = model.logits(hidden)
        return PrefillResult(cache, every[-1], every)
    return PrefillResult(cache, model.logits(hidden[-1]))


@torch.no_grad()
def generate(model: HybridLM, prompt_ids: Sequence[int] | Tensor, max_new_tokens: int = 64,
             *, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             cache: RequestCache | None = None, stop_on_eos: bool = True) -> GenerateResult:
    """Generate up to max_new_tokens after the prompt, one request in one process.

    cache: an optional cache of a prefix of the prompt (it is cloned, not modified).
    """
    prompt = _as_ids(prompt_ids)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, seed=seed, stop_on_eos=stop_on_eos)
    start = RequestCache.empty(model.cfg, model.dtype) if cache is None else cache.clone(False)
    if start.length >= prompt.numel():
        raise CacheError(f"cache length {start.length} must be < prompt length {prompt.numel()}")
    result = prefill(model, prompt[start.length :], start)
    token = RequestSampler(params, model.cfg.eos_id).sample(result.logits, 0)
    tokens = [token]
    reason = finish_reason(token, 1, params, model.cfg.eos_id)
    if reason is not None:
        return GenerateResult(tokens, reason, result.cache, prompt.numel())
    batch = DecodeBatch(model, slots=1)
    batch.join("generate", result.cache, token, params)
    while True:
        step = batch.step()
        event = step.events[0]
        tokens.append(event.token)
        if event.finish_reason is not None:
            return GenerateResult(tokens, event.finish_reason, step.finished["generate"],
                                  prompt.numel())
