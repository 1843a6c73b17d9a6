"""Protobuf bytes written by hand, for messages no generated class would write (wrong on
purpose, or too large to build field by field)."""

from __future__ import annotations


def length_delimited(number: int, data: bytes) -> bytes:
    """Field ``number`` holding ``data`` (wire type 2)."""
    size = len(data)
    length = bytearray()
    while size >= 0x80:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return bytes([number << 3 | 2]) + bytes(length) + data


def nested(inner: bytes, *fields: int) -> bytes:
    """``inner`` as field ``fields[-1]`` of a message that is field ``fields[-2]`` of ...
    of the outermost message."""
    for number in reversed(fields):
        inner = length_delimited(number, inner)
    return inner
