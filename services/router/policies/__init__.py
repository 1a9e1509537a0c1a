"""The routing policies by name: what `--policy NAME` and the router's live switch choose from.

To add a policy: write `services/router/policies/<name>.py` with a class that implements
`services.router.policy.Policy` (subclassing `PolicyBase[YourConfig]` gives the bookkeeping
and `from_options`), name its `config_type`, then add the class to `REGISTERED` below.
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

# The one list of policies: the CLI, the router, the dashboard and the simulation read it.
REGISTERED = (
    HomogeneousPolicy, NaiveHeteroPolicy, PrfaasPolicy, PrfaasDynamicPolicy, DynamoPolicy,
)
POLICIES: dict[str, PolicyFactory] = {cls.name: cls.from_options for cls in REGISTERED}


def create_policy(name: str, options: Mapping[str, object] | None = None) -> Policy:
    """A fresh policy by name, configured from plain options (unknown keys are refused)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise PolicyError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return factory(options or {})


__all__ = ["POLICIES", "PolicyFactory", "create_policy"]
