"""Node configuration: the bounds and default deadlines of one node, validated once."""

from __future__ import annotations

import msgspec

from mesh.connection import RECEIVE_SIZE, SEND_BUFFER
from mesh.errors import ConfigError


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Bounds and default deadlines of one node (seconds on anyio's clock).

    mailbox_size: requests queued before the readers wait (and push back on the peers); a
    unary request that finds the mailbox empty and a handler free skips it and runs in its
    connection's reader task (mesh.server);
    max_concurrency: handlers running at once, however they were started (1 gives strict
    one-at-a-time actor order);
    stream_buffer: items queued per open stream; call_timeout: the default deadline of
    call/cast/streams; receive_size: bytes asked of the socket per read; send_buffer: bytes
    queued per connection before deferred senders wait; max_connections: accepted
    connections served at once (handshaking included); one over is closed at once, logged.
    """

    mailbox_size: int = 256
    max_concurrency: int = 64
    stream_buffer: int = 64
    call_timeout: float = 30.0
    connect_timeout: float = 10.0
    handshake_timeout: float = 10.0
    receive_size: int = RECEIVE_SIZE
    send_buffer: int = SEND_BUFFER
    max_connections: int = 256

    def __post_init__(self) -> None:
        names = ("mailbox_size", "max_concurrency", "stream_buffer", "receive_size",
                 "send_buffer", "max_connections")
        for name in names:
            if getattr(self, name) < 1:
                raise ConfigError(f"NodeConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("call_timeout", "connect_timeout", "handshake_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"NodeConfig.{name} must be > 0, got {getattr(self, name)}")
