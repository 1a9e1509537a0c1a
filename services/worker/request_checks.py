"""What both workers check of a request before they take it, and what they take of it: a
prompt of token ids in the vocabulary, a hash chain that ends where the prompt's blocks do
(completed to all of them), the prefill's lanes and the decode's timeouts in range; its
sampling as the model takes it.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NamedTuple

from services.contract.errors import RequestError
from services.contract.messages import DecodeRequest, PrefillRequest
from services.contract.prefix import check_chain_end, extend_hashes
from services.contract.sampling import Sampling
from services.model.sampling import SamplingParams


class Checked(NamedTuple):
    """What a worker takes of a checked request."""

    params: SamplingParams  # its sampling as the model takes it
    hashes: list[int]  # the hash chain of all its prompt's full blocks


def check_prefill(request: PrefillRequest, vocab: int, block: int, max_lanes: int) -> Checked:
    """The request as the worker takes it; SamplingError names a bad sampling value,
    RequestError any other bad field of a prefill request."""
    params = sampling_params(request.sampling)
    length = len(request.prompt)
    if length < 1:
        raise RequestError(f"prompt must hold at least one token, got {length}")
    bad = out_of_range(request.prompt, vocab)
    if bad is not None:
        raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad}")
    check_held_tokens("decode_has_tokens", request.decode_has_tokens, block, length)
    check_lanes(request.connections, max_lanes)
    return Checked(params, prompt_chain(request.prompt, block, request.hashes))


def check_held_tokens(name: str, held: int, block: int, length: int) -> None:
    """RequestError unless `held` (the tokens the receiver already holds) is a whole number
    of blocks short of `length`."""
    if held % block or not 0 <= held < length:
        raise RequestError(f"{name} must be a multiple of {block} in [0, {length}), got {held}")


def check_lanes(connections: int, max_lanes: int) -> None:
    """RequestError unless a transfer asks for 1 to `max_lanes` lanes."""
    if not 1 <= connections <= max_lanes:
        raise RequestError(f"connections must be in [1, {max_lanes}], got {connections}")


def check_decode(request: DecodeRequest, vocab: int, block: int) -> Checked:
    """The request as the worker takes it; SamplingError names a bad sampling value,
    RequestError any other bad field of a decode request."""
    params = sampling_params(request.sampling)
    if not request.prompt:
        raise RequestError("prompt must hold at least one token, got 0")
    bad = out_of_range(request.prompt, vocab)
    if bad is not None:
        raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad}")
    hashes = prompt_chain(request.prompt, block, request.hashes)
    if not request.kv_timeout > 0:
        raise RequestError(f"kv_timeout must be > 0 seconds, got {request.kv_timeout}")
    if request.kv_stall < 0:
        raise RequestError(f"kv_stall must be >= 0 seconds, got {request.kv_stall}")
    return Checked(params, hashes)


def sampling_params(sampling: Sampling) -> SamplingParams:
    """The model's SamplingParams for a request's `Sampling`; SamplingError names a bad value."""
    return SamplingParams(
        max_new_tokens=sampling.max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, seed=sampling.seed, stop_on_eos=sampling.stop_on_eos,
        logprobs=sampling.logprobs, min_tokens=sampling.min_tokens,
        stop_token_ids=tuple(sampling.stop_token_ids),
    )


def prompt_chain(prompt: list[int], block_size: int, hashes: Sequence[int]) -> list[int]:
    """The hash chain of all the prompt's full blocks, of which `hashes` (a request's chain of
    its prompt's first blocks) is the lead, taken as sent: RequestError unless it names at
    most the prompt's full blocks and its last hash is that of its block (a sender that hashes
    another way would fill the prefix store with chains no lookup matches)."""
    try:
        check_chain_end(prompt, block_size, hashes)
    except ValueError as exc:
        raise RequestError(f"hashes: {exc}") from exc
    return extend_hashes(prompt, block_size, hashes)


def out_of_range(tokens: Sequence[int], vocab: int) -> int | None:
    """The first token id outside [0, vocab), or None; `out_of_range_reference`, faster on
    ids that are all in range (every request the workers take: its prompt is checked twice)."""
    if not tokens:
        return None
    try:
        # Packing to C unsigned ints checks in one pass that each id is an int >= 0, at half
        # the cost of min. (numpy's max over the packed ids, quick in a loop of its own, cost
        # more than min in the simulation, where its code is never warm.)
        array.array("I", tokens)
    except (TypeError, OverflowError):
        return out_of_range_reference(tokens, vocab)
    if max(tokens) < vocab:
        return None
    return out_of_range_reference(tokens, vocab)


def out_of_range_reference(tokens: Sequence[int], vocab: int) -> int | None:
    """`out_of_range` by min and max over the list and a scan (the slow, obvious reference)."""
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab):
        return None
    return next(t for t in tokens if not 0 <= t < vocab)
