"""Choosing the next token: greedy, or temperature + top-p with a per-request generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from services.contract.sampling import TokenChoice, TokenLogprob
from services.model.config import ModelError


class SamplingError(ModelError, ValueError):
    """A sampling parameter is out of range."""


class SamplingParams(TokenChoice, frozen=True, kw_only=True):
    """temperature 0 is greedy; seed None draws a fresh seed; generation stops at end-of-text
    (when stop_on_eos) or a stop token, or after max_new_tokens tokens (the first, from
    prefill, included). Before min_tokens tokens, end-of-text and stop tokens cannot be drawn
    (their logits are masked, as vLLM does). logprobs: None computes none; k >= 0 gives each
    token's logprob and its k most likely alternatives (`token_logprob`)."""

    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise SamplingError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.min_tokens < 0:
            raise SamplingError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# A fixed odd multiplier spreads (seed, index) pairs over the 63-bit seed space; being odd,
# it is invertible there, which `continued_seed` relies on.
_SPREAD = 0x9E3779B97F4A7C15
_SEED_SPACE = 2**63


def _token_seed(seed: int, index: int) -> int:
    """The generator seed of output token number `index` of a request seeded `seed`."""
    return (seed * _SPREAD + index) % _SEED_SPACE


def continued_seed(seed: int, drawn: int) -> int:
    """The seed whose token i is drawn as token `drawn` + i of a request seeded `seed`: a
    request continued elsewhere after `drawn` tokens (the router's migration) keeps its
    place in the seed's stream."""
    return (seed + drawn * pow(_SPREAD, -1, _SEED_SPACE)) % _SEED_SPACE


class RequestSampler:
    """Draws one request's tokens. Token i is drawn with a generator seeded from (seed, i),
    so a decode worker in another process continues exactly where the prefill side (which
    drew token 0) left off, with no generator state to ship."""

    def __init__(self, params: SamplingParams, eos_id: int | None = None) -> None:
        self.params = params
        eos = (eos_id,) if params.stop_on_eos and eos_id is not None else ()
        # The tokens min_tokens keeps out of the first min_tokens outputs.
        self._blocked = [*eos, *params.stop_token_ids] if params.min_tokens else []
        self._generator = None if params.greedy else torch.Generator()
        self._seed = params.seed
        if self._generator is not None and self._seed is None:
            self._seed = self._generator.seed()

    def generator_for(self, index: int) -> torch.Generator | None:
        if self._generator is None or self._seed is None:
            return None
        return self._generator.manual_seed(_token_seed(self._seed, index))

    def blocks(self, index: int) -> bool:
        """Whether output token number `index` has tokens masked (min_tokens)."""
        return bool(self._blocked) and index < self.params.min_tokens

    def logits_for(self, logits: Tensor, index: int) -> Tensor:
        """The logits token number `index` is drawn from: end-of-text and stop tokens masked
        before min_tokens."""
        if not self.blocks(index):
            return logits
        masked = logits.clone()
        masked[self._blocked] = float("-inf")
        return masked

    def sample(self, logits: Tensor, index: int) -> int:
        """logits [V] of output token number `index` (0 = the one drawn after prefill)."""
        return sample_token(self.logits_for(logits, index), self.params,
                            self.generator_for(index))

    def logprob(self, logits: Tensor, index: int, token: int) -> TokenLogprob | None:
        """The logprob of `token`, drawn as number `index` from `logits`; None unless asked."""
        if self.params.logprobs is None:
            return None
        return token_logprob(self.logits_for(logits, index), token, self.params)


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """probs [V] -> probs restricted to the smallest top set with mass >= top_p, renormalised."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def sample_token(logits: Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """logits [V] -> one token id."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    probs = top_p_filter(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: Tensor, token: int, params: SamplingParams) -> TokenLogprob:
    """`token`'s logprob and the params.logprobs most likely tokens, most likely first.

    The log_softmax, in float32, of the logits the token is sampled from: after the min_tokens
    mask and the temperature (greedy, temperature 0: the unscaled logits), before top-p (top-p
    would give the tokens it drops -inf).
    """
    scale = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    k = min(params.logprobs or 0, logp.numel())
    values, ids = logp.topk(k) if k else (logp[:0], torch.empty(0, dtype=torch.long))
    return TokenLogprob(float(logp[token]), [int(i) for i in ids.tolist()],
                        [float(v) for v in values.tolist()])


def sample_tokens(logits: Tensor, samplers: Sequence[RequestSampler],
                  indices: Sequence[int]) -> list[int]:
    """logits [B, V] -> B token ids (row i is output token number indices[i]); greedy rows
    share one argmax (unless min_tokens masks some of theirs)."""
    greedy = logits.argmax(dim=-1).tolist()
    return [
        int(greedy[i]) if s.params.greedy and not s.blocks(indices[i])
        else s.sample(logits[i], indices[i])
        for i, s in enumerate(samplers)
    ]
