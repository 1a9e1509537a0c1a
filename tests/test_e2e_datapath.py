"""The data path over real processes on 127.0.0.1 (issue 4 acceptance).

`prfaas serve` children from a generated topology: the cache directory, the link (netem
proxy), and per model family a PrfaaS prefill worker and a PD decode worker. A prompt is
prefilled in the PrfaaS cluster, its KV crosses the link to the decode worker, and the greedy
tokens equal a one-process generation; a second turn sends only what the decode worker lacks;
a prefill worker killed mid-stream fails that request explicitly and the decode worker goes
on serving.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import trio

from mesh.errors import RemoteError
from mesh.node import Node
from mesh.topology import Topology, load_topology, parse_topology
from mesh.transport import TcpTransport
from mesh.wire import Codec
from services.cli.launch import in_process, launch
from services.cli.send import decode_has_tokens, drive_request, link_egress_bytes
from services.contract.events import KVFlow
from services.contract.messages import CODEC_MESSAGES, Sampling, Subscribe
from services.model.config import family_config, kv_bytes_split
from services.model.generate import generate
from services.model.model import build_model

pytestmark = pytest.mark.slow

FAMILIES = {"kimi-linear": 0, "qwen-next": 1}
SAMPLING = Sampling(max_tokens=64, stop_on_eos=False)


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def topology_text(ports: list[int]) -> str:
    parts = [
        '[[clusters]]\nname = "prfaas"\nkind = "prfaas"\n',
        '[[clusters]]\nname = "pd"\nkind = "pd"\n',
        f'[[services]]\nname = "cachedir"\nkind = "cachedir"\nport = {ports[0]}\n',
        f'[[services]]\nname = "link-0"\nkind = "link"\nport = {ports[1]}\n'
        f"options = {{ control_port = {ports[2]}, proxy_base_port = {ports[9]} }}\n",
    ]
    for family, i in FAMILIES.items():
        options = (f'options = {{ family = "{family}", size = "tiny", checkpoint = "none", '
                   f'threads = 1, connections = 2, profile = "h200" }}')
        for role, cluster, port in (("prefill", "prfaas", ports[5 + 2 * i]),
                                    ("decode", "pd", ports[6 + 2 * i])):
            parts.append(f'[[services]]\nname = "{cluster}-{role}-{i}"\nkind = "{role}"\n'
                         f'cluster = "{cluster}"\nport = {port}\n{options}\n')
    parts.append(f'[[services]]\nname = "prfaas-prefill-slow"\nkind = "prefill"\n'
                 f'cluster = "prfaas"\nport = {ports[4]}\n'
                 f'options = {{ family = "kimi-linear", size = "tiny", checkpoint = "none", '
                 f'threads = 1, profile = "h200" }}\n')
    parts.append('[[links]]\nname = "link-0"\na = "prfaas"\nb = "pd"\n'
                 "bandwidth_bps = 400e6\ndelay_s = 0.002\n")
    return "\n".join(parts)


# The live default is uvloop; PRFAAS_E2E_BACKEND=trio|asyncio runs the children on another.
BACKEND = ["--backend", os.environ.get("PRFAAS_E2E_BACKEND", "uvloop")]
MAIN = ["cachedir", "link-0", "prfaas-prefill-0", "pd-decode-0", "prfaas-prefill-1",
        "pd-decode-1"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Topology]]:
    root = tmp_path_factory.mktemp("mesh")
    path = root / "topology.toml"
    path.write_text(topology_text(free_ports(10)))
    topology = load_topology(path, "")
    with launch(path, MAIN, extra_args=BACKEND, log_dir=root) as children:
        assert all(child.poll() is None for child in children.values())
        yield path, topology


def reference(family: str, prompt: list[int]) -> list[int]:
    model = build_model(family_config(family, "tiny"), seed=0)
    return generate(model, prompt, SAMPLING.max_tokens, stop_on_eos=False).tokens


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13) % 500 + 1 for i in range(n)]


def client(topology: Topology) -> Node:
    return Node(f"test-{os.getpid()}", Codec(CODEC_MESSAGES), TcpTransport(), topology.address)


@pytest.mark.trio
@pytest.mark.parametrize("family", list(FAMILIES))
async def test_kv_crosses_the_link_and_tokens_equal_one_process(
    mesh: tuple[Path, Topology], family: str
) -> None:
    _, topology = mesh
    i = FAMILIES[family]
    prompt = tokens(150, i)
    before = await link_egress_bytes(topology)
    async with client(topology) as node:
        with trio.fail_after(120):
            result = await drive_request(node, prompt, prefill_worker=f"prfaas-prefill-{i}",
                                         decode_worker=f"pd-decode-{i}", request_id=f"e2e-{i}",
                                         sampling=SAMPLING, connections=2)
    moved = (await link_egress_bytes(topology))["link-0"] - before["link-0"]
    assert result.tokens == reference(family, prompt)
    assert result.prefill.lanes == 2
    assert result.prefill.kv_bytes < moved < 1.05 * result.prefill.kv_bytes + 4096


@pytest.mark.trio
async def test_a_second_turn_moves_only_what_the_decode_worker_lacks(
    mesh: tuple[Path, Topology],
) -> None:
    _, topology = mesh
    cfg = family_config("kimi-linear", "tiny")
    fixed, per_token = kv_bytes_split(cfg, "float32")
    first = tokens(200, 7)
    async with client(topology) as node:
        with trio.fail_after(120):
            one = await drive_request(node, first, prefill_worker="prfaas-prefill-0",
                                      decode_worker="pd-decode-0", request_id="turn-1",
                                      sampling=SAMPLING)
            second = first + one.tokens + tokens(50, 8)
            has = 0
            while has == 0:  # the decode worker's report reaches the directory (a cast)
                has = await decode_has_tokens(node, "cachedir", second, "pd-decode-0", 64)
                await trio.sleep(0.05)
            before = await link_egress_bytes(topology)
            two = await drive_request(node, second, prefill_worker="prfaas-prefill-0",
                                      decode_worker="pd-decode-0", request_id="turn-2",
                                      sampling=SAMPLING, decode_has=has)
            moved = (await link_egress_bytes(topology))["link-0"] - before["link-0"]
    assert has == (len(first) + 63) // 64 * 64 == 256
    assert two.tokens == reference("kimi-linear", second)
    assert two.prefill.reused_tokens == 192  # resumed from the prefill worker's own cache
    assert moved <= 1.05 * ((len(second) - has) * per_token + fixed)


async def wait_for_first_piece(node: Node) -> None:
    async with node.open_stream("prfaas-prefill-slow", Subscribe()) as events:
        async for event in events:
            if isinstance(event, KVFlow) and event.phase == "progress":
                return


@pytest.mark.trio
async def test_a_prefill_killed_mid_stream_fails_only_its_request(
    mesh: tuple[Path, Topology],
) -> None:
    path, topology = mesh
    prompt = tokens(100, 9)
    outcome: list[BaseException] = []
    # Emulated H200 pacing, slowed 40x: each of the 4 layers takes about 4 s.
    paced = ["--mode", "emulated", "--time-scale", "40", *BACKEND]
    with launch(path, ["prfaas-prefill-slow"], extra_args=paced) as slow:
        async with client(topology) as node:

            async def doomed() -> None:
                try:
                    await drive_request(node, prompt, prefill_worker="prfaas-prefill-slow",
                                        decode_worker="pd-decode-0", request_id="doomed",
                                        sampling=SAMPLING, kv_timeout=60)
                except RemoteError as exc:
                    outcome.append(exc)

            with trio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(doomed)
                    await wait_for_first_piece(node)
                    slow["prfaas-prefill-slow"].send_signal(signal.SIGKILL)
                    killed_at = trio.current_time()
                failed_after = trio.current_time() - killed_at
                after = await drive_request(node, prompt, prefill_worker="prfaas-prefill-0",
                                            decode_worker="pd-decode-0", request_id="after",
                                            sampling=SAMPLING)
    assert len(outcome) == 1 and isinstance(outcome[0], RemoteError)
    assert outcome[0].error == "KVTransferError" and "cut off" in outcome[0].detail
    assert failed_after < 10.0
    assert after.tokens == reference("kimi-linear", prompt)


def test_prfaas_send_prints_tokens_and_bytes(mesh: tuple[Path, Topology]) -> None:
    path, _ = mesh
    prompt = tokens(90, 11)
    command = [sys.executable, "-m", "services.cli.main", "send", "--topology", str(path),
               "--tokens", ",".join(map(str, prompt)), "--prefill", "prfaas-prefill-1",
               "--decode", "pd-decode-1", "--max-tokens", "64", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["result"]["tokens"][:63] == reference("qwen-next", prompt)[:63]
    assert report["link_bytes"]["link-0"] >= report["result"]["prefill"]["kv_bytes"] > 0


@pytest.mark.trio
async def test_streaming_overlaps_transfer_with_compute() -> None:
    """In one process over real TCP and the link: compute paced to about 2 s (emulated H200),
    the link set so that the KV takes about as long. Streamed while computing, the KV must be
    in well before compute + transfer one after the other (as benchmarks/bench_link.py
    measures it, with the transfer alone taken from the held run)."""
    p, d, link, control, proxy = free_ports(5)
    worker = ('options = { family = "kimi-linear", size = "tiny", checkpoint = "none", '
              'profile = "h200", chunk_tokens = 64 }')
    text = (
        f'[[clusters]]\nname = "prfaas"\nkind = "prfaas"\n{worker}\n'
        f'[[clusters]]\nname = "pd"\nkind = "pd"\n{worker}\n'
        f'[[services]]\nname = "p"\nkind = "prefill"\ncluster = "prfaas"\nport = {p}\n'
        f'[[services]]\nname = "d"\nkind = "decode"\ncluster = "pd"\nport = {d}\n'
        f'[[services]]\nname = "link"\nkind = "link"\nport = {link}\n'
        f"options = {{ control_port = {control}, proxy_base_port = {proxy} }}\n"
        '[[links]]\nname = "link"\na = "prfaas"\nb = "pd"\nbandwidth_bps = 4e5\n'
    )
    topology = parse_topology(text)
    done = {}
    async with in_process(topology, ["link", "p", "d"], transport=TcpTransport(),
                          mode="emulated", time_scale=5.0, via_links=True) as mesh, \
            mesh.client() as node:
        for salt, overlap in enumerate((False, True)):
            with trio.fail_after(60):
                result = await drive_request(node, tokens(512, 20 + salt), prefill_worker="p",
                                             decode_worker="d", request_id=f"ov-{overlap}",
                                             sampling=Sampling(max_tokens=1), overlap=overlap)
            done[overlap] = result.prefill
    held, streamed = done[False], done[True]
    assert streamed.chunks == 8 and streamed.compute_s > 1.5
    assert 0.5 < held.transfer_s / held.compute_s < 2.0  # the link is about as slow as compute
    assert streamed.total_s < 0.8 * (streamed.compute_s + held.transfer_s)
