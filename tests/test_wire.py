"""Wire format: envelopes round-trip, the parser matches its reference, bad frames fail."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.errors import (
    ConfigError,
    FrameDecodeError,
    FrameTooLarge,
    InvalidEnvelope,
    UnknownMessageType,
)
from mesh.parser import ASSEMBLE_MAX, FrameParser, parse_frames_reference
from mesh.wire import (
    BULK_BYTES,
    HEADER_SIZE,
    MAX_ID,
    MAX_NAME,
    MAX_TIMEOUT,
    PROTOCOL_VERSION,
    Abort,
    Call,
    Cast,
    Codec,
    End,
    Envelope,
    Fail,
    Hello,
    Item,
    Open,
    Proof,
    Push,
    Reply,
    wire_timeout,
)
from tests.ping import Ping


class Blob(msgspec.Struct, frozen=True, tag=True):
    seq: int
    payload: bytes


class View(msgspec.Struct, tag=True):
    payload: memoryview


class Note(msgspec.Struct, frozen=True, tag="note.v2"):
    text: str
    tokens: list[int] = []


APP = (Ping, Blob, View, Note)
BODIES: list[msgspec.Struct] = [Ping(7), Blob(1, b"\x00" * 1000), Note("hi", [1, 2])]
ENVELOPES: list[Envelope] = [
    Hello(1, "router"),
    Hello(PROTOCOL_VERSION, "router", b"n" * 32, b"p" * 32),
    Proof(b"m" * 32),
    *(Call(9, body, 1.5) for body in BODIES),
    Call(3, Ping(1)),
    *(Cast(body) for body in BODIES),
    Reply(4, Ping(2)),
    Reply(4, None),
    Fail(5, "ValueError", "bad n"),
    Open(6, Note("x")),
    Push(7, Blob(0, b""), 30.0),
    *(Item(8, body) for body in BODIES),
    End(8),
    Abort(8, "sender raised"),
]


def codec(max_frame: int = 1 << 20) -> Codec:
    return Codec(APP, max_frame=max_frame)


def decode_frame(c: Codec, frame: bytes | bytearray | memoryview) -> Envelope:
    return c.decode(memoryview(frame)[HEADER_SIZE:])


@pytest.mark.parametrize("envelope", ENVELOPES, ids=lambda e: type(e).__name__)
def test_every_envelope_round_trips(envelope: Envelope) -> None:
    c = codec()
    frame = c.encode(envelope)
    assert int.from_bytes(frame[:HEADER_SIZE], "big") == len(frame) - HEADER_SIZE
    assert decode_frame(c, frame) == envelope


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_every_message_type_round_trips_in_every_carrier(body: msgspec.Struct) -> None:
    c = codec()
    for carrier in (Call(1, body), Cast(body), Reply(1, body), Item(1, body), Push(1, body)):
        assert decode_frame(c, c.encode(carrier)) == carrier


def test_memoryview_field_round_trips_and_points_into_the_chunk() -> None:
    c = codec()
    chunk = bytes(c.encode(Cast(View(memoryview(b"abc" * 100)))))
    (envelope,) = FrameParser(c).feed(chunk)
    assert isinstance(envelope, Cast) and isinstance(envelope.body, View)
    assert bytes(envelope.body.payload) == b"abc" * 100
    # Zero-copy: the decoded view is a window on the received chunk itself.
    assert envelope.body.payload.obj is chunk


def test_split_frame_decodes_zero_copy_and_parser_stays_usable() -> None:
    c = codec()
    first = bytes(c.encode(Cast(View(memoryview(b"q" * 5000)))))
    second = bytes(c.encode(Cast(Ping(2))))
    parser = FrameParser(c)
    assert parser.feed(first[:10]) == []
    assert parser.buffered == 10 - HEADER_SIZE  # the header is parsed, not held
    (big,) = parser.feed(first[10:])
    (small,) = parser.feed(second)
    assert isinstance(big, Cast) and bytes(big.body.payload) == b"q" * 5000
    assert small == Cast(Ping(2))
    assert parser.buffered == 0


class Piece(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """As a KV piece: the bulk field between others, so the frame has a tail."""

    name: str
    data: memoryview
    extra: bytes = b""
    start: int = 0


def test_bulk_bytes_go_out_uncopied_in_a_frame_equal_to_the_plain_encoding() -> None:
    c = Codec((*APP, Piece), max_frame=1 << 22)
    payload = bytes(range(256)) * (BULK_BYTES // 256 + 3)
    cases: list[tuple[Envelope, bytes]] = [
        (Item(3, Blob(1, payload)), payload),
        (Push(4, Blob(2, payload), 9.0), payload),
        (Cast(View(memoryview(payload)[5:])), payload),
        (Item(5, Piece(name="p", data=memoryview(payload), extra=b"x" * 10, start=7)), payload),
        # The larger of two bulk fields is the one cut out.
        (Call(6, Piece(name="q", data=memoryview(payload[:BULK_BYTES]), extra=payload)), payload),
    ]
    for envelope, source in cases:
        parts = c.encode_parts(envelope)
        assert len(parts) in (2, 3)
        joined = b"".join(parts)
        assert joined == bytes(c.encode(envelope))
        assert decode_frame(c, joined) == envelope
        bulk = parts[1]
        assert isinstance(bulk, memoryview) and bulk.obj is source  # not a copy


def test_small_or_mutable_payloads_stay_one_frame() -> None:
    c = Codec((*APP, Piece), max_frame=1 << 22)
    big = b"z" * BULK_BYTES
    for envelope in (
        Cast(Blob(1, b"z" * (BULK_BYTES - 1))),  # below the bulk size
        Cast(View(memoryview(bytearray(big)))),  # may change after the send: copied
        Cast(Ping(1)),
        Fail(1, "E", "m"),
    ):
        (frame,) = c.encode_parts(envelope)
        assert frame == c.encode(envelope)


def test_a_payload_holding_the_stand_in_is_sent_whole_and_right() -> None:
    c = Codec((*APP, Piece), max_frame=1 << 22)
    payload = b"y" * BULK_BYTES
    # The stand-in's encoding also occurs in another field: no cut, still the same bytes.
    envelope = Item(1, Piece(name="n", data=memoryview(payload),
                             extra=c._stand_in_encoded * 2))
    (frame,) = c.encode_parts(envelope)
    assert decode_frame(c, frame) == envelope


def test_bulk_frames_over_max_frame_fail_that_send() -> None:
    c = Codec(APP, max_frame=BULK_BYTES + 64)
    with pytest.raises(FrameTooLarge):
        c.encode_parts(Cast(Blob(1, b"w" * (BULK_BYTES + 64))))
    assert len(c.encode_parts(Cast(Blob(1, b"w" * BULK_BYTES)))) == 2


def test_codec_rejects_bad_message_sets() -> None:
    class Untagged(msgspec.Struct):
        x: int

    class Clash(msgspec.Struct, tag="Ping"):
        y: int

    class Row(msgspec.Struct, tag=True, array_like=True):
        z: int

    with pytest.raises(ConfigError, match="Untagged needs tag=True"):
        Codec([Untagged])
    with pytest.raises(ConfigError, match=r"not a msgspec\.Struct"):
        Codec([int])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="at least one"):
        Codec([])
    with pytest.raises(ConfigError, match="unique"):
        Codec([Ping, Clash])
    with pytest.raises(ConfigError, match="array_like"):
        Codec([Ping, Row])
    with pytest.raises(ConfigError, match="max_frame"):
        Codec([Ping], max_frame=0)


def test_oversized_header_rejected_before_the_body_arrives() -> None:
    c = codec(max_frame=1000)
    parser = FrameParser(c)
    with pytest.raises(FrameTooLarge) as info:
        parser.feed((1001).to_bytes(HEADER_SIZE, "big"))
    assert (info.value.size, info.value.max_frame) == (1001, 1000)
    # Only the header was seen: nothing was buffered for the announced body.
    assert parser.buffered == 0


def test_oversized_header_split_across_chunks_is_rejected() -> None:
    parser = FrameParser(codec(max_frame=1000))
    header = (2**32 - 1).to_bytes(HEADER_SIZE, "big")
    assert parser.feed(header[:2]) == []
    with pytest.raises(FrameTooLarge):
        parser.feed(header[2:])


def test_encoding_an_oversized_message_fails_that_send() -> None:
    c = codec(max_frame=100)
    with pytest.raises(FrameTooLarge, match="max_frame=100"):
        c.encode(Cast(Blob(0, b"x" * 200)))
    assert decode_frame(c, c.encode(Cast(Ping(1)))) == Cast(Ping(1))


def test_encoding_a_message_outside_the_codec_fails_that_send() -> None:
    class Stranger(msgspec.Struct, tag=True):
        pass

    for encode in (codec().encode, codec().encode_parts):
        with pytest.raises(UnknownMessageType, match="Stranger is not one of the codec's messages"):
            encode(Reply(1, Stranger()))


@pytest.mark.parametrize("envelope", ENVELOPES)
def test_a_frame_without_bulk_bytes_is_its_length_and_msgpack(envelope: Envelope) -> None:
    """The obvious frame (a big-endian length, then msgspec's msgpack) is what `encode` and
    `encode_parts` (its one-buffer fast path for bodies without a bulk field) both build."""
    reference = len(body := msgspec.msgpack.encode(envelope)).to_bytes(HEADER_SIZE, "big") + body
    c = codec()
    assert c.encode(envelope) == reference
    assert c.encode_parts(envelope) == (reference,)


def test_undecodable_frame_raises_frame_decode_error() -> None:
    parser = FrameParser(codec())
    body = msgspec.msgpack.encode(["call", 1, {"type": "Nope"}, None])
    with pytest.raises(FrameDecodeError, match="undecodable frame"):
        parser.feed(len(body).to_bytes(HEADER_SIZE, "big") + body)



def test_a_tag_that_is_not_utf8_is_a_decode_error() -> None:
    # msgspec reports this one as UnicodeDecodeError; the codec makes it a FrameDecodeError.
    body = b"\x91\xa5\x00\x00\x00\x00\x80"
    with pytest.raises(FrameDecodeError, match="undecodable frame"):
        FrameParser(codec()).feed(len(body).to_bytes(HEADER_SIZE, "big") + body)


def test_chunks_of_exactly_one_frame_take_the_fast_path_and_match_the_reference() -> None:
    c = codec(max_frame=2000)
    parser = FrameParser(c)
    for envelope in ENVELOPES:
        frame = bytes(c.encode(envelope))
        assert parser.feed(frame) == parse_frames_reference(c, frame)[0] == [envelope]
    too_big = (3000).to_bytes(HEADER_SIZE, "big") + b"\x00" * 3000
    with pytest.raises(FrameTooLarge):
        parser.feed(too_big)


@st.composite
def stream_and_cuts(draw: st.DrawFn) -> tuple[list[Envelope], bytes, list[int]]:
    envelopes = draw(st.lists(st.sampled_from(ENVELOPES), max_size=12))
    extra = draw(st.lists(st.binary(max_size=3000).map(lambda b: Cast(Blob(0, b))), max_size=3))
    messages: list[Envelope] = [*envelopes, *extra]
    c = codec()
    stream = b"".join(bytes(c.encode(e)) for e in messages)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    return messages, stream, cuts


def parse_in_pieces(case: tuple[list[Envelope], bytes, list[int]], assemble_from: int,
                    read: Callable[[FrameParser, bytes], list[Envelope]]) -> FrameParser:
    """Feeds the stream to a parser piece by piece through `read`; the messages must come out."""
    messages, stream, cuts = case
    parser = FrameParser(codec(), assemble_from=assemble_from)
    out: list[Envelope] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out.extend(read(parser, stream[start:end]))
    assert out == messages
    return parser


def read_in_place(parser: FrameParser, piece: bytes) -> list[Envelope]:
    """As a stream that reads into the parser's buffer where it offers one (mesh.tcp)."""
    out: list[Envelope] = []
    while piece:
        into = parser.into()
        if into is None:
            return out + parser.feed(piece)
        count = min(len(into), len(piece))
        into[:count] = piece[:count]
        out.extend(parser.filled(count))
        piece = piece[count:]
    return out


@given(stream_and_cuts(), st.sampled_from([1, 64, BULK_BYTES]))
def test_parser_assembling_in_place_matches_reference_under_any_chunking(
    case: tuple[list[Envelope], bytes, list[int]], assemble_from: int,
) -> None:
    parser = parse_in_pieces(case, assemble_from, read_in_place)
    assert parser.buffered == 0 and parser.into() is None


def test_a_bulk_frame_is_reserved_once_and_filled_in_place() -> None:
    c = Codec(APP, max_frame=2 * ASSEMBLE_MAX)
    frame = bytes(c.encode(Cast(Blob(1, b"\x07" * (3 * BULK_BYTES)))))
    parser = FrameParser(c)
    assert parser.into() is None
    # An announced frame is not reserved until a quarter of it has arrived.
    quarter = HEADER_SIZE - (-(len(frame) - HEADER_SIZE) // 4)  # rounded up
    assert parser.feed(frame[:1000]) == [] and parser.feed(frame[1000 : quarter - 1]) == []
    assert parser.into() is None and parser.capacity <= quarter
    assert parser.feed(frame[quarter - 1 : quarter]) == []
    into = parser.into()
    assert into is not None and len(into) == len(frame) - quarter
    assert parser.capacity == len(frame) - HEADER_SIZE  # the whole body, at once
    into[:500] = frame[quarter : quarter + 500]
    assert parser.filled(500) == [] and parser.buffered == quarter + 500 - HEADER_SIZE
    with pytest.raises(ValueError, match="without that much room"):
        parser.filled(len(frame))
    rest = parser.into()
    assert rest is not None
    rest[:] = frame[quarter + 500 :]
    (envelope,) = parser.filled(len(rest))
    assert envelope == Cast(Blob(1, b"\x07" * (3 * BULK_BYTES)))
    assert parser.capacity == 0 and parser.into() is None
    # Beyond ASSEMBLE_MAX nothing is reserved before the bytes arrive.
    huge = bytes(c.encode(Cast(Blob(2, b"\x08" * (ASSEMBLE_MAX + 1)))))
    assert parser.feed(huge[:100]) == [] and parser.into() is None
    assert parser.capacity <= 100


@given(stream_and_cuts(), st.sampled_from([1, BULK_BYTES]))
def test_parser_matches_reference_under_any_chunking(
    case: tuple[list[Envelope], bytes, list[int]], assemble_from: int,
) -> None:
    parser = parse_in_pieces(case, assemble_from, FrameParser.feed)
    messages, stream, _ = case
    reference, leftover = parse_frames_reference(codec(), stream)
    assert reference == messages
    assert leftover == b"" and parser.buffered == 0


@given(st.binary(max_size=2000), st.integers(1, 64))
def test_random_bytes_give_frames_or_typed_errors_only(data: bytes, step: int) -> None:
    c = codec(max_frame=4096)
    parser: FrameParser = FrameParser(c)
    try:
        out: list[Any] = []
        for start in range(0, len(data), step):
            out.extend(parser.feed(data[start : start + step]))
    except (FrameDecodeError, FrameTooLarge):
        return
    # Whatever did parse agrees with the reference parser on the same bytes.
    reference, _ = parse_frames_reference(c, data)
    assert out == reference


PING = {"type": "Ping", "n": 1}


@pytest.mark.parametrize(
    "fields",
    [
        *(["call", 1, PING, bad] for bad in (math.nan, math.inf, -math.inf, -0.5)),
        *(["open", 1, PING, bad] for bad in (math.nan, MAX_TIMEOUT * 2)),
        ["push", 1, PING, math.nan],
        *(["call", bad, PING, 1.0] for bad in (-1, MAX_ID + 1, 2**64 - 1)),
        ["reply", -3, None],
        ["end", -1],
        ["abort", MAX_ID + 1, "x"],
        ["hello", PROTOCOL_VERSION, "n" * (MAX_NAME + 1)],
        ["hello", -1, "x"],
        ["hello", PROTOCOL_VERSION, "x", b"\x00" * 65],
        ["fail", 1, "E" * (MAX_NAME + 1), "detail"],
    ],
)
def test_out_of_range_fields_are_invalid_envelopes(fields: list[Any]) -> None:
    body = msgspec.msgpack.encode(fields)
    with pytest.raises(InvalidEnvelope, match="undecodable frame"):
        codec().decode(body)


def test_the_edges_of_the_ranges_still_decode() -> None:
    c = codec()
    for envelope in (Call(MAX_ID, Ping(1), MAX_TIMEOUT), Call(0, Ping(1), 0.0), End(0)):
        assert decode_frame(c, c.encode(envelope)) == envelope


def test_wire_timeout_sends_none_beyond_the_cap() -> None:
    assert wire_timeout(math.inf) is None
    assert wire_timeout(MAX_TIMEOUT + 1) is None
    assert wire_timeout(2.5) == 2.5
    assert wire_timeout(-1.0) == 0.0


def test_after_a_large_frame_the_parser_holds_only_a_small_tail() -> None:
    # Codec default max_frame (64 MiB): nothing of it is reserved up front.
    c = Codec(APP)
    parser = FrameParser(c)
    assert parser.capacity == 0
    big = c.encode(Cast(Blob(1, b"\x01" * (5 << 19))))
    small = c.encode(Cast(Ping(2)))
    stream = bytes(big + small)
    cut = len(big) + 10
    # Reads of 1 MiB; the last one ends 10 bytes into the small frame.
    chunks = [stream[i : min(i + (1 << 20), cut)] for i in range(0, cut, 1 << 20)]
    got: list[Envelope] = []
    for chunk in chunks:
        got += parser.feed(chunk)
        assert parser.capacity <= len(big)
    assert len(got) == 1 and parser.buffered == 10 - HEADER_SIZE
    # The chunk that held the big frame's end is released; only the tail's bytes are kept.
    assert parser.capacity == parser.buffered
    assert parser.feed(stream[cut:]) == [Cast(Ping(2))]
    assert parser.capacity == 0
