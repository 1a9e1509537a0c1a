"""The router's configuration: the service's options, as the topology gives them (all
optional), and the scheduler's bounds and deadlines that they set (`SchedulerConfig`).

Flat keys set `RouterConfig`'s fields; a dotted key "policy.option[.field]" sets one policy's
option (`router_config`), checked when that policy is built. `policy_options` derives each
policy's defaults from `scale` (router tokens per paper token) and `prefix_rule`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from mesh.errors import ConfigError
from mesh.topology import Topology
from services.contract.messages import DEFAULT_LANES
from services.contract.types import DEFAULT_TOKEN_SCALE
from services.paper.case_study import T_STAR_TOKENS
from services.router.link_meter import EstimatorConfig
from services.router.policies import POLICIES
from services.router.policy import PolicyError
from services.router.static_policies import PrefixRule, with_prefix_rule

# Request migration (services/router/runner.py): how many times one request may be continued
# elsewhere after its data path broke, and how long KV crossing a link may make no progress
# before it is abandoned and the request re-prefilled in the PD cluster. The topology's
# router options `migration_limit` and `kv_stall_s` set them.
MIGRATION_LIMIT = 3
KV_STALL_S = 3.0
# How long a request's attempt may make no progress on a worker that answers no status poll
# (alive but hung: stopped, or cut off from the router) before that worker is declared lost
# and the request migrated as for a crash; the router option `silence_s` sets it.
SILENCE_S = 5.0


class LinkEnds(msgspec.Struct, frozen=True):
    """A link of the topology: its name and the clusters it joins (a: PrfaaS side)."""

    name: str
    a: str
    b: str


def link_ends(topology: Topology) -> tuple[LinkEnds, ...]:
    return tuple(LinkEnds(link.name, link.a, link.b) for link in topology.links)


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds and deadlines (seconds on the scheduler's clock)."""

    block_size: int = 64  # the model's KV block: prefix hashes must match the workers'
    max_inflight: int = 64
    cachedir: str = "cachedir"
    lookup_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    kv_timeout_s: float = 60.0
    # KV lanes for a cross-cluster prefill, at most the worker's own (1 within a cluster)
    connections: int = DEFAULT_LANES
    stall_window_s: float = 30.0
    links: tuple[LinkEnds, ...] = ()  # the topology's links (which joins which clusters)
    migration_limit: int = MIGRATION_LIMIT  # 0: a broken data path fails its request
    # 0: no stall bound (the simulation's default: its queues may hold KV back for long);
    # the router service takes the topology's, KV_STALL_S unless it says otherwise.
    kv_stall_s: float = 0.0
    # 0: a silent worker's requests wait (the simulation's default: its workers never hang);
    # the router service takes the topology's, SILENCE_S unless it says otherwise.
    silence_s: float = 0.0
    # How each link's bandwidth is estimated from its senders' transfers (link_meter.py).
    link_estimator: EstimatorConfig = EstimatorConfig()

    id_prefix: str = ""  # request ids req-PREFIX-N; "" draws a random prefix

    def __post_init__(self) -> None:
        for name in ("block_size", "max_inflight", "connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("lookup_timeout_s", "request_timeout_s", "kv_timeout_s", "stall_window_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("migration_limit", "kv_stall_s", "silence_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The router service's options in the topology (all optional)."""

    # "": the router service's bind host (services.service.http_bind_host).
    http_host: str = ""
    http_port: int = 8000
    policy: str = "prfaas"
    # Router tokens per paper token: scales t (the paper's t*), prfaas-dynamic's model
    # and the demo workload's lengths to the small model.
    scale: float = DEFAULT_TOKEN_SCALE
    # The prefix rule (paper section 3.3): "auto" counts the best cache anywhere while the
    # link is calm (moving it across, services/worker/prefix_pull.py) and each cluster's own
    # under load; "scarce" / "abundant" pin one rule.
    # The old name of this option, `bandwidth`, is still read (deprecated).
    prefix_rule: PrefixRule = "auto"
    max_context: int = 4096
    max_inflight: int = 64
    block_size: int = 64  # must equal the workers' model block size
    connections: int = DEFAULT_LANES
    tick_s: float = 1.0
    # Times one request may continue elsewhere after a worker or its KV stream failed
    # (0: off), and the seconds KV crossing a link may make no progress (0: no bound).
    migration_limit: int = MIGRATION_LIMIT
    kv_stall_s: float = KV_STALL_S
    # Seconds a request may make no progress on a worker that answers no status poll before
    # the worker is declared lost and the request migrated (0: never).
    silence_s: float = SILENCE_S
    model: str = "prfaas"
    tokenizer: Literal["bpe", "byte"] = "bpe"  # "byte" for the tiny test models (vocab 512)
    # How each link's bandwidth is measured from the router's own transfers (link_meter.py);
    # dotted keys in a topology: "link_estimator.window_s". Its `provisioned_bps` is the rate
    # the line was bought at, if the operator says so (never read from the link itself).
    link_estimator: EstimatorConfig = EstimatorConfig()
    # Where the router's OpenTelemetry spans go (an OTLP/HTTP traces URL); "": the standard
    # OTEL_EXPORTER_OTLP_* variables decide, and without them tracing is off
    # (services/contract/tracing.py).
    otlp_endpoint: str = ""
    # Each policy's own options (fields of its config type) over the defaults that
    # `policy_options` derives from `scale` and `prefix_rule`; checked when the policy is built.
    # A topology's options are flat, so there they are dotted keys: "prfaas-dynamic.dwell_s".
    policies: dict[str, dict[str, Any]] = {}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.policies) - set(POLICIES))
        if unknown:
            raise ConfigError(f"router option policies names unknown policies {unknown}; "
                              f"known: {sorted(POLICIES)}")
        for name in ("scale", "max_context", "max_inflight", "block_size", "connections",
                     "tick_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"router option {name} must be > 0, got "
                                  f"{getattr(self, name)!r}")

    def policy_options(self) -> dict[str, dict[str, object]]:
        t = T_STAR_TOKENS * self.scale
        derived: dict[str, dict[str, object]] = {
            "prfaas": {"threshold": t, "prefix_rule": self.prefix_rule},
            "prfaas-dynamic": {"token_scale": self.scale, "prefix_rule": self.prefix_rule},
            "dynamo": {"max_local_prefill_length": round(t)}}
        return {name: {**derived.get(name, {}), **self.policies.get(name, {})}
                for name in {*derived, *self.policies}}

    def scheduler_config(self, links: tuple[LinkEnds, ...] = ()) -> SchedulerConfig:
        return SchedulerConfig(block_size=self.block_size, max_inflight=self.max_inflight,
                               connections=self.connections, links=links,
                               migration_limit=self.migration_limit, kv_stall_s=self.kv_stall_s,
                               silence_s=self.silence_s, link_estimator=self.link_estimator)


