"""Reading Kafka frames' bytes without decoding them: the helpers of the fast readers
(``produce``, ``fetch``) that walk a frame for a few facts.  Anything unexpected raises
``Unexpected``: the reader returns None and its caller falls back to the full decoder,
which reports the error."""

from __future__ import annotations

import struct
from typing import Final

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
