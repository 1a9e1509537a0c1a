"""Wire format: length-prefixed MessagePack frames, each holding one envelope.

A frame is a 4-byte big-endian body length followed by the msgspec MessagePack encoding of an
envelope (`Hello`, `Call`, `Reply`, ...). Envelopes carry the application's messages in their
`body` field; the application names its message types (tagged msgspec Structs) once, in a
`Codec`, and the mesh never looks inside them.

Bulk payloads avoid needless copies. The sender encodes straight into one fresh bytearray per
frame and never reuses it (uvloop keeps a reference to a sent buffer, docs/engineering-notes.md
G8); a message's large byte string that cannot change (`bytes`, or a memoryview of one) is not
copied at all: `Codec.encode_parts` cuts the frame around it, and the socket reads it where it
lies (the bytes on the wire are the same). The receiving side is `mesh.parser.FrameParser`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from typing import Annotated, Any, Generic, TypeVar, Union

import msgspec
import msgspec.inspect
import msgspec.structs

from mesh.errors import (
    ConfigError,
    FrameDecodeError,
    FrameTooLarge,
    InvalidEnvelope,
    UnknownMessageType,
)

# 2: Hello carries a nonce and a membership proof, and a `Proof` frame may follow it.
PROTOCOL_VERSION = 2
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
HEADER_SIZE = 4
_MAX_HEADER_VALUE = 2**32 - 1
# Writes a frame's length prefix in place (a tenth of a microsecond under int.to_bytes).
_write_header = struct.Struct(">I").pack_into
# An immutable byte string this long or longer in a message travels as its own part of the
# frame (`Codec.encode_parts`), uncopied. MessagePack writes it as bin 32: 0xc6, then its
# length in 4 big-endian bytes, then the bytes.
BULK_BYTES = 64 * 1024
_BIN32 = 0xC6
# Bounds on envelope fields, checked by the decoder (in C) before anything uses a value: a
# peer's NaN, infinite or negative timeout would otherwise reach a cancel scope and raise.
MAX_ID = 2**63 - 1
MAX_TIMEOUT = 7 * 24 * 3600.0
MAX_NAME = 256
MAX_NONCE = 64

B = TypeVar("B")
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
Timeout = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TIMEOUT)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Nonce = Annotated[bytes, msgspec.Meta(max_length=MAX_NONCE)]


def wire_timeout(seconds: float) -> float | None:
    """`seconds` as a Call/Open/Push may carry it: None (no deadline) above MAX_TIMEOUT.

    A caller may wait as long as it likes; the callee is only told of deadlines it would
    accept, and the caller's own deadline watch still ends the wait on time.
    """
    return None if seconds > MAX_TIMEOUT else max(0.0, seconds)


class Hello(msgspec.Struct, frozen=True, tag="hello", array_like=True):
    """First frame each way: protocol version, the sender's name, and membership material.

    `nonce` is fresh random bytes from the sender; `proof` (server only, when it has a
    secret) is its HMAC over both nonces (mesh.membership). Empty when unused.
    """

    protocol: Annotated[int, msgspec.Meta(ge=0, le=2**31)]
    name: Name
    nonce: Nonce = b""
    proof: Nonce = b""


class Proof(msgspec.Struct, frozen=True, tag="proof", array_like=True):
    """The client's answer to the server's nonce: its HMAC, sent right after the Hellos."""

    mac: Nonce


class _Opening(msgspec.Struct, Generic[B], frozen=True, array_like=True):
    """What opens an exchange (`Call`, `Open`, `Push`): its id, its message, and the
    caller's deadline relative to now (None: none)."""

    id: Id
    body: B
    timeout: Timeout | None = None


class Call(_Opening[B], frozen=True, tag="call", array_like=True):
    """A request expecting one `Reply` or `Fail` with the same id."""


class Cast(msgspec.Struct, Generic[B], frozen=True, tag="cast", array_like=True):
    """A one-way message: no reply, no id."""

    body: B


class Reply(msgspec.Struct, Generic[B], frozen=True, tag="reply", array_like=True):
    """The handler's result for a `Call` or an upload (`Push`); None for handlers without one."""

    id: Id
    body: B | None


