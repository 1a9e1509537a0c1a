"""`prfaas serve`: options, routes through links, the default topology, runners, the event
stream, the echo service in this process."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from mesh.errors import ConfigError, HandshakeError, PeerGone
from mesh.events import EventBus
from mesh.node import Node
from mesh.topology import parse_topology
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport
from netem.params import LinkParams
from services.cli.launch import in_process
from services.cli.serve import default_topology, run_service, runner_for, serve_main
from services.contract.access import MESH_SECRET_ENV
from services.contract.events import Event, WorkerStatus
from services.contract.messages import MAX_SUBSCRIBE_MAXLEN, Echo, Subscribe
from services.link import service as link_service
from services.service import ServiceContext, link_of_peer, link_routes, resolve_from, serve_events
from services.worker.service import WorkerService
from tests.ports import free_port
from ui.feed import FeedConfig

TOPOLOGY_TEXT = f"""
[[clusters]]
name = "prfaas"
kind = "prfaas"
options = {{ family = "mimo", seed = 3, threads = 1 }}
[[clusters]]
name = "pd"
kind = "pd"
[[services]]
name = "p"
kind = "prefill"
cluster = "prfaas"
port = 7001
options = {{ seed = 4, cache_mib = 64 }}
[[services]]
name = "q"
kind = "prefill"
cluster = "pd"
port = 7002
[[services]]
name = "d"
kind = "decode"
cluster = "pd"
port = 7003
[[services]]
name = "wan"
kind = "link"
port = 7004
options = {{ proxy_base_port = 7300, control_port = 7005 }}
[[services]]
name = "echo"
kind = "echo"
port = {free_port()}
[[links]]
name = "wan"
a = "prfaas"
b = "pd"
bandwidth_bps = 1e9
"""
TOPOLOGY = parse_topology(TOPOLOGY_TEXT)


def context(name: str) -> ServiceContext:
    return ServiceContext(TOPOLOGY, TOPOLOGY.service(name))


def test_options_come_from_the_service_then_its_cluster() -> None:
    ctx = context("p")
    assert ctx.option("seed", 0) == 4
    assert ctx.option("family", "kimi-linear") == "mimo"
    assert ctx.option("cache_mib", 256.0) == 64.0
    assert ctx.option("slots", 8) == 8
    with pytest.raises(ConfigError, match="option family='mimo' must be a int"):
        ctx.option("family", 0)


def test_cross_cluster_peers_go_through_the_link_and_lanes_share_an_address() -> None:
    routes = link_routes(TOPOLOGY, TOPOLOGY.links[0])
    assert [(r.service, r.listen.port, r.upstream.port, r.reverse) for r in routes] == [
        ("q", 7300, 7002, False), ("d", 7301, 7003, False), ("p", 7302, 7001, True)]
    from_prfaas = resolve_from(TOPOLOGY, "prfaas")
    assert from_prfaas("d") == from_prfaas("d#2") == Address("127.0.0.1", 7301)
    assert from_prfaas("p") == Address("127.0.0.1", 7001)
    from_pd = resolve_from(TOPOLOGY, "pd")
    assert from_pd("d") == Address("127.0.0.1", 7003)
    # A PD worker pushing a cached prefix to PrfaaS crosses the same link, the other way.
    assert from_pd("p#1") == Address("127.0.0.1", 7302)
    assert link_of_peer(TOPOLOGY, "prfaas")("d#1") == "wan"
    assert link_of_peer(TOPOLOGY, "pd")("d") is None
    assert link_of_peer(TOPOLOGY, "pd")("p") == "wan"


def test_the_default_topology_is_the_designs() -> None:
    topology = default_topology()
    kinds = {s.name: (s.kind, s.cluster, s.port) for s in topology.services}
    assert kinds["prfaas-prefill-0"] == ("prefill", "prfaas", 7110)
    assert kinds["pd-prefill-0"] == ("prefill", "pd", 7120)
    assert kinds["pd-decode-0"] == ("decode", "pd", 7130)
    assert kinds["cachedir"][0] == "cachedir" and kinds["link-0"][0] == "link"
    assert [(c.name, c.kind) for c in topology.clusters] == [("prfaas", "prfaas"), ("pd", "pd")]
    assert resolve_from(topology, "prfaas")("pd-decode-0") == Address("127.0.0.1", 7201)
    link = topology.service("link-0").options
    assert (link["control_port"], link["proxy_base_port"]) == (8474, 7200)


def test_unknown_kinds_and_names_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="service kind must be one of"):
        runner_for("teapot")
    assert serve_main(["no-such-service"]) == 2
    assert "service 'no-such-service' is not in the topology" in capsys.readouterr().err


@pytest.mark.trio
async def test_echo_and_the_event_stream_over_tcp() -> None:
    async with in_process(TOPOLOGY, ["echo"], transport=TcpTransport()) as mesh:
        address = mesh.addresses["echo"]
        node = Node("client", mesh.client().codec, TcpTransport(), {"echo": address})
        async with node:
            with trio.fail_after(10):
                assert await node.call("echo", Echo(text="hi", hops=1), Echo) == Echo(
                    text="hi", hops=2)


@pytest.mark.trio
async def test_subscribers_see_events_published_after_they_asked(memory_hub: object) -> None:
    async with in_process(TOPOLOGY, []) as mesh:
        bus: EventBus[Event] = EventBus()
        server = Node("events", mesh.client().codec, mesh.transport, {"events": Address("e", 1)})
        serve_events(server, bus)
        event = WorkerStatus(ts=1.0, source="w", worker="w", cluster="pd", role="decode",
                             queue_depth=0, running=1, busy=True, cached_blocks=2)
        async with server, Node("ui", mesh.client().codec, mesh.transport,
                                {"events": Address("e", 1)}) as client:
            await server.listen(Address("e", 1))
            with trio.fail_after(10):
                async with client.open_stream("events", Subscribe(maxlen=4)) as events:
                    while bus.statistics().subscribers == 0:
                        await trio.sleep(0.01)
                    bus.publish(event)
                    assert await events.__anext__() == event


@pytest.mark.trio
async def test_a_worker_serves_its_statistics_at_metrics() -> None:
    port = free_port()
    topology = parse_topology(f"""
