"""Arrays of number-only structs decoded lazily (``codecs.FlatRecords``).

The generated Python decoder checks a Metadata response's partitions at decode and
keeps them as their bytes; these tests hold that the lazy array is, for every reader,
the tuple an eager decode gives, that re-encoding writes its bytes back only where they
mean the same thing, and that the metrics read its error codes without building records.
(The C decoder builds the records at once into the same FlatRecords: tests/
test_codec_native.py; here it is turned off, ``python_decoder``.)
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import _flat
from gatehouse.codecs._compile import message_codec
from gatehouse.metrics import error_codes
from tests.codec_strategies import examples

METADATA = 3


@pytest.fixture(autouse=True)
def python_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata responses decoded by the generated Python decoder (lazy partitions)."""
    for version in codecs.api(METADATA).response.valid:
        monkeypatch.setattr(message_codec(codecs.api(METADATA).response, version), "decode_native", None)


def _partition(index: int, error: int = 0, replicas: int = 3) -> dict[str, Any]:
    return {"error_code": error, "partition_index": index, "leader_id": index % 3,
            "leader_epoch": 5 + index, "replica_nodes": [(index + i) % 5 for i in range(replicas)],
            "isr_nodes": [(index + i) % 5 for i in range(replicas)], "offline_replicas": []}


def _metadata(version: int, partitions: list[dict[str, Any]], name: str = "orders") -> bytes:
    topic: dict[str, Any] = {"error_code": 0, "name": name, "is_internal": False,
                             "partitions": partitions}
    if version >= 10:
        topic["topic_id"] = "6ba7b810-9dad-11d1-80b4-00c04fd430c8"
    if version >= 8:
        topic["topic_authorized_operations"] = -2147483648
    body: dict[str, Any] = {"brokers": [{"node_id": 0, "host": "b0", "port": 9092, "rack": None}],
                            "controller_id": 0, "topics": [topic]}
    if version >= 2:
        body["cluster_id"] = "c"
    if version >= 3:
        body["throttle_time_ms"] = 0
    if version >= 8 and version <= 10:
        body["cluster_authorized_operations"] = -2147483648
    if version >= 13:
        body["error_code"] = 0
    plain = {"header": {"correlation_id": 7}, "body": body}
    resp = codecs.response_from_dict(plain, api_key=METADATA, api_version=version)
    return bytes(codecs.encode_response(resp))


def _decoded_partitions(frame: bytes, version: int) -> Any:
    return codecs.decode_response(frame, METADATA, version).body.topics[0].partitions


def _eager(frame: bytes, version: int) -> tuple[Any, ...]:
    """The partitions as tuples of records, through plain data (no lazy array)."""
    plain = codecs.to_dict(codecs.decode_response(frame, METADATA, version))
    resp = codecs.response_from_dict(plain, api_key=METADATA, api_version=version)
    partitions = resp.body.topics[0].partitions
    assert type(partitions) is tuple
    return partitions


def test_a_flat_array_reads_as_the_tuple_of_its_records() -> None:
    version = codecs.APIS[METADATA].versions.hi
    frame = _metadata(version, [_partition(i, error=3 if i == 2 else 0) for i in range(6)])
    lazy = _decoded_partitions(frame, version)
    eager = _eager(frame, version)
    assert type(lazy) is codecs.FlatRecords
    assert lazy == eager and eager == lazy
    assert not lazy != eager  # noqa: SIM202 (__ne__ is its own method)
    assert lazy == _decoded_partitions(frame, version)  # two lazy arrays
    assert lazy != eager[:-1] and lazy != list(eager)  # a list is not a tuple
    assert hash(lazy) == hash(eager)
    assert len(lazy) == 6 and bool(lazy)
    assert lazy[2].error_code == 3 and lazy[-1] == eager[-1] and lazy[1:3] == eager[1:3]
    assert list(lazy) == list(eager) and list(reversed(lazy)) == list(reversed(eager))
    assert eager[4] in lazy and lazy.index(eager[4]) == 4 and lazy.count(eager[0]) == 1
    assert lazy + eager[:1] == (*eager, eager[0]) and eager[:1] + lazy == (eager[0], *eager)
    assert repr(lazy) == repr(eager)
    assert lazy[0].replica_nodes == (0, 1, 2) and type(lazy[0].replica_nodes) is tuple
    for copied in (copy.deepcopy(lazy), copy.copy(lazy)):
        assert type(copied) is tuple and copied == eager


def test_a_column_is_read_without_building_records() -> None:
    version = codecs.APIS[METADATA].versions.hi
    frame = _metadata(version, [_partition(i, error=i % 4, replicas=2) for i in range(9)])
    lazy = _decoded_partitions(frame, version)
    assert lazy.column("error_code") == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert lazy.column("isr_nodes") == [p.isr_nodes for p in _eager(frame, version)]
    assert lazy._items is None  # still bytes


