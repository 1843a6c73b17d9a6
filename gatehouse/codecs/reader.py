"""Splitting a byte stream into size-prefixed frames, h11 style.

``FrameReader`` never blocks and never does I/O: feed it bytes, ask for the next frame,
get ``None`` when more data is needed.  The size prefix is checked as soon as its four
bytes arrive, so an oversized or negative length is refused before any payload is
buffered: a peer cannot make us allocate what it merely announces.
"""

from __future__ import annotations

import struct
from typing import Final

from gatehouse.codecs.errors import FrameTooLarge, RemoteProtocolError
from gatehouse.codecs.primitives import Buffer

DEFAULT_MAX_FRAME_SIZE: Final = 100 * 1024 * 1024
_SIZE: Final = struct.Struct(">i")
_COMPACT_AT: Final = 64 * 1024


class FrameReader:
    """Bytes in, frames (the bytes after each 4-byte size prefix) out."""

    __slots__ = ("_buf", "_expected", "_start", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if max_frame_size <= 0:
            raise ValueError("max_frame_size must be positive")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._start = 0
        self._expected: int | None = None  # size of the frame being assembled

    def feed(self, data: Buffer) -> None:
        """Add received bytes."""
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as frames."""
        return len(self._buf) - self._start

    @property
    def expected_size(self) -> int | None:
        """The announced size of the frame being received, once its prefix is in."""
        return self._expected

    def next_frame(self) -> bytes | None:
        """The next complete frame, or None if more data is needed.

        Raises ``FrameTooLarge`` for a size above ``max_frame_size`` or below zero.
        """
        buf = self._buf
        start = self._start
        available = len(buf) - start
        size = self._expected
        if size is None:
            if available < 4:
                return None
            (size,) = _SIZE.unpack_from(buf, start)
            if size < 0 or size > self.max_frame_size:
                raise FrameTooLarge(
                    f"frame size {size} is outside 0..{self.max_frame_size}", offset=0
                )
            self._expected = size
        if available < 4 + size:
            return None
        end = start + 4 + size
        with memoryview(buf) as view:
            frame = bytes(view[start + 4 : end])
        self._expected = None
        if end == len(buf):
            buf.clear()
            self._start = 0
        elif end >= _COMPACT_AT and end * 2 >= len(buf):
            del buf[:end]
            self._start = 0
        else:
            self._start = end
        return frame

    def check_eof(self) -> None:
        """At end of stream: raise if a frame was cut off in the middle."""
        if self.buffered:
            raise RemoteProtocolError(
                f"connection closed in the middle of a frame ({self.buffered} bytes of "
                f"{'an unknown size' if self._expected is None else self._expected + 4} received)"
            )
