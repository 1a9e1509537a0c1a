"""Continuous-batching decode: requests of different lengths join and leave between steps.

Each step embeds one token per member, runs every layer once for the whole batch and samples
each member's next token with its own parameters and generator. Projections, FFNs and the
linear/window layers' recurrences are batched. Their fixed-size states live in batch-owned
buffers [slots, ...]: while a request is a member, its cache's LinearState/WindowKV tensors
are views of its slot, so a step updates them in place with no gather or scatter. Full-
attention KV lives the same way in zero-padded rows [slots, A, capacity, X] (`TokenSlots`,
capacity grown for the longest member), attended with masks for the shorter ones.
Leaving gives the request its own copies back and moves the last member into the freed slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch
from torch import Tensor

from services.contract.sampling import TokenLogprob
from services.model.cache import (
    CacheError,
    LinearState,
    RequestCache,
    TokenKV,
    WindowKV,
    token_shapes,
)
from services.model.config import FULL_ATTENTION_KINDS, LINEAR_KINDS, WINDOW_KINDS, ModelConfig
from services.model.model import BatchLayerState, HybridLM
from services.model.padded_kv import TokenSlots, release
from services.model.sampling import RequestSampler, SamplingParams, sample_tokens


class TokenEvent(msgspec.Struct, frozen=True):
    """One generated token; finish_reason is "stop" (end-of-text), "length" or None."""

    request_id: str
    token: int
    index: int
    finish_reason: str | None = None
    # Tokens this event stands for (`token` repeated): a modeled batch (the simulation) takes
    # several steps at once; the real batch makes one token per step.
    count: int = 1
    # The token's logprob when its request asked for them (SamplingParams.logprobs).
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class StepResult:
    events: tuple[TokenEvent, ...]
    # Caches of the requests that finished in this step (they have left the batch).
    finished: dict[str, RequestCache]
    # With step(return_logits=True): the fp32 logits [B, V] the events were drawn from.
    logits: Tensor | None = None


def result_reason(result: StepResult, request_id: str) -> str:
    """How `request_id` finished in `result` ("length" when its last event says nothing)."""
    reason = next(e.finish_reason for e in result.events if e.request_id == request_id)
    return reason or "length"


class DecodeBatchStatistics(msgspec.Struct, frozen=True):
    members: int
    slots: int
    steps: int
    tokens: int
    joined: int
    left: int
    tokens_in_cache: int
    # Tokens each member's full-attention row holds (the padded rows cost slots x this).
    token_capacity: int = 0


@dataclass
class _Member:
    request_id: str
    cache: RequestCache
    sampler: RequestSampler
    next_token: int
    generated: int


def finish_reason(token: int, generated: int, params: SamplingParams, eos_id: int) -> str | None:
    """"stop" for end-of-text or a stop token (once past min_tokens), "length" at the limit."""
    stops = token in params.stop_token_ids or (params.stop_on_eos and token == eos_id)
    if stops and generated > params.min_tokens:
        return "stop"
    if generated >= params.max_new_tokens:
        return "length"
    return None


# Full-attention rows never shrink below this many blocks (no churn for short requests).
SHRINK_FLOOR_BLOCKS = 4


class DecodeBatch:
    """The decode side's running batch over one model."""

    def __init__(self, model: HybridLM, slots: int = 8) -> None:
        self.model = model
        self.cfg = model.cfg
        self._members: list[_Member] = []
        self._buffers: dict[int, LinearState | WindowKV] = {}
        self._token_slots = {
            layer: TokenSlots(token_shapes(self.cfg, kind), 0, 0, self.cfg.block_size,
                              model.dtype)
            for layer, kind in enumerate(self.cfg.layer_kinds) if kind in FULL_ATTENTION_KINDS}
        self._slots = 0
        self._steps = self._tokens = self._joined = self._left = 0
        self._grow(max(1, slots))

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request_id: object) -> bool:
        return any(m.request_id == request_id for m in self._members)

    def request_ids(self) -> list[str]:
        return [m.request_id for m in self._members]

    def join(self, request_id: str, cache: RequestCache, next_token: int,
             params: SamplingParams, generated: int = 1) -> None:
        """Add a request whose cache holds its prompt (and earlier output); `next_token` is
        the latest sampled token, to be fed next; `generated` counts output tokens so far."""
        self._check_joinable(request_id, cache, next_token, params, generated)
        if len(self._members) == self._slots:
            self._grow(2 * self._slots)
        self._fit_tokens(cache.length + 1)
        slot = len(self._members)
        for index, buffer in self._buffers.items():
            _adopt(cache, index, buffer, slot)
        for index, storage in self._token_slots.items():
            storage.adopt(cache.token_kv(index), slot)
        sampler = RequestSampler(params, self.cfg.eos_id)
        self._members.append(_Member(request_id, cache, sampler, next_token, generated))
        self._joined += 1

    def _check_joinable(self, request_id: str, cache: RequestCache, next_token: int,
                        params: SamplingParams, generated: int) -> None:
        if request_id in self:
            raise CacheError(f"request_id {request_id!r} is already in the batch")
        if cache.cfg != self.cfg or cache.dtype != self.model.dtype:
            raise CacheError(f"request {request_id!r}: cache config or dtype differs from model")
        if cache.length < 1:
            raise CacheError(f"request {request_id!r}: cache is empty (prefill first)")
        cache.check_integrity()
        if not 0 <= next_token < self.cfg.vocab_size:
            raise CacheError(f"next_token must be in [0, {self.cfg.vocab_size}), got {next_token}")
        if finish_reason(next_token, generated, params, self.cfg.eos_id) is not None:
            raise CacheError(f"request {request_id!r} has already finished (token {next_token}, "
                             f"{generated} of {params.max_new_tokens} generated)")

    def leave(self, request_id: str) -> RequestCache:
        """Remove a request; its cache gets its own tensors back."""
        index = next((i for i, m in enumerate(self._members) if m.request_id == request_id),
                     None)
        if index is None:
            raise CacheError(f"request_id {request_id!r} is not in the batch")
        member = self._members[index]
        for layer in self._buffers:
            _release(member.cache, layer)
        for layer in self._token_slots:
            release(member.cache.token_kv(layer))
        last = self._members.pop()
        if last is not member:
            self._members[index] = last
            self._adopt_all(last.cache, index)
        self._left += 1
        self._shrink_tokens()
        return member.cache

    def _grow(self, slots: int) -> None:
        """(Re)allocate every batched buffer with `slots` rows; members keep their data."""
        for layer, kind in enumerate(self.cfg.layer_kinds):
            fresh = _empty_buffer(self.cfg, kind, slots, self.model.dtype)
            if fresh is not None:
                self._buffers[layer] = fresh
        for layer, storage in self._token_slots.items():
            self._token_slots[layer] = storage.resized(slots, 0)
        self._slots = slots
        for slot, member in enumerate(self._members):
            self._adopt_all(member.cache, slot)

    def _fit_tokens(self, length: int) -> None:
        """Grow the full-attention rows (all members re-adopted) so `length` tokens fit."""
        if all(s.capacity >= length for s in self._token_slots.values()):
            return
        for layer, storage in self._token_slots.items():
            self._token_slots[layer] = storage.resized(self._slots, length)
        self._readopt_tokens()

    def _shrink_tokens(self) -> None:
        """Shrink the full-attention rows once the longest member needs under half of them:
        a step attends over whole rows, so a long request that has left would otherwise slow
        every later step of the short ones. (A copy of the members' tokens, amortised.)"""
        need = max((m.cache.length + 1 for m in self._members), default=1)
        floor = SHRINK_FLOOR_BLOCKS * self.cfg.block_size
        capacity = max((s.capacity for s in self._token_slots.values()), default=0)
        if capacity <= max(2 * need, floor):
            return
        for layer, storage in self._token_slots.items():
            self._token_slots[layer] = storage.shrunk(max(need + need // 4, floor))
        self._readopt_tokens()

    def _readopt_tokens(self) -> None:
        for slot, member in enumerate(self._members):
            for layer, storage in self._token_slots.items():
                storage.adopt(member.cache.token_kv(layer), slot)

    def _adopt_all(self, cache: RequestCache, slot: int) -> None:
        for layer, buffer in self._buffers.items():
            _adopt(cache, layer, buffer, slot)
        for layer, storage in self._token_slots.items():
            storage.adopt(cache.token_kv(layer), slot)

    def layer_states(self, lengths: Tensor) -> list[BatchLayerState]:
        """Each layer's state for one step; `lengths` [B] the members' cache lengths."""
        n = len(self._members)
        states: list[BatchLayerState] = []
        for layer in range(self.cfg.n_layers):
            buffer = self._buffers.get(layer)
            if isinstance(buffer, LinearState):
                states.append(LinearState(buffer.state[:n], buffer.conv_tail[:n]))
            elif isinstance(buffer, WindowKV):
                states.append(WindowKV(buffer.k[:n], buffer.v[:n]))
            else:
                members = [m.cache.token_kv(layer) for m in self._members]
                states.append(self._token_slots[layer].padded(members, lengths))
        return states

    @torch.no_grad()
    def step(self, return_logits: bool = False) -> StepResult:
        """One token for every member; finished members leave and their caches are returned."""
        if not self._members:
            return StepResult((), {})
        members = list(self._members)
        ids = torch.tensor([m.next_token for m in members])
        lengths = [m.cache.length for m in members]
        self._fit_tokens(max(lengths) + 1)
        positions = torch.tensor(lengths)
        hidden = self.model.decode_hidden(ids, self.layer_states(positions), positions)
        logits = self.model.logits(hidden)  # [B, V]
        tokens = sample_tokens(logits, [m.sampler for m in members],
                               [m.generated for m in members])
        events = []
        finished: dict[str, RequestCache] = {}
        for row, (member, token) in enumerate(zip(members, tokens, strict=True)):
            member.cache.length += 1
            member.generated += 1
            member.next_token = token
            reason = finish_reason(token, member.generated, member.sampler.params,
                                   self.cfg.eos_id)
            logprob = member.sampler.logprob(logits[row], member.generated - 1, token)
            events.append(TokenEvent(member.request_id, token, member.generated - 1, reason,
                                     logprob=logprob))
            if reason is not None:
                finished[member.request_id] = self.leave(member.request_id)
        self._steps += 1
        self._tokens += len(members)
        return StepResult(tuple(events), finished, logits if return_logits else None)

    def statistics(self) -> DecodeBatchStatistics:
        return DecodeBatchStatistics(
            members=len(self._members), slots=self._slots, steps=self._steps,
            tokens=self._tokens, joined=self._joined, left=self._left,
            tokens_in_cache=sum(m.cache.length for m in self._members),
            token_capacity=max((s.capacity for s in self._token_slots.values()), default=0),
        )

    def check_integrity(self) -> None:
        ids = [m.request_id for m in self._members]
        if len(set(ids)) != len(ids) or len(ids) > self._slots:
            raise CacheError(f"batch members {ids} exceed {self._slots} slots or repeat")
        for slot, member in enumerate(self._members):
            member.cache.check_integrity()
            for layer, buffer in self._buffers.items():
                if not _is_view_of(member.cache.layers[layer], buffer, slot):
                    raise CacheError(f"{member.request_id!r} layer {layer} is not slot {slot}")
            for layer, storage in self._token_slots.items():
                if not storage.holds(member.cache.token_kv(layer), slot):
                    raise CacheError(f"{member.request_id!r} layer {layer} is not slot {slot}")


def _empty_buffer(cfg: ModelConfig, kind: str, slots: int,
                  dtype: torch.dtype) -> LinearState | WindowKV | None:
    if kind in LINEAR_KINDS:
        h, d = cfg.linear_heads, cfg.linear_head_dim
        return LinearState(torch.zeros(slots, h, d, d),
                           torch.zeros(slots, cfg.conv_size - 1, 3 * h * d, dtype=dtype))
    if kind in WINDOW_KINDS:
        shape = (slots, cfg.window, cfg.n_kv_heads, cfg.head_dim)
        return WindowKV(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    return None


def _pairs(layer: LinearState | WindowKV | TokenKV) -> list[tuple[str, Tensor]]:
    if isinstance(layer, LinearState):
        return [("state", layer.state), ("conv_tail", layer.conv_tail)]
    if isinstance(layer, WindowKV):
        return [("k", layer.k), ("v", layer.v)]
    raise CacheError("token KV is not batched")


def _adopt(cache: RequestCache, layer: int, buffer: LinearState | WindowKV, slot: int) -> None:
    """Copy the layer's state into `slot` of `buffer` and make the cache use that row."""
    own = cache.layers[layer]
    for name, batched in _pairs(buffer):
        row = batched[slot : slot + 1]
        current = getattr(own, name)
        if current.data_ptr() != row.data_ptr():
            row.copy_(current)
        setattr(own, name, row)


def _release(cache: RequestCache, layer: int) -> None:
    own = cache.layers[layer]
    for name, tensor in _pairs(own):
        setattr(own, name, tensor.clone())


def _is_view_of(own: object, buffer: LinearState | WindowKV, slot: int) -> bool:
    if not isinstance(own, LinearState | WindowKV):
        return False
    return all(getattr(own, name).data_ptr() == batched[slot].data_ptr()
               for name, batched in _pairs(buffer))
