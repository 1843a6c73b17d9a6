"""Splitting a byte stream into size-prefixed frames, h11 style.

``FrameReader`` never blocks and never does I/O: feed it bytes, ask for the next frame,
get ``None`` when more data is needed.  The size prefix is checked as soon as its four
bytes arrive, so an oversized or negative length is refused before any payload is
buffered: a peer cannot make us allocate what it merely announces.
"""

from __future__ import annotations

import itertools
import struct
from collections import deque
from typing import Final

from gatehouse.codecs.errors import FrameTooLarge, RemoteProtocolError
from gatehouse.codecs.primitives import Buffer

DEFAULT_MAX_FRAME_SIZE: Final = 100 * 1024 * 1024
_SIZE: Final = struct.Struct(">i")
_SMALL_CHUNK: Final = 4096
# Frames this big come as views of their chunk from ``next_wire_view``: copying them costs
# more than keeping the chunk (at most _RECEIVE_SIZE-ish bytes) alive a little longer.
VIEW_SIZE: Final = 16 * 1024


class FrameReader:
    """Bytes in, frames (the bytes after each 4-byte size prefix) out.

    Received chunks are kept as a list and joined once per frame, so a large frame is
    copied once (not once per chunk as with a growing buffer), and a chunk that is exactly
    one frame is handed back without any copy.  ``next_wire_frame`` keeps the size prefix
    so a proxy can forward an unchanged frame as the very bytes it received.
    """

    __slots__ = ("_buffered", "_chunks", "_expected", "_offset", "_small", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size <= 0:
            raise ValueError("max_frame_size must be positive")
        self.max_frame_size = max_frame_size
        self._chunks: deque[bytes] = deque()
        self._offset = 0  # bytes of _chunks[0] already handed out
        self._buffered = 0
        self._expected: int | None = None  # size of the frame being assembled
        # Small chunks collect here first: one object per tiny read (a client trickling
        # bytes) would cost far more memory than the bytes themselves.
        self._small = bytearray()

    def feed(self, data: Buffer) -> None:
        """Add received bytes."""
        n = len(data)
        if not n:
            return
        self._buffered += n
        if n >= _SMALL_CHUNK:
            self._flush_small()
            self._chunks.append(data if type(data) is bytes else bytes(data))  # ours, immutable
        else:
            small = self._small
            small += data
            if len(small) >= _SMALL_CHUNK:
                self._flush_small()

    def whole_frame(self, data: Buffer) -> bytes | None:
        """``data`` itself, when nothing is buffered and it is exactly one complete frame
        (size prefix included) within ``max_frame_size``: the usual small request or
        answer, read whole, needs no trip through the reader (a copy in, a copy out).
        None otherwise: ``feed`` it (a size out of bounds is refused there)."""
        if self._buffered or type(data) is not bytes or len(data) < 4:
            return None
        (size,) = _SIZE.unpack_from(data)
        if len(data) != 4 + size or size > self.max_frame_size:
            return None
        return data

    def _flush_small(self) -> None:
        if self._small:
            self._chunks.append(bytes(self._small))
            self._small.clear()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as frames."""
        return self._buffered

    @property
    def expected_size(self) -> int | None:
        """The announced size of the frame being received, once its prefix is in."""
        return self._expected

    def next_frame(self) -> bytes | None:
        """The next complete frame without its size prefix, or None if more data is needed.

        Raises ``FrameTooLarge`` for a size above ``max_frame_size`` or below zero.
        """
        wire = self.next_wire_frame()
        return None if wire is None else wire[4:]

    def next_wire_frame(self) -> bytes | None:
        """The next complete frame with its 4-byte size prefix, or None (need more data).

        Raises ``FrameTooLarge`` for a size above ``max_frame_size`` or below zero.
        """
        return self._next_wire(False)  # type: ignore[return-value]

    def next_wire_view(self) -> Buffer | None:
        """``next_wire_frame``, but a frame of ``VIEW_SIZE`` bytes or more that arrived
        inside one received chunk comes as a read-only view of that chunk instead of a
        copy of its bytes (it keeps the chunk alive as long as it lives): for a proxy
        that forwards each frame and lets it go."""
        return self._next_wire(True)

    def _next_wire(self, view: bool) -> Buffer | None:
        size = self._expected
        if size is None:
            if self._buffered < 4:
                return None
            self._flush_small()
            (size,) = _SIZE.unpack_from(self._peek(4))
            if size < 0 or size > self.max_frame_size:
                raise FrameTooLarge(
                    f"frame size {size} is outside 0..{self.max_frame_size}", offset=0
                )
            self._expected = size
        if self._buffered < 4 + size:
            return None
        self._expected = None
        self._flush_small()
        return self._take(4 + size, view and size >= VIEW_SIZE)

    def take_partial(self) -> bytes:
        """The bytes received so far of a frame not yet complete, size prefix included,
        for a caller that forwards a large frame as it arrives: the rest of that frame
        is then the caller's to read, and the reader starts afresh after it.

        Raises ``ValueError`` unless a frame's size is known and the frame incomplete.
        """
        size = self._expected
        if size is None or self._buffered >= 4 + size:
            raise ValueError("no incomplete frame of a known size")
        self._expected = None
        self._flush_small()
        return self._take(self._buffered)  # type: ignore[return-value]

    def peek_partial(self, n: int) -> bytes:
        """Up to ``n`` of the bytes received so far of a frame not yet complete, size
        prefix included, left in place: enough to read its header before deciding
        whether to ``take_partial`` it."""
        if self._expected is None:
            raise ValueError("no incomplete frame of a known size")
        self._flush_small()
        return self._peek(min(n, self._buffered))

    def _peek(self, n: int) -> bytes:
        first, offset = self._chunks[0], self._offset
        if len(first) - offset >= n:
            return first[offset : offset + n]
        parts, need = [first[offset:]], n - (len(first) - offset)
        for chunk in itertools.islice(self._chunks, 1, None):  # no more than n bytes
            parts.append(chunk[:need])
            need -= len(parts[-1])
            if not need:
                break
        return b"".join(parts)

    def _take(self, n: int, view: bool = False) -> Buffer:
        """The next ``n`` bytes: a copy, or with ``view`` a view where they lie in one
        chunk.  Bytes spread over several chunks are joined: copied once."""
        chunks = self._chunks
        self._buffered -= n
        first, offset = chunks[0], self._offset
        left = len(first) - offset
        if left > n:
            self._offset = offset + n
            if view:
                return memoryview(first)[offset : offset + n]
            return first[offset : offset + n]
        if left == n:
            chunks.popleft()
            self._offset = 0
            if offset == 0:
                return first
            return memoryview(first)[offset:] if view else first[offset:]
        parts: list[Buffer] = [memoryview(first)[offset:] if offset else first]
        chunks.popleft()
        need = n - left
        while need:
            chunk = chunks[0]
            if len(chunk) <= need:
                parts.append(chunks.popleft())
                need -= len(chunk)
            else:
                parts.append(memoryview(chunk)[:need])  # joined below: not copied twice
                self._offset = need
                break
        else:
            self._offset = 0
        return b"".join(parts)

    def check_eof(self) -> None:
        """At end of stream: raise if a frame was cut off in the middle."""
        if self.buffered:
            raise RemoteProtocolError(
                f"connection closed in the middle of a frame ({self.buffered} bytes of "
                f"{'an unknown size' if self._expected is None else self._expected + 4} received)"
            )