def router_config(options: Mapping[str, object]) -> RouterConfig:
    """The router's config; a dotted key "policy.option[.field]" goes into `policies`, one
    "link_estimator.field" into `link_estimator`; `bandwidth` is read as `prefix_rule`."""
    try:
        renamed = with_prefix_rule(options, "router options")
    except PolicyError as exc:
        raise ConfigError(str(exc)) from exc
    plain: dict[str, Any] = {key: value for key, value in renamed.items() if "." not in key}
    estimator = {key.split(".", 1)[1]: value for key, value in options.items()
                 if key.startswith("link_estimator.")}
    if estimator:
        plain["link_estimator"] = {**dict(plain.get("link_estimator", {})), **estimator}
    options = {key: value for key, value in options.items()
               if not key.startswith("link_estimator.")}
    try:
        policies = _with_dotted(msgspec.convert(plain, RouterConfig).policies, options)
        return msgspec.convert({**plain, "policies": policies}, RouterConfig)
    except (msgspec.ValidationError, ConfigError) as exc:
        raise ConfigError(f"router options: {exc}") from exc


def _with_dotted(policies: dict[str, dict[str, Any]],
                 options: Mapping[str, object]) -> dict[str, Any]:
    """A copy of `policies` with each dotted option "policy.option[.field]" set in it."""
    out: dict[str, Any] = copy.deepcopy(policies)
    for key, value in options.items():
        if "." not in key:
            continue
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"option {key!r}: {part!r} is set to a value, not a table")
        node[leaf] = value
    return out
