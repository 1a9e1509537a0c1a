"""Cross-cluster cache transfer in the data path (services/worker/prefix_pull.py), end to end.

In one process over real TCP, through the emulated link (in_process with via_links): the
cache directory, the link, a PrfaaS prefill worker, a PD prefill worker and a PD decode worker
of the tiny kimi-linear model, and the router's real scheduler with the `prfaas` policy on the
`auto` prefix rule. Turn 1 is long and prefills on PrfaaS; turn 2 extends it by a short
suffix. On the calm link the abundant rule counts the PrfaaS cache, so turn 2 prefills on the
PD prefill worker, which first pulls exactly that prefix's KV over the link (the link's own
counters see S_kv of the prefix once), computes only the suffix, and the tokens equal a
one-process generation. The workers load the noticing kimi-linear of tests/kv_exact.py (its
greedy tokens vary and change with the cache, checked for each prompt), so a prefix that
arrives wrong changes the tokens.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import pytest
import trio

from mesh.histogram import HistogramSeries
from mesh.topology import Topology, parse_topology
from mesh.transport import TcpTransport
from services.cli.launch import in_process
from services.contract.messages import KVOpen
from services.contract.prefix import block_hashes
from services.contract.sampling import Sampling
from services.model.cache import RequestCache
from services.model.config import family_config
from services.router.config import SchedulerConfig
from services.router.policies import create_policy
from services.router.requests import GenerationRequest, RequestHandle
from services.router.scheduler import Scheduler
from services.router.workers import WorkerTable
from services.worker.engine import ModelEngine, expected_kv_bytes
from services.worker.service import WorkerService
from tests.kv_exact import (
    MUTATIONS,
    Mutation,
    assert_model_notices,
    cache_bytes,
    noticing_config,
    one_process_cache,
    write_checkpoint,
)
from tests.ports import free_ports
from tests.topologies import mesh_toml

pytestmark = pytest.mark.slow

BLOCK = 64
MAX_TOKENS = 16  # enough for the noticing check's 8 distinct tokens
BASE = 0x4E00  # token id i is the character chr(BASE + i): text maps back to ids exactly


class IdTokenizer:
    """Each token id its own character, so the router's text gives the ids back."""

    eot_id = 0
    vocab_size = 512

    def encode(self, text: str) -> list[int]:
        return [ord(c) - BASE for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(BASE + i) for i in ids)




@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield write_checkpoint("kimi-linear", tmp_path_factory.mktemp("noticing"))


def topology(checkpoint: Path) -> Topology:
    cachedir, link, control, proxy, p, q, d = free_ports(7)
    worker = (f'family = "kimi-linear", size = "tiny", checkpoint = "{checkpoint}", threads = 1, '
              'connections = 2')
    return parse_topology(mesh_toml(
        {"cachedir": cachedir, "p": p, "q": q, "d": d, "link": link}, worker=worker,
        options={"link": f"control_port = {control}, proxy_base_port = {proxy}"}, link_bps=1e9))


async def link_bytes(topo: Topology) -> int:
    """Bytes the link carried so far, both directions, from its control API."""
    port = topo.service("link").options["control_port"]
    async with httpx.AsyncClient() as client:
        view = (await client.get(f"http://127.0.0.1:{port}/link")).json()
    link = view["statistics"]["link"]
    return int(link["egress"]["bytes_out"]) + int(link["ingress"]["bytes_out"])


def reference(prompt: list[int]) -> list[int]:
    """The one-process tokens of the noticing model, checked to depend on the cache."""
    return assert_model_notices("kimi-linear", prompt, MAX_TOKENS)


