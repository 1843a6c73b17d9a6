"""The decoders' fast paths give what the plain field-by-field decoder gives.

- Arrays of flat structs are read in bulk (``gatehouse.codecs._flat``): Metadata
  partitions and the like, by one ``Struct.iter_unpack`` per array when every element
  has the layout of the first, falling back whenever an element differs.
- Fixed fields around an array that is nearly always empty (Fetch's aborted
  transactions) are read by one unpack while the array is empty.

Both must give the very records the plain decoder gives (same values, same types) and
leave every error (class, reason, path, offset) as it was.  The reference is the same
message compiled with ``fast_paths=False``.
"""

from __future__ import annotations

import random
import re
import struct
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.codecs import _flat
from gatehouse.codecs._compile import MessageCodec, _Compiler, generated_source, message_codec
from gatehouse.codecs.schema import MessageSpec, StructSpec
from tests.codec_strategies import (
    ALL_CASES,
    case_id,
    exact,
    message_spec,
    random_scalar,
    random_struct,
)


def _flat_structs(message: MessageSpec, version: int) -> set[str]:
    compiler = _Compiler(message, version)
    compiler.collect(message.root)
    return set(compiler.flat)


def _has_fast_paths(message: MessageSpec, version: int) -> bool:
    compiler = _Compiler(message, version)
    compiler.compile()
    return bool(compiler.flat or compiler.speculated)


FAST_CASES = [case for case in ALL_CASES if _has_fast_paths(message_spec(case[0], case[2]), case[1])]


def _uniform_struct(struct: StructSpec, version: int, flexible: bool, rng: random.Random,
                    flat: set[str], depth: int = 0) -> Any:
    """A record like ``random_struct``'s, whose arrays of flat structs hold runs of
    elements of one layout (and, now and then, one element that breaks the run)."""
    values: list[Any] = []
    for f in struct.fields:
        if version not in f.versions:
            values.append(f.default)
        elif f.is_array and f.struct is not None and f.struct.name in flat:
            values.append(_flat_run(f.struct, version, flexible, rng))
        elif f.struct is not None and not f.tagged_in(version) and not f.is_array:
            values.append(_uniform_struct(f.struct, version, flexible, rng, flat, depth + 1))
        elif f.is_array and f.struct is not None and depth < 2:
            values.append(tuple(_uniform_struct(f.struct, version, flexible, rng, flat, depth + 1)
                                for _ in range(rng.randint(0, 3))))
        else:
            values.append(random_struct(struct, version, flexible, rng, depth)[struct.fields.index(f)])
    return struct.cls(*values, ())


def _flat_element(struct: StructSpec, version: int, rng: random.Random,
                  lengths: dict[str, int]) -> Any:
    values: list[Any] = []
    for f in struct.fields:
        if version not in f.versions or f.tagged_in(version):
            values.append(f.default)
        elif f.is_array:
            values.append(tuple(random_scalar(f.type, rng) for _ in range(lengths[f.name])))
        else:
            values.append(random_scalar(f.type, rng))
    return struct.cls(*values, ())


def _flat_run(struct: StructSpec, version: int, flexible: bool, rng: random.Random) -> tuple[Any, ...]:
    arrays = [f for f in struct.fields if f.is_array and version in f.versions]
    # Mostly short arrays; sometimes 126 (the longest one-byte compact length) or 127.
    lengths = {f.name: rng.choice((0, 1, 3, 3, 5, 126, 127)) for f in arrays}
    items = [_flat_element(struct, version, rng, lengths) for _ in range(rng.randint(3, 9))]
    if rng.random() < 0.4:  # one element that is not like the others
        items[rng.randrange(len(items))] = random_struct(struct, version, flexible, rng, 3)
    return tuple(items)


def _outcome(codec: MessageCodec, frame: bytes) -> Any:
    try:
        body, end, spans = codec.decode(memoryview(frame))
    except codecs.ProtocolError as exc:
        return (type(exc), exc.reason, exc.path, exc.offset)
    return (exact(body), end, spans)


def random_frame(codec: MessageCodec, rng: random.Random, uniform: bool) -> tuple[Any, bytes]:
    """A random body of the codec's message and its bytes: with ``uniform``, the arrays of
    bulk-read structs hold runs of one layout; without, arrays of 0-3 of anything."""
    message, version = codec.message, codec.version
    flexible = message.is_flexible(version)
    if uniform:
        body = _uniform_struct(message.root, version, flexible, rng, _flat_structs(message, version))
    else:
        body = random_struct(message.root, version, flexible, rng)
    out = bytearray()
    codec.encode(out, body)
    return body, bytes(out)


@pytest.mark.parametrize(("api_key", "version", "direction"), FAST_CASES,
                         ids=[case_id(c) for c in FAST_CASES])
