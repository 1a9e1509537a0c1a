"""Membership: with a shared secret, only peers that hold it get past the Hello exchange."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from mesh.connection import Connection
from mesh.errors import ConfigError, HandshakeError, PeerGone
from mesh.membership import (
    NONCE_SIZE,
    check_secret,
    is_loopback,
    new_nonce,
    proof,
    require_secret_beyond_loopback,
    verify,
)
from mesh.node import Node
from mesh.server import Context
from mesh.transport import Address, MemoryHub, MemoryTransport, TcpTransport, Transport
from mesh.wire import PROTOCOL_VERSION, Call, Codec, Fail, Hello, Proof, Reply
from tests.backends import backends_fixture
from tests.ping import Ping, Pong

CODEC = Codec([Ping, Pong])
SECRET = b"the mesh's shared secret, 32 b.."
OTHER = b"another secret, also long enough"


anyio_backend = backends_fixture(plain_asyncio=True)


def service(transport: Transport, secret: bytes | None, handled: list[int]) -> Node:
    node = Node("svc", CODEC, transport, {}, secret=secret)

    @node.handles(Ping)
    async def on_ping(msg: Ping, ctx: Context) -> Pong:
        handled.append(msg.n)
        return Pong(msg.n)

    return node


def test_proofs_depend_on_role_names_and_both_nonces() -> None:
    a, b = new_nonce(), new_nonce()
    base = proof(SECRET, "client", "c", "s", a, b)
    assert len(a) == NONCE_SIZE and a != b
    assert verify(base, proof(SECRET, "client", "c", "s", a, b))
    for other in (
        proof(SECRET, "server", "c", "s", a, b),
        proof(SECRET, "client", "c", "s", a, new_nonce()),
        proof(SECRET, "client", "cs", "", a, b),
        proof(OTHER, "client", "c", "s", a, b),
    ):
        assert not verify(base, other)


def test_secret_and_loopback_checks() -> None:
    assert check_secret(None) is None and check_secret(SECRET) == SECRET
    with pytest.raises(ConfigError, match="at least 16"):
        check_secret(b"short")
    assert all(map(is_loopback, ["127.0.0.1", "127.8.0.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.2", "::", "example.org"]))
    require_secret_beyond_loopback("127.0.0.1", None)
    require_secret_beyond_loopback("0.0.0.0", SECRET)
    with pytest.raises(ConfigError, match="beyond loopback needs a mesh secret"):
        require_secret_beyond_loopback("0.0.0.0", None)


@asynccontextmanager
async def client_of_a_tcp_service(
    service_secret: bytes | None, handled: list[int],
) -> AsyncIterator[tuple[Node, Node]]:
    """The service with `service_secret` listening on loopback, and a client holding SECRET."""
    async with service(TcpTransport(), service_secret, handled) as svc:
        address = await svc.listen(Address("127.0.0.1", 0))
        async with Node("cli", CODEC, TcpTransport(), {"svc": address}, secret=SECRET) as cli:
            yield svc, cli


@pytest.mark.anyio
async def test_matching_secrets_call_over_tcp() -> None:
    handled: list[int] = []
    async with client_of_a_tcp_service(SECRET, handled) as (svc, cli):
        assert await cli.call("svc", Ping(3), timeout=10) == Pong(3)
        assert await cli.call("svc", Ping(4), timeout=10) == Pong(4)
    assert handled == [3, 4]
    assert svc.statistics().connection_errors == 0


async def good_client_is_served(transport: Transport, address: Address) -> None:
    async with Node("good", CODEC, transport, {"svc": address}, secret=SECRET) as good:
        assert await good.call("svc", Ping(9), timeout=10) == Pong(9)


@pytest.mark.parametrize("client_secret", [OTHER, None], ids=["wrong", "missing"])
@pytest.mark.anyio
async def test_a_client_without_the_secret_is_refused_and_others_are_served(
    client_secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    handled: list[int] = []
    transport = TcpTransport()
    async with service(transport, SECRET, handled) as svc:
        address = await svc.listen(Address("127.0.0.1", 0))
        peers = {"svc": address}
        async with Node("intruder", CODEC, transport, peers, secret=client_secret) as intruder:
            # Wrong secret: the client sees the server's proof fail. None: the server drops it.
            with pytest.raises((HandshakeError, PeerGone)):
                await intruder.call("svc", Ping(1), timeout=10)
        await good_client_is_served(transport, address)
        assert handled == [9]
        assert svc.statistics().connection_errors == 1
        assert svc.statistics().handshakes_failed == 1
    refusals = [r for r in caplog.records if "refused a connection from intruder" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING


@pytest.mark.anyio
async def test_a_client_with_a_secret_refuses_a_server_without_one() -> None:
    handled: list[int] = []
    async with client_of_a_tcp_service(None, handled) as (_svc, cli):
        with pytest.raises(HandshakeError, match="did not prove mesh membership"):
            await cli.call("svc", Ping(1), timeout=10)
    assert handled == []


async def hello(conn: Connection, nonce: bytes) -> Hello:
    await conn.send(Hello(PROTOCOL_VERSION, "rogue", nonce))
    answer = await conn.receive()
    assert isinstance(answer, Hello)
    return answer


@pytest.mark.anyio
async def test_a_handshake_replayed_on_another_connection_fails(memory_hub: MemoryHub) -> None:
    transport = MemoryTransport(memory_hub)
    handled: list[int] = []
    async with service(transport, SECRET, handled) as svc:
        address = await svc.listen(Address("svc", 1))
        nonce = new_nonce()
        first = Connection(await transport.connect(address), CODEC)
        server_hello = await hello(first, nonce)
        recorded = Proof(proof(SECRET, "client", "rogue", "svc", nonce, server_hello.nonce))
        await first.send(recorded)
        await first.send(Call(1, Ping(1), 5.0))
        assert await first.receive() == Reply(1, Pong(1))
        # Someone who saw that exchange replays the same Hello and Proof on a new connection.
        second = Connection(await transport.connect(address), CODEC)
        assert (await hello(second, nonce)).nonce != server_hello.nonce
        await second.send(recorded)
        await second.send(Call(1, Ping(2), 5.0))
        refusal = await second.receive()
        assert isinstance(refusal, Fail) and "no valid membership proof" in refusal.detail
        with pytest.raises(PeerGone):
            await second.receive()
        await first.aclose()
        await second.aclose()
        await good_client_is_served(transport, address)
        assert handled == [1, 9]


@pytest.mark.anyio
async def test_listening_beyond_loopback_can_require_a_secret(memory_hub: MemoryHub) -> None:
    transport = MemoryTransport(memory_hub)
    open_node = Node("a", CODEC, transport, {}, require_secret_beyond_loopback=True)
    async with open_node:
        with pytest.raises(ConfigError, match="beyond loopback"):
            await open_node.listen(Address("10.0.0.2", 1))
        assert await open_node.listen(Address("127.0.0.1", 1)) == Address("127.0.0.1", 1)
    closed = Node("b", CODEC, transport, {}, secret=SECRET, require_secret_beyond_loopback=True)
    async with closed:
        assert await closed.listen(Address("10.0.0.2", 1)) == Address("10.0.0.2", 1)
    with pytest.raises(ConfigError, match="at least 16"):
        Node("c", CODEC, transport, {}, secret=b"short")
