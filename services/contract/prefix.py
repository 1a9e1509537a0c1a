"""Prefix block hashes: the hash chain that names cached KV blocks across the mesh.

A prompt is cut into fixed-size token blocks; only full blocks are hashed (a partial last block
is never shared, as in vLLM's and Mooncake's prefix caches). Block i's hash is a keyed BLAKE2b of
its tokens, keyed by block i-1's hash, so it depends on every token of blocks 0..i: two prompts
share their first k hashes exactly when they share their first k blocks (barring collisions,
about 2**-63 per pair). The cache directory relies on this: a hash names a whole prefix.

Hash ids are non-negative integers below 2**63 everywhere (the top bit of the 64-bit digest is
cleared), so they fit int64 (numpy, torch) and uint64 alike, and msgpack always encodes them as
the same non-negative integer. Which worker holds which chains: services.cachedir.directory.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np
import numpy.typing as npt

HASH_BITS = 63
MAX_HASH = (1 << HASH_BITS) - 1
# Personalisation strings keep token-derived and trace-derived chains in separate hash domains.
_TOKEN_PERSON = b"prfaas/tokens"
_TRACE_PERSON = b"prfaas/trace-ids"
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1

BlockHash = Annotated[int, msgspec.Meta(ge=0, le=MAX_HASH)]
"""A block hash id as it travels in messages: validated to [0, 2**63) on decode."""


def block_hashes(tokens: npt.ArrayLike, block_size: int, seed: int = 0) -> list[int]:
    """Hash chain over the full `block_size`-token blocks of `tokens` (partial tail ignored).

    hash[-1] = seed; hash[i] = blake2b(int32-LE bytes of block i, key=u64-LE(hash[i-1]),
    digest 8 bytes, person "prfaas/tokens") read little-endian with the top bit cleared.
    `seed` namespaces chains (e.g. per model) and must itself be a valid hash id.
    """
    _check_block_size(block_size)
    return _token_chain(_int32_bytes(tokens), block_size, check_hash("seed", seed), [])


def extend_hashes(tokens: Sequence[int], block_size: int, known: Sequence[int],
                  seed: int = 0) -> list[int]:
    """`block_hashes(tokens, block_size, seed)` when `known` is already the chain of the first
    len(known) blocks of `tokens` (hashed by whoever saw that prefix first: a prompt's chain
    is the start of the chain of the prompt and its output): only the blocks after them are
    hashed. `known` is taken as given; `check_chain_end` tests a received one."""
    _check_known(len(tokens), block_size, known)
    if not known:
        return block_hashes(tokens, block_size, seed)
    return extend_chain(known, tokens[len(known) * block_size:], block_size, seed)


def extend_chain(known: Sequence[int], tail: Sequence[int], block_size: int,
                 seed: int = 0) -> list[int]:
    """`extend_hashes(tokens, block_size, known, seed)` given only `tail`, the tokens after
    the known blocks: a caller holding the tokens in parts (a finished request's prompt and
    its output) hashes what follows the known blocks without joining the parts whole."""
    if not known:
        return block_hashes(tail, block_size, seed)
    _check_block_size(block_size)
    check_hash("seed", seed)
    return _token_chain(_int32_bytes(tail), block_size, known[-1], list(known))


def check_chain_end(tokens: Sequence[int], block_size: int, hashes: Sequence[int],
                    seed: int = 0) -> None:
    """ValueError unless the last of `hashes` is the hash of its block of `tokens` chained
    from the one before it (from `seed` for a one-block chain): one block hashed, so a chain
    made another way (another block size or token encoding, or shifted by a block) is
    refused at once. The blocks before the last are taken on trust from the sender."""
    _check_known(len(tokens), block_size, hashes)
    if not hashes:
        return
    last = len(hashes) - 1
    prev = hashes[last - 1] if last else check_hash("seed", seed)
    block = _int32_bytes(tokens[last * block_size:(last + 1) * block_size])
    if _keyed(block, prev, _TOKEN_PERSON) != hashes[last]:
        raise ValueError(f"hashes[{last}] is not the hash of block {last} of the tokens "
                         f"({block_size}-token blocks, seed {seed}): the chain was made "
                         "another way")


def _check_known(length: int, block_size: int, known: Sequence[int]) -> None:
    _check_block_size(block_size)
    if len(known) > length // block_size:
        raise ValueError(f"hashes must name at most the {length // block_size} full blocks "
                         f"of {length} tokens, got {len(known)}")


def _token_chain(data: memoryview, block_size: int, prev: int, out: list[int]) -> list[int]:
    """`out` extended by the chain over the full blocks of `data` (int32-LE), from `prev`."""
    stride = block_size * 4
    for start in range(0, len(data) // stride * stride, stride):
        prev = _keyed(data[start : start + stride], prev, _TOKEN_PERSON)
        out.append(prev)
    return out


def reusable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Whole blocks of a `prompt_tokens`-token prompt that a cache may supply: those strictly
    below its last token, which must always be computed (its logits give the first output
    token). A 128-token prompt with 64-token blocks may reuse 1 block, never 2."""
    _check_block_size(block_size)
    return max(0, prompt_tokens - 1) // block_size


