"""`dynamo`: NVIDIA Dynamo's conditional-disaggregation rule, as a baseline from another system.

Dynamo v0.x ("conditional disaggregation", docs/architecture/disagg_serving.md in
github.com/ai-dynamo/dynamo; archived at docs.nvidia.com/dynamo/archive/0.2.0/architecture/
disagg_serving.html) prefills a request remotely only if both hold:
1. the prefill length without prefix-cache hit, prefill_len - prefix_hit_len, exceeds
   `max_local_prefill_length` (default 1000 in its Rust `DisaggRouterConf`), and
2. the remote prefill queue holds fewer than `max_prefill_queue_size` requests.
Otherwise it prefills locally. Facts from docs/prior-work.md section 2.3.

Our mapping, a simplification: Dynamo's "remote" is its prefill-worker pool in the same
datacenter and "local" is chunked prefill on the decode worker; here remote is the PrfaaS
cluster and local a PD prefill worker. The prefix hit is the PD cluster's (Dynamo counts the
decode worker's). A remote prefill in Dynamo reads the prefix-hit blocks from the decode
worker, so a longer PD cache is moved to PrfaaS (`cross_cluster_cache_transfer`). The queue
limit's default (8) is ours: the source gives none we could verify. The rule knows nothing of
link bandwidth; that blindness is what it is here to show.
"""

from __future__ import annotations

import msgspec

from services.router.policy import (
    Decision,
    PolicyBase,
    PolicyError,
    RouteInputs,
    format_tokens,
    is_bandwidth_scarce,
)


class DynamoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 8
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field

    def __post_init__(self) -> None:
        for name in ("max_local_prefill_length", "max_prefill_queue_size"):
            if getattr(self, name) < 0:
                raise PolicyError(f"{name} must be >= 0, got {getattr(self, name)!r}")


class DynamoPolicy(PolicyBase[DynamoConfig]):
    """Remote (PrfaaS) prefill iff the uncached length is long and the remote queue short."""

    name = "dynamo"
    config_type = DynamoConfig

    def _own_threshold(self) -> float:
        return float(self.config.max_local_prefill_length)

    def _why_local(self, inputs: RouteInputs, incremental: int, limit: float) -> str | None:
        """None when the request goes remote, else the reason it stays local."""
        if not inputs.prfaas_available:
            return "PrfaaS unavailable"
        if incremental <= limit:
            return f"l = {format_tokens(incremental)} <= local limit {format_tokens(limit)}"
        if inputs.queue_prfaas >= self.config.max_prefill_queue_size:
            return (f"remote queue {inputs.queue_prfaas} >= "
                    f"{self.config.max_prefill_queue_size}")
        return None

    def _decide(self, inputs: RouteInputs) -> Decision:
        limit = self.threshold
        assert limit is not None
        incremental = inputs.total_len - inputs.cached_pd
        scarce = is_bandwidth_scarce(inputs, self.config.abundant_below)
        local = self._why_local(inputs, incremental, limit)
        if local is not None:
            return Decision(
                cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
                resume_prefix=inputs.cached_pd, threshold=limit, bandwidth_scarce=scarce,
                cross_cluster_cache_transfer=False, reason=f"dynamo: {local} -> PD prefill")
        resume = max(inputs.cached_prfaas, inputs.cached_pd)
        return Decision(
            cluster="prfaas", counted_prefix=inputs.cached_pd, incremental_len=incremental,
            resume_prefix=resume, threshold=limit, bandwidth_scarce=scarce,
            cross_cluster_cache_transfer=resume > inputs.cached_prfaas,
            reason=(f"dynamo: l = {format_tokens(incremental)} > local limit "
                    f"{format_tokens(limit)} and remote queue {inputs.queue_prfaas} < "
                    f"{self.config.max_prefill_queue_size} -> PrfaaS"))
