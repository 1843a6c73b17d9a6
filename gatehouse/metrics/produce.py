"""Produce requests and responses read straight from their bytes: the metrics' hot path.

Every Produce request carries records and every response carries error codes.  Decoding
either into objects costs more than the proxy's own work per request, and the counters
need only per topic (records, bytes) and per code counts.  These readers walk the frame
for exactly that, check that they consumed it exactly, and return None on anything
unexpected: the caller then falls back to the full decoder, which reports the error.

Layouts (Produce v3-v13; flexible from v9): Kafka's ProduceRequest.json and
ProduceResponse.json.  tests/test_metrics_produce.py holds them to the full decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, Final

from gatehouse.codecs.primitives import Buffer
from gatehouse.codecs.records import BATCH_OVERHEAD, LOG_OVERHEAD, summarize

_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_MAGIC_AT: Final = 16  # in a batch: base offset (8), length (4), leader epoch (4)
_COUNT_AT: Final = 57  # a v2 batch's record count
_V2_HEAD: Final = struct.Struct(">8xi4xb40xi")  # length (8), magic (16), count (57)
_LEGACY_MIN_LENGTH: Final = (14, 22)  # magic 0 / 1: crc, magic, attributes (, timestamp)
FLEXIBLE_SINCE: Final = 9
TOPIC_IDS_SINCE: Final = 13
FIRST_VERSION: Final = 3


class _Unexpected(Exception):
    """Anything the fast path does not handle: the full decoder takes over."""


TopicCounts = list[tuple[str | bytes, int, int]]  # (name, or topic id bytes; records; bytes)


def _uvarint(view: memoryview, pos: int) -> tuple[int, int]:
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
            raise _Unexpected


def _skip_tags(view: memoryview, pos: int) -> int:
    count, pos = _uvarint(view, pos)
    for _ in range(count):
        _, pos = _uvarint(view, pos)
        size, pos = _uvarint(view, pos)
        pos += size
    return pos


def _array(view: memoryview, pos: int, flexible: bool) -> tuple[int, int]:
    if flexible:
        n, pos = _uvarint(view, pos)
        n -= 1
    else:
        (n,) = _I32.unpack_from(view, pos)
        pos += 4
    if n < 0:
        raise _Unexpected  # null arrays: not in Produce
    return n, pos


def _skip_string(view: memoryview, pos: int, flexible: bool) -> int:
    """Skips a (nullable) string."""
    if flexible:
        n, pos = _uvarint(view, pos)
        return pos + max(n - 1, 0)
    length: int = _I16.unpack_from(view, pos)[0]
    return pos + 2 + max(length, 0)


def count_records(view: memoryview, start: int, end: int) -> tuple[int, int]:
    """(records, bytes of complete batches) in ``view[start:end]``, from batch headers,
    as ``gatehouse.codecs.records.summarize`` counts them."""
    pos = start
    count = 0
    # v2 batches (all a modern client sends): length, magic and count in one unpack.
    while end - pos >= BATCH_OVERHEAD:
        length, magic, records = _V2_HEAD.unpack_from(view, pos)
        if magic != 2:
            break
        size = LOG_OVERHEAD + length
        if pos + size > end:
            if length < 0:
                raise _Unexpected
            return count, pos - start
        if size < BATCH_OVERHEAD:
            raise _Unexpected
        count += records
        pos += size
    while end - pos >= LOG_OVERHEAD + 5:
        (length,) = _I32.unpack_from(view, pos + 8)
        size = LOG_OVERHEAD + length
        if length < 0:
            raise _Unexpected
        if pos + size > end:
            break
        magic = view[pos + _MAGIC_AT]
        if magic == 2:
            if size < BATCH_OVERHEAD:
                raise _Unexpected
            count += _I32.unpack_from(view, pos + _COUNT_AT)[0]
        elif magic == 0 or magic == 1:
            if length < _LEGACY_MIN_LENGTH[magic]:
                raise _Unexpected
            count += 1
        else:
            raise _Unexpected
        pos += size
    return count, pos - start


def records_and_bytes(records: Buffer | None) -> tuple[int, int]:
    """(records, bytes of complete batches) of a records field; anything ``count_records``
    does not take is left to ``records.summarize``, which counts it or says what is wrong
    (``ProtocolError``)."""
    if records is None:
        return 0, 0
    view = memoryview(records)
    try:
        return count_records(view, 0, len(view))
    except _Unexpected:
        summary = summarize(view)
        return summary.records, summary.bytes


def partitions_total(partitions: Iterable[Any]) -> tuple[int, int]:
    """(records, bytes) over the ``records`` fields of a topic's decoded partitions."""
    records_total = bytes_total = 0
    for partition in partitions:
        counted, size = records_and_bytes(partition.records)
        records_total += counted
        bytes_total += size
    return records_total, bytes_total


