"""The simulated side of `prfaas validate-sim`: the live mesh's deployment run on virtual time."""

from __future__ import annotations

from collections.abc import Sequence

from services.cli.validate.config import Job, Outcome, ValidationConfig, policy_options
from services.sim.run import run_virtual
from services.sim.world import Deployment


def deployment(config: ValidationConfig) -> Deployment:
    """The live mesh's shape for the simulation: one remote prefill, `config.pd_prefill`
    local ones, one decode, one link, the same policy and t."""
    return Deployment(name="validate", n_prfaas=1,
                      n_pd_prefill=config.pd_prefill, n_decode=1,
                      prfaas_profile=config.profile, pd_profile=config.profile,
                      model=config.model, bandwidth_bps=config.bandwidth_bps,
                      delay_s=config.delay_s, policy="prfaas",
                      policy_options=policy_options(config), scale=1.0,
                      chunk_tokens=config.chunk_tokens, connections=1,
                      snapshot_every=config.snapshot_every, seed=config.seed)


def simulate(config: ValidationConfig, load: Sequence[Job]) -> list[Outcome]:
    """Each job's outcome in the simulation, in the jobs' order (their arrival order)."""
    result, _ = run_virtual(deployment(config), [j.arrival for j in load])
    if len(result.records) != len(load):
        raise RuntimeError(f"the simulation recorded {len(result.records)} of {len(load)} "
                           f"requests")
    return [Outcome(r.arrival_s, r.prompt_tokens, r.output_tokens, r.ttft_s, r.tpot_s, r.e2e_s,
                    r.ok, queue_s=r.queue_s, error=r.error, probe=j.probe,
                    cluster=r.cluster)
            for r, j in zip(result.records, load, strict=True)]
