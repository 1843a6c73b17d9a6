"""Reading Kafka frames' bytes without decoding them: the helpers of the fast readers
(``produce``, ``fetch``) that walk a frame for a few facts.  Anything unexpected raises
``Unexpected``: the reader returns None and its caller falls back to the full decoder,
which reports the error."""

from __future__ import annotations

import struct
from typing import Final

from gatehouse.codecs.primitives import write_tag_section
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
    flexible version, the header's tag section."""
    n: int = I16.unpack_from(view, 8)[0]
    pos = 10 + max(n, 0)
    if flexible:
        pos = skip_tags(view, pos) if view[pos] else pos + 1
    return pos


def skip_tags(view: memoryview, pos: int) -> int:
    return read_tag_numbers(view, pos)[1]


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
