"""The C decoder (gatehouse/codecs/_decoder.c) against the generated Python decoders.

For every message, version and direction: random bodies (arrays of every length the
bulk readers care about, null and unknown tagged fields), encoded, then cut short and
mutated byte by byte.  Where the Python decoder reads a frame, the C decoder must give the
same records (values and types, every array's elements), the same end and the same spans;
where the Python decoder refuses it, the C decoder must answer None (the caller then asks
the Python decoder, which raises the error).
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.codecs import _native, consumer
from gatehouse.codecs._compile import MessageCodec, _Compiler, message_codec, new_output
from tests.codec_strategies import ALL_CASES, case_id, exact, message_spec
from tests.reliability.fuzz_codec import mutate
from tests.test_codec_fast_paths import _metadata_response, random_frame

ROOT = Path(__file__).resolve().parents[1]


def test_the_c_decoder_is_built_and_used() -> None:
    assert _native.decoder is not None
    codec = message_codec(codecs.APIS[3].response, 13)
    assert codec.decode_native is not None
    # The plain decoder the fast paths are compared with has none.
    assert _Compiler(codecs.APIS[3].response, 13, fast_paths=False).compile().decode_native is None


def _python(codec: MessageCodec, frame: bytes) -> Any:
    try:
        body, end, spans = codec.decode(memoryview(frame))
    except codecs.ProtocolError:
        return None
    return (exact(body), end, spans)


def _native_outcome(codec: MessageCodec, frame: bytes) -> Any:
    assert codec.decode_native is not None
    decoded = codec.decode_native(memoryview(frame))
    if decoded is None:
        return None
    body, end, spans = decoded
    return (exact(body), end, spans)


# Every request and response, and the consumer protocol's payloads.
CASES = [(message_spec(key, direction), version) for key, version, direction in ALL_CASES] + [
    (spec, version) for spec in (consumer.SUBSCRIPTION, consumer.ASSIGNMENT) for version in spec.valid]
IDS = [case_id(case) for case in ALL_CASES] + [f"{spec.name}-v{version}"
                                               for spec, version in CASES[len(ALL_CASES):]]


@pytest.mark.parametrize(("message", "version"), CASES, ids=IDS)
def test_the_c_decoder_reads_what_the_python_decoder_reads(
        message: codecs.MessageSpec, version: int) -> None:
    codec = message_codec(message, version)
    rng = random.Random(f"native/{message.name}/{version}")
    for i in range(6):
        _, frame = random_frame(codec, rng, uniform=i % 2 == 0)
        expected = _python(codec, frame)
        assert expected is not None and expected[1] == len(frame)
        assert _native_outcome(codec, frame) == expected
        for _ in range(10):
            cut = frame[:rng.randrange(len(frame))] if frame else frame
            assert _native_outcome(codec, cut) == _python(codec, cut)
            broken = mutate(frame, rng)
            assert _native_outcome(codec, broken) == _python(codec, broken)


def _metadata_body(frame: bytes) -> tuple[MessageCodec, memoryview]:
    resp = codecs.decode_response(frame, 3, 13)
    return message_codec(codecs.APIS[3].response, 13), memoryview(frame)[resp._body_offset:]


def test_bulk_read_arrays_are_flat_records_with_their_records_built() -> None:
    """Metadata's partitions: a FlatRecords (so an unchanged array is written back as its
    bytes) whose records the C decoder has built, even where their layouts differ."""
    frame = _metadata_response([3] * 20 + [2] + [3] * 9, 13)
    codec, view = _metadata_body(frame)
    assert codec.decode_native is not None
    decoded = codec.decode_native(view)
    assert decoded is not None
    partitions = decoded[0].topics[0].partitions
    assert type(partitions) is codecs.FlatRecords and partitions._items is not None
    assert [len(p.isr_nodes) for p in partitions] == [3] * 20 + [2] + [3] * 9
    assert partitions == codec.decode(view)[0].topics[0].partitions
    assert partitions.column("isr_nodes")[20] == (1, 2)
    # Written back: the array's own bytes, and the frame as it was.
    assert bytes(partitions.raw) in frame
    out = bytearray()
    codec.encode(out, decoded[0])
    assert bytes(out) == bytes(view)


def test_what_the_c_decoder_makes_is_left_out_of_the_collector() -> None:
    frame = _metadata_response([3] * 5, 13)
    resp = codecs.decode_response(frame, 3, 13)
    body = resp.body
    topic = body.topics[0]
    assert topic.topic_id is not None
    for obj in (body, body.brokers, body.topics, topic, topic.partitions, topic.partitions[0],
                topic.partitions[0].replica_nodes):
        assert not gc.is_tracked(obj), obj
    # A UUID made in C is a real one.
    made = _native_uuid(uuid.UUID("12345678-9abc-def0-1234-56789abcdef0"))
    assert made == uuid.UUID("12345678-9abc-def0-1234-56789abcdef0") and not gc.is_tracked(made)
    assert str(made) == "12345678-9abc-def0-1234-56789abcdef0" and made.is_safe is uuid.SafeUUID.unknown
    assert _native_uuid(uuid.UUID(int=0)) is codecs.schema.ZERO_UUID


def _native_uuid(value: uuid.UUID) -> uuid.UUID:
    """A topic id read by the C decoder (a Metadata v13 response with one topic)."""
    body = {"brokers": [], "topics": [{"error_code": 0, "name": "t", "topic_id": str(value),
                                       "partitions": []}]}
    frame = bytes(codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                            api_key=3, api_version=13).encode())
    codec, view = _metadata_body(frame)
    assert codec.decode_native is not None
    decoded = codec.decode_native(view)
    assert decoded is not None
    made: uuid.UUID = decoded[0].topics[0].topic_id
    return made


def test_decoding_leaks_nothing_on_good_and_bad_frames() -> None:
    frame = _metadata_response([3] * 40, 13)
    codec, view = _metadata_body(frame)
    assert codec.decode_native is not None
    data = bytes(view)
    rng = random.Random(7)
    broken = [mutate(data, rng) for _ in range(200)]

    def run() -> None:
        for _ in range(20):
            codec.decode_native(memoryview(data))
        for b in broken:
            codec.decode_native(memoryview(b))

    # 20 x (20 decodes of 40 partitions + 200 broken frames): a leaked record or tuple
    # per decode would be tens of KiB.
    grown = _grown(run, 20)
    assert grown < 16 * 1024, grown


def _grown(run: Callable[[], None], times: int) -> int:
    """Bytes still allocated after ``times`` calls of ``run`` (after one to warm caches)."""
    run()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(times):
            run()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_gatehouse_pure_python_turns_the_c_decoder_off() -> None:
    code = ("from gatehouse.codecs import _native\n"
            "from gatehouse.codecs._compile import message_codec\n"
            "from gatehouse import codecs\n"
            "assert _native.decoder is None\n"
            "assert message_codec(codecs.APIS[3].response, 13).decode_native is None\n")
    env = {**os.environ, "GATEHOUSE_PURE_PYTHON": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


# ApiVersions response v3: no api keys, then a tag section: FinalizedFeaturesEpoch (tag 1,
# an int64) = 5 and two unknown tags, 7 and 9.
_API_VERSIONS = bytes.fromhex("0000" "01" "00000000" "03" "0108" "0000000000000005"
                              "0701" "78" "0902" "797a")
# ConsumerGroupHeartbeat response v0 with no assignment (its marker is the last byte but one).
_HEARTBEAT = bytes.fromhex("00000000" "0000" "00" "00" "00000000" "00000000" "ff" "00")


@pytest.mark.parametrize(("api_key", "version", "frame", "reads"), [
    (18, 3, _API_VERSIONS, True),
    (18, 3, _API_VERSIONS.replace(bytes.fromhex("0701780902797a"), bytes.fromhex("0902797a070178")),
     False),  # tags out of order
    (18, 3, _API_VERSIONS.replace(bytes.fromhex("0902797a"), bytes.fromhex("0702797a")),
     False),  # a tag twice
    (18, 3, _API_VERSIONS.replace(bytes.fromhex("0108" "0000000000000005"),
                                  bytes.fromhex("0109" "000000000000000500")),
     False),  # a known tag's value shorter than its size
    (18, 3, _API_VERSIONS.replace(bytes.fromhex("0108" "0000000000000005"),
                                  bytes.fromhex("0107" "00000000000005")),
     False),  # ... and longer
    (18, 3, _API_VERSIONS[:-1], False),
    (68, 0, _HEARTBEAT, True),
    (68, 0, _HEARTBEAT[:-2] + b"\x80\x00", True),  # any negative marker is null
    (68, 0, _HEARTBEAT[:-2] + b"\x01\x00", False),  # present, but no bytes for it
    (68, 0, _HEARTBEAT[:-2], False),
], ids=["tags", "tags-out-of-order", "tag-twice", "tag-value-short", "tag-value-long", "cut",
        "null-struct", "null-struct-0x80", "struct-missing", "struct-cut"])
def test_edges_the_random_frames_seldom_reach(api_key: int, version: int, frame: bytes,
                                              reads: bool) -> None:
    codec = message_codec(codecs.APIS[api_key].response, version)
    expected = _python(codec, frame)
    assert (expected is not None) == reads
    assert _native_outcome(codec, frame) == expected


# -- the C encoder ----------------------------------------------------------------------

_JUNK: list[Any] = [2**70, -(2**70), -1, 2**31, 40_000, "text", b"bytes", 1.5, None, True, (),
                    uuid.UUID(int=1), object(), ["list"], "\udc80"]


def _written(codec: MessageCodec, body: Any) -> tuple[str, Any]:
    """What the C encoder makes of ``body``: ("bytes", the frame), or ("left", None) when it
    leaves it to the Python encoder (then it must have written nothing)."""
    assert codec.encode_native is not None
    out = new_output()
    out += b"head"
    result = codec.encode_native(out, body)
    if result is NotImplemented:
        assert bytes(out) == b"head" and not out.holes, "a refused body left bytes behind"
        return ("left", None)
    assert result is None
    return ("bytes", out.finish()[4:])


def _python_written(codec: MessageCodec, body: Any) -> bytes | None:
    out = new_output()
    try:
        codec.encode(out, body)
    except codecs.ProtocolError:
        return None
    return out.finish()


def _plain(struct: Any) -> Any:
    """``struct`` without unknown tags and with every tagged field at its default (what
    the C encoder writes itself), recursively."""
    spec = type(struct)._spec
    values = []
    for f, value in zip(spec.fields, struct, strict=False):
        if f.tag is not None:
            value = f.default
        elif isinstance(value, codecs.Record):
            value = _plain(value)
        elif type(value) is tuple and value and isinstance(value[0], codecs.Record):
            value = tuple(_plain(v) for v in value)
        values.append(value)
    return type(struct)(*values, ())


def _spoil(record: Any, rng: random.Random) -> Any:
    """``record`` with one value somewhere in it replaced by junk."""
    slot = rng.randrange(len(record))
    value = record[slot]
    if isinstance(value, codecs.Record) and rng.random() < 0.6:
        value = _spoil(value, rng)
    elif type(value) is tuple and value and isinstance(value[0], codecs.Record) and rng.random() < 0.6:
        at = rng.randrange(len(value))
        value = (*value[:at], _spoil(value[at], rng), *value[at + 1:])
    else:
        value = rng.choice(_JUNK)
    items = list(record)
    items[slot] = value
    return tuple.__new__(type(record), items)


@pytest.mark.parametrize(("message", "version"), CASES, ids=IDS)
def test_the_c_encoder_writes_what_the_python_encoder_writes(
        message: codecs.MessageSpec, version: int) -> None:
    codec = message_codec(message, version)
    rng = random.Random(f"native-encode/{message.name}/{version}")
    taken = 0
    for i in range(6):
        body, frame = random_frame(codec, rng, uniform=i % 2 == 0)
        kind, written = _written(codec, body)
        assert kind == "left" or written == frame
        plain = _plain(body)
        kind, written = _written(codec, plain)
        assert kind == "bytes" and written == _python_written(codec, plain)
        taken += 1
        # Decoded, then written again: FlatRecords (their bytes), views of the frame.
        decoded = codec.read(memoryview(frame))[0]
        kind, written = _written(codec, decoded)
        assert kind == "left" or written == frame
        for _ in range(6):
            spoiled = _spoil(plain, rng)
            kind, written = _written(codec, spoiled)
            python = _python_written(codec, spoiled)
            # Never bytes the Python encoder would not write: refused, or the same.
            assert kind == "left" or written == python, (spoiled, written, python)
    assert taken == 6


def test_large_record_sets_stay_holes_and_flat_arrays_their_bytes() -> None:
    payload = bytes(range(256)) * 128  # 32 KiB
    body = {"responses": [{"topic_id": "00000000-0000-0000-0000-00000000abcd", "partitions": [
        {"partition_index": p, "error_code": 0, "high_watermark": 10, "last_stable_offset": 10,
         "log_start_offset": 0, "aborted_transactions": [], "preferred_read_replica": -1,
         "records": payload} for p in range(3)]}]}
    resp = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                     api_key=1, api_version=18)
    codec = message_codec(codecs.APIS[1].response, 18)
    assert codec.encode_native is not None
    out = new_output()
    assert codec.encode_native(out, resp.body) is None
    assert [len(data) for _, data in out.holes] == [len(payload)] * 3
    assert all(data is payload for _, data in out.holes)  # referenced, not copied
    assert out.finish() == _python_written(codec, resp.body)
    # A Metadata answer decoded (partitions as FlatRecords), one topic renamed, written in full.
    frame = _metadata_response([3] * 6, 13)
    meta = message_codec(codecs.APIS[3].response, 13)
    decoded = codecs.decode_response(frame, 3, 13).body
    renamed = decoded.replace(topics=(decoded.topics[0].replace(name="renamed"),))
    assert type(renamed.topics[0].partitions) is codecs.FlatRecords
    assert _written(meta, renamed) == ("bytes", _python_written(meta, renamed))


def test_encoding_leaks_nothing_written_or_refused() -> None:
    codec = message_codec(codecs.APIS[1].response, 18)
    rng = random.Random(11)
    bodies = [_plain(random_frame(codec, rng, uniform=True)[0]) for _ in range(4)]
    bodies += [_spoil(body, rng) for body in bodies for _ in range(10)]
    big = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {"responses": [
        {"topic_id": "00000000-0000-0000-0000-00000000abcd", "partitions": [
            {"partition_index": p, "records": bytes(20_000)} for p in range(4)]}]}},
        api_key=1, api_version=18).body
    bodies += [big, _spoil(big, rng)]

    def run() -> None:
        for body in bodies:
            _written(codec, body)

    # 400 x 46 bodies, 1,600 holes: a leaked object a body or a hole would be 50+ KiB.
    grown = _grown(run, 400)
    assert grown < 16 * 1024, grown
