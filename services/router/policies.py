"""The one list of routing policies (`REGISTERED`), which the CLI, the router, the dashboard
and the simulation read, and `create_policy`, which builds one by name from plain options.

To add a policy: write a class that implements `Policy` (services/router/policy.py;
subclassing `PolicyBase[YourConfig]` gives the bookkeeping and `from_options`), name its frozen
`config_type`, then add the class to `REGISTERED`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from services.router.dynamic_policy import PrfaasDynamicPolicy
from services.router.policy import Policy, PolicyError
from services.router.static_policies import (
    DynamoPolicy,
    HomogeneousPolicy,
    NaiveHeteroPolicy,
    PrfaasPolicy,
)

# The one list of policies: the CLI, the router, the dashboard and the simulation read it.
REGISTERED = (
    HomogeneousPolicy, NaiveHeteroPolicy, PrfaasPolicy, PrfaasDynamicPolicy, DynamoPolicy,
)
PolicyFactory = Callable[[Mapping[str, object]], Policy]
POLICIES: dict[str, PolicyFactory] = {cls.name: cls.from_options for cls in REGISTERED}


def create_policy(name: str, options: Mapping[str, object] | None = None) -> Policy:
    """A fresh policy by name, configured from plain options (unknown keys are refused)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise PolicyError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return factory(options or {})
