"""The simulation as the dashboard tests' event source: a small deployment, conversations.

`SMALL` is the paper's deployment shrunk to one PrfaaS and one PD prefill instance and two
decode instances; `conversations` are multi-turn requests (a follow-up's prompt is an earlier
turn's prompt plus new blocks, so it hits the prefix caches), their lengths on both sides of
the prfaas policy's threshold, with short answers so that requests finish within a short
recording; `sim_events` records them on virtual time (cached per arguments: a recording is
deterministic).
"""

from __future__ import annotations

import random
from functools import cache

import httpx

from services.contract.events import AnyEvent
from services.sim.live import LiveConfig
from services.sim.record import record_virtual
from services.sim.workload import BLOCK, Arrival
from services.sim.world import Deployment

# On a paced clock httpx's timeouts count virtual seconds: its default 5 s is 25 ms of wall
# time at 200x, less than a loaded 2-core host may take to answer. The tests' clients wait
# 30 wall seconds at the fastest pace they set.
PACED_TIMEOUT_S = 30.0 * 200


def paced_client(host: str, port: int) -> httpx.AsyncClient:
    """A client of a server that runs on a `PacedClock` (virtual time up to 200x wall)."""
    return httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=PACED_TIMEOUT_S)


# The prfaas policy's t in the router's tokens: the paper's 19.4K at the simulation's scale.
SMALL = Deployment(name="small", n_prfaas=1, n_pd_prefill=1, n_decode=2,
                   policy_options={"threshold": 19400 / 8})
SMALL_WORKERS = 4


@cache
def conversations(seconds: float, rate: float = 1.0, seed: int = 0) -> tuple[Arrival, ...]:
    """Poisson arrivals at `rate`; each a new conversation or, half the time, the next turn
    of an earlier one (its whole prompt plus 4 to 16 new blocks)."""
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    out, at = [], rng.expovariate(rate)
    while at < seconds:
        fresh = tuple(range(len(out) * 4096, len(out) * 4096 + rng.randint(4, 16)))
        if prompts and rng.random() < 0.5:
            blocks = rng.choice(prompts) + fresh
        else:
            blocks = tuple(range(len(out) * 4096, len(out) * 4096 + rng.randint(2, 60)))
        prompts.append(blocks)
        length = len(blocks) * BLOCK
        out.append(Arrival(at, blocks, length, 32, length * 8))
        at += rng.expovariate(rate)
    return tuple(out)


@cache
def sim_events(seconds: float, *, rate: float = 1.0, live_rate: float = 0.0,
               deployment: Deployment = SMALL) -> tuple[AnyEvent, ...]:
    """`seconds` of the deployment's events under `conversations` at `rate` (and a live
    load at `live_rate` beside them)."""
    config = LiveConfig(rate=live_rate, output_len=32)
    arrivals = conversations(seconds, rate)
    return tuple(record_virtual(deployment, seconds, config=config, arrivals=arrivals))
