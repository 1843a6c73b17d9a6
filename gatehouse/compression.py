"""Record batches decompressed, within a bound, for the rules that read records.

Kafka compresses a batch's records with gzip, snappy (xerial's framing from the Java
client, raw blocks from others), lz4 (the LZ4 frame format) or zstd.  Only
``validate_records`` reads records, so only it decompresses; the codecs stay pure
(``gatehouse.codecs.records.iter_records`` takes the decompressed bytes).

A batch of a few KiB can decompress to gigabytes (a "zip bomb"): every codec here is
read into a bounded buffer, and a batch that would pass ``limit`` bytes raises
``DecompressionLimit`` instead of growing the proxy's memory.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Final

from gatehouse.codecs.primitives import Buffer

_XERIAL_MAGIC: Final = b"\x82SNAPPY\x00"
_XERIAL_HEADER: Final = 16  # magic, version, compatible version
_BLOCK_LENGTH: Final = struct.Struct(">i")
_TOO_SMALL: Final = "failed to write whole buffer"  # cramjam's word for a full buffer
_FIRST_GUESS: Final = 8  # times the compressed size: most batches fit the first try


class DecompressionError(Exception):
    """A batch whose records do not decompress with the codec its header names."""


class DecompressionLimit(DecompressionError):
    """A batch whose records decompress past the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the batch's records decompress past {limit} bytes")


def decompress(codec: str, data: Buffer, limit: int) -> bytes:
    """The records of a batch compressed with ``codec`` (``gzip``, ``snappy``, ``lz4``,
    ``zstd``), at most ``limit`` bytes of them."""
    if codec == "gzip":
        try:
            return _gunzip(data, limit)
        except zlib.error as exc:
            raise DecompressionError(f"the batch's gzip data does not decompress: "
                                     f"{str(exc)[:200]}") from None
    # Imported on first use: 3 MiB of every proxy's memory otherwise.
    import cramjam

    try:
        if codec == "snappy":
            return _unsnappy(cramjam, bytes(data), limit)
        if codec == "lz4":
            return _bounded(cramjam, cramjam.lz4.decompress_into, data, limit)
        if codec == "zstd":
            return _bounded(cramjam, cramjam.zstd.decompress_into, data, limit)
    except (cramjam.DecompressionError, ValueError) as exc:
        raise DecompressionError(f"the batch's {codec} data does not decompress: "
                                 f"{str(exc)[:200]}") from None
    raise DecompressionError(f"unknown compression {codec!r}")


def compress_zstd(data: bytes) -> bytes:
    """``data`` as one zstd frame (level 3, zstd's default): record values compressed
    before they are encrypted (``encrypt_records``)."""
    import cramjam

    return bytes(cramjam.zstd.compress(data, level=3))


def compress_gzip(data: bytes) -> bytes:
    """``data`` gzip-compressed (level 6, as the Java client's default): for clients too
    old for zstd."""
    import gzip

    return gzip.compress(data, compresslevel=6, mtime=0)


def _gunzip(data: Buffer, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31)  # a gzip header and trailer
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit or inflater.unconsumed_tail:
        raise DecompressionLimit(limit)
    if not inflater.eof:
        raise DecompressionError("the batch's gzip data ends before its stream does")
    return out


def _unsnappy(cramjam: Any, data: bytes, limit: int) -> bytes:
    if not data.startswith(_XERIAL_MAGIC):
        return _snappy_block(cramjam, data, limit)
    parts = []
    pos, left = _XERIAL_HEADER, limit
    while pos < len(data):
        if pos + 4 > len(data):
            raise DecompressionError("the batch's snappy framing is cut short")
        (length,) = _BLOCK_LENGTH.unpack_from(data, pos)
        pos += 4
        if length < 0 or pos + length > len(data):
            raise DecompressionError("a snappy block runs past the batch")
        block = _snappy_block(cramjam, data[pos : pos + length], left)
        left -= len(block)
        parts.append(block)
        pos += length
    return b"".join(parts)


def _snappy_block(cramjam: Any, data: bytes, limit: int) -> bytes:
    # A raw block says its size first: checked before anything is allocated.
    size = cramjam.snappy.decompress_raw_len(data)
    if size > limit:
        raise DecompressionLimit(limit)
    return bytes(cramjam.snappy.decompress_raw(data))


def _bounded(cramjam: Any, decompress_into: Any, data: Buffer, limit: int) -> bytes:
    """Into a buffer that grows fourfold from a guess up to ``limit`` (lz4 and zstd frames
    need not say their size); the codec fails on a buffer too small, and each try costs
    at most the buffer it fills."""
    size = min(limit, max(len(data) * _FIRST_GUESS, 64 * 1024))
    while True:
        out = bytearray(size)
        try:
            written = decompress_into(data, out)
        except cramjam.DecompressionError as exc:
            if _TOO_SMALL not in str(exc):
                raise  # corrupt data
            if size >= limit:
                raise DecompressionLimit(limit) from None
            size = min(limit, size * 4)
            continue
        if written < size:
            return bytes(memoryview(out)[:written])
        if size >= limit:
            raise DecompressionLimit(limit)
        size = min(limit, size * 4)  # exactly full: there may be more