def test_fast_paths_give_the_records_and_errors_of_the_plain_decoder(
        api_key: int, version: int, direction: str) -> None:
    message = message_spec(api_key, direction)
    fast = message_codec(message, version)
    plain = _Compiler(message, version, fast_paths=False).compile()
    rng = random.Random(f"{api_key}/{version}/{direction}")
    for i in range(12):
        body, frame = random_frame(fast, rng, uniform=i % 3 != 2)
        decoded, end, _ = fast.decode(memoryview(frame))
        assert decoded == body and end == len(frame)
        assert _outcome(fast, frame) == _outcome(plain, frame)
        # Broken frames: cut short, or one byte changed.
        for _ in range(8):
            cut = frame[:rng.randrange(len(frame))] if frame else frame
            assert _outcome(fast, cut) == _outcome(plain, cut)
            if frame:
                at = rng.randrange(len(frame))
                mutated = frame[:at] + bytes((rng.randrange(256),)) + frame[at + 1:]
                assert _outcome(fast, mutated) == _outcome(plain, mutated)


def _struct_of(struct: StructSpec, field: str) -> StructSpec:
    sub = next(f for f in struct.fields if f.name == field).struct
    assert sub is not None
    return sub


def _metadata_response(isr: list[int], version: int) -> bytes:
    """A Metadata response with one topic whose partitions have these ISR sizes."""
    partition = _struct_of(_struct_of(codecs.APIS[3].response.root, "Topics"), "Partitions")
    present = {f.attr for f in partition.fields if version in f.versions}
    partitions = [
        {k: v for k, v in {"error_code": 0, "partition_index": p, "leader_id": 1, "leader_epoch": 5,
                           "replica_nodes": [1, 2, 3], "isr_nodes": list(range(1, n + 1)),
                           "offline_replicas": []}.items() if k in present}
        for p, n in enumerate(isr)
    ]
    body = {"brokers": [], "topics": [{"error_code": 0, "name": "t", "partitions": partitions}]}
    resp = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                     api_key=3, api_version=version)
    return bytes(resp.encode())