[[clusters]]
name = "pd"
kind = "pd"
[[services]]
name = "d"
kind = "decode"
cluster = "pd"
port = 1
options = {{ family = "qwen-next", size = "tiny", checkpoint = "none", metrics_port = {port} }}
""")
    async with in_process(topology, ["d"]) as mesh:
        worker = mesh.services["d"]
        assert isinstance(worker, WorkerService)
        # A subscriber gets the worker's status at once, with what it serves.
        with worker.bus.subscribe() as events, trio.fail_after(10):
            status = await events.receive()
        assert isinstance(status, WorkerStatus) and status.model == "qwen-next tiny float32"
        async with httpx.AsyncClient() as http:
            with trio.fail_after(20):
                while True:
                    try:
                        response = await http.get(f"http://127.0.0.1:{port}/metrics")
                        break
                    except httpx.ConnectError:
                        await trio.sleep(0.05)
    assert response.status_code == 200
    assert 'prfaas_decode_finished_total{service="d"} 0.0' in response.text
    assert "prfaas_prefix_cache_budget_bytes" in response.text
    assert "\nprocess_resident_memory_bytes " in response.text
    model = next(line for line in response.text.splitlines()
                 if line.startswith("prfaas_model_info{"))
    assert 'service="d"' in model and 'family="qwen-next"' in model and 'dtype="' in model


MESH_SECRET = b"the mesh's secret, 32 bytes long"


@pytest.mark.trio
async def test_a_service_with_the_mesh_secret_refuses_peers_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = ServiceContext(TOPOLOGY, TOPOLOGY.service("echo"), transport=TcpTransport(),
                         secret=MESH_SECRET)
    codec = ctx.codec
    async with trio.open_nursery() as nursery:
        address = await nursery.start(run_service, ctx)
        for name, secret in (("none", None), ("wrong", b"another secret, 32 bytes long..")):
            async with Node(name, codec, TcpTransport(), {"echo": address},
                            secret=secret) as intruder:
                with trio.fail_after(10), pytest.raises((HandshakeError, PeerGone)):
                    await intruder.call("echo", Echo(text="hi", hops=0))
        async with Node("member", codec, TcpTransport(), {"echo": address},
                        secret=MESH_SECRET) as member:
            with trio.fail_after(10):
                assert await member.call("echo", Echo(text="hi", hops=0)) == Echo(text="hi", hops=1)
        nursery.cancel_scope.cancel()
    refused = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refused) == 2, refused
    assert "from none:" in refused[0] and "from wrong:" in refused[1]


def test_a_service_beyond_loopback_without_a_secret_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(MESH_SECRET_ENV, raising=False)
    path = tmp_path / "topology.toml"
    # 198.18.0.1 (a benchmarking address, not on this host): refused before any bind.
    path.write_text('[[services]]\nname = "echo"\nkind = "echo"\nhost = "198.18.0.1"\n'
                    'port = 7190\n')
    assert serve_main(["echo", "--topology", str(path)]) == 2
    assert "'198.18.0.1' beyond loopback needs a mesh secret" in capsys.readouterr().err


@pytest.mark.trio
async def test_a_node_beyond_loopback_needs_the_secret_over_tcp_not_in_memory(
    memory_hub: MemoryHub,
) -> None:
    topology = parse_topology('[[services]]\nname = "echo"\nkind = "echo"\n'
                              'host = "198.18.0.1"\nport = 7190\n')
    tcp = ServiceContext(topology, topology.service("echo"), transport=TcpTransport())
    async with tcp.node() as node:
        with pytest.raises(ConfigError, match="beyond loopback needs a mesh secret"):
            await node.listen()
    memory = ServiceContext(topology, topology.service("echo"),
                            transport=MemoryTransport(memory_hub))
    async with memory.node() as node:
        assert await node.listen() == Address("198.18.0.1", 7190)


@pytest.mark.trio
async def test_a_service_listens_on_its_bind_address_not_the_host_peers_dial() -> None:
    port = free_port()
    # Peers would dial 198.18.0.9 (not on this host: listening there would fail).
    topology = parse_topology(f'[[services]]\nname = "echo"\nkind = "echo"\n'
                              f'host = "198.18.0.9"\nbind = "127.0.0.1"\nport = {port}\n')
    ctx = ServiceContext(topology, topology.service("echo"), transport=TcpTransport())
    async with trio.open_nursery() as nursery:
        assert await nursery.start(run_service, ctx) == Address("127.0.0.1", port)
        async with Node("c", ctx.codec, TcpTransport(), {"echo": Address("127.0.0.1", port)}
                        ) as client:
            with trio.fail_after(10):
                assert await client.call("echo", Echo(text="x", hops=0)) == Echo(text="x",
                                                                                 hops=1)
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_link_binds_its_proxy_and_control_api_where_told_with_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, object] = {}
    token = "an-admin-token-of-32-characters."
    text = TOPOLOGY_TEXT.replace('kind = "link"\nport = 7004\n',
                                 'kind = "link"\nport = 7004\nhost = "198.18.0.9"\nbind = "::"\n')
    topology = parse_topology(text)
    ctx = ServiceContext(topology, topology.service("wan"), transport=MemoryTransport(MemoryHub()))
    with trio.CancelScope() as scope:

        async def fake_serve_link(routes: object, params: object, port: int,
                                  **kw: object) -> None:
            seen.update(kw, routes=routes)
            scope.cancel()
            await trio.sleep_forever()

        monkeypatch.setenv("PRFAAS_ADMIN_TOKEN", token)
        monkeypatch.setattr(link_service, "serve_link", fake_serve_link)
        await link_service.run_link(ctx)
    assert seen["control_host"] == "::" and seen["admin_token"] == token
    # Its Host check answers the name others dial it at.
    assert seen["control_names"] == ("198.18.0.9",)
    routes = seen["routes"]
    assert isinstance(routes, list) and routes
    assert {r.listen_host for r in routes} == {"::"}
    # Senders in cluster prfaas dial the link's host.
    assert resolve_from(topology, "prfaas")("d").host == "198.18.0.9"


def test_the_emulator_adds_the_links_impairments_unless_the_kernel_does() -> None:
    link = parse_topology(TOPOLOGY_TEXT.replace(
        "bandwidth_bps = 1e9", "bandwidth_bps = 1e9\ndelay_s = 0.01\njitter_s = 0.002\n"
        "loss_rate = 0.01")).links[0]
    assert link_service.link_params(link) == LinkParams(
        bandwidth_bps=1e9, delay_s=0.01, jitter_s=0.002, loss_rate=0.01)
    kernel = msgspec.structs.replace(link, options={"impairments": "kernel"})
    assert link_service.link_params(kernel) == LinkParams(bandwidth_bps=1e9)
    with pytest.raises(ConfigError, match=r"options.impairments must be one of .*got 'tc'"):
        link_service.link_params(msgspec.structs.replace(link, options={"impairments": "tc"}))


@pytest.mark.trio
async def test_a_subscriber_cannot_ask_for_an_unbounded_backlog(
    memory_hub: MemoryHub, caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = ServiceContext(TOPOLOGY, TOPOLOGY.service("echo"), transport=MemoryTransport(memory_hub))
    async with trio.open_nursery() as nursery:
        address = await nursery.start(run_service, ctx)
        async with Node("ui", ctx.codec, ctx.transport, {"echo": address}) as client:
            # The service drops a peer whose frame breaks the contract.
            with trio.fail_after(10), pytest.raises(PeerGone):
                async with client.open_stream("echo", Subscribe(maxlen=10**9)) as events:
                    await events.__anext__()
            assert any("maxlen" in r.getMessage() for r in caplog.records)
            with trio.fail_after(10), pytest.raises(ConfigError, match="maxlen"):
                FeedConfig(maxlen=MAX_SUBSCRIBE_MAXLEN + 1)
        nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_the_link_services_control_api_takes_the_admin_token_for_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = "an-admin-token-of-32-characters."
    monkeypatch.setenv("PRFAAS_ADMIN_TOKEN", token)
    control, base = free_port(), free_port()
    topology = parse_topology(f"""
[[clusters]]
name = "a"
[[clusters]]
name = "b"
[[services]]
name = "d"
kind = "decode"
cluster = "b"
port = {free_port()}
[[services]]
name = "wan"
kind = "link"
port = {free_port()}
options = {{ proxy_base_port = {base}, control_port = {control} }}
[[links]]
name = "wan"
a = "a"
b = "b"
bandwidth_bps = 1e9
""")
    ctx = ServiceContext(topology, topology.service("wan"), transport=TcpTransport())
    async with trio.open_nursery() as nursery:
        await nursery.start(run_service, ctx)
        url = f"http://127.0.0.1:{control}/link"
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(url)).status_code == 200
            refused = await client.post(url, json={"delay_ms": 5})
            assert refused.status_code == 401
            taken = await client.post(url, json={"delay_ms": 5},
                                      headers={"authorization": f"Bearer {token}"})
            assert taken.status_code == 200
        nursery.cancel_scope.cancel()
