"""Variable-length integers (KIP-482 unsigned varints, zig-zag varints of records)."""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Final, TypeAlias

from gatehouse.codecs.errors import LocalProtocolError, RemoteProtocolError

MAX_UVARINT32: Final = 0xFFFFFFFF

# What the codec reads from (collections.abc.Buffer arrives in Python 3.12).
Buffer: TypeAlias = bytes | bytearray | memoryview


def read_uvarint(buf: Buffer, pos: int) -> tuple[int, int]:
    """An unsigned varint of at most 5 bytes (32 bits) at ``pos``: ``(value, new_pos)``."""
    view = memoryview(buf)
    value = shift = 0
    while True:
        if pos >= len(view):
            raise RemoteProtocolError("truncated varint", offset=pos)
        b = view[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise RemoteProtocolError("varint longer than 5 bytes", offset=pos - 1)


def read_uvarlong(buf: Buffer, pos: int) -> tuple[int, int]:
    """An unsigned varint of at most 10 bytes (64 bits)."""
    view = memoryview(buf)
    value = shift = 0
    while True:
        if pos >= len(view):
            raise RemoteProtocolError("truncated varlong", offset=pos)
        b = view[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise RemoteProtocolError("varlong longer than 10 bytes", offset=pos - 1)


def read_varint(buf: Buffer, pos: int) -> tuple[int, int]:
    """A zig-zag signed varint (record fields)."""
    raw, pos = read_uvarint(buf, pos)
    return (raw >> 1) ^ -(raw & 1), pos


def read_varlong(buf: Buffer, pos: int) -> tuple[int, int]:
    raw, pos = read_uvarlong(buf, pos)
    return (raw >> 1) ^ -(raw & 1), pos


def uvarint_bytes(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def varint_bytes(value: int) -> bytes:
    """Zig-zag encode (64-bit) and write as an unsigned varint."""
    return uvarint_bytes((value << 1) ^ (value >> 63))


_TAG = itemgetter(0)


def write_tag_section(out: bytearray, tags: list[tuple[int, Any]],
                      what: str = "tagged field") -> None:
    """A tag section (KIP-482) of (tag, value bytes) fields: ``tags`` is sorted in place;
    ``what`` names a field that appears twice in the error."""
    tags.sort(key=_TAG)
    out += uvarint_bytes(len(tags))
    last = -1
    for tag, payload in tags:
        if tag == last:
            raise LocalProtocolError(f"{what} {tag} appears twice")
        last = tag
        out += uvarint_bytes(tag)
        out += uvarint_bytes(len(payload))
        out += payload