def request(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(prompt=prompt,
                             sampling=Sampling(max_tokens=MAX_TOKENS, stop_on_eos=False))


@dataclass
class Pulls:
    """Every prefix a worker pulled and every cache a decode worker imported (each as
    imported), `mutation` applied to the pulled ones first."""

    mutation: Mutation | None = None
    seen: list[RequestCache] = field(default_factory=list)
    decoded: list[RequestCache] = field(default_factory=list)


def recording(real: Callable[..., Awaitable[RequestCache]], record: Pulls,
              ) -> Callable[..., Awaitable[RequestCache]]:
    """`ModelEngine.import_kv` recording each cache it builds: a pulled prefix (its stream's
    purpose "prefix", `record.mutation` applied first) in `seen`, a decode's in `decoded`."""
    async def import_kv(engine: ModelEngine, opening: KVOpen, base: RequestCache | None,
                        pieces: Mapping[tuple[int, int], bytes]) -> RequestCache:
        cache = await real(engine, opening, base, pieces)
        pulled = opening.purpose == "prefix"
        if pulled and record.mutation is not None:
            record.mutation(cache)
        (record.seen if pulled else record.decoded).append(cache.clone(keep_snapshots=False))
        return cache

    return import_kv


@pytest.fixture
def pulls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pulls]:
    record = Pulls()
    monkeypatch.setattr(ModelEngine, "import_kv", recording(ModelEngine.import_kv, record))
    yield record


FIRST = [(i * 7) % 500 + 1 for i in range(200)]
SECOND = FIRST + [(i * 11) % 500 + 3 for i in range(40)]


@dataclass
class PullOutcome:
    one: RequestHandle
    two: RequestHandle
    text: str
    moved: int
    # (service, link, kind) -> (transfers, bytes) of the workers' KV-transfer histograms
    transfers: dict[tuple[str, str, str], tuple[int, float]] = field(default_factory=dict)


async def pull_scenario(checkpoint: Path) -> PullOutcome:
    """Turn 1 (FIRST) prefills on PrfaaS; turn 2 (SECOND) on PD, pulling the prefix."""
    topo = topology(checkpoint)
    names = ["cachedir", "link", "p", "q", "d"]
    async with in_process(topo, names, transport=TcpTransport(), via_links=True) as mesh, \
            mesh.client("router") as node, anyio.create_task_group() as group:
        policy = create_policy("prfaas", {"threshold": 100.0, "prefix_rule": "auto"})
        scheduler = Scheduler(node, policy, WorkerTable.from_topology(topo), IdTokenizer(),
                              SchedulerConfig(block_size=BLOCK, connections=2))
        await group.start(scheduler.run)
        with trio.fail_after(120):
            one = await scheduler.submit(request(FIRST))
            await one.collect()
            while scheduler.workers.get("p").prefills or not await _cached(scheduler, SECOND):
                await trio.sleep(0.05)  # p's cache report reaches the directory (a cast)
            before = await link_bytes(topo)
            two = await scheduler.submit(request(SECOND))
            text, _ = await two.collect()
            moved = await link_bytes(topo) - before
        group.cancel_scope.cancel()
        transfers = {labels: (series.count, bytes_series.sum)
                     for name in ("q", "d") for labels, series, bytes_series in
                     kv_transfers(mesh.services[name])}
    return PullOutcome(one, two, text, moved, transfers)


def kv_transfers(service: object) -> list[tuple[tuple[str, str, str], HistogramSeries,
                                                HistogramSeries]]:
    """Each (service, link, kind) a worker's KV-transfer histograms hold: seconds, bytes."""
    assert isinstance(service, WorkerService)
    metrics = service.kv_metrics
    return [(labels, series, metrics.bytes.labels(*labels))
            for labels, series in metrics.seconds.items()]


