"""Codec checks not covered by the test_codec_* files: laziness, header quirks, splices,
framing limits, record batches and the generated tables' freshness."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import consumer, records
from gatehouse.codecs.generate import strip_comments
from gatehouse.codecs.peek import produce_acks
from tests.codec_strategies import examples, few_examples

ALL = [(k, v) for k, a in sorted(codecs.APIS.items()) for v in a.versions]


def few(n: int = 3) -> Any:
    return few_examples(n)


# -- round trips: every API, version and direction ----------------------------------


def test_lazy_header_and_identity() -> None:
    body = codecs.api(3).request.root.cls(topics=())
    frame = bytes(codecs.Request.build(3, 12, 1, "c", body).encode())
    req = codecs.decode_request(frame)
    assert not req.body_decoded  # the header alone was read
    assert req.encode() is frame  # unchanged: the very same bytes object
    req.body  # noqa: B018
    assert req.encode() is frame


def test_splice_equals_full_encode() -> None:
    plain = {"header": {"correlation_id": 4}, "body": {
        "throttle_time_ms": 5, "cluster_id": "c", "controller_id": 1,
        "brokers": [{"node_id": 1, "host": "a", "port": 1, "rack": None}],
        "topics": [{"name": f"t{i}", "topic_id": str(uuid.UUID(int=i + 1)),
                    "partitions": [{"partition_index": 0, "leader_id": 1,
                                    "replica_nodes": [1], "isr_nodes": [1]}]}
                   for i in range(50)]}}
    frame = bytes(codecs.response_from_dict(plain, api_key=3, api_version=12).encode())
    resp = codecs.decode_response(frame, 3, 12)
    new_broker = resp.body.brokers[0].replace(host="proxy.example", port=9999)
    spliced = resp.replace(body=resp.body.replace(brokers=(new_broker,)))
    plain["body"]["brokers"][0].update(host="proxy.example", port=9999)  # type: ignore[index]
    full = codecs.response_from_dict(plain, api_key=3, api_version=12).encode()
    assert bytes(spliced.encode()) == bytes(full)


# -- quirks (../shared/notes/kafka-protocol-quirks.md), with hand-written bytes -------


def test_header_versions() -> None:
    # Metadata v12 is flexible: request header v2 (tag section after the client id).
    frame = struct.pack(">hhih", 3, 12, 7, 1) + b"c" + b"\x00" + b"\x01\x00\x00\x00"
    req = codecs.decode_request(frame)
    assert req.header.client_id == "c" and req.header_version == 2
    assert req.body.topics == () and not req.body.allow_auto_topic_creation
    # Metadata v8 is not: header v1, no tag section.
    v8 = struct.pack(">hhih", 3, 8, 7, 1) + b"c" + struct.pack(">i", -1) + b"\x01\x00\x00"
    req8 = codecs.decode_request(v8)
    assert req8.header_version == 1 and req8.body.topics is None
    # ControlledShutdown (the one API with a v0 header) left the specs with ZooKeeper.
    assert 7 not in codecs.APIS


def test_client_id_is_never_compact_even_in_header_v2() -> None:
    req = codecs.Request.build(3, 12, 1, "abc", codecs.api(3).request.root.cls(topics=None))
    frame = bytes(req.encode())
    assert frame[8:13] == b"\x00\x03abc"  # int16 length, not a uvarint
    null = codecs.Request.build(3, 12, 1, None, codecs.api(3).request.root.cls(topics=None))
    assert bytes(null.encode())[8:10] == b"\xff\xff"


def test_api_versions_response_header_is_v0_even_when_flexible() -> None:
    resp = codecs.Response.build(18, 3, 5, codecs.api(18).response.root.cls())
    frame = bytes(resp.encode())
    # correlation id, then straight to the body (error code 0): no header tag section.
    assert frame[:6] == struct.pack(">ih", 5, 0)


def test_unknown_tagged_fields_survive_byte_identical() -> None:
    # ApiVersions v3 request body: software name, version, then 2 tags: 0 (known? no:
    # none are defined) and 7, sorted.
    body = b"\x04rdk\x060.1.0" + b"\x02" + b"\x00\x02hi" + b"\x07\x01\xff"
    frame = struct.pack(">hhih", 18, 3, 1, 1) + b"c" + b"\x00" + body
    req = codecs.decode_request(frame)
    assert req.body.unknown_tags == ((0, b"hi"), (7, b"\xff"))
    assert bytes(codecs.encode_request(codecs.request_from_dict(codecs.to_dict(req)))) == frame


def test_api_versions_v4_features_are_tagged_and_kept() -> None:
    resp = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "api_keys": [{"api_key": 0, "min_version": 0, "max_version": 13}],
        "supported_features": [{"name": "transaction.version", "min_version": 0,
                                "max_version": 2}],
        "finalized_features_epoch": 3,
        "finalized_features": [{"name": "transaction.version", "max_version_level": 2,
                                "min_version_level": 2}],
        "zk_migration_ready": False}}, api_key=18, api_version=4)
    back = codecs.decode_response(bytes(resp.encode()), 18, 4)
    assert back.body.finalized_features_epoch == 3
    assert back.body.supported_features[0].name == "transaction.version"


def test_api_versions_unsupported_version_answer_in_v0_layout() -> None:
    body = struct.pack(">hi", 35, 1) + struct.pack(">hhh", 18, 0, 3)
    resp = codecs.decode_response(struct.pack(">i", 8) + body, 18, 4)
    assert resp.api_version == 0 and resp.body.error_code == 35
    assert [(k.api_key, k.max_version) for k in resp.body.api_keys] == [(18, 3)]


def test_compact_and_classic_nulls() -> None:
    # FindCoordinator v3 (flexible): error_message null = uvarint 0.
    flexible = codecs.Response.build(10, 3, 1, codecs.api(10).response.root.cls(
        error_message=None, host="h"))
    assert b"\x00\x02h" in bytes(flexible.encode())
    # v1 (classic): null string = int16 -1.
    classic = codecs.Response.build(10, 1, 1, codecs.api(10).response.root.cls(
        error_message=None, host="h"))
    assert b"\xff\xff" + b"\x00" * 4 + b"\x00\x01h" in bytes(classic.encode())


def test_nullable_struct_cursor() -> None:
    api = codecs.api(75)  # DescribeTopicPartitions
    cursor_cls = api.request.structs["Cursor"].cls
    for cursor in (None, cursor_cls(topic_name="t", partition_index=2)):
        body = api.request.root.cls(topics=(), response_partition_limit=10, cursor=cursor)
        frame = bytes(codecs.Request.build(75, 0, 1, "c", body).encode())
        assert codecs.decode_request(frame).body.cursor == cursor
        if cursor is None:
            assert frame.endswith(b"\xff\x00")  # int8 -1 marker, then the tag section


def test_uuid_float64_uint16_types() -> None:
    quota = codecs.api(48).response  # DescribeClientQuotas: float64 values
    assert any(f.type == "float64" for s in quota.structs.values() for f in s.fields)
    plain = {"header": {"correlation_id": 1}, "body": {"error_code": 0, "entries": [{
        "entity": [{"entity_type": "user", "entity_name": "u"}],
        "values": [{"key": "producer_byte_rate", "value": 1.5e6}]}]}}
    resp = codecs.response_from_dict(plain, api_key=48, api_version=1)
    back = codecs.decode_response(bytes(resp.encode()), 48, 1)
    assert back.body.entries[0].values[0].value == 1.5e6
    topic_id = uuid.uuid4()
    md = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "brokers": [], "topics": [{"name": "t", "topic_id": str(topic_id),
                                   "partitions": []}]}}, api_key=3, api_version=12)
    assert topic_id.bytes in bytes(md.encode())
    uint16 = [f for m in codecs.MESSAGES.values() for s in m.structs.values()
              for f in s.fields if f.type == "uint16"]
    assert uint16  # e.g. BrokerRegistration listeners' ports


def test_produce_acks_position() -> None:
    for version, tx in ((3, b"\xff\xff"), (8, struct.pack(">h", 2) + b"tx"), (9, b"\x03tx")):
        header = struct.pack(">hhih", 0, version, 1, 1) + b"c" + (b"\x00" if version >= 9
                                                                   else b"")
        frame = header + tx + struct.pack(">h", 0) + b"rest"
        assert produce_acks(codecs.decode_request(frame)) == 0


def test_ignorable_fields() -> None:
    # Metadata v3 lacks AllowAutoTopicCreation (not ignorable): a non-default value fails.
    body = codecs.api(3).request.root.cls(topics=(), allow_auto_topic_creation=False)
    with pytest.raises(codecs.LocalProtocolError):
        codecs.Request.build(3, 3, 1, "c", body).encode()
    # JoinGroup v0 lacks RebalanceTimeoutMs, which is ignorable: silently left out.
    join = codecs.api(11).request.root.cls(group_id="g", rebalance_timeout_ms=5000)
    frame = bytes(codecs.Request.build(11, 0, 1, "c", join).encode())
    assert codecs.decode_request(frame).body.rebalance_timeout_ms == -1


def test_specs_with_comments_parse() -> None:
    text = '// header\n{\n  "name": "X", // trailing\n  "about": "a // not a comment"\n}'
    stripped = strip_comments(text)
    assert "// header" not in stripped and "a // not a comment" in stripped


def test_version_drift_is_in_the_tables() -> None:
    assert codecs.KAFKA_RELEASE == "4.4.0"
    assert codecs.api(0).versions.hi >= 13 and codecs.api(1).versions.hi >= 18
    assert {88, 89, 90, 91, 92} <= set(codecs.APIS)


def test_sasl_bodies() -> None:
    hs = struct.pack(">hhih", 17, 1, 1, 1) + b"c" + struct.pack(">h", 5) + b"PLAIN"
    assert codecs.decode_request(hs).body.mechanism == "PLAIN"
    auth = codecs.Request.build(36, 2, 1, "c", codecs.api(36).request.root.cls(
        auth_bytes=b"\x00user\x00secret"))
    assert codecs.decode_request(bytes(auth.encode())).body.auth_bytes == b"\x00user\x00secret"


# -- errors and fuzz -----------------------------------------------------------------


def test_errors_carry_api_path_and_offset() -> None:
    # Metadata v9 request whose topics array claims 1,000,000 entries in 3 bytes.
    frame = struct.pack(">hhih", 3, 9, 1, 1) + b"c" + b"\x00" + b"\xc0\x84\x3d" + b"\x00"
    with pytest.raises(codecs.RemoteProtocolError) as info:
        codecs.decode_request(frame).body  # noqa: B018
    err = info.value
    assert (err.api_name, err.api_version) == ("Metadata", 9)
    assert err.path and err.path[0] == "Topics" and err.offset is not None  # spec names


# -- framing -------------------------------------------------------------------------


def _stream() -> tuple[bytes, list[bytes]]:
    frames = [b"", b"a", bytes(range(256)) * 3, b"xyz" * 1000]
    return b"".join(struct.pack(">i", len(f)) + f for f in frames), frames


def test_frames_split_at_every_byte_boundary() -> None:
    data, frames = _stream()
    for cut in range(len(data) + 1):
        reader = codecs.FrameReader()
        got: list[bytes] = []
        for part in (data[:cut], data[cut:]):
            reader.feed(part)
            while (frame := reader.next_frame()) is not None:
                got.append(frame)
        assert got == frames
        reader.check_eof()


@settings(max_examples=examples(100), deadline=None, database=None)
@given(st.lists(st.integers(1, 500), max_size=30))
def test_frames_random_chunking(sizes: list[int]) -> None:
    data, frames = _stream()
    reader = codecs.FrameReader()
    got, pos = [], 0
    for size in [*sizes, len(data)]:
        reader.feed(data[pos:pos + size])
        pos += size
        while (frame := reader.next_frame()) is not None:
            got.append(frame)
    assert got == frames


def test_frame_limits() -> None:
    reader = codecs.FrameReader()
    reader.feed(b"\x00\x00")
    assert reader.next_frame() is None  # need more data
    reader.feed(b"\x00\x05ab")
    assert reader.next_frame() is None
    with pytest.raises(codecs.RemoteProtocolError):
        reader.check_eof()  # cut off mid-frame
    huge = codecs.FrameReader()
    huge.feed(struct.pack(">i", 2**31 - 1))
    with pytest.raises(codecs.FrameTooLarge):
        huge.next_frame()  # refused from the prefix alone, nothing buffered
    negative = codecs.FrameReader()
    negative.feed(struct.pack(">i", -5))
    with pytest.raises(codecs.FrameTooLarge):
        negative.next_frame()
    assert codecs.DEFAULT_MAX_FRAME_SIZE == 100 * 1024 * 1024


# -- record batches ------------------------------------------------------------------


def batch_v2(payload: bytes, count: int, compression: int = 0, base_offset: int = 0) -> bytes:
    after_crc = struct.pack(">hiqqqhii", compression, count - 1, 1000, 2000, 77, 1, 5, count)
    after_crc += payload
    crc = records.crc32c(after_crc)
    body = struct.pack(">ibI", 3, 2, crc) + after_crc
    return struct.pack(">qi", base_offset, len(body)) + body


def test_record_batch_header_read_without_decompressing() -> None:
    compressed = gzip.compress(b"\x00" * 1000)
    data = batch_v2(compressed, count=42, compression=1) + batch_v2(b"raw", count=3)
    batches = list(records.iter_batches(data))
    first = batches[0]
    assert isinstance(first, records.RecordBatch)
    assert (first.record_count, first.compression, first.producer_id, first.base_sequence,
            first.partition_leader_epoch) == (42, "gzip", 77, 5, 3)
    assert first.crc_ok(data)
    summary = records.summarize(data)
    assert (summary.batches, summary.records, summary.compressions) == (
        2, 45, frozenset({"gzip", "none"}))
    corrupted = bytearray(data)
    corrupted[70] ^= 0xFF
    assert not next(iter(records.iter_batches(bytes(corrupted)))).crc_ok(bytes(corrupted))
    partial = records.summarize(data + data[:30])
    assert partial.truncated_bytes == 30 and partial.records == 45


def test_legacy_message_sets_use_crc32() -> None:
    def message(magic: int) -> bytes:
        rest = struct.pack(">bb", magic, 0) + (struct.pack(">q", 5) if magic else b"")
        rest += struct.pack(">i", -1) + struct.pack(">i", 1) + b"v"
        crc = zlib.crc32(rest) & 0xFFFFFFFF
        body = struct.pack(">I", crc) + rest
        return struct.pack(">qi", 0, len(body)) + body

    data = message(0) + message(1)
    summary = records.summarize(data)
    assert summary.legacy_messages == 2 and summary.records == 2
    assert all(m.crc_ok(data) for m in records.iter_batches(data))


# -- consumer protocol ---------------------------------------------------------------


def test_consumer_protocol_versions_and_unknown_tail() -> None:
    tp = consumer.SUBSCRIPTION.structs["TopicPartition"].cls
    for version in range(consumer.SUBSCRIPTION.valid.hi + 1):
        fields: dict[str, Any] = {"topics": ("orders", "payments"), "user_data": b"u"}
        if version >= 1:
            fields["owned_partitions"] = (tp(topic="orders", partitions=(0, 1)),)
        if version >= 3:
            fields["rack_id"] = "r1"
        sub = consumer.subscription(version, **fields)
        data = sub.encode()
        assert data[:2] == struct.pack(">h", version)
        assert consumer.decode_subscription(data).body.topics == ("orders", "payments")
    newer = struct.pack(">h", 99) + consumer.subscription(3, topics=("t",)).encode()[2:] + b"\x01\x02"
    parsed = consumer.decode_subscription(newer)
    assert parsed.body.topics == ("t",) and parsed.trailing == b"\x01\x02"
    assert parsed.encode() == newer
    with pytest.raises(codecs.ProtocolError):
        consumer.decode_assignment(b"\x00")


# -- the generated tables ------------------------------------------------------------


def test_generated_tables_are_fresh(kafka_libs: Path) -> None:
    from scripts.fetch_kafka import PREVIOUS_KAFKA_VERSION, kafka_clients_jar

    jar, older = kafka_clients_jar(), kafka_clients_jar(PREVIOUS_KAFKA_VERSION)
    result = subprocess.run([sys.executable, "-m", "gatehouse.codecs.generate",
                             "--kafka-clients-jar", str(jar), "--older-kafka-clients-jar",
                             str(older), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generator_reads_the_shared_4_0_specs(tmp_path: Path) -> None:
    specs = Path(__file__).resolve().parents[2] / "shared" / "kafka-message-specs"
    if not specs.is_dir():
        specs = Path("/work/shared/kafka-message-specs")
    out = tmp_path / "schema40.py"
    result = subprocess.run([sys.executable, "-m", "gatehouse.codecs.generate", "--specs",
                             str(specs), "--release", "4.0.0", "--output", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    namespace: dict[str, Any] = {}
    exec(compile(out.read_text(), str(out), "exec"), namespace)
    assert namespace["KAFKA_RELEASE"] == "4.0.0"
    assert len(namespace["MESSAGES"]) < len(codecs.MESSAGES)
