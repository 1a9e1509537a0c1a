"""The synthetic mesh's figures and rules: costs from the paper, its workload, its policies.

Pure functions and plain records; `ui.demo_mesh` runs them on a clock.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from services.contract.types import WorkerRole as Role

MIB = 1 << 20
# Paper Table 5 (1T hybrid, 8 H200): S_kv is about 163 MiB of fixed linear-attention state plus
# 16.8 KiB a token (fit through 190.8 / 308.9 / 701.3 / 2316.3 MiB at 1K / 8K / 32K / 128K).
KV_FIXED_BYTES = 163 * MIB
KV_BYTES_PER_TOKEN = 16.8 * 1024
# ... and T_prefill at those lengths (seconds); linear between the points.
PREFILL_TABLE = ((0, 0.0), (1024, 0.44), (8192, 0.72), (32768, 1.84), (131072, 7.40))
BLOCK_TOKENS = 512  # prefix-cache block (Mooncake's hash_ids granularity)
INTRA_CLUSTER_BPS = 400e9  # RDMA inside a cluster: KV moves there almost for free
UNSHAPED_BPS = 100e9  # what an unshaped link carries (the paper's inter-cluster line)
POLICIES = ("prfaas", "length", "pd-only", "prfaas-only")
T_MIN, T_MAX = 2048.0, 65536.0  # the short-term loop keeps t within these (tokens)
Positive = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


def prefill_seconds(tokens: int) -> float:
    """T_prefill(tokens) on the PrfaaS hardware, interpolated in Table 5 (extrapolated above)."""
    for (x0, y0), (x1, y1) in itertools.pairwise(PREFILL_TABLE):
        if tokens <= x1:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = PREFILL_TABLE[-2:]
    return y1 + (y1 - y0) * (tokens - x1) / (x1 - x0)


def kv_bytes(tokens: int) -> int:
    """Bytes of KV a decode worker lacking `tokens` tokens must receive (state + blocks)."""
    return int(KV_FIXED_BYTES + KV_BYTES_PER_TOKEN * tokens)


def blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


class SyntheticConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The synthetic mesh: its size, link, policy, workload and pace."""

    seed: int = 0
    start_ts: float = 0.0
    rate: Positive = 2.0  # requests per second
    running: bool = True
    prfaas_prefill: Count = 2
    pd_prefill: Count = 2
    pd_decode: Count = 2
    link: str = "wan"
    bandwidth_bps: Positive = 25e9
    delay_ms: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    policy: str = "prfaas"
    threshold: Positive = 19_400.0  # t of the paper's Table 6
    auto_threshold: bool = True
    speedup: Positive = 4.0  # compute runs this much faster than the paper's hardware
    pd_slowdown: Positive = 3.0  # PD (H20) prefill against PrfaaS (H200)
    mu: float = 9.90  # input length: the paper's truncated log-normal
    sigma: Positive = 1.00
    min_len: Annotated[int, msgspec.Meta(ge=1)] = 128
    max_len: Annotated[int, msgspec.Meta(ge=1)] = 131_072
    continue_prob: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.35
    output_min: Annotated[int, msgspec.Meta(ge=1)] = 32
    output_max: Annotated[int, msgspec.Meta(ge=1)] = 256
    tpot_s: Positive = 0.02
    layers: Annotated[int, msgspec.Meta(ge=1)] = 48
    chunks: Annotated[int, msgspec.Meta(ge=1)] = 4  # KV moves in this many layer groups
    stats_interval_s: Positive = 0.5
    tune_interval_s: Positive = 2.0
    max_decode_batch: Annotated[int, msgspec.Meta(ge=1)] = 64

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.min_len > self.max_len or self.output_min > self.output_max:
            raise ValueError("min_len/output_min must not exceed max_len/output_max")


@dataclass(eq=False)
class Worker:
    name: str
    cluster: str
    role: Role
    queue: deque[Request] = field(default_factory=deque)
    running: int = 0
    cached_blocks: int = 0
    converting_to: Role | None = None  # draining now, then this role

    @property
    def load(self) -> int:
        return len(self.queue) + self.running


@dataclass(eq=False)
class Request:
    request_id: str
    arrival: float
    total: int
    computed: int  # tokens the prefill computes (the rest was cached where it ran)
    sent: int  # tokens whose KV the decode side lacks
    remote: bool
    prefill: Worker
    decode: Worker
    output: int
    bytes_total: int = 0
    bytes_done: int = 0
    chunks_done: int = 0


History = deque[tuple[int, bool, Worker]]  # finished: (length, prefilled in PrfaaS, decoder)


def prompt(
    rng: random.Random, config: SyntheticConfig, history: History
) -> tuple[int, int, int, Worker | None]:
    """A new request: (total, cached in PrfaaS, cached in PD, the decoder holding the prefix).

    Some continue an earlier conversation: its whole context is cached where it ran and at
    its decode worker; the new turn is short. The rest are fresh, with the paper's lengths.
    """
    if history and rng.random() < config.continue_prob:
        prefix, in_prfaas, decoder = rng.choice(history)
        turn = max(int(rng.lognormvariate(7.0, 1.0)), 16)
        return min(prefix + turn, config.max_len), prefix if in_prfaas else 0, prefix, decoder
    length = int(rng.lognormvariate(config.mu, config.sigma))
    return min(max(length, config.min_len), config.max_len), 0, 0, None


class Route(msgspec.Struct, frozen=True):
    remote: bool
    incremental: int  # the length the policy counted
    threshold: float | None
    reason: str


def route(
    policy: str, t: float, total: int, cached_prfaas: int, cached_pd: int, scarce: bool
) -> Route:
    """Where a request prefills (paper 3.3 / 3.4.3, docs/architecture.md section 4 step 3) and
    why."""
    if policy == "pd-only":
        return Route(False, total - cached_pd, None, "pd-only: every prefill stays in PD")
    if policy == "prfaas-only":
        return Route(True, total - cached_prfaas, None, "prfaas-only: every prefill offloaded")
    if policy == "length":
        remote = total > t
        sign = ">" if remote else "<="
        where = "offload" if remote else "local"
        reason = f"length {total} {sign} t = {t:.0f}: {where} (cache ignored)"
        return Route(remote, total, t, reason)
    prefix = cached_pd if scarce else max(cached_prfaas, cached_pd)
    incremental = total - prefix
    remote = incremental > t
    verdict = "offload to PrfaaS" if remote else "prefill in PD"
    why = "link busy: PD cache only" if scarce else "link free: best cache anywhere"
    sign = ">" if remote else "<="
    return Route(remote, incremental, t, f"l = {incremental} {sign} t = {t:.0f}: {verdict} ({why})")


def tune(t: float, utilisation: float, queue_prfaas: int, queue_pd: int) -> tuple[float, str]:
    """The short-term loop's next t and why (paper 3.4.3); the same t when nothing calls for it."""
    if utilisation > 0.8 or queue_prfaas > queue_pd + 2:
        new = min(t * 1.25, T_MAX)
        cause = f"egress {utilisation:.0%}" if utilisation > 0.8 else "PrfaaS queue longer"
        return new, f"{cause}: raise t, offload less"
    if utilisation < 0.5 and queue_pd > queue_prfaas + 1:
        return max(t / 1.25, T_MIN), f"PD queue longer, egress {utilisation:.0%}: lower t"
    return t, ""