def check_pull(outcome: PullOutcome, pulls: Pulls) -> None:
    one, two = outcome.one, outcome.two
    assert one.placement.cluster == "prfaas" and one.placement.pull is None
    decision = two.placement.decision
    # Calm link, abundant rule: the 192 cached tokens in PrfaaS count, l = 48 <= t -> PD.
    assert (decision.cluster, decision.counted_prefix, decision.incremental_len) == (
        "pd", 192, 48)
    assert not decision.bandwidth_scarce and decision.cross_cluster_cache_transfer
    assert two.placement.pull is not None and two.placement.pull.holder == "p"
    assert two.prefill is not None
    assert two.placement.decision.resume_prefix == two.prefill.reused_tokens == 192
    assert two.prefill.computed_tokens == 48
    prefix_kv = expected_kv_bytes(noticing_config("kimi-linear"), 192, 0, "float32")
    assert prefix_kv <= outcome.moved <= 1.05 * prefix_kv
    # Bit for bit, as one process computes them: the pulled prefix, and the whole cache the
    # decode worker holds after turn 2 (a prefix perturbed after the pull shows there). The
    # tokens alone may not show a one-element change within 16 tokens.
    assert len(pulls.seen) == 1 and len(pulls.decoded) == 2
    assert cache_bytes(pulls.seen[0]) == cache_bytes(one_process_cache("kimi-linear",
                                                                       SECOND[:192]))
    assert cache_bytes(pulls.decoded[1]) == cache_bytes(one_process_cache("kimi-linear",
                                                                          SECOND))
    assert IdTokenizer().encode(outcome.text) == reference(SECOND)
    # Each transfer observed once by its receiver: turn 1 whole over the link to d, the
    # prefix over the link to q, turn 2's rest from q to d inside the PD cluster.
    assert {labels: count for labels, (count, _) in outcome.transfers.items()} == {
        ("d", "link", "full"): 1, ("q", "link", "prefix"): 1, ("d", "local", "incremental"): 1}
    assert prefix_kv <= outcome.transfers["q", "link", "prefix"][1] <= outcome.moved


@pytest.mark.trio
async def test_a_prefix_cached_only_in_the_other_cluster_moves_once_and_only_the_rest_computes(
    checkpoint: Path, pulls: Pulls,
) -> None:
    check_pull(await pull_scenario(checkpoint), pulls)


@pytest.mark.trio
@pytest.mark.parametrize("mutation", list(MUTATIONS))
async def test_the_pull_check_fails_when_the_pulled_prefix_is_perturbed(
    checkpoint: Path, pulls: Pulls, mutation: str,
) -> None:
    """Mutation check: one flipped KV byte or one changed state element in the pulled prefix
    makes the test above fail."""
    pulls.mutation = MUTATIONS[mutation]
    outcome = await pull_scenario(checkpoint)
    with pytest.raises(AssertionError):
        check_pull(outcome, pulls)


async def _cached(scheduler: Scheduler, prompt: list[int], worker: str = "p") -> bool:
    """The directory knows `worker` can resume the prompt's first 3 blocks."""
    match = await scheduler.placer._lookup(block_hashes(prompt, scheduler.config.block_size))
    return scheduler.workers.resumable_of(worker, match) >= 3


POLICIES = {
    "homogeneous": {},
    "naive-hetero": {},
    "prfaas": {"threshold": 100.0},
    "prfaas-dynamic": {"token_scale": 1 / 200},
    "dynamo": {"max_local_prefill_length": 100},
}


@pytest.mark.trio
@pytest.mark.parametrize("name", list(POLICIES))
async def test_every_policy_resumes_from_the_prefix_its_decision_counts(
    name: str, checkpoint: Path,
) -> None:
    """Whatever the policy and wherever the prefix is cached, the prefill worker resumes
    from the decision's `resume_prefix` (moving it first when it lies elsewhere)."""
    topo = topology(checkpoint)
    cfg = family_config("kimi-linear", "tiny")
    first = [(i * 5) % 500 + 2 for i in range(200)]
    second = first + [(i * 3) % 500 + 5 for i in range(40)]
    async with in_process(topo, ["cachedir", "link", "p", "q", "d"], transport=TcpTransport(),
                          via_links=True) as mesh, \
            mesh.client("router") as node, anyio.create_task_group() as group:
        scheduler = Scheduler(node, create_policy(name, POLICIES[name]),
                              WorkerTable.from_topology(topo), IdTokenizer(),
                              SchedulerConfig(block_size=cfg.block_size, connections=2))
        await group.start(scheduler.run)
        with trio.fail_after(120):
            one = await scheduler.submit(request(first))
            await one.collect()
            holder = one.placement.prefill_worker
            while scheduler.workers.get(holder).prefills or \
                    not await _cached(scheduler, second, holder):
                await trio.sleep(0.05)
            two = await scheduler.submit(request(second))
            text, _ = await two.collect()
        group.cancel_scope.cancel()
    for handle in (one, two):
        assert handle.prefill is not None
        assert handle.placement.decision.resume_prefix == handle.prefill.reused_tokens
    assert two.prefill is not None and two.prefill.reused_tokens == 192
    if name != "dynamo":  # dynamo counts the PD hit only, by its own rule
        assert two.placement.decision.counted_prefix == 192
    assert IdTokenizer().encode(text) == reference(second)


