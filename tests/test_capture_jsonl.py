"""The observation log's JSON lines from C (gatehouse/capture/_jsonl.c) are the json
module's bytes, for capture records and for any tree the json encoder takes."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse.capture import schema
from gatehouse.capture.schema import FIELDS, encode_json

jsonl = schema.jsonl


def test_built_here() -> None:
    # The image and `make test` build it (setup.py); the Python path is tested with
    # GATEHOUSE_PURE_PYTHON in tests/test_speedups.py.
    assert jsonl is not None


def _python_lines(records: list[Any]) -> bytes:
    return "".join([encode_json(r) + "\n" for r in records]).encode()


class Text(str):
    pass


class Number(int):
    pass


_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e16, 1e-5, 1.0]),
    st.text(), st.text(alphabet=st.characters(max_codepoint=0x7F)),
    st.sampled_from(["\ud800", "\U0001f600", '"\\', "\x7f\x00\x1f", "é"]),
)
_trees = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=30,
)
# What only the fallback writes: the record goes to json whole, so still its bytes.
_others = st.one_of(
    st.builds(Text, st.text(max_size=4)), st.builds(Number, st.integers()),
    st.dictionaries(st.one_of(st.integers(), st.booleans(), st.none(), st.floats()),
                    st.integers(), min_size=1, max_size=3),
)


@given(st.lists(st.one_of(_trees, st.dictionaries(st.text(max_size=5),
                                                     st.one_of(_trees, _others)))))
@settings(max_examples=400)
def test_the_same_bytes_as_json(records: list[Any]) -> None:
    assert jsonl.encode_lines(records, encode_json) == _python_lines(records)
    for record in records:
        assert jsonl.encode_record(record, encode_json) == encode_json(record).encode()


@given(st.fixed_dictionaries({
    name: (st.none() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text()
           | st.lists(st.integers(-(2**31), 2**31)) | st.lists(st.fixed_dictionaries({
               "name": st.text() | st.none(), "broker": st.text() | st.none(),
               "id": st.uuids().map(str) | st.none(),
               "partitions": st.lists(st.integers(0, 2**31 - 1)),
               "records": st.integers(0, 2**40) | st.none(),
               "bytes": st.integers(0, 2**40) | st.none()})))
    for name, _ in FIELDS}))
def test_capture_records(record: dict[str, Any]) -> None:
    assert jsonl.encode_lines([record, record], encode_json) == _python_lines([record, record])
    assert json.loads(jsonl.encode_record(record, encode_json)) == json.loads(encode_json(record)) \
        or any(isinstance(v, float) and math.isnan(v) for v in record.values())


def test_what_the_fallback_writes() -> None:
    seen: list[Any] = []

    def fallback(record: Any) -> str:
        seen.append(record)
        return encode_json(record)

    plain, odd, deep = {"a": [1, 2.5, None]}, {"a": Text("x")}, [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]
    assert jsonl.encode_lines([plain, odd, deep, {1: 2}], fallback) == _python_lines(
        [plain, odd, deep, {1: 2}])
    assert seen == [odd, deep, {1: 2}]  # the plain one was written in C


def test_errors_are_the_json_modules() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        jsonl.encode_lines([{"a": object()}], encode_json)
    with pytest.raises(TypeError, match="not str"):
        jsonl.encode_lines([{"a": object()}], lambda record: b"bytes")
    with pytest.raises(TypeError):
        jsonl.encode_lines(({"a": 1},), encode_json)  # a list of records


def test_the_writer_writes_them(tmp_path: Any) -> None:
    from gatehouse.capture.settings import CaptureSettings
    from gatehouse.capture.writer import CaptureWriter

    writer = CaptureWriter(CaptureSettings(dir=tmp_path, instance="t"))
    records = [{"v": 1, "client": "é\n", "n": i, "t": i / 3} for i in range(100)]
    for record in records:
        assert writer.offer(dict(record))
    assert writer.close()
    [path] = tmp_path.glob("*.jsonl")
    assert path.read_bytes() == _python_lines(records)