def test_a_column_absent_from_the_version_is_its_default() -> None:
    partitions = [_partition(i) for i in range(4)]
    for p in partitions:
        del p["leader_epoch"]  # not in v5 (from v7)
    frame = _metadata(5, partitions)
    lazy = _decoded_partitions(frame, 5)
    assert type(lazy) is codecs.FlatRecords
    assert lazy.column("leader_epoch") == [-1] * 4
    assert [p.leader_epoch for p in lazy] == [-1] * 4


def test_an_undecoded_array_is_written_back_as_its_bytes() -> None:
    version = codecs.APIS[METADATA].versions.hi
    frame = _metadata(version, [_partition(i) for i in range(5)])
    resp = codecs.decode_response(frame, METADATA, version)
    topic = resp.body.topics[0]
    renamed = resp.body.replace(topics=(topic.replace(name="orders.v2"),))
    out = codecs.Response.build(METADATA, version, 7, renamed).encode()
    assert topic.partitions._items is None  # copied, not built
    assert bytes(out) == _metadata(version, [_partition(i) for i in range(5)], name="orders.v2")


def test_lazy_partitions_encode_in_another_version_field_by_field() -> None:
    # v9 is flexible (compact arrays, tagged fields), v8 is not: the bytes of one are not
    # the other's, so the encoder builds the records and writes them.
    frame9 = _metadata(9, [_partition(i) for i in range(4)])
    lazy = _decoded_partitions(frame9, 9)
    assert type(lazy) is codecs.FlatRecords
    frame8 = _metadata(8, [_partition(i) for i in range(4)])
    body8 = codecs.decode_response(frame8, METADATA, 8).body
    moved = body8.replace(topics=(body8.topics[0].replace(partitions=lazy),))
    assert bytes(codecs.Response.build(METADATA, 8, 7, moved).encode()) == frame8


def test_metrics_count_partition_errors_from_the_bytes() -> None:
    version = codecs.APIS[METADATA].versions.hi
    errors = [0, 0, 5, 0, 6, 0, 5]
    frame = _metadata(version, [_partition(i, error=e) for i, e in enumerate(errors)])
    resp = codecs.decode_response(frame, METADATA, version)
    codes = error_codes(resp)
    assert sorted(codes) == sorted([0, *errors, 0])  # the response's, the topic's, the partitions'
    assert resp.body.topics[0].partitions._items is None


_VERSIONS = [v for v in codecs.api(METADATA).response.valid if v >= 7]  # what _metadata writes


@settings(max_examples=examples(150), deadline=None)
@given(st.sampled_from(_VERSIONS), st.integers(3, 40), st.integers(0, 6),
       st.integers(-(2**31), 2**31 - 1), st.integers(-(2**15), 2**15 - 1))
def test_records_built_in_c_are_the_python_ones(version: int, n: int, replicas: int,
                                                 big: int, error: int) -> None:
    partitions = [{**_partition(i, replicas=replicas), "leader_epoch": big if i % 2 else -big - 1,
                   "error_code": error, "offline_replicas": [big] * (replicas % 3)}
                  for i in range(n)]
    frame = _metadata(version, partitions)
    lazy = _decoded_partitions(frame, version)
    assert isinstance(lazy, codecs.FlatRecords)
    in_c = lazy.records()
    python = codecs.decode_response(frame, METADATA, version).body.topics[0].partitions
    _flat._C_FLAT_RECORDS, saved = None, _flat._C_FLAT_RECORDS
    try:
        in_python = python.records()
    finally:
        _flat._C_FLAT_RECORDS = saved
    assert in_c == in_python == _eager(frame, version)
    assert [type(r) for r in in_c] == [type(r) for r in in_python]
    assert [tuple(map(type, r)) for r in in_c] == [tuple(map(type, r)) for r in in_python]
    # Numbers and tuples of numbers only: out of the cyclic collector's lists.
    assert not any(gc.is_tracked(r) for r in in_c) or saved is None


def test_the_c_builder_refuses_a_plan_that_does_not_fit() -> None:
    if _flat._C_FLAT_RECORDS is None:
        return  # not built: the Python builder runs (tests/test_speedups.py)
    frame = _metadata(12, [_partition(i) for i in range(4)])
    lazy = _decoded_partitions(frame, 12)
    _, size, checks, _, _ = lazy._shape
    cls = lazy.kind[0]
    with pytest.raises(ValueError):
        _flat._C_FLAT_RECORDS(lazy.raw, 4, size + 1, checks.plan, True, cls)
    with pytest.raises(ValueError):
        _flat._C_FLAT_RECORDS(lazy.raw, 5, size, checks.plan, True, cls)
    with pytest.raises(ValueError):
        _flat._C_FLAT_RECORDS(lazy.raw, 4, size, ((7, "x"),), True, cls)