def two_prfaas_topology() -> Topology:
    """services/cli/topologies/two-prfaas.toml's shape, on free ports, with the tiny model."""
    cachedir, la, lb, ca, cb, pa, pb, a, b, q, d = free_ports(11)
    worker = ('options = { family = "kimi-linear", size = "tiny", checkpoint = "none", '
              'threads = 1, connections = 2 }')
    text = "".join(f'[[clusters]]\nname = "{c}"\nkind = "{k}"\n{worker}\n'
                   for c, k in (("prfaas-a", "prfaas"), ("prfaas-b", "prfaas"), ("pd", "pd")))
    for name, kind, cluster, port in (("a", "prefill", "prfaas-a", a),
                                      ("b", "prefill", "prfaas-b", b),
                                      ("q", "prefill", "pd", q), ("d", "decode", "pd", d)):
        text += (f'[[services]]\nname = "{name}"\nkind = "{kind}"\ncluster = "{cluster}"\n'
                 f"port = {port}\n")
    text += f'[[services]]\nname = "cachedir"\nkind = "cachedir"\nport = {cachedir}\n'
    for name, port, control, proxy, side in (("link-a", la, ca, pa, "prfaas-a"),
                                             ("link-b", lb, cb, pb, "prfaas-b")):
        text += (f'[[services]]\nname = "{name}"\nkind = "link"\nport = {port}\n'
                 f"options = {{ control_port = {control}, proxy_base_port = {proxy} }}\n"
                 f'[[links]]\nname = "{name}"\na = "{side}"\nb = "pd"\nbandwidth_bps = 1e9\n')
    return parse_topology(text)


async def egress(topo: Topology, link: str) -> int:
    port = topo.service(link).options["control_port"]
    async with httpx.AsyncClient() as client:
        view = (await client.get(f"http://127.0.0.1:{port}/link")).json()
    return int(view["statistics"]["link"]["egress"]["bytes_out"])


@pytest.mark.trio
async def test_two_prfaas_clusters_both_take_long_requests_each_over_its_own_link() -> None:
    topo = two_prfaas_topology()
    cfg = family_config("kimi-linear", "tiny")
    names = ["cachedir", "link-a", "link-b", "a", "b", "q", "d"]
    prompts = [[(i * 7 + 31 * k) % 500 + 1 for i in range(150)] for k in range(4)]
    async with in_process(topo, names, transport=TcpTransport(), via_links=True) as mesh, \
            mesh.client("router") as node, anyio.create_task_group() as group:
        scheduler = Scheduler(node, create_policy("prfaas", {"threshold": 100.0}),
                              WorkerTable.from_topology(topo), IdTokenizer(),
                              SchedulerConfig(block_size=cfg.block_size, connections=2))
        await group.start(scheduler.run)
        handles = []
        with trio.fail_after(120):
            for prompt in prompts:
                handles.append(await scheduler.submit(request(prompt)))
                await handles[-1].collect()
            moved = {link: await egress(topo, link) for link in ("link-a", "link-b")}
        group.cancel_scope.cancel()
    used = [h.placement.prefill_worker for h in handles]
    assert sorted(used) == ["a", "a", "b", "b"]  # equal clusters: both take long requests
    for link, worker in (("link-a", "a"), ("link-b", "b")):
        sent = sum(h.prefill.kv_bytes for h in handles
                   if h.prefill is not None and h.placement.prefill_worker == worker)
        assert sent <= moved[link] <= 1.05 * sent + 8192  # its KV crossed its own link
