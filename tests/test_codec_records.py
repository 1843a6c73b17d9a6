"""``codecs.records``: record batch headers read without decompressing anything.

Batches are built by hand (record batch v2 as in Kafka's ``DefaultRecordBatch``, legacy
message sets as in ``LegacyRecord``), plus, where kafka-python is installed, by an
independent producer implementation.
"""

from __future__ import annotations

import gzip
import random
import struct
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import records
from gatehouse.codecs.records import LegacyMessage, RecordBatch
from tests.codec_strategies import examples

# -- building batches by hand -------------------------------------------------------------


def zigzag(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        byte, z = z & 0x7F, z >> 7
        out.append(byte | (0x80 if z else 0))
        if not z:
            return bytes(out)


def record_v2(offset_delta: int, timestamp_delta: int, key: bytes | None, value: bytes) -> bytes:
    """One DefaultRecord: length, attributes, deltas, key, value, no headers."""
    body = (b"\x00" + zigzag(timestamp_delta) + zigzag(offset_delta)
            + (zigzag(-1) if key is None else zigzag(len(key)) + key)
            + zigzag(len(value)) + value + zigzag(0))
    return zigzag(len(body)) + body


def batch_v2(payload: bytes, count: int, *, attributes: int = 0, base_offset: int = 0,
             leader_epoch: int = 0, producer_id: int = -1, producer_epoch: int = -1,
             base_sequence: int = -1, base_timestamp: int = 1_700_000_000_000,
             max_timestamp: int | None = None, crc: int | None = None) -> bytes:
    after_crc = struct.pack(
        ">hiqqqhii", attributes, max(count - 1, 0), base_timestamp,
        base_timestamp if max_timestamp is None else max_timestamp,
        producer_id, producer_epoch, base_sequence, count,
    ) + payload
    if crc is None:
        crc = records.crc32c(after_crc)
    after_length = struct.pack(">ibI", leader_epoch, 2, crc) + after_crc
    return struct.pack(">qi", base_offset, len(after_length)) + after_length


def plain_records(n: int) -> bytes:
    return b"".join(record_v2(i, i * 10, None if i % 2 else b"k%d" % i, b"value-%d" % i)
                    for i in range(n))


def legacy_message(magic: int, value: bytes, *, offset: int = 0, attributes: int = 0,
                   timestamp: int = 1_700_000_000_000, key: bytes | None = None) -> bytes:
    rest = struct.pack(">bb", magic, attributes)
    if magic == 1:
        rest += struct.pack(">q", timestamp)
    rest += struct.pack(">i", -1) if key is None else struct.pack(">i", len(key)) + key
    rest += struct.pack(">i", len(value)) + value
    message = struct.pack(">I", zlib.crc32(rest)) + rest
    return struct.pack(">qi", offset, len(message)) + message


# -- batch v2 ---------------------------------------------------------------------------------


def test_batch_v2_header_fields() -> None:
    data = batch_v2(plain_records(3), 3, attributes=0x08, base_offset=42, leader_epoch=7,
                    producer_id=1001, producer_epoch=3, base_sequence=17,
                    base_timestamp=1000, max_timestamp=1020)
    (b,) = records.iter_batches(data)
    assert isinstance(b, RecordBatch)
    assert (b.position, b.base_offset, b.batch_length, b.partition_leader_epoch, b.magic) == (
        0, 42, len(data) - 12, 7, 2)
    assert (b.attributes, b.last_offset_delta, b.base_timestamp, b.max_timestamp) == (8, 2, 1000, 1020)
    assert (b.producer_id, b.producer_epoch, b.base_sequence, b.record_count) == (1001, 3, 17, 3)
    assert (b.compression, b.timestamp_type, b.is_transactional, b.is_control) == (
        "none", "log_append_time", False, False)
    assert b.size == len(data) and b.crc_ok(data)
    assert records.BATCH_OVERHEAD == 61 and records.LOG_OVERHEAD == 12


@pytest.mark.parametrize(("code", "name"), [
    (0, "none"), (1, "gzip"), (2, "snappy"), (3, "lz4"), (4, "zstd"),
    (5, "unknown-5"), (6, "unknown-6"), (7, "unknown-7"),
])
def test_compression_codec_attribute(code: int, name: str) -> None:
    data = batch_v2(b"opaque", 9, attributes=code | 0x10 | 0x20)
    (b,) = records.iter_batches(data)
    assert isinstance(b, RecordBatch)
    assert b.compression == name and b.is_transactional and b.is_control
    assert b.timestamp_type == "create_time"
    assert records.summarize(data).compressions == frozenset({name})


def test_gzip_batch_is_read_without_decompressing(monkeypatch: pytest.MonkeyPatch) -> None:
    compressed = gzip.compress(plain_records(50))
    data = batch_v2(compressed, 50, attributes=1)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decompression attempted")

    for module, name in ((gzip, "decompress"), (gzip, "GzipFile"), (zlib, "decompress"),
                         (zlib, "decompressobj")):
        monkeypatch.setattr(module, name, refuse)
    (b,) = records.iter_batches(data)
    assert isinstance(b, RecordBatch)
    assert (b.compression, b.record_count, b.last_offset_delta) == ("gzip", 50, 49)
    assert b.crc_ok(data)
    summary = records.summarize(data)
    assert (summary.batches, summary.records, summary.bytes) == (1, 50, len(data))
    # A "gzip" payload that is not gzip at all reads just as well: nothing looks inside.
    fake = batch_v2(b"\x00not gzip\xff" * 3, 7, attributes=1)
    assert records.summarize(fake).records == 7


def test_crc32c_check_value_and_crc_ok() -> None:
    assert records.crc32c(b"") == 0
    assert records.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert records.crc32c(b"6789", records.crc32c(b"12345")) == 0xE3069283  # incremental
    data = batch_v2(plain_records(4), 4, producer_id=5)
    (b,) = records.iter_batches(data)
    assert b.crc_ok(data)
    # Bytes the CRC covers: attributes (offset 21) to the end of the batch.
    for pos in (21, 30, 57, len(data) - 1):
        corrupted = bytearray(data)
        corrupted[pos] ^= 0x01
        (c,) = records.iter_batches(bytes(corrupted))
        assert not c.crc_ok(bytes(corrupted)), pos
    # Bytes it does not: base offset, length stays, and the leader epoch (brokers set it).
    rewritten = bytearray(data)
    rewritten[0:8] = struct.pack(">q", 99)
    rewritten[12:16] = struct.pack(">i", 12)
    (r,) = records.iter_batches(bytes(rewritten))
    assert isinstance(r, RecordBatch)
    assert r.crc_ok(bytes(rewritten)) and r.base_offset == 99 and r.partition_leader_epoch == 12
    # A stored CRC-32 (IEEE, the legacy checksum) over the same bytes is wrong for v2.
    ieee = batch_v2(b"x", 1, crc=zlib.crc32(struct.pack(">hiqqqhii", 0, 0, 1_700_000_000_000,
                                                        1_700_000_000_000, -1, -1, -1, 1) + b"x"))
    (i,) = records.iter_batches(ieee)
    assert not i.crc_ok(ieee)


def test_batches_in_sequence_and_positions() -> None:
    batches = [batch_v2(plain_records(n), n, base_offset=off) for n, off in ((1, 0), (5, 1), (2, 6))]
    data = b"".join(batches)
    got = list(records.iter_batches(data))
    assert [b.position for b in got] == [0, len(batches[0]), len(batches[0]) + len(batches[1])]
    assert [b.record_count for b in got] == [1, 5, 2]
    assert all(b.crc_ok(data) for b in got)
    summary = records.summarize(data)
    assert summary == records.RecordsSummary(3, 8, len(data), 0, 0, frozenset({"none"}))


# -- legacy message sets ------------------------------------------------------------------------


def test_legacy_magic_0_and_1_are_recognised_and_counted() -> None:
    data = (legacy_message(0, b"v0", offset=0) + legacy_message(1, b"v1", offset=1, key=b"k",
                                                                  timestamp=1234)
            + legacy_message(1, gzip.compress(b"wrapped"), offset=5, attributes=1))
    got = [m for m in records.iter_batches(data) if isinstance(m, LegacyMessage)]
    assert len(got) == 3
    assert [(m.magic, m.offset, m.timestamp, m.compression) for m in got] == [
        (0, 0, None, "none"), (1, 1, 1234, "none"), (1, 5, 1_700_000_000_000, "gzip")]
    assert all(m.crc_ok(data) for m in got)  # CRC-32 from the magic byte on
    assert all(m.record_count == 1 for m in got)  # a compressed wrapper counts as one
    summary = records.summarize(data)
    assert (summary.batches, summary.records, summary.legacy_messages) == (3, 3, 3)
    assert summary.compressions == frozenset({"none", "gzip"}) and summary.truncated_bytes == 0
    corrupted = bytearray(data)
    corrupted[-1] ^= 0xFF
    assert not list(records.iter_batches(bytes(corrupted)))[-1].crc_ok(bytes(corrupted))


def test_legacy_and_v2_mixed() -> None:
    data = legacy_message(1, b"old") + batch_v2(plain_records(3), 3, base_offset=1)
    summary = records.summarize(data)
    assert (summary.batches, summary.records, summary.legacy_messages) == (2, 4, 1)


# -- truncated tails and malformed headers ---------------------------------------------------------


def test_truncated_trailing_partial_batch_at_every_cut() -> None:
    first = batch_v2(plain_records(3), 3)
    second = batch_v2(plain_records(4), 4, base_offset=3)
    for cut in range(len(second)):
        data = first + second[:cut]
        summary = records.summarize(data)
        assert (summary.batches, summary.records, summary.bytes) == (1, 3, len(first)), cut
        assert summary.truncated_bytes == cut
        assert [b.record_count for b in records.iter_batches(data)] == [3]
    legacy = legacy_message(1, b"abc")
    for cut in range(len(legacy)):
        summary = records.summarize(legacy + legacy[:cut])
        assert (summary.legacy_messages, summary.truncated_bytes) == (1, cut)


@pytest.mark.parametrize(("data", "offset"), [
    (struct.pack(">qi", 0, -5) + bytes(60), 0),  # negative length
    (batch_v2(b"", 0)[:16] + b"\x03" + batch_v2(b"", 0)[17:], 16),  # magic 3
    (struct.pack(">qi", 0, 20) + struct.pack(">ib", 0, 2) + bytes(15), 0),  # v2 shorter than its header
    (struct.pack(">qi", 0, 5) + struct.pack(">Ib", 0, 1), 0),  # legacy shorter than its header
    # legacy v1 of 18 bytes (the minimum is 22: crc, magic, attributes, timestamp, lengths)
    (struct.pack(">qi", 0, 18) + struct.pack(">Ibbq", 0, 1, 0, 0) + bytes(4), 0),
    # legacy v0 of 10 bytes (the minimum is 14)
    (struct.pack(">qi", 0, 10) + struct.pack(">Ibb", 0, 0, 0) + bytes(4), 0),
])
def test_impossible_headers_are_errors(data: bytes, offset: int) -> None:
    for read in (records.summarize, lambda d: list(records.iter_batches(d))):
        with pytest.raises(codecs.RemoteProtocolError) as info:
            read(data)
        assert info.value.offset == offset


def test_no_records() -> None:
    assert records.summarize(None) == records.RecordsSummary(0, 0, 0, 0, 0, frozenset())
    assert list(records.iter_batches(None)) == []
    assert records.summarize(b"") == records.RecordsSummary(0, 0, 0, 0, 0, frozenset())


# -- summarize and iter_batches agree ------------------------------------------------------------


batch_specs = st.lists(st.tuples(st.sampled_from(["v2", "v0", "v1"]), st.integers(0, 6),
                                 st.integers(0, 4)), max_size=6)


@settings(max_examples=examples(100), deadline=None, database=None)
@given(batch_specs, st.integers(0, 80))
def test_summarize_agrees_with_iter_batches(specs: list[tuple[str, int, int]], tail: int) -> None:
    parts = []
    for kind, count, codec in specs:
        if kind == "v2":
            parts.append(batch_v2(plain_records(count), count, attributes=codec))
        else:
            parts.append(legacy_message(int(kind[1]), b"x" * count, attributes=codec))
    complete = b"".join(parts)
    data = complete + (parts[0][:tail] if parts and tail < len(parts[0]) else b"")
    got = list(records.iter_batches(data))
    summary = records.summarize(data)
    assert summary.batches == len(got) == len(specs)
    assert summary.records == sum(b.record_count for b in got)
    assert summary.legacy_messages == sum(isinstance(b, LegacyMessage) for b in got)
    assert summary.compressions == frozenset(b.compression for b in got)
    assert summary.bytes == len(complete) and summary.truncated_bytes == len(data) - len(complete)
    assert all(b.crc_ok(data) for b in got)


# -- inside messages ------------------------------------------------------------------------------


def test_records_in_a_fetch_response_with_a_partial_batch() -> None:
    full = batch_v2(plain_records(3), 3) + batch_v2(gzip.compress(plain_records(9)), 9,
                                                    attributes=1, base_offset=3)
    data = full + batch_v2(plain_records(2), 2, base_offset=12)[:40]  # cut at max bytes
    spec = codecs.api(1).response
    partition = spec.structs["PartitionData"].cls(partition_index=0, high_watermark=14, records=data)
    topic = spec.structs["FetchableTopicResponse"].cls(topic_id=codecs.schema.ZERO_UUID,
                                                       partitions=(partition,))
    frame = bytes(codecs.Response.build(1, 16, 3, spec.root.cls(responses=(topic,))).encode())
    resp = codecs.decode_response(frame, 1, 16)
    field = resp.body.responses[0].partitions[0].records
    assert isinstance(field, memoryview) and bytes(field) == data
    summary = records.summarize(field)
    assert (summary.batches, summary.records, summary.truncated_bytes) == (2, 12, 40)
    assert summary.compressions == frozenset({"none", "gzip"})
    assert all(b.crc_ok(field) for b in records.iter_batches(field))


# -- an independent producer: kafka-python --------------------------------------------------------


@pytest.mark.parametrize(("codec", "name"), [(0, "none"), (1, "gzip")])
def test_batches_built_by_kafka_python(codec: int, name: str) -> None:
    default_records = pytest.importorskip("kafka.record.default_records")
    builder = default_records.DefaultRecordBatchBuilder(
        magic=2, compression_type=codec, is_transactional=True, producer_id=4242,
        producer_epoch=2, base_sequence=100, batch_size=1 << 20)
    rng = random.Random(codec)
    for i in range(25):  # compressible values (kafka-python sends incompressible ones plain)
        builder.append(i, timestamp=1_700_000_000_000 + i, key=b"k%d" % i,
                       value=b"value " * rng.randrange(1, 40), headers=[])
    data = bytes(builder.build())
    (b,) = records.iter_batches(data)
    assert isinstance(b, RecordBatch)
    assert (b.record_count, b.last_offset_delta, b.compression, b.is_transactional) == (
        25, 24, name, True)
    assert (b.producer_id, b.producer_epoch, b.base_sequence) == (4242, 2, 100)
    assert (b.base_timestamp, b.max_timestamp) == (1_700_000_000_000, 1_700_000_000_024)
    assert b.crc_ok(data) and b.size == len(data)


@pytest.mark.parametrize("magic", [0, 1])
def test_legacy_sets_built_by_kafka_python(magic: int) -> None:
    legacy_records = pytest.importorskip("kafka.record.legacy_records")
    plain = legacy_records.LegacyRecordBatchBuilder(magic=magic, compression_type=0, batch_size=1 << 20)
    for i in range(5):
        plain.append(i, timestamp=1_700_000_000_000 if magic else None, key=None, value=b"v%d" % i)
    data = bytes(plain.build())
    got = list(records.iter_batches(data))
    assert [m.magic for m in got] == [magic] * 5 and all(m.crc_ok(data) for m in got)
    wrapped = legacy_records.LegacyRecordBatchBuilder(magic=magic, compression_type=1, batch_size=1 << 20)
    for i in range(5):
        wrapped.append(i, timestamp=1_700_000_000_000 if magic else None, key=None, value=b"v%d" % i)
    data = bytes(wrapped.build())
    summary = records.summarize(data)
    assert (summary.legacy_messages, summary.compressions) == (1, frozenset({"gzip"}))
