"""Models that notice their KV, and the checks built on them (shared by the data-path tests).

A tiny model at the default init (std 0.02) answers nearly the same token whatever its cache
holds: qwen-next repeats one token 64 times even when every KV entry and state is noise. So the
exactness tests use the same tiny configs with init std 0.2, where 64 greedy tokens hold more
than 50 distinct ones and change when the cache is perturbed. Workers load these weights from
a float32 checkpoint written into the test's temporary directory (the checkpoint option), so
every process and the in-test reference hold the same weights bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import torch

from services.model.cache import LinearState, RequestCache, TokenKV, WindowKV
from services.model.config import FAMILIES, ModelConfig, family_config, kv_bytes
from services.model.export import export_cache
from services.model.generate import generate, prefill
from services.model.model import HybridLM, build_model, count_params
from services.model.train import CheckpointMeta, save_checkpoint

NOTICING_STD = 0.2
ALL_FAMILIES: tuple[str, ...] = tuple(FAMILIES)
MIN_DISTINCT = 8

Mutation = Callable[[RequestCache], None]


def noticing_config(family: str) -> ModelConfig:
    return msgspec.structs.replace(family_config(family, "tiny"), init_std=NOTICING_STD)


@functools.cache
def noticing_model(family: str) -> HybridLM:
    return build_model(noticing_config(family), seed=0)


def write_checkpoint(family: str, directory: Path) -> Path:
    """The noticing model of `family` as a float32 checkpoint a worker can load."""
    cfg = noticing_config(family)
    model = noticing_model(family)
    meta = CheckpointMeta(
        family=family, size="tiny", config=msgspec.json.encode(cfg).decode(),
        config_hash=cfg.config_hash(), tokenizer_hash="", params=count_params(model), steps=0,
        tokens_seen=0, train_seconds=0.0, train_loss=0.0, val_loss_per_token=0.0,
        chars_per_token=0.0, val_nats_per_char=0.0, weights_dtype="float32", seed=0)
    path = directory / f"{family}-noticing.safetensors"
    save_checkpoint(path, dict(model.state_dict()), meta)
    return path


def reference(family: str, prompt: Sequence[int], n: int, stop_on_eos: bool = False) -> list[int]:
    return generate(noticing_model(family), list(prompt), n, stop_on_eos=stop_on_eos).tokens


def s_kv(family: str, length: int) -> int:
    """S_kv(length) from the model config alone (float32)."""
    return kv_bytes(noticing_config(family), length, "float32")


def cache_bytes(cache: RequestCache) -> list[bytes]:
    """Every layer's exported payload: equal lists mean bit-for-bit equal caches."""
    return [bytes(piece.payload) for piece in export_cache(cache)]


def one_process_cache(family: str, prompt: Sequence[int]) -> RequestCache:
    with torch.no_grad():
        return prefill(noticing_model(family), list(prompt)).cache


def _flip_byte(tensor: torch.Tensor) -> None:
    # The sign byte of the middle element: a one-byte change that is never a no-op.
    flat = tensor.view(-1).view(torch.uint8)
    flat[flat.numel() // 2 + 3 - (flat.numel() // 2) % 4] ^= 0x80


def flip_one_kv_byte(cache: RequestCache) -> None:
    """Flip one byte of the last token's full-attention KV (the first such layer)."""
    for layer in cache.layers:
        if isinstance(layer, TokenKV):
            _flip_byte(layer.buffers[0][0, cache.length - 1])
            return
    raise AssertionError("no full-attention layer")


def bump_one_state_element(cache: RequestCache) -> None:
    """Add 1 to one element of the first linear state or window (dense: a KV element)."""
    for layer in cache.layers:
        if isinstance(layer, LinearState):
            layer.state.view(-1)[0] += 1.0
            return
        if isinstance(layer, WindowKV):
            layer.k.view(-1)[0] += 1.0
            return
    cache.token_kv(0).buffers[0][0, 0, 0] += 1.0


def noise_everything(cache: RequestCache) -> None:
    """Replace every full-attention KV entry and every state by noise (the issue's probe)."""
    gen = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        tensors = (layer.buffers if isinstance(layer, TokenKV) else
                   [layer.state, layer.conv_tail] if isinstance(layer, LinearState) else
                   [layer.k, layer.v])
        for t in tensors:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))


MUTATIONS: dict[str, Mutation] = {
    "one-kv-byte": flip_one_kv_byte,
    "one-state-element": bump_one_state_element,
}


def continue_from(family: str, prompt: Sequence[int], cache: RequestCache, n: int) -> list[int]:
    """Greedy tokens after `prompt` decoded from `cache` (of the prompt minus its last token)."""
    return generate(noticing_model(family), list(prompt), n, cache=cache,
                    stop_on_eos=False).tokens


def assert_model_notices(family: str, prompt: Sequence[int], n: int) -> list[int]:
    """The reference tokens, after checking they vary and change when the KV is noise."""
    tokens = reference(family, prompt, n)
    assert len(set(tokens)) >= min(MIN_DISTINCT, n), (family, tokens)
    for mutate in (noise_everything, *MUTATIONS.values()):
        cache = one_process_cache(family, prompt[:-1])
        mutate(cache)
        if mutate is noise_everything:
            assert continue_from(family, prompt, cache, n) != tokens, (family, "noise")
    return tokens
