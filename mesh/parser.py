"""FrameParser: a connection's incoming byte stream, in chunks of any size, turned back into
envelopes (the frames of mesh.wire).

The receiver decodes a frame that arrived whole from a memoryview of the received chunk, and
assembles a split frame into a bytearray of exactly its size that no one touches afterwards,
so an application field typed `memoryview` decodes zero-copy (docs/engineering-notes.md G9).
The declared length is checked against `max_frame` before anything is allocated.
"""

from __future__ import annotations

from mesh.errors import FrameTooLarge
from mesh.wire import BULK_BYTES, HEADER_SIZE, Codec, Envelope

# A receiver reserves a bulk frame's whole size, once a quarter of it has arrived, only up to
# this (as much as an asyncio connection may already hold unread, mesh.tcp.READ_BUFFER);
# larger frames take memory as their bytes come.
ASSEMBLE_MAX = 4 * 1024 * 1024


class FrameParser:
    """Turns a byte stream, fed in chunks of any size, into envelopes.

    Fast path: frames lying whole in a chunk decode from a view of that chunk. A frame split
    across chunks is assembled in one bytearray of exactly its size, which is then decoded
    and which no one touches afterwards. Bulk frames (`assemble_from` .. ASSEMBLE_MAX bytes)
    get that buffer as soon as their first bytes arrive, and a stream that can read into
    memory fills it in place (`into`, then `filled`): the frame's bytes are copied once, by
    the kernel. That buffer is taken once a quarter of the frame has arrived (the pieces so
    far are copied in), so a peer cannot make a receiver reserve more than 4x what it sent.
    Smaller and larger frames keep their pieces as views and join them when the last arrives
    (one copy; nothing is reserved before the bytes arrive).
    Errors (FrameTooLarge, FrameDecodeError) leave the parser unusable: the stream is out
    of sync.
    """

    def __init__(self, codec: Codec, *, assemble_from: int = BULK_BYTES) -> None:
        self._codec = codec
        self._assemble_from = assemble_from
        self._header = bytearray()
        self._parts: list[memoryview] = []
        self._frame: bytearray | None = None
        self._filled = 0
        self._missing = 0

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete."""
        held = self._filled if self._frame is not None else sum(len(p) for p in self._parts)
        return len(self._header) + held

    @property
    def capacity(self) -> int:
        """Bytes of memory this parser keeps alive: a bulk frame's buffer, or the whole
        chunks its held pieces view.

        Grows only while a frame is incomplete and falls to (about) `buffered` once it is
        decoded: at most 4x `buffered` and ASSEMBLE_MAX is reserved before the bytes arrive,
        whatever `max_frame` allows.
        """
        if self._frame is not None:
            return len(self._header) + len(self._frame)
        return len(self._header) + sum(_base_size(part) for part in self._parts)

    def into(self) -> memoryview | None:
        """Where the next bytes of the stream belong when a bulk frame is being assembled
        (its unfilled rest; write at the start, then call `filled`), else None."""
        if self._frame is None:
            return None
        return memoryview(self._frame)[self._filled :]

    def filled(self, count: int) -> list[Envelope]:
        """`count` bytes were written at the start of the view `into` returned."""
        if self._frame is None or not 0 < count <= self._missing:
            raise ValueError(f"filled({count}) without that much room from into()")
        self._filled += count
        self._missing -= count
        return self._finish_frame() if not self._missing else []

    def feed(self, data: bytes | bytearray) -> list[Envelope]:
        """Consumes `data`, which must not change afterwards (pieces of it are held)."""
        if not self._missing and not self._header and len(data) > HEADER_SIZE:
            # The common case of request/reply: the chunk is exactly one whole frame.
            size = int.from_bytes(data[:HEADER_SIZE], "big")
            if size == len(data) - HEADER_SIZE and size <= self._codec.max_frame:
                return [self._codec.decode(memoryview(data)[HEADER_SIZE:])]
        view = memoryview(data)
        out: list[Envelope] = []
        pos = 0
        end = len(view)
        while pos < end:
            if self._missing:
                pos = self._continue_frame(view, pos, out)
            else:
                pos = self._start_frame(view, pos, out)
        return out

    def _start_frame(self, view: memoryview, pos: int, out: list[Envelope]) -> int:
        end = len(view)
        if not self._header and end - pos >= HEADER_SIZE:
            size = int.from_bytes(view[pos : pos + HEADER_SIZE], "big")
            pos += HEADER_SIZE
        else:
            take = min(HEADER_SIZE - len(self._header), end - pos)
            self._header += view[pos : pos + take]
            pos += take
            if len(self._header) < HEADER_SIZE:
                return pos
            size = int.from_bytes(self._header, "big")
            self._header.clear()
        if size > self._codec.max_frame:
            raise FrameTooLarge(size, self._codec.max_frame)
        if end - pos >= size:
            out.append(self._codec.decode(view[pos : pos + size]))
            return pos + size
        self._parts = [_hold(view, pos)]
        self._missing = size - (end - pos)
        self._maybe_assemble(size)
        return end

    def _continue_frame(self, view: memoryview, pos: int, out: list[Envelope]) -> int:
        take = min(self._missing, len(view) - pos)
        if self._frame is not None:
            self._frame[self._filled : self._filled + take] = view[pos : pos + take]
            self._filled += take
        else:
            self._parts.append(view[pos : pos + take])
        self._missing -= take
        if not self._missing:
            out += self._finish_frame()
        elif self._frame is None:
            self._maybe_assemble(self._missing + sum(len(part) for part in self._parts))
        return pos + take

    def _maybe_assemble(self, size: int) -> None:
        """Moves the held pieces of a bulk frame into a buffer of its size once a quarter of
        it has arrived: announcing a frame costs a peer 4 bytes, so the rest is reserved only
        for a peer that has sent a fair part of it (at most 4x what it sent)."""
        held = size - self._missing
        if not self._assemble_from <= size <= ASSEMBLE_MAX or 4 * held < size:
            return
        frame = bytearray(size)
        at = 0
        for part in self._parts:
            frame[at : at + len(part)] = part
            at += len(part)
        self._frame, self._filled, self._parts = frame, held, []

    def _finish_frame(self) -> list[Envelope]:
        body: bytes | bytearray
        if self._frame is not None:
            body, self._frame, self._filled = self._frame, None, 0
        else:
            body, self._parts = b"".join(self._parts), []
        return [self._codec.decode(body)]


# A frame's first piece at most this big, in a chunk over twice its size, is copied out, so
# that a large read (up to the connection's receive size) is not kept alive by a short tail.
_COPY_TAIL = 64 * 1024


def _hold(view: memoryview, pos: int) -> memoryview:
    tail = view[pos:]
    if len(tail) <= _COPY_TAIL and 2 * len(tail) < len(view):
        return memoryview(bytes(tail))
    return tail


def _base_size(part: memoryview) -> int:
    base = part.obj
    return len(base) if isinstance(base, bytes | bytearray) else part.nbytes


def parse_frames_reference(codec: Codec, stream: bytes) -> tuple[list[Envelope], bytes]:
    """Slow, obvious reference for FrameParser: whole frames decoded, and the leftover bytes."""
    out: list[Envelope] = []
    pos = 0
    while len(stream) - pos >= HEADER_SIZE:
        size = int.from_bytes(stream[pos : pos + HEADER_SIZE], "big")
        if size > codec.max_frame:
            raise FrameTooLarge(size, codec.max_frame)
        if len(stream) - pos - HEADER_SIZE < size:
            break
        out.append(codec.decode(stream[pos + HEADER_SIZE : pos + HEADER_SIZE + size]))
        pos += HEADER_SIZE + size
    return out, stream[pos:]