def block_hashes_reference(tokens: Sequence[int], block_size: int, seed: int = 0) -> list[int]:
    """Slow, obvious version of `block_hashes` (token by token, no numpy), tested equal."""
    _check_block_size(block_size)
    prev = check_hash("seed", seed)
    out: list[int] = []
    for first in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(digest_size=8, key=struct.pack("<Q", prev), person=_TOKEN_PERSON)
        for token in tokens[first : first + block_size]:
            digest.update(struct.pack("<i", int(token)))
        prev = int.from_bytes(digest.digest(), "little") & MAX_HASH
        out.append(prev)
    return out


def chain_from_ids(hash_ids: Sequence[int], seed: int = 0) -> list[int]:
    """Map a Mooncake trace's `hash_ids` into this module's hash space, chained.

    Mooncake's ids (FAST'25 traces, 512-token blocks) are already prefix-chained: an id names
    its block together with all preceding blocks (data/traces/README.md; checked in
    tests/test_prefix.py: every id has one position and one predecessor). Chaining them again
    is therefore harmless, keeps them correct for traces whose ids name single blocks only,
    and spreads them over [0, 2**63) in their own domain, apart from token-derived hashes.
    hash[i] = blake2b(u64-LE(id[i]), key=u64-LE(hash[i-1]), person "prfaas/trace-ids").
    """
    prev = check_hash("seed", seed)
    out: list[int] = []
    for index, block_id in enumerate(hash_ids):
        check_hash(f"hash_ids[{index}]", block_id)
        prev = _keyed(struct.pack("<Q", block_id), prev, _TRACE_PERSON)
        out.append(prev)
    return out


def _keyed(data: bytes | memoryview, prev: int, person: bytes) -> int:
    digest = hashlib.blake2b(data, digest_size=8, key=prev.to_bytes(8, "little"), person=person)
    return int.from_bytes(digest.digest(), "little") & MAX_HASH


def _int32_bytes(tokens: npt.ArrayLike) -> memoryview:
    """The tokens as little-endian int32s; ValueError naming what is wrong with them."""
    if isinstance(tokens, list | tuple):
        # A list of ints (the usual case) packs directly, range-checked in C: struct takes
        # each int as it is, twice as fast as array("i") (which parses each as an argument)
        # and a ninth of numpy's round trip. What it refuses, numpy's path explains.
        try:
            return memoryview(_int32_packer(len(tokens)).pack(*tokens))
        except struct.error:
            pass
    return memoryview(_token_array(tokens).astype("<i4").tobytes())


@functools.lru_cache(maxsize=1024)
def _int32_packer(count: int) -> struct.Struct:
    """The packer of `count` little-endian int32s, compiled once per count: struct.pack's own
    cache of formats (100, emptied when full) missed often in the simulation."""
    return struct.Struct(f"<{count}i")


def _token_array(tokens: npt.ArrayLike) -> npt.NDArray[np.int64]:
    array = np.asarray(tokens)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(
            f"tokens must be a flat sequence of ints, got shape {array.shape} dtype {array.dtype}"
        )
    low, high = int(array.min()), int(array.max())
    if low < _INT32_MIN or high > _INT32_MAX:
        raise ValueError(f"tokens must fit int32, got values in [{low}, {high}]")
    return array.astype(np.int64, copy=False)


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def check_hash(name: str, value: int) -> int:
    """`value` if it is a valid hash id, else ValueError naming it `name`."""
    if not 0 <= value <= MAX_HASH:
        raise ValueError(f"{name} must be in [0, 2**63), got {value}")
    return value

