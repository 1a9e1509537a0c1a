"""The routing policies by name: what `--policy NAME` and the router's live switch choose from.

To add a policy: write `services/router/policies/<name>.py` with a class that implements
`services.router.policy.Policy` (subclassing `PolicyBase` gives the bookkeeping) and a
`from_options(options) -> Policy` classmethod, then add one line to `POLICIES` below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from services.router.policies.dynamo import DynamoPolicy
from services.router.policies.homogeneous import HomogeneousPolicy
from services.router.policies.naive_hetero import NaiveHeteroPolicy
from services.router.policies.prfaas import PrfaasPolicy
from services.router.policies.prfaas_dynamic import PrfaasDynamicPolicy
from services.router.policy import Policy, PolicyError

PolicyFactory = Callable[[Mapping[str, object]], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "homogeneous": HomogeneousPolicy.from_options,
    "naive-hetero": NaiveHeteroPolicy.from_options,
    "prfaas": PrfaasPolicy.from_options,
    "prfaas-dynamic": PrfaasDynamicPolicy.from_options,
    "dynamo": DynamoPolicy.from_options,
}


def create_policy(name: str, options: Mapping[str, object] | None = None) -> Policy:
    """A fresh policy by name, configured from plain options (unknown keys are refused)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise PolicyError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return factory(options or {})


__all__ = ["POLICIES", "PolicyFactory", "create_policy"]
