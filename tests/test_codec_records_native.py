"""``iter_records`` reads records in C (``_speedups.read_records``) a chunk at a time and
in Python from the first record the C reader does not take: the two give the same
records and, for records that do not parse, the same error at the same place, on
generated record sections (keys, values, headers, large deltas, thousands of records)
and on their mutants."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse.codecs import records
from gatehouse.codecs.errors import RemoteProtocolError
from gatehouse.codecs.primitives import varint_bytes
from tests.codec_strategies import examples
from tests.support.mutants import mutant


def record_bytes(timestamp_delta: int, offset_delta: int, key: bytes | None,
                 value: bytes | None, headers: list[tuple[bytes | None, bytes | None]]
                 ) -> bytes:
    def field(data: bytes | None) -> bytes:
        return varint_bytes(-1) if data is None else varint_bytes(len(data)) + data

    body = (b"\x00" + varint_bytes(timestamp_delta) + varint_bytes(offset_delta)
            + field(key) + field(value) + varint_bytes(len(headers))
            + b"".join(field(name) + field(data) for name, data in headers))
    return varint_bytes(len(body)) + body


def outcome(data: bytes, count: int) -> tuple[list[Any], tuple[str, int] | None]:
    """The records read (as plain tuples) and the error that ended the reading."""
    read: list[Any] = []
    try:
        for record in records.iter_records(data, count):
            assert type(record) is records.Record
            read.append(tuple(record))
    except RemoteProtocolError as exc:
        return read, (str(exc), exc.offset)
    return read, None


def both(data: bytes, count: int) -> tuple[Any, Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(records, "_C_READ_RECORDS", None)
        python = outcome(data, count)
    return outcome(data, count), python


def test_the_c_reader_is_built() -> None:
    assert records._C_READ_RECORDS is not None


names = st.one_of(st.none(), st.text(max_size=6).map(str.encode),
                  st.binary(max_size=4))  # not always UTF-8
a_record = st.builds(
    record_bytes, st.integers(-(2**63), 2**63 - 1), st.integers(-(2**31), 2**31 - 1),
    st.one_of(st.none(), st.binary(max_size=20)),
    st.one_of(st.none(), st.binary(max_size=300)),
    st.lists(st.tuples(names, st.one_of(st.none(), st.binary(max_size=8))), max_size=3))


@settings(max_examples=examples(400), deadline=None)
@given(parts=st.lists(a_record, max_size=12), extra=st.integers(-2, 2), data=st.data())
def test_the_same_records_and_errors(parts: list[bytes], extra: int,
                                     data: st.DataObject) -> None:
    section = b"".join(parts)
    count = max(len(parts) + extra, 0)
    c, python = both(section, count)
    assert c == python
    # Mutants: a byte changed, some inserted, the end cut.
    c, python = both(mutant(data, section), len(parts))
    assert c == python


def test_many_records_a_chunk_at_a_time() -> None:
    """More records than a chunk; a bad one after several chunks: the records before it
    read, then its error, as the Python reader has them."""
    good = [record_bytes(i, i, b"k%d" % i, b"v" * (i % 50), [(b"h", b"%d" % i)])
            for i in range(1000)]
    c, python = both(b"".join(good), 1000)
    assert c == python and c[1] is None and len(c[0]) == 1000
    assert c[0][777] == (777, b"k777", b"v" * 27, (("h", b"777"),))
    bad = [*good[:600], record_bytes(0, 0, None, b"x", [(b"\xff", None)]), *good[600:]]
    c, python = both(b"".join(bad), 1001)
    assert c == python and len(c[0]) == 600
    assert c[1] is not None and c[1][0].startswith("record 600: a header key that is not UTF-8")