class Fail(msgspec.Struct, frozen=True, tag="fail", array_like=True):
    """The handler for request `id` raised: exception type name and message."""

    id: Id
    error: Name
    detail: str


class Open(_Opening[B], frozen=True, tag="open", array_like=True):
    """Opens a download stream: the server answers with `Item`s then `End` (or Abort/Fail)."""


class Push(_Opening[B], frozen=True, tag="push", array_like=True):
    """Opens an upload stream: the client sends `Item`s then `End`; the server then replies."""


class Item(msgspec.Struct, Generic[B], frozen=True, tag="item", array_like=True):
    """One message of stream `id`, in either direction."""

    id: Id
    body: B


class End(msgspec.Struct, frozen=True, tag="end", array_like=True):
    """Stream `id` ended normally."""

    id: Id


class Abort(msgspec.Struct, frozen=True, tag="abort", array_like=True):
    """Stream or request `id` was abandoned by its sender; `reason` says why."""

    id: Id
    reason: str


Envelope = (
    Hello
    | Proof
    | Call[Any]
    | Cast[Any]
    | Reply[Any]
    | Fail
    | Open[Any]
    | Push[Any]
    | Item[Any]
    | End
    | Abort
)


def _check_messages(messages: tuple[type[msgspec.Struct], ...]) -> None:
    if not messages:
        raise ConfigError("messages must name at least one message type, got none")
    for message in messages:
        if not (isinstance(message, type) and issubclass(message, msgspec.Struct)):
            raise ConfigError(f"messages: {message!r} is not a msgspec.Struct subclass")
        if message.__struct_config__.tag is None:
            raise ConfigError(f"messages: {message.__name__} needs tag=True to join the union")


