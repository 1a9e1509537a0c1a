"""`homogeneous`: the PD cluster prefills everything (the paper's homogeneous PD baseline)."""

from __future__ import annotations

import msgspec

from services.router.policy import (
    Decision,
    PolicyBase,
    RouteInputs,
    format_tokens,
    is_bandwidth_scarce,
)


class HomogeneousConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field


class HomogeneousPolicy(PolicyBase[HomogeneousConfig]):
    """Every request prefills in the PD cluster, resuming from the PD cluster's own cache."""

    name = "homogeneous"
    config_type = HomogeneousConfig

    def _decide(self, inputs: RouteInputs) -> Decision:
        incremental = inputs.total_len - inputs.cached_pd
        return Decision(
            cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
            resume_prefix=inputs.cached_pd, threshold=None,
            bandwidth_scarce=is_bandwidth_scarce(inputs, self.config.abundant_below),
            cross_cluster_cache_transfer=False,
            reason=f"homogeneous: l = {format_tokens(incremental)} prefills in the PD cluster")
