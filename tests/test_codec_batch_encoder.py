"""``records.encode_batch``: what we write, our reader and an independent one read back."""

from __future__ import annotations

import pytest

from gatehouse.codecs import records
from gatehouse.codecs.records import RecordBatch

ENTRIES = [(1_700_000_000_500, b"conn-1", b'{"api":"Produce"}'),
           (1_700_000_000_000, None, b"x" * 300),  # earlier than the first: base is the min
           (1_700_000_000_900, b"", None)]


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_an_encoded_batch_reads_back_with_its_crc(compression: str) -> None:
    data = records.encode_batch(ENTRIES, compression=compression)
    (batch,) = records.iter_batches(data)
    assert isinstance(batch, RecordBatch)
    assert batch.crc_ok(data) and batch.size == len(data)
    assert (batch.magic, batch.record_count, batch.last_offset_delta) == (2, 3, 2)
    assert (batch.base_timestamp, batch.max_timestamp) == (1_700_000_000_000, 1_700_000_000_900)
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (-1, -1, -1)
    assert (batch.compression, batch.timestamp_type, batch.is_transactional) == (
        compression, "create_time", False)
    summary = records.summarize(data)
    assert (summary.batches, summary.records, summary.bytes, summary.truncated_bytes) == (
        1, 3, len(data), 0)
    # A flipped byte anywhere after the CRC field is caught.
    broken = bytearray(data)
    broken[-1] ^= 0x01
    assert not batch.crc_ok(bytes(broken))


@pytest.mark.parametrize(("compression", "codec"), [("none", 0), ("gzip", 1)])
def test_an_independent_reader_sees_the_same_records(compression: str, codec: int) -> None:
    default_records = pytest.importorskip("kafka.record.default_records")
    data = records.encode_batch(ENTRIES, compression=compression, base_offset=40)
    batch = default_records.DefaultRecordBatch(data)
    assert batch.validate_crc() and batch.compression_type == codec
    got = [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in batch]
    assert got == [(40 + i, ts, key, value, []) for i, (ts, key, value) in enumerate(ENTRIES)]


def test_gzip_makes_repetitive_json_smaller() -> None:
    entries = [(1_700_000_000_000 + i, b"k", b'{"v":1,"api":"Fetch","topics":[]}')
               for i in range(500)]
    plain = records.encode_batch(entries)
    packed = records.encode_batch(entries, compression="gzip")
    assert len(packed) * 10 < len(plain)


def test_encode_batch_rejects_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="at least one record"):
        records.encode_batch([])
    with pytest.raises(ValueError, match="not available"):
        records.encode_batch(ENTRIES, compression="zstd")