class Codec:
    """Encodes envelopes to frames and decodes frame bodies, for one set of app messages.

    `messages` are msgspec Structs with unique tags (`tag=True` uses the class name); msgspec
    requires them to be all `array_like` or all not. `max_frame` bounds a frame's body size.
    """

    def __init__(
        self, messages: Iterable[type[msgspec.Struct]], *, max_frame: int = DEFAULT_MAX_FRAME
    ) -> None:
        self.messages = tuple(dict.fromkeys(messages))
        _check_messages(self.messages)
        if not 0 < max_frame <= _MAX_HEADER_VALUE:
            raise ConfigError(f"max_frame must be in 1..{_MAX_HEADER_VALUE}, got {max_frame}")
        self.max_frame = max_frame
        self._known = frozenset(self.messages)
        # Built at run time from the caller's types, so static checkers see it as Any.
        body: Any = Union.__getitem__(self.messages)
        envelope: Any = Union[  # noqa: UP007
            Hello,
            Proof,
            Call[body],
            Cast[body],
            Reply[body],
            Fail,
            Open[body],
            Push[body],
            Item[body],
            End,
            Abort,
        ]
        try:
            self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(envelope)
        except TypeError as exc:
            raise ConfigError(f"messages: {exc}") from exc
        self._encoder = msgspec.msgpack.Encoder()
        # encode_parts encodes a bulk field as this random stand-in, then finds it.
        self._stand_in = os.urandom(16)
        self._stand_in_encoded = self._encoder.encode(self._stand_in)
        self._bulk_fields = {message: _bulk_fields(message) for message in self.messages}
        # Bodies (None: an envelope without one) that never hold a bulk field: encode_parts
        # builds their one buffer at once, without looking for a field to cut out.
        self._plain: frozenset[type[Any]] = frozenset(
            [type(None), *(m for m, fields in self._bulk_fields.items() if not fields)])

    def encode_parts(self, envelope: Envelope) -> tuple[bytes | bytearray | memoryview, ...]:
        """The frame of `envelope` as buffers to write in order: their bytes joined are
        `encode(envelope)`. One buffer, unless the body holds an immutable byte string of at
        least BULK_BYTES (a `bytes` or `memoryview` field): then three, the middle one being
        that string itself, uncopied. Errors as `encode`."""
        body: msgspec.Struct | None = getattr(envelope, "body", None)
        if type(body) in self._plain:
            # Most frames (control messages, token chunks): a known body, nothing to cut.
            return (self._frame(envelope),)
        fields = self._bulk_fields.get(type(body), ()) if body is not None else ()
        name, bulk = _largest_bulk(body, fields) if fields else ("", None)
        if body is None or bulk is None:
            return (self.encode(envelope),)
        stand_in = msgspec.structs.replace(body, **{name: self._stand_in})
        frame = self.encode(msgspec.structs.replace(envelope, body=stand_in))
        marker = self._stand_in_encoded
        at = frame.find(marker, HEADER_SIZE)
        if at < 0 or frame.find(marker, at + 1) >= 0:
            # The stand-in's bytes also occur elsewhere in the message: no cut, one copy.
            return (self.encode(envelope),)
        size = len(frame) - HEADER_SIZE - len(marker) + 5 + bulk.nbytes
        if size > self.max_frame:
            raise FrameTooLarge(size, self.max_frame)
        head = frame[:at]
        head[:HEADER_SIZE] = size.to_bytes(HEADER_SIZE, "big")
        head.append(_BIN32)
        head += bulk.nbytes.to_bytes(4, "big")
        tail = frame[at + len(marker) :]
        return (head, bulk, tail) if tail else (head, bulk)

    def encode(self, envelope: Envelope) -> bytearray:
        """One complete frame in a fresh buffer; the caller must not reuse it after sending.

        UnknownMessageType for a body outside the codec (the peer would drop the connection
        on it), FrameTooLarge above max_frame: both fail this send only.
        """
        body = getattr(envelope, "body", None)
        if body is not None and type(body) not in self._known:
            raise UnknownMessageType(f"{type(body).__name__} is not one of the codec's messages")
        return self._frame(envelope)

    def _frame(self, envelope: Envelope) -> bytearray:
        """`encode` of an envelope whose body is known to be one of the codec's (or None)."""
        frame = bytearray(HEADER_SIZE)
        self._encoder.encode_into(envelope, frame, HEADER_SIZE)
        size = len(frame) - HEADER_SIZE
        if size > self.max_frame:
            raise FrameTooLarge(size, self.max_frame)
        _write_header(frame, 0, size)
        return frame

    def decode(self, body: bytes | bytearray | memoryview) -> Envelope:
        """The envelope in one frame body (without its length prefix)."""
        try:
            envelope: Envelope = self._decoder.decode(body)
        except msgspec.ValidationError as exc:
            # Includes a tag outside the codec: msgspec checks tags as values.
            raise InvalidEnvelope(f"undecodable frame of {len(body)} bytes: {exc}") from exc
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            # msgspec lets a tag string that is not UTF-8 through as UnicodeDecodeError.
            raise FrameDecodeError(f"undecodable frame of {len(body)} bytes: {exc}") from exc
        return envelope


def _bulk_fields(message: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of `message` declared as plain `bytes` or `memoryview`."""
    info = msgspec.inspect.type_info(message)
    assert isinstance(info, msgspec.inspect.StructType)
    kinds = (msgspec.inspect.BytesType, msgspec.inspect.MemoryViewType)
    return tuple(f.name for f in info.fields if isinstance(f.type, kinds))


def _largest_bulk(body: Any, fields: tuple[str, ...]) -> tuple[str, memoryview | None]:
    """(name, bytes view) of `body`'s largest field among `fields` that is immutable (a
    `bytes`, or a flat memoryview of one) and at least BULK_BYTES long; ("", None) if none."""
    best, found = "", None
    for name in fields:
        value = getattr(body, name)
        if isinstance(value, bytes):
            view = memoryview(value)
        elif (isinstance(value, memoryview) and isinstance(value.obj, bytes)
              and value.c_contiguous):
            view = value.cast("B") if value.format != "B" or value.ndim != 1 else value
        else:
            continue
        if view.nbytes >= BULK_BYTES and (found is None or view.nbytes > found.nbytes):
            best, found = name, view
    return best, found
