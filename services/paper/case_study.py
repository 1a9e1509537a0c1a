"""The paper's case study (arXiv 2604.15039 v2, section 4), stated once.

What the planner, the simulation, the router's defaults, the CLI and the benchmarks compare
themselves with: the threshold t* the paper's grid search finds, the decode SLO, the three
deployments of equal hardware and their names, and the figures Table 6 reports for each.
Table 5 (prefill times and KV sizes of the 1T hybrid) is the measured data of the hardware
profiles, `profiles/h200.toml` and `profiles/hybrid_1t.toml`.
"""

from __future__ import annotations

from typing import Final

import msgspec

# t* of Table 6 (section 4.2), in the paper's tokens: prompts whose uncached part is longer
# prefill on the PrfaaS cluster. Served models scale it by the router's `scale`.
T_STAR_TOKENS: Final = 19_400.0

# The decode SLO of section 4.1: 40 tokens/s per request, so one decode step takes 25 ms.
SLO_TOKENS_PER_S: Final = 40.0
DECODE_STEP_S: Final = 1.0 / SLO_TOKENS_PER_S

# The deployments of Table 6, each by its one name.
PRFAAS_PD: Final = "prfaas-pd"
HOMOGENEOUS: Final = "homogeneous"
NAIVE: Final = "naive"
DEPLOYMENTS: Final = (PRFAAS_PD, HOMOGENEOUS, NAIVE)

# The policy each deployment runs in the paper's comparison; every other policy (prfaas,
# prfaas-dynamic, dynamo) routes on PrfaaS-PD.
POLICY_DEPLOYMENTS: Final = {"homogeneous": HOMOGENEOUS, "naive-hetero": NAIVE}


def deployment_for(policy: str) -> str:
    """The deployment `policy` is compared on."""
    return POLICY_DEPLOYMENTS.get(policy, PRFAAS_PD)


class PaperShape(msgspec.Struct, frozen=True):
    """Instances per stage: PrfaaS prefill, PD prefill, PD decode (0: the stage is absent)."""

    n_prfaas: int
    n_p: int
    n_d: int

    def text(self) -> str:
        """As Table 6 writes it: "4 / 3 / 5", a dash for an absent stage."""
        return " / ".join(str(n) if n else "-" for n in (self.n_prfaas, self.n_p, self.n_d))


class PaperRow(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment's column of Table 6 (with sections 4.2-4.3); None: not reported."""

    shape: PaperShape
    lambda_max: float  # req/s
    ratio: float  # Lambda_max over the homogeneous deployment's
    ttft_mean_s: float
    ttft_p90_s: float
    p: float  # the offloaded share of requests
    t: float | None = None
    theta_prfaas: float | None = None  # req/s per stage, Eqs. 3-5
    theta_pd_p: float | None = None
    theta_pd_d: float | None = None
    l_long: float | None = None  # mean offloaded length, "about 44K"
    egress_gbps: float | None = None


TABLE6: Final = {
    PRFAAS_PD: PaperRow(
        shape=PaperShape(4, 3, 5), t=T_STAR_TOKENS, theta_prfaas=1.61, theta_pd_p=1.64,
        theta_pd_d=3.91, lambda_max=3.24, ratio=1.54, ttft_mean_s=2.22, ttft_p90_s=3.51,
        p=0.496, l_long=44_000.0, egress_gbps=13.0),
    HOMOGENEOUS: PaperRow(
        shape=PaperShape(0, 9, 3), theta_pd_p=2.11, theta_pd_d=2.35, lambda_max=2.11,
        ratio=1.00, ttft_mean_s=4.44, ttft_p90_s=9.73, p=0.0),
    NAIVE: PaperRow(
        shape=PaperShape(4, 0, 8), theta_prfaas=2.45, theta_pd_d=6.25, lambda_max=2.45,
        ratio=1.16, ttft_mean_s=1.74, ttft_p90_s=3.51, p=1.0),
}
