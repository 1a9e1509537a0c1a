"""TCP byte streams that cost one scheduler pass per wait, not one per operation.

`TcpTransport` (mesh.transport) opens and accepts these instead of anyio's socket streams.
anyio's streams are correct but pay for every operation: on trio each successful `recv` and
`send` ends with a forced yield (trio's fairness checkpoint), and on asyncio every receive
resumes and then pauses the transport's reading (two epoll_ctl calls) and every send awaits a
checkpoint. A request/reply round trip does four such operations per side
(docs/engineering-notes.md 3d has the cost per round trip).

* trio (`mesh.tcp.trio_stream`): a non-blocking socket. `send` writes at once and waits
  (`wait_writable`) only for the part the kernel did not take; `receive` waits
  (`wait_readable`) only when the last read drained the socket, so the common case is one
  wait and one read. Reads that find data at once do not yield; every FAIR_READS-th of them
  in a row does, so one busy peer cannot starve the other tasks.
* asyncio, uvloop or not (`mesh.tcp.asyncio_stream`): a Protocol that keeps reading on,
  queues the chunks it is given and wakes the one reader through a future; reading pauses
  while more than READ_BUFFER bytes wait unread (backpressure to the peer), and `send` waits
  only while the transport has paused writing.

Both also write several buffers as one (`send_parts`, or `send_parts_nowait` for what the
socket takes at once: a frame cut around its bulk payload, mesh.wire.Codec.encode_parts)
without joining them, and read the rest of a bulk frame straight into its own buffer
(mesh.parser.FrameParser.into), BULK_READ bytes at a time: trio's `receive_into`, asyncio's
`fill_into`.
Neither `send` nor `receive` is a checkpoint when it need not wait: callers loop around real
waits (mesh.connection's readers and writer do). Errors follow anyio's streams: EndOfStream
at the peer's end, BrokenResourceError for a reset or refused write, ClosedResourceError after
our own `aclose`. `mesh.tcp.listener` accepts connections and wraps them; this module
dials them (`connect`) and wraps a connected socket for the running loop (`wrap_socket`).
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

import anyio
import anyio.abc

from mesh.native import on_asyncio
from mesh.tcp.asyncio_stream import READ_BUFFER, AsyncioSocketStream
from mesh.tcp.sockets import BULK_READ
from mesh.tcp.trio_stream import FAIR_READS, TrioSocketStream

__all__ = [
    "BULK_READ",
    "FAIR_READS",
    "READ_BUFFER",
    "AsyncioSocketStream",
    "TrioSocketStream",
    "connect",
    "connect_socket",
    "wrap_socket",
]


async def wrap_socket(sock: socket.socket) -> anyio.abc.ByteStream:
    """The fast stream for a connected socket, for the backend that runs this task."""
    if on_asyncio():
        return await AsyncioSocketStream.wrap(sock)
    return TrioSocketStream(sock)


async def connect(host: str, port: int) -> anyio.abc.ByteStream:
    """Connects to the first address of `host` that accepts; OSError if none does."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(errno.EADDRNOTAVAIL, f"no address for {host!r}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            await connect_socket(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return await wrap_socket(sock)
    raise error


async def connect_socket(sock: socket.socket, address: Any, name: str | None = None) -> None:
    """Connects `sock` (made non-blocking) to `address`; OSError naming `name` (else the
    address) if it cannot."""
    sock.setblocking(False)
    code = sock.connect_ex(address)
    if code == errno.EINPROGRESS:
        await anyio.wait_writable(sock)
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        raise OSError(code, f"connect to {name or address}: {os.strerror(code)}")
