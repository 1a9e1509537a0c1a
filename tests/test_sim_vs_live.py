"""The simulation against the emulated live mesh: same arrivals, same decisions, close TTFTs.

The live side is the real thing at small scale: the cache directory, the link (TCP proxy) and
a PrfaaS prefill, a PD prefill and a PD decode worker running the tiny model over TCP in
emulated mode (paced to H200 / H20 at the modeled length: served tokens x 8), and the
router's scheduler. The simulation composes the same classes on virtual time with the
modeled engine. Arrivals are spaced so that nothing queues: TTFT is prefill, the KV's trip
and the first token, which both sides time with the same cost model.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import anyio
import pytest

from mesh.topology import Topology, load_topology
from mesh.transport import TcpTransport
from services.cli.launch import in_process
from services.contract.events import RequestDone, RoutingDecision
from services.contract.sampling import Sampling
from services.paper.hardware import CostModel
from services.router.config import SchedulerConfig
from services.router.control import ControlConfig, RouterControl
from services.router.link import link_ends
from services.router.openai.schema import GenerationRequest
from services.router.policies import create_policy
from services.router.scheduler import Scheduler
from services.router.workers import WorkerTable
from services.service import ServiceContext
from services.sim.engine import ModeledConfig, ModeledTokenizer
from services.sim.run import run_virtual
from services.sim.workload import Arrival
from services.sim.world import Deployment
from tests.ports import free_ports

pytestmark = pytest.mark.slow

SCALE = 1 / 8
T_SERVED = 300  # t = 2,400 paper tokens
LENGTHS = [120, 420, 260, 640, 90, 380, 300, 520]  # served tokens: 4 above t, 4 not
GAP_S = 3.0
OUTPUT = 8
BS_MAX = CostModel.load("h20").decode_slo()[0]




def live_topology() -> Topology:
    ports = free_ports(10)
    common = (f'scale = {SCALE}, chunk_tokens = 2048, connections = 1, max_batch = {BS_MAX}, '
              f'family = "kimi-linear", size = "tiny", checkpoint = "none", threads = 1')
    text = f"""
[[clusters]]
name = "prfaas"
kind = "prfaas"
options = {{ profile = "h200", {common} }}
[[clusters]]
name = "pd"
kind = "pd"
options = {{ profile = "h20", {common} }}
[[services]]
name = "cachedir"
kind = "cachedir"
port = {ports[0]}
[[services]]
name = "link-0"
kind = "link"
port = {ports[1]}
options = {{ control_port = {ports[2]}, proxy_base_port = {ports[3]} }}
[[services]]
name = "prfaas-prefill-0"
kind = "prefill"
cluster = "prfaas"
port = {ports[7]}
[[services]]
name = "pd-prefill-0"
kind = "prefill"
cluster = "pd"
port = {ports[8]}
[[services]]
name = "pd-decode-0"
kind = "decode"
cluster = "pd"
port = {ports[9]}
[[services]]
name = "router"
kind = "router"
port = {ports[6]}
[[links]]
name = "link-0"
a = "prfaas"
b = "pd"
bandwidth_bps = 100e9
delay_s = 0.005
"""
    return load_topology(None, text)


def prompt(length: int, salt: int) -> list[int]:
    return [1 + (salt * 7919 + i * 31) % 500 for i in range(length)]


def arrivals() -> list[Arrival]:
    # Blocks of their own per request (no prefix is shared), lengths as LENGTHS.
    return [Arrival(i * GAP_S, tuple(range(1000 * (i + 1), 1000 * (i + 1) + 20)), n, OUTPUT,
                    round(n / SCALE)) for i, n in enumerate(LENGTHS)]


async def run_live() -> tuple[list[str], list[float]]:
    topology = live_topology()
    names = ["cachedir", "link-0", "prfaas-prefill-0", "pd-prefill-0", "pd-decode-0"]
    async with in_process(topology, names, transport=TcpTransport(), mode="emulated",
                          via_links=True):
        ctx = ServiceContext(topology, topology.service("router"), "emulated", 1.0,
                             TcpTransport())
        policy = create_policy("prfaas", {"threshold": T_SERVED, "bandwidth": "scarce"})
        scheduler = Scheduler(ctx.node(), policy, WorkerTable.from_topology(topology),
                              ModeledTokenizer(ModeledConfig(vocab_size=512)),
                              SchedulerConfig(connections=1, links=link_ends(topology)))
        clusters: dict[str, str] = {}
        ttfts: dict[str, float] = {}
        async with scheduler.node, anyio.create_task_group() as tg:
            await scheduler.node.listen()
            await tg.start(scheduler.run)
            control = RouterControl(scheduler, ControlConfig(tick_s=0.5))
            await tg.start(control.run)
            with scheduler.events.subscribe(10_000) as events:
                order = await _send(scheduler, tg)
                while len(ttfts) < len(LENGTHS):
                    event = await events.receive()
                    if isinstance(event, RoutingDecision):
                        clusters[event.request_id] = event.cluster
                    elif isinstance(event, RequestDone):
                        assert event.ok, event.error
                        ttfts[event.request_id] = event.ttft_s
            tg.cancel_scope.cancel()
    return [clusters[r] for r in order], [ttfts[r] for r in order]


async def _send(scheduler: Scheduler, tg: anyio.abc.TaskGroup) -> list[str]:
    order: list[str] = []
    start = anyio.current_time()
    for i, n in enumerate(LENGTHS):
        await anyio.sleep_until(start + i * GAP_S)
        handle = await scheduler.submit(GenerationRequest(
            prompt=prompt(n, i), sampling=Sampling(max_tokens=OUTPUT, stop_on_eos=False)))
        order.append(handle.placement.request_id)
        tg.start_soon(handle.collect)
    return order


def run_sim() -> tuple[list[str], list[float]]:
    d = Deployment(n_prfaas=1, n_pd_prefill=1, n_decode=1, scale=SCALE, connections=1,
                   delay_s=0.005, policy_options={"threshold": T_SERVED,
                                                  "bandwidth": "scarce"})
    result, _ = run_virtual(d, arrivals())
    assert len(result.records) == len(LENGTHS)
    return [r.cluster for r in result.records], [r.ttft_s for r in result.records]


@pytest.fixture(scope="module")
def live() -> tuple[list[str], list[float]]:
    return anyio.run(run_live, backend="trio")


def test_the_sim_and_the_live_mesh_route_every_request_alike(
    live: tuple[list[str], list[float]],
) -> None:
    sim_clusters, _ = run_sim()
    live_clusters, _ = live
    assert sim_clusters == live_clusters
    assert sim_clusters == ["prfaas" if n > T_SERVED else "pd" for n in LENGTHS]


def test_sim_ttft_is_within_15_percent_of_the_live_mesh(
    live: tuple[list[str], list[float]], tmp_path: Path,
) -> None:
    _, sim = run_sim()
    _, real = live
    for name, f in (("mean", statistics.fmean), ("p90", lambda v: sorted(v)[-1])):
        assert f(sim) == pytest.approx(f(real), rel=0.15), (name, sim, real)
