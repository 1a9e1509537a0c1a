"""An emulated decode worker paces each step to its hardware profile.

The tokens of a request come one modeled decode step apart (the H20 profile at batch 1,
about 25 ms, slowed 4x): the first with the prefill's KV and the second from the first step
at once (a step delivers its tokens, then waits out the rest of its modeled time), each
later one a stretched step after the one before. On real time (the tiny model's step takes a
few ms), so only the lower bound is asserted: a loaded host only makes the steps longer."""

from __future__ import annotations

import pytest
import trio

from mesh.topology import parse_topology
from services.cli.launch import in_process
from services.cli.send import drive_request
from services.contract.messages import TokenChunk
from services.contract.sampling import Sampling
from services.paper.hardware import CostModel, Pacer
from services.worker.compute import Pacing
from tests.topologies import mesh_toml

TIME_SCALE = 4.0
TOPOLOGY = mesh_toml(
    {"q": 1, "d": 2},
    worker='family = "kimi-linear", size = "tiny", checkpoint = "none", profile = "h20"')
PROMPT = [(i * 7) % 500 + 1 for i in range(200)]
NEW_TOKENS = 12


@pytest.mark.trio
async def test_each_decode_step_takes_the_profiles_step_time() -> None:
    arrivals: list[float] = []

    def arrived(chunk: TokenChunk) -> None:
        arrivals.extend([trio.current_time()] * len(chunk.tokens))

    async with in_process(parse_topology(TOPOLOGY), ["q", "d"], mode="emulated",
                          time_scale=TIME_SCALE) as mesh, mesh.client() as client:
        result = await drive_request(client, PROMPT, prefill_worker="q", decode_worker="d",
                                     request_id="r", on_chunk=arrived, timeout=3600.0,
                                     kv_timeout=3600.0,
                                     sampling=Sampling(max_tokens=NEW_TOKENS, stop_on_eos=False))
    assert len(result.tokens) == len(arrivals) == NEW_TOKENS
    # Steps run one after another, each at least its modeled time (which grows with the
    # context); one arrival's delay on the way could shorten a single gap, not the sum of
    # the NEW_TOKENS - 2 paced ones.
    step = TIME_SCALE * Pacing(CostModel.load("h20"), Pacer(1.0)).decode_step_time(
        1, len(PROMPT))
    assert step > 0.05
    assert arrivals[-1] - arrivals[0] >= 0.95 * (NEW_TOKENS - 2) * step
