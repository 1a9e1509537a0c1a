"""`naive-hetero`: every prefill on PrfaaS (the paper's naive heterogeneous baseline).

Paper section 4.3.3: all prefill on the compute-dense cluster, all decode on the PD cluster,
"without length-based routing or load balancing". Only when PrfaaS is unavailable (no worker,
or its link down) does a request fall back to the PD cluster, so the system keeps serving.
"""

from __future__ import annotations

import msgspec

from services.router.policy import (
    Decision,
    PolicyBase,
    RouteInputs,
    format_tokens,
    is_bandwidth_scarce,
)


class NaiveHeteroConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field


class NaiveHeteroPolicy(PolicyBase[NaiveHeteroConfig]):
    """Every request prefills on PrfaaS, resuming from the PrfaaS cluster's own cache."""

    name = "naive-hetero"
    config_type = NaiveHeteroConfig

    def _decide(self, inputs: RouteInputs) -> Decision:
        scarce = is_bandwidth_scarce(inputs, self.config.abundant_below)
        if not inputs.prfaas_available:
            incremental = inputs.total_len - inputs.cached_pd
            return Decision(
                cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
                resume_prefix=inputs.cached_pd, threshold=None, bandwidth_scarce=scarce,
                cross_cluster_cache_transfer=False,
                reason=f"naive-hetero: PrfaaS unavailable, l = {format_tokens(incremental)} "
                       "falls back to the PD cluster")
        incremental = inputs.total_len - inputs.cached_prfaas
        return Decision(
            cluster="prfaas", counted_prefix=inputs.cached_prfaas, incremental_len=incremental,
            resume_prefix=inputs.cached_prfaas, threshold=None, bandwidth_scarce=scarce,
            cross_cluster_cache_transfer=False,
            reason=f"naive-hetero: every prefill on PrfaaS, l = {format_tokens(incremental)}")