@pytest.mark.parametrize("version", [1, 7, 12, 13])
def test_metadata_partitions_of_one_layout_are_read_in_bulk(
        version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = message_codec(codecs.APIS[3].response, version)
    name = "b_MetadataResponsePartition"
    bulk = codec.functions[name]
    results: list[Any] = []

    def recording(buf: memoryview, pos: int, n: int) -> Any:
        results.append(bulk(buf, pos, n))
        return results[-1]

    monkeypatch.setitem(codec.functions, name, recording)  # the decoder looks it up there

    def decode(frame: bytes) -> Any:  # the Python decoder (decode_response may run C's)
        body_at = codecs.decode_response(frame, 3, version)._body_offset
        return codec.decode(memoryview(frame)[body_at:])[0]

    partitions = decode(_metadata_response([3] * 50, version)).topics[0].partitions
    assert results and results[0] is not None and results[0][0] is partitions
    assert [p.isr_nodes for p in partitions] == [(1, 2, 3)] * 50
    assert partitions[7].partition_index == 7
    assert partitions[7].leader_epoch == (5 if version >= 7 else -1)  # the default before v7
    # One shrunk ISR breaks the run: the bulk reader says so, the decoder still reads it.
    results.clear()
    mixed = decode(_metadata_response([3] * 20 + [2] + [3] * 29, version))
    assert [len(p.isr_nodes) for p in mixed.topics[0].partitions] == [3] * 20 + [2] + [3] * 29
    assert results == [None]


@pytest.mark.parametrize("probed", [True, False], ids=["one-unpack", "strided"])
def test_bulk_reader_refuses_what_it_cannot_prove(probed: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The same proofs whether the length bytes of all elements are read with one Struct
    (arrays up to MAX_PROBE_ELEMENTS) or compared in strided slices (longer ones)."""
    if not probed:
        monkeypatch.setattr(_flat, "MAX_PROBE_ELEMENTS", 2)
    codec = _Compiler(codecs.APIS[3].response, 13).compile()  # shapes and probes of its own
    bulk = codec.functions["b_MetadataResponsePartition"]
    element = struct.pack(">hiii", 0, 1, 2, 3) + b"\x02\x00\x00\x00\x01" * 2 + b"\x01" + b"\x00"
    assert bulk(memoryview(element * 4), 0, 4) is not None
    assert bulk(memoryview(element * 3), 0, 4) is None  # the buffer ends early
    tagged = element[:-1] + b"\x01\x05\x00"  # a tagged field in the last element
    assert bulk(memoryview(element * 3 + tagged), 0, 4) is None
    null = element[:14] + b"\x00" + element[19:]  # null replicas (not nullable: an error)
    assert bulk(memoryview(null * 4), 0, 4) is None
    # The third element of the same size, in another layout: two replicas, an empty ISR.
    shifted = element[:14] + b"\x03" + b"\x00\x00\x00\x01" * 2 + b"\x01" + b"\x01" + b"\x00"
    assert len(shifted) == len(element)
    assert bulk(memoryview(element * 2 + shifted + element), 0, 4) is None
    checks = bulk(memoryview(element * 4), 0, 4)[0]._shape[2]
    assert (4 in checks) == probed  # the probe made for 4 elements is kept
    with pytest.raises(codecs.RemoteProtocolError) as info:
        codec.decode(memoryview(b"\x00" * 4 + b"\x01" + b"\x00" + b"\x00" * 4
                                + b"\x02" + b"\x00\x00\x02t" + bytes(16) + b"\x00"
                                + b"\x05" + element * 3 + null + b"\x00" * 6))
    assert info.value.path == ("Topics", "Partitions", "ReplicaNodes")



def test_layouts_past_the_cache_limit_are_read_element_by_element(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames made to have a new layout in every array cannot make the codec build (and
    keep) a Struct per array: past MAX_SHAPES layouts, arrays are decoded one by one."""
    codec = _Compiler(codecs.APIS[3].response, 13).compile()  # a cache of its own
    bulk = codec.functions["b_MetadataResponsePartition"]
    monkeypatch.setattr(_flat, "MAX_SHAPES", 2)
    for isr in (3, 2, 1):
        frame = _metadata_response([isr] * 5, 13)
        resp = codecs.decode_response(frame, 3, 13)
        body, _, _ = codec.decode(memoryview(frame)[resp._body_offset:])
        assert body == resp.body and [len(p.isr_nodes) for p in body.topics[0].partitions] == [isr] * 5
        first = frame.index(b"\x06\x00\x00", resp._body_offset)  # 5 partitions, the first's error code
        assert (bulk(memoryview(frame), first + 1, 5) is None) == (isr == 1)


def _fetch_response(version: int, records: list[bytes | None], aborted: list[Any] | None) -> bytes:
    """A Fetch response with one partition per entry of ``records``; every partition has
    the ``aborted`` transactions (None: null, [] : empty)."""
    topic: dict[str, Any] = {"topic_id": "00000000-0000-0000-0000-00000000abcd"} if version >= 13 \
        else {"topic": "t"}
    topic["partitions"] = [
        {"partition_index": p, "error_code": 0, "high_watermark": 10, "last_stable_offset": 10,
         "log_start_offset": 0, "aborted_transactions": aborted, "preferred_read_replica": -1,
         "records": r}
        for p, r in enumerate(records)
    ]
    resp = codecs.response_from_dict({"header": {"correlation_id": 1},
                                      "body": {"responses": [topic]}}, api_key=1, api_version=version)
    return bytes(resp.encode())


# Record set sizes at every varint length boundary: 1, 2, 3 and 4 bytes (the last read by
# the general varint reader), and null.
_RECORD_SIZES: list[int | None] = [None, 0, 1, 126, 127, 16382, 16383, 2_097_150, 2_097_151]


@pytest.mark.parametrize("version", [12, 16, 18])
@pytest.mark.parametrize("aborted", [[], None, [{"producer_id": 7, "first_offset": 3}]],
                         ids=["empty", "null", "one"])
def test_fetch_records_lengths_read_ahead_by_the_speculative_unpack(
        version: int, aborted: list[Any] | None) -> None:
    """Fetch's partitions read the records' length with the fixed fields before it (while
    the aborted transactions are empty or null); every length size, the other branches and
    every cut through the lengths decode as the plain decoder does."""
    fast = message_codec(codecs.APIS[1].response, version)
    plain = _Compiler(codecs.APIS[1].response, version, fast_paths=False).compile()
    source = generated_source(codecs.APIS[1].response, version)
    assert re.search(r"c\d+, c\d+_1, c\d+_2, = ", source)  # the read-ahead is there
    records = [None if n is None else bytes(range(256)) * (n // 256) + bytes(n % 256)
               for n in _RECORD_SIZES]
    frame = _fetch_response(version, records, aborted)
    body = codecs.decode_response(frame, 1, version)._body_offset
    view = memoryview(frame)[body:]
    decoded, end, _ = fast.decode(view)
    assert end == len(view)
    got = [None if p.records is None else len(p.records) for p in decoded.responses[0].partitions]
    assert got == _RECORD_SIZES
    assert _outcome(fast, frame[body:]) == _outcome(plain, frame[body:])
    # Cuts anywhere in the first partitions (fixed fields, aborted array, records length),
    # where the read-ahead reaches past the end of the frame.
    for cut in range(1, 200):
        assert _outcome(fast, frame[body:body + cut]) == _outcome(plain, frame[body:body + cut])
    # The last partition (2 MiB of records) cut in its length and just after it.
    last = frame.rindex(b"\x80\x80\x80\x01") - body  # its length: 2_097_152 (size + 1)
    for cut in range(last - 40, last + 6):
        assert _outcome(fast, frame[body:body + cut]) == _outcome(plain, frame[body:body + cut])
