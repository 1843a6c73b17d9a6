"""Reading Kafka frames' bytes without decoding them: the helpers of the fast readers
(``produce``, ``fetch``) that walk a frame for a few facts.  Anything unexpected raises
``Unexpected``: the reader returns None and its caller falls back to the full decoder,
which reports the error."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from gatehouse.codecs.primitives import Buffer, write_tag_section
from gatehouse.codecs.records import Uncounted

I16: Final = struct.Struct(">h")
I32: Final = struct.Struct(">i")

# What the Produce request and Fetch response readers say of each topic: its name (or
# its 16 topic id bytes), its partitions' indexes, its records and record bytes.
TopicCounts = list[tuple[str | bytes, list[int], int, int]]

Unexpected = Uncounted  # one class: a records field the counter does not take is one too


def uvarint(view: memoryview, pos: int) -> tuple[int, int]:
    b = view[pos]
    if b < 0x80:
        return b, pos + 1
    value = b & 0x7F
    shift = 7
    while True:
        pos += 1
        b = view[pos]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 28:
            raise Unexpected


def request_body_at(view: memoryview, flexible: bool) -> int:
    """Where a request's body begins, its frame read from the api key on: after the
    header's client id (a nullable int16 string in every header version) and, in a
    flexible version, the header's tag section; IndexError or struct.error when ``view``
    ends before it (a walk then waits for more)."""
    n: int = I16.unpack_from(view, 8)[0]
    pos = 10 + max(n, 0)
    if flexible:
        pos = skip_tags_whole(view, pos) if view[pos] else pos + 1
    return pos


def skip_tags(view: memoryview, pos: int) -> int:
    return read_tag_numbers(view, pos)[1]


def skip_tags_whole(view: memoryview, pos: int) -> int:
    """The end of the tag section at ``pos``; IndexError when ``view`` ends inside it."""
    count, pos = uvarint(view, pos)
    for _ in range(count):
        _, pos = uvarint(view, pos)
        size, pos = uvarint(view, pos)
        pos += size
    if pos > len(view):
        raise IndexError
    return pos


def read_tag_numbers(view: memoryview, pos: int) -> tuple[tuple[int, ...], int]:
    """Skips a tag section; the numbers of its fields."""
    count, pos = uvarint(view, pos)
    tags = []
    for _ in range(count):
        tag, pos = uvarint(view, pos)
        size, pos = uvarint(view, pos)
        tags.append(tag)
        pos += size
    if pos > len(view):
        raise Unexpected
    return tuple(tags), pos


def tag_fields(view: memoryview, pos: int) -> list[tuple[int, bytes]]:
    """The (tag, value bytes) of the tag section at ``pos``, which must end the frame."""
    count, pos = uvarint(view, pos)
    fields = []
    for _ in range(count):
        tag, pos = uvarint(view, pos)
        size, pos = uvarint(view, pos)
        if pos + size > len(view):
            raise Unexpected
        fields.append((tag, bytes(view[pos:pos + size])))
        pos += size
    if pos != len(view):
        raise Unexpected
    return fields


def _tag_section(fields: list[tuple[int, bytes]]) -> bytearray:
    out = bytearray()
    write_tag_section(out, list(fields))
    return out


def fit_tag_section(fields: list[tuple[int, bytes]], size: int, unknown_from: int) -> bytes | None:
    """A tag section of exactly ``size`` bytes holding ``fields`` (ascending tags), made
    up to that size with one or two tagged fields of zeros after them, numbered from
    ``unknown_from`` (a tag the message does not define: readers skip tags they do not
    know, KIP-482); None when ``fields`` alone take more room, or one byte less (no field
    is one byte long).

    A proxy that has sent a frame's size prefix before the frame's end arrived uses it
    to change a tagged field at the end (NodeEndpoints) without changing the size.
    """
    exact = _tag_section(fields)
    if len(exact) == size:
        return bytes(exact)
    first = max(unknown_from, fields[-1][0] + 1 if fields else 0)
    # One filler, then two (the second empty): some sizes need the second's byte or two
    # because a varint's length jumps.
    for extra in ((), ((first + 1, b""),)):
        for overhead in range(2, 12):
            fill = size - len(exact) - overhead - sum(len(_tag_section([f])) - 1 for f in extra)
            if fill < 0:
                break
            made = _tag_section([*fields, (first, bytes(fill)), *extra])
            if len(made) == size:
                return bytes(made)
    return None


def last_tags(view: memoryview, pos: int) -> tuple[int, ...]:
    """The numbers of a message's top-level tagged fields, whose section must end the
    frame at ``pos``."""
    tags: tuple[int, ...] = ()
    if view[pos]:
        tags, pos = read_tag_numbers(view, pos)
    else:
        pos += 1
    if pos != len(view):
        raise Unexpected
    return tags


def array(view: memoryview, pos: int, flexible: bool) -> tuple[int, int]:
    if flexible:
        n, pos = uvarint(view, pos)
        n -= 1
    else:
        (n,) = I32.unpack_from(view, pos)
        pos += 4
    if n < 0:
        raise Unexpected  # a null array: the caller's fast path does not take it
    return n, pos


def skip_string(view: memoryview, pos: int, flexible: bool) -> int:
    """Skips a (nullable) string."""
    if flexible:
        n, pos = uvarint(view, pos)
        return pos + max(n - 1, 0)
    length: int = I16.unpack_from(view, pos)[0]
    return pos + 2 + max(length, 0)


_PIECE: Final = 4096  # held bytes grow by this much while a part is short
_Step = Callable[[memoryview], int]


class StepWalk:
    """Follows a frame as its bytes come, part by part, keeping none of its records: the
    machinery of ``fetch.AnswerWalk`` and ``produce.RequestWalk``, which let a proxy pass
    records on socket to socket (splice(2)) and still read what lies around them.

    ``feed(data)`` takes the frame's next bytes (after its size prefix) and returns how
    many it took: all of them until the walk is ``finished`` (and has no records left).
    ``opaque`` is how many of the bytes after those fed are records: they may go by
    unread (``skip``) or be fed.

    Subclasses set ``_step``: a method that reads one part from the start of a view and
    returns its length, or raises IndexError/struct.error when the view ends inside it (a
    short part is held until the rest comes).  Bytes that cannot be the frame, or a part
    that runs past its ``size``, raise ``Unexpected``.
    """

    __slots__ = ("_at", "_held", "_size", "_step", "finished", "opaque")

    def __init__(self, size: int, first: _Step) -> None:
        self._size = size  # the frame's bytes after its size prefix
        self._at = 0  # frame offset of the next byte not taken
        self._held = bytearray()  # the start of a part that was short
        self._step = first
        self.opaque = 0
        self.finished = False

    def feed(self, data: Buffer) -> int:
        view = memoryview(data)
        taken = 0
        while taken < len(view) and (self.opaque or not self.finished):
            if self.opaque:
                n = min(self.opaque, len(view) - taken)
                self.skip(n)
                taken += n
                continue
            held = self._held
            if held:
                piece = view[taken:taken + _PIECE]
                before = len(held)
                held += piece
                source = memoryview(held)
            else:
                before = 0
                source = view[taken:]
            try:
                used = self._step(source)
            except (IndexError, struct.error):  # short: the rest comes in a later feed
                if not held:
                    self._held = bytearray(source)
                    taken = len(view)
                else:
                    taken += len(piece)
                if self._at + len(self._held) > self._size:
                    raise Unexpected from None  # a part runs past the frame's end
                continue
            finally:
                del source
            if held:
                if used <= before:  # a part that was short of the held bytes is longer
                    raise Unexpected
                self._held = bytearray()
            taken += used - before
            self._at += used
            if self._at + self.opaque > self._size:
                raise Unexpected  # records past the frame's end
        return taken

    @property
    def holding(self) -> int:
        """Bytes of a part that has not all come yet, held until it has."""
        return len(self._held)

    def skip(self, n: int) -> None:
        """``n`` bytes of records went by (not fed)."""
        if not 0 < n <= self.opaque:
            raise ValueError(f"{n} bytes skipped, {self.opaque} of records left")
        self.opaque -= n
        self._at += n
