"""How a request's tokens are picked, and what a sampled token reports: the sampling terms
of the contract, which the router's OpenAI schema, the wire messages (services.contract.messages)
and the model's sampler (services.model.sampling) share.
"""

from __future__ import annotations

import msgspec


class TokenChoice(msgspec.Struct, frozen=True, kw_only=True):
    """How each token is picked: greedy when temperature is 0 (services.model.sampling).

    logprobs: None computes none (the default costs nothing); k >= 0 sends each sampled
    token's logprob and its k most likely alternatives (`TokenLogprob`). min_tokens: no
    end-of-text or stop token before that many output tokens. stop_token_ids: tokens that end
    the generation like end-of-text does (even with stop_on_eos False). The wire's `Sampling`
    and the model's `SamplingParams` add how many tokens, each in its own words.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_on_eos: bool = True
    logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()


class Sampling(TokenChoice, frozen=True, kw_only=True):
    """How to pick a request's tokens (`TokenChoice`), and at most how many."""

    max_tokens: int = 64


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token's logprob and the `top` most likely tokens (id, logprob), most
    likely first (services.model.sampling.token_logprob says which logits)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
