"""The mesh's one small exception tree.

Every error the runtime raises is a `MeshError`. Foreign errors (OSError from sockets,
msgspec decode errors, anyio stream errors) are translated once, where they enter the mesh,
with `raise ... from exc`, so callers catch mesh types only. Messages name the parameter or
peer and the bad value.
"""

from __future__ import annotations


class MeshError(Exception):
    """Base of every error raised by the mesh runtime."""


class RequestFailed(Exception):
    """Base for the errors a handler raises on purpose to fail its one request (a service's
    own error tree subclasses it): the caller gets it by type name, and the node logs it in
    one line. Any other exception escaping a handler is a bug and is logged with its traceback.
    Not a MeshError: services' `except MeshError` must not catch their own errors."""


class ConfigError(MeshError, ValueError):
    """A constructor argument or a topology file holds a bad value."""


class FrameTooLarge(MeshError):
    """A frame's declared or encoded size exceeds the connection's `max_frame`."""

    def __init__(self, size: int, max_frame: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds max_frame={max_frame}")
        self.size = size
        self.max_frame = max_frame


class UnknownMessageType(MeshError, TypeError):
    """A message to send whose type is not in the codec: the peer could not decode it."""


class FrameDecodeError(MeshError):
    """A frame's bytes are not a valid envelope of the codec's message types."""


class InvalidEnvelope(FrameDecodeError):
    """A frame decoded, but a field is out of range (NaN timeout, negative id, long name)."""


class HandshakeError(MeshError):
    """The peer did not open with a valid Hello, or speaks another protocol version."""


class PeerGone(MeshError):
    """The connection to a peer closed, broke, or could not be opened."""


class UnknownPeer(MeshError):
    """A peer name that the resolver (topology) does not know."""


class DeadlineExceeded(MeshError, TimeoutError):
    """A call or stream did not finish before its deadline."""


class StreamAborted(MeshError):
    """The other side ended a stream with an explicit abort; carries its reason."""


class RemoteError(MeshError):
    """A handler on the peer raised; carries the exception's type name and message."""

    def __init__(self, peer: str, error: str, detail: str) -> None:
        super().__init__(f"{peer}: {error}: {detail}")
        self.peer = peer
        self.error = error
        self.detail = detail


class UnexpectedReply(MeshError):
    """A reply whose type differs from the one the caller expected."""