def _body_start(view: memoryview, flexible: bool) -> int:
    """Where a request body starts: after api key, version, correlation id, client id
    (a nullable int16 string in every header version) and, in v2 headers, tags."""
    (n,) = _I16.unpack_from(view, 8)
    pos = 10 + max(n, 0)
    return _skip_tags(view, pos) if flexible else pos


def request_topics(frame: Buffer, version: int) -> TopicCounts | None:
    """Per topic: (name, or the 16 topic id bytes from v13; records; record bytes)."""
    if version < FIRST_VERSION:
        return None
    view = memoryview(frame)
    flexible = version >= FLEXIBLE_SINCE
    ids = version >= TOPIC_IDS_SINCE
    # One-byte varints and empty tag sections (nearly all of them) are read inline: this
    # runs for every Produce request.
    try:
        pos = _body_start(view, flexible)
        pos = _skip_string(view, pos, flexible)  # TransactionalId
        pos += 6  # Acks, TimeoutMs
        topics, pos = _array(view, pos, flexible)
        out: TopicCounts = []
        for _ in range(topics):
            key: str | bytes
            if ids:
                key = bytes(view[pos:pos + 16])
                pos += 16
            else:
                if flexible:
                    n = view[pos]
                    if n < 0x80:
                        pos += 1
                    else:
                        n, pos = _uvarint(view, pos)
                    n -= 1
                else:
                    (n,) = _I16.unpack_from(view, pos)
                    pos += 2
                if n < 0 or pos + n > len(view):
                    raise _Unexpected
                key = str(view[pos:pos + n], "utf-8")
                pos += n
            if flexible and view[pos] < 0x80:
                partitions = view[pos] - 1
                pos += 1
                if partitions < 0:
                    raise _Unexpected
            else:
                partitions, pos = _array(view, pos, flexible)
            records = size = 0
            for _ in range(partitions):
                pos += 4  # Index
                if flexible:
                    n = view[pos]
                    if n < 0x80:
                        pos += 1
                    else:
                        n, pos = _uvarint(view, pos)
                    n -= 1
                else:
                    (n,) = _I32.unpack_from(view, pos)
                    pos += 4
                if n > 0:
                    if pos + n > len(view):
                        raise _Unexpected
                    c, b = count_records(view, pos, pos + n)
                    records += c
                    size += b
                    pos += n
                if flexible:
                    pos = _skip_tags(view, pos) if view[pos] else pos + 1
            if flexible:
                pos = _skip_tags(view, pos) if view[pos] else pos + 1
            out.append((key, records, size))
        if flexible:
            pos = _skip_tags(view, pos)
        if pos != len(view):
            raise _Unexpected
        return out
    except (_Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None


def response_codes(frame: Buffer, version: int) -> dict[int, int] | None:
    """How often each error code appears (Produce has them per partition only)."""
    if version < FIRST_VERSION:
        return None
    view = memoryview(frame)
    flexible = version >= FLEXIBLE_SINCE
    try:
        pos = _skip_tags(view, 4) if flexible else 4  # CorrelationId (, tags)
        topics, pos = _array(view, pos, flexible)
        codes: dict[int, int] = {}
        fixed = 4 + 2 + 8 + 8 + (8 if version >= 5 else 0)  # Index .. LogStartOffset
        for _ in range(topics):
            if version >= TOPIC_IDS_SINCE:
                pos += 16
            else:
                pos = _skip_string(view, pos, flexible)
            partitions, pos = _array(view, pos, flexible)
            for _ in range(partitions):
                (code,) = _I16.unpack_from(view, pos + 4)
                codes[code] = codes.get(code, 0) + 1
                pos += fixed
                if flexible and view[pos] == 1 and view[pos + 1] == 0:
                    pos += 2  # no RecordErrors, a null ErrorMessage: the usual case
                elif version >= 8:
                    errors, pos = _array(view, pos, flexible)  # RecordErrors
                    for _ in range(errors):
                        pos = _skip_string(view, pos + 4, flexible)
                        if flexible:
                            pos = _skip_tags(view, pos)
                    pos = _skip_string(view, pos, flexible)  # ErrorMessage
                if flexible:
                    pos = _skip_tags(view, pos) if view[pos] else pos + 1
            if flexible:
                pos = _skip_tags(view, pos) if view[pos] else pos + 1
        pos += 4  # ThrottleTimeMs
        if flexible:
            pos = _skip_tags(view, pos)
        if pos != len(view):
            raise _Unexpected
        return codes
    except (_Unexpected, struct.error, IndexError):
        return None
