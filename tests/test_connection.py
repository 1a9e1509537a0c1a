"""Connection: framed envelopes over a byte stream, the Hello handshake, traffic counts."""

from __future__ import annotations

import msgspec
import pytest
import trio

from mesh.connection import Connection, client_handshake, server_handshake
from mesh.errors import HandshakeError, PeerGone
from mesh.transport import memory_pipe
from mesh.wire import Call, Codec, Fail, Hello, Reply


class Ping(msgspec.Struct, frozen=True, tag=True):
    n: int


CODEC = Codec([Ping])


def connected() -> tuple[Connection, Connection]:
    left, right = memory_pipe(8)
    return Connection(left, CODEC), Connection(right, CODEC)


@pytest.mark.trio
async def test_handshake_names_both_ends() -> None:
    client, server = connected()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server_handshake, server, "srv")
        await client_handshake(client, "cli")
    assert (client.peer, server.peer) == ("srv", "cli")


@pytest.mark.trio
async def test_server_refuses_another_protocol_version() -> None:
    client, server = connected()
    await client.send(Hello(99, "old"))
    with pytest.raises(HandshakeError, match="protocol=99"):
        await server_handshake(server, "srv")
    # The refusal travels back as a Fail frame naming the reason.
    refusal = await client.receive()
    assert isinstance(refusal, Fail) and "protocol=99" in refusal.detail


@pytest.mark.trio
async def test_client_reports_a_refused_handshake() -> None:
    client, server = connected()
    await server.send(Fail(0, "HandshakeError", "protocol=1, this server speaks 2"))
    with pytest.raises(HandshakeError, match="refused the handshake"):
        await client_handshake(client, "cli")


@pytest.mark.trio
async def test_first_frame_must_be_hello() -> None:
    client, server = connected()
    await client.send(Call(1, Ping(1)))
    with pytest.raises(HandshakeError, match="expected Hello as first frame, got Call"):
        await server_handshake(server, "srv")


@pytest.mark.trio
async def test_frames_and_bytes_are_counted_both_ways() -> None:
    client, server = connected()
    await client.send(Call(1, Ping(5)))
    await client.send(Call(2, Ping(6)))
    assert await server.receive() == Call(1, Ping(5))
    assert await server.receive() == Call(2, Ping(6))
    await server.send(Reply(1, None))
    assert await client.receive() == Reply(1, None)
    sent, got = client.statistics(), server.statistics()
    assert (sent.frames_out, got.frames_in) == (2, 2)
    assert sent.bytes_out == got.bytes_in > 0
    assert (got.frames_out, sent.frames_in) == (1, 1)


@pytest.mark.trio
async def test_receive_after_peer_closed_is_peer_gone() -> None:
    client, server = connected()
    await server.aclose()
    with pytest.raises(PeerGone, match="ended"):
        await client.receive()
    with pytest.raises(PeerGone, match="send to"):
        await client.send(Reply(1, None))
    assert client.closed
