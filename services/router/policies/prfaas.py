"""`prfaas`: the paper's length-threshold rule with a fixed t (arXiv 2604.15039 v2, 3.3, 3.4.3).

Rule: l = l_total - l_prefix; l > t prefills on PrfaaS, l <= t on a PD prefill worker.
Which prefix counts depends on the link (docs/paper-notes.md, section 2.4 step 3):
- bandwidth scarce: each cluster's cache is judged on its own; the local decision counts the
  PD cluster's prefix (l = l_total - l_pd), and a request sent to PrfaaS resumes from the
  PrfaaS cluster's own cache. Nothing but the new KV crosses the link.
- bandwidth abundant: the best cache anywhere counts (l_prefix = max(l_prfaas, l_pd)); "when
  the cluster with the longer cache differs from the compute cluster, a cross-cluster cache
  transfer is performed", so the compute cluster resumes from that longer prefix.
`threshold_rule` is shared with `prfaas-dynamic`, which moves t instead of fixing it.
"""

from __future__ import annotations

import math

import msgspec

from services.contract.types import Cluster
from services.paper.case_study import T_STAR_TOKENS
from services.router.policy import (
    BandwidthMode,
    Decision,
    PolicyBase,
    PolicyError,
    RouteInputs,
    format_tokens,
    is_bandwidth_scarce,
    link_note,
)


def check_watermark(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise PolicyError(f"{name} must be a finite number >= 0, got {value!r}")


class PrfaasConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    threshold: float = T_STAR_TOKENS  # t in the router's tokens; the paper's case-study optimum
    abundant_below: float = 0.5  # link utilisation under which bandwidth counts as abundant
    bandwidth: BandwidthMode = "auto"  # or pin "scarce" / "abundant"

    def __post_init__(self) -> None:
        if math.isnan(self.threshold) or self.threshold < 0:
            raise PolicyError(f"threshold must be a number >= 0, got {self.threshold!r}")
        check_watermark("abundant_below", self.abundant_below)


def _unavailable(inputs: RouteInputs, t: float, scarce: bool, who: str) -> Decision:
    incremental = inputs.total_len - inputs.cached_pd
    return Decision(
        cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
        resume_prefix=inputs.cached_pd, threshold=t, bandwidth_scarce=scarce,
        cross_cluster_cache_transfer=False,
        reason=f"{who}: PrfaaS unavailable, l = {format_tokens(incremental)} prefills locally")


def _counted_prefix(inputs: RouteInputs, scarce: bool) -> int:
    return inputs.cached_pd if scarce else max(inputs.cached_prfaas, inputs.cached_pd)


def _own_cache(inputs: RouteInputs, cluster: Cluster) -> int:
    return inputs.cached_prfaas if cluster == "prfaas" else inputs.cached_pd


def threshold_rule(inputs: RouteInputs, t: float, scarce: bool, who: str = "prfaas",
                   link: str = "") -> Decision:
    """The paper's rule at threshold t under the scarce or abundant prefix rule; `link` says
    in the reason why that rule applies (`link_note`), else the rule alone is named."""
    if not inputs.prfaas_available:
        return _unavailable(inputs, t, scarce, who)
    counted = _counted_prefix(inputs, scarce)
    incremental = inputs.total_len - counted
    cluster: Cluster = "prfaas" if incremental > t else "pd"
    own = _own_cache(inputs, cluster)
    resume = own if scarce else counted
    transfer = resume > own
    where = "PrfaaS" if cluster == "prfaas" else "PD prefill"
    rule = "PD cache counts" if scarce else "best cache anywhere counts"
    why = link or ("bandwidth scarce" if scarce else "bandwidth abundant")
    reason = (f"{who}: l = {format_tokens(inputs.total_len)} - {format_tokens(counted)} = "
              f"{format_tokens(incremental)} {'>' if cluster == 'prfaas' else '<='} "
              f"t = {format_tokens(t)} -> {where} ({why}: {rule})")
    if transfer:
        other = "pd" if cluster == "prfaas" else "prfaas"
        reason += f"; pull {format_tokens(resume - own)} cached tokens from {other}"
    return Decision(
        cluster=cluster, counted_prefix=counted, incremental_len=incremental,
        resume_prefix=resume, threshold=t, bandwidth_scarce=scarce,
        cross_cluster_cache_transfer=transfer, reason=reason)


class PrfaasPolicy(PolicyBase[PrfaasConfig]):
    """The threshold rule with the t of its config (or an override set live)."""

    name = "prfaas"
    config_type = PrfaasConfig

    def _own_threshold(self) -> float:
        return self.config.threshold

    def _decide(self, inputs: RouteInputs) -> Decision:
        below, mode = self.config.abundant_below, self.config.bandwidth
        scarce = is_bandwidth_scarce(inputs, below, mode)
        t = self.threshold
        assert t is not None
        return threshold_rule(inputs, t, scarce, self.name, link_note(inputs, below, mode))
