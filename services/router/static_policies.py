"""The bookkeeping every routing policy shares (`PolicyBase`), the test of which prefix rule
applies (`is_bandwidth_scarce`), and the static policies, in the order the paper meets them:
`homogeneous` and `naive-hetero` (its baselines), `prfaas` (its threshold rule,
`threshold_rule`, which `prfaas-dynamic` shares) and `dynamo` (a baseline from another system).
The base lives beside the policies because a policy's `_decide` reads its threshold through
it: the call and its callback stay in one module.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import ClassVar, Generic, Literal, TypeVar

import msgspec

from services.contract.types import Cluster
from services.paper.case_study import T_STAR_TOKENS
from services.router.policy import (
    Action,
    ClusterState,
    Decision,
    Feedback,
    Policy,
    PolicyError,
    PolicyStatistics,
    RequestFinished,
    RouteInputs,
    site_key,
)

# Which prefix rule of paper section 3.3 applies: "auto" decides from the link
# (`is_bandwidth_scarce`), "scarce" / "abundant" pin one.
PrefixRule = Literal["auto", "scarce", "abundant"]
_Config = TypeVar("_Config", bound=msgspec.Struct)
# The option's name before `prefix_rule`: `bandwidth` now names a rate only.
DEPRECATED_PREFIX_RULE_KEY = "bandwidth"

log = logging.getLogger(__name__)


class PolicyBase(Generic[_Config]):
    """Counting, overrides and no-op loops shared by the policies; subclasses write `_decide`.

    Each policy names its frozen config type (`config_type`); it is built from plain options
    (CLI, TOML, the admin API) here, once for all policies (`from_options`).
    `_own_threshold` returns the policy's t (None: it has none, and overrides are refused).
    In code the paper's t is `threshold` (Dynamo's `max_local_prefill_length` too); None is
    the one "none" (no threshold, no override), and math.inf is a threshold (offload
    nothing) that only JSON writes as null (`json_threshold`).
    """

    name = "base"
    config_type: ClassVar[type[msgspec.Struct]]

    def __init__(self, config: _Config | None = None) -> None:
        self.config: _Config = config if config is not None else self._default_config()
        self._threshold_override: float | None = None
        self._decisions = self._to_prfaas = self._transfers = self._finished = 0
        self._last_reason = ""
        self._sent: dict[str, int] = {}  # requests sent to each PrfaaS cluster

    def pick_prfaas_site(self, inputs: RouteInputs) -> RouteInputs:
        """`inputs` with `site` the available PrfaaS cluster a request would go to
        (`site_key`); unchanged, its site unavailable, when none is available."""
        sites = inputs.prfaas_sites
        open_sites = [i for i, s in enumerate(sites) if s.available]
        if not open_sites:
            return inputs
        best = min(open_sites,
                   key=lambda i: site_key(sites[i], self._sent.get(sites[i].name, 0)))
        return msgspec.structs.replace(inputs, site_index=best)

    def _default_config(self) -> _Config:
        return self.config_type()  # type: ignore[return-value]

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Policy:
        return cls(build_config(cls.name, cls.config_type, options))  # type: ignore[arg-type]

    def _decide(self, inputs: RouteInputs) -> Decision:
        raise NotImplementedError

    def _own_threshold(self) -> float | None:
        return None

    @property
    def threshold(self) -> float | None:
        pinned = self._threshold_override
        return pinned if pinned is not None else self._own_threshold()

    def decide(self, inputs: RouteInputs) -> Decision:
        decision = self._decide(inputs)
        self._decisions += 1
        self._to_prfaas += decision.cluster == "prfaas"
        if decision.cluster == "prfaas":
            self._sent[inputs.site.name] = self._sent.get(inputs.site.name, 0) + 1
        self._transfers += decision.cross_cluster_cache_transfer
        self._last_reason = decision.reason
        return decision

    def observe(self, feedback: Feedback) -> None:
        if isinstance(feedback, RequestFinished):
            self._finished += 1

    def tick(self, now: float, state: ClusterState) -> list[Action]:
        return []

    def set_threshold_override(self, threshold: float | None) -> None:
        """Pin t (None: back to the policy's own); refused by policies without a threshold."""
        if self._own_threshold() is None:
            raise PolicyError(f"policy {self.name!r} has no threshold to override "
                              f"(t={threshold!r})")
        if threshold is not None and (math.isnan(threshold) or threshold < 0):
            raise PolicyError(f"t must be a number >= 0 or None, got {threshold!r}")
        self._threshold_override = threshold

    def check_integrity(self) -> None:
        """Raise PolicyError if the bookkeeping contradicts itself (tests call this)."""
        problems = []
        if not 0 <= self._to_prfaas <= self._decisions:
            problems.append(f"to_prfaas={self._to_prfaas} outside 0..{self._decisions}")
        if not 0 <= self._transfers <= self._decisions:
            problems.append(f"transfers={self._transfers} outside 0..{self._decisions}")
        problems += self._integrity_problems()
        if problems:
            raise PolicyError(f"policy {self.name!r} integrity: " + "; ".join(problems))

    def _integrity_problems(self) -> list[str]:
        threshold = self.threshold
        return ([f"threshold is NaN ({threshold!r})"]
                if threshold is not None and math.isnan(threshold) else [])

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(
            name=self.name, decisions=self._decisions, to_prfaas=self._to_prfaas,
            to_pd=self._decisions - self._to_prfaas,
            offload_fraction=self._to_prfaas / self._decisions if self._decisions else 0.0,
            cross_cluster_transfers=self._transfers, finished=self._finished,
            threshold=self.threshold, override=self._threshold_override,
            last_reason=self._last_reason)



def format_tokens(value: float | None) -> str:
    """A length or threshold for reason lines: 2,048; inf; none."""
    if value is None:
        return "none"
    return f"{value:,.0f}" if math.isfinite(value) else ("inf" if value > 0 else "-inf")


def is_bandwidth_scarce(inputs: RouteInputs, abundant_below: float,
                        mode: PrefixRule = "auto") -> bool:
    """Which prefix rule of paper section 3.3 applies (section 2.4 step 3 of docs/paper-notes.md).

    The paper names the two cases but gives no test. Ours: bandwidth is abundant while the
    link's egress utilisation is below `abundant_below` and no transfer stalled recently,
    i.e. there is room left for a cross-cluster cache transfer; otherwise it is scarce.
    `mode` pins either case (for experiments and tests).
    """
    if mode != "auto":
        return mode == "scarce"
    return inputs.site.link_utilisation >= abundant_below or inputs.site.link_stalls > 0


def link_note(inputs: RouteInputs, abundant_below: float, mode: PrefixRule = "auto") -> str:
    """What `is_bandwidth_scarce` decided from, for the reason line: the link's utilisation
    against the watermark and its recent stalls ("link calm (util 3% < 50%)"), or the pin."""
    if mode != "auto":
        return f"bandwidth pinned {mode}"
    util = f"util {inputs.site.link_utilisation:.0%}"
    if inputs.site.link_stalls > 0:
        return f"link busy ({inputs.site.link_stalls} recent stalls, {util})"
    if inputs.site.link_utilisation >= abundant_below:
        return f"link busy ({util} >= {abundant_below:.0%})"
    return f"link calm ({util} < {abundant_below:.0%})"


def with_prefix_rule(options: Mapping[str, object], where: str) -> dict[str, object]:
    """`options` with the deprecated key `bandwidth` (the prefix rule's old name) moved to
    `prefix_rule`, logging the deprecation; both given is refused."""
    out = dict(options)
    if DEPRECATED_PREFIX_RULE_KEY not in out:
        return out
    if "prefix_rule" in out:
        raise PolicyError(f"{where}: give prefix_rule only, not also its deprecated name "
                          f"bandwidth={out[DEPRECATED_PREFIX_RULE_KEY]!r}")
    log.warning("%s: option 'bandwidth' is deprecated, call it 'prefix_rule'", where)
    out["prefix_rule"] = out.pop(DEPRECATED_PREFIX_RULE_KEY)
    return out


def build_config(policy: str, kind: type[_Config], options: Mapping[str, object]) -> _Config:
    """A policy's frozen config from plain options (CLI, TOML); errors name the bad key."""
    if "prefix_rule" in kind.__struct_fields__:
        options = with_prefix_rule(options, f"policy {policy!r}")
    try:
        return msgspec.convert(dict(options), kind)
    except msgspec.ValidationError as exc:
        raise PolicyError(f"policy {policy!r}: bad option: {exc}") from exc


def check_watermark(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise PolicyError(f"{name} must be a finite number >= 0, got {value!r}")



class HomogeneousConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field


class HomogeneousPolicy(PolicyBase[HomogeneousConfig]):
    """`homogeneous`, the paper's homogeneous PD baseline: every request prefills in the PD
    cluster, resuming from the PD cluster's own cache.
    """

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


class NaiveHeteroConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field


class NaiveHeteroPolicy(PolicyBase[NaiveHeteroConfig]):
    """`naive-hetero`, the paper's naive heterogeneous baseline: every request prefills on
    PrfaaS, resuming from the PrfaaS cluster's own cache.

    Paper section 4.3.3: all prefill on the compute-dense cluster, all decode on the PD cluster,
    "without length-based routing or load balancing". Only when PrfaaS is unavailable (no worker,
    or its link down) does a request fall back to the PD cluster, so the system keeps serving.
    """

    name = "naive-hetero"
    config_type = NaiveHeteroConfig

    def _decide(self, inputs: RouteInputs) -> Decision:
        scarce = is_bandwidth_scarce(inputs, self.config.abundant_below)
        if not inputs.site.available:
            incremental = inputs.total_len - inputs.cached_pd
            return Decision(
                cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
                resume_prefix=inputs.cached_pd, threshold=None, bandwidth_scarce=scarce,
                cross_cluster_cache_transfer=False,
                reason=f"naive-hetero: PrfaaS unavailable, l = {format_tokens(incremental)} "
                       "falls back to the PD cluster")
        incremental = inputs.total_len - inputs.site.cached
        return Decision(
            cluster="prfaas", counted_prefix=inputs.site.cached, incremental_len=incremental,
            resume_prefix=inputs.site.cached, threshold=None, bandwidth_scarce=scarce,
            cross_cluster_cache_transfer=False,
            reason=f"naive-hetero: every prefill on PrfaaS, l = {format_tokens(incremental)}")



class PrfaasConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    threshold: float = T_STAR_TOKENS  # t in the router's tokens; the paper's case-study optimum
    abundant_below: float = 0.5  # link utilisation under which bandwidth counts as abundant
    prefix_rule: PrefixRule = "auto"  # or pin "scarce" / "abundant"

    def __post_init__(self) -> None:
        if math.isnan(self.threshold) or self.threshold < 0:
            raise PolicyError(f"threshold must be a number >= 0, got {self.threshold!r}")
        check_watermark("abundant_below", self.abundant_below)


def _unavailable(inputs: RouteInputs, threshold: float, scarce: bool, who: str) -> Decision:
    incremental = inputs.total_len - inputs.cached_pd
    return Decision(
        cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
        resume_prefix=inputs.cached_pd, threshold=threshold, bandwidth_scarce=scarce,
        cross_cluster_cache_transfer=False,
        reason=f"{who}: PrfaaS unavailable, l = {format_tokens(incremental)} prefills locally")


def _counted_prefix(inputs: RouteInputs, scarce: bool) -> int:
    return inputs.cached_pd if scarce else max(inputs.site.cached, inputs.cached_pd)


def _own_cache(inputs: RouteInputs, cluster: Cluster) -> int:
    return inputs.site.cached if cluster == "prfaas" else inputs.cached_pd


def threshold_rule(inputs: RouteInputs, threshold: float, scarce: bool, who: str = "prfaas",
                   link: str = "") -> Decision:
    """The paper's rule at threshold t under the scarce or abundant prefix rule; `link` says
    in the reason why that rule applies (`link_note`), else the rule alone is named."""
    if not inputs.site.available:
        return _unavailable(inputs, threshold, scarce, who)
    counted = _counted_prefix(inputs, scarce)
    incremental = inputs.total_len - counted
    cluster: Cluster = "prfaas" if incremental > threshold else "pd"
    own = _own_cache(inputs, cluster)
    resume = own if scarce else counted
    transfer = resume > own
    where = "PrfaaS" if cluster == "prfaas" else "PD prefill"
    rule = "PD cache counts" if scarce else "best cache anywhere counts"
    why = link or ("bandwidth scarce" if scarce else "bandwidth abundant")
    reason = (f"{who}: l = {format_tokens(inputs.total_len)} - {format_tokens(counted)} = "
              f"{format_tokens(incremental)} {'>' if cluster == 'prfaas' else '<='} "
              f"t = {format_tokens(threshold)} -> {where} ({why}: {rule})")
    if transfer:
        other = "pd" if cluster == "prfaas" else "prfaas"
        reason += f"; pull {format_tokens(resume - own)} cached tokens from {other}"
    return Decision(
        cluster=cluster, counted_prefix=counted, incremental_len=incremental,
        resume_prefix=resume, threshold=threshold, bandwidth_scarce=scarce,
        cross_cluster_cache_transfer=transfer, reason=reason)


class PrfaasPolicy(PolicyBase[PrfaasConfig]):
    """`prfaas`: the paper's length-threshold rule with a fixed t (arXiv 2604.15039 v2, 3.3, 3.4.3).

    Rule: l = l_total - l_prefix; l > t prefills on PrfaaS, l <= t on a PD prefill worker.
    Which prefix counts depends on the link (docs/paper-notes.md, section 2.4 step 3):
    - bandwidth scarce: each cluster's cache is judged on its own; the local decision counts the
      PD cluster's prefix (l = l_total - l_pd), and a request sent to PrfaaS resumes from the
      PrfaaS cluster's own cache. Nothing but the new KV crosses the link.
    - bandwidth abundant: the best cache anywhere counts (l_prefix = max(l_prfaas, l_pd)); "when
      the cluster with the longer cache differs from the compute cluster, a cross-cluster cache
      transfer is performed", so the compute cluster resumes from that longer prefix.
    The t is its config's (or an override set live); `threshold_rule` is shared with
    `prfaas-dynamic`, which moves t instead of fixing it.
    """

    name = "prfaas"
    config_type = PrfaasConfig

    def _own_threshold(self) -> float:
        return self.config.threshold

    def _decide(self, inputs: RouteInputs) -> Decision:
        below, mode = self.config.abundant_below, self.config.prefix_rule
        scarce = is_bandwidth_scarce(inputs, below, mode)
        threshold = self.threshold
        assert threshold is not None
        return threshold_rule(inputs, threshold, scarce, self.name,
                              link_note(inputs, below, mode))


class DynamoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 8
    abundant_below: float = 0.5  # only labels the event's bandwidth_scarce field

    def __post_init__(self) -> None:
        for name in ("max_local_prefill_length", "max_prefill_queue_size"):
            if getattr(self, name) < 0:
                raise PolicyError(f"{name} must be >= 0, got {getattr(self, name)!r}")


class DynamoPolicy(PolicyBase[DynamoConfig]):
    """`dynamo`: NVIDIA Dynamo's conditional-disaggregation rule, a baseline from another
    system.

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

    name = "dynamo"
    config_type = DynamoConfig

    def _own_threshold(self) -> float:
        return float(self.config.max_local_prefill_length)

    def _why_local(self, inputs: RouteInputs, incremental: int,
                   threshold: float) -> str | None:
        """None when the request goes remote, else the reason it stays local."""
        if not inputs.site.available:
            return "PrfaaS unavailable"
        if incremental <= threshold:
            return f"l = {format_tokens(incremental)} <= local limit {format_tokens(threshold)}"
        if inputs.site.queue >= self.config.max_prefill_queue_size:
            return (f"remote queue {inputs.site.queue} >= "
                    f"{self.config.max_prefill_queue_size}")
        return None

    def _decide(self, inputs: RouteInputs) -> Decision:
        threshold = self.threshold
        assert threshold is not None
        incremental = inputs.total_len - inputs.cached_pd
        scarce = is_bandwidth_scarce(inputs, self.config.abundant_below)
        local = self._why_local(inputs, incremental, threshold)
        if local is not None:
            return Decision(
                cluster="pd", counted_prefix=inputs.cached_pd, incremental_len=incremental,
                resume_prefix=inputs.cached_pd, threshold=threshold, bandwidth_scarce=scarce,
                cross_cluster_cache_transfer=False, reason=f"dynamo: {local} -> PD prefill")
        resume = max(inputs.site.cached, inputs.cached_pd)
        return Decision(
            cluster="prfaas", counted_prefix=inputs.cached_pd, incremental_len=incremental,
            resume_prefix=resume, threshold=threshold, bandwidth_scarce=scarce,
            cross_cluster_cache_transfer=resume > inputs.site.cached,
            reason=(f"dynamo: l = {format_tokens(incremental)} > local limit "
                    f"{format_tokens(threshold)} and remote queue {inputs.site.queue} < "
                    f"{self.config.max_prefill_queue_size} -> PrfaaS"))
