"""The protocol traps of /work/shared/notes/kafka-protocol-quirks.md that concern the codec.

One test (or a few) per numbered item, named ``test_qN_...``.  Frames are written by hand
with ``struct.pack`` and the helpers below (which do not use the codec), so these tests do
not depend on our encoder: they check decoding against bytes laid out as the specs say,
and encoding against those same bytes.

Items left out: 13 (error responses are built by the proxy, per API) and the SASL
connection states of 9 (raw tokens after SaslHandshake v0 never reach the codec).
"""

from __future__ import annotations

import gzip
import struct
import uuid
import zlib
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.codecs import generate, primitives, records
from gatehouse.codecs.peek import produce_acks

# -- hand encoding helpers (independent of the codec) ----------------------------------


def i8(v: int) -> bytes:
    return struct.pack(">b", v)


def i16(v: int) -> bytes:
    return struct.pack(">h", v)


def u16(v: int) -> bytes:
    return struct.pack(">H", v)


def i32(v: int) -> bytes:
    return struct.pack(">i", v)


def i64(v: int) -> bytes:
    return struct.pack(">q", v)


def uv(n: int) -> bytes:
    """Unsigned varint (KIP-482), written out by hand."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def s16(text: str | None) -> bytes:
    """Classic string: int16 length, -1 = null."""
    if text is None:
        return i16(-1)
    raw = text.encode()
    return i16(len(raw)) + raw


def cstr(text: str | None) -> bytes:
    """Compact string: uvarint length + 1, 0 = null."""
    if text is None:
        return b"\x00"
    raw = text.encode()
    return uv(len(raw) + 1) + raw


def cbytes(data: bytes | None) -> bytes:
    return b"\x00" if data is None else uv(len(data) + 1) + data


def carr(n: int | None) -> bytes:
    """Compact array length prefix."""
    return b"\x00" if n is None else uv(n + 1)


NO_TAGS = b"\x00"


def req_v1(api_key: int, version: int, correlation_id: int, client_id: str | None = "c") -> bytes:
    return struct.pack(">hhi", api_key, version, correlation_id) + s16(client_id)


def req_v2(api_key: int, version: int, correlation_id: int, client_id: str | None = "c",
           tags: bytes = NO_TAGS) -> bytes:
    return req_v1(api_key, version, correlation_id, client_id) + tags


def plain_round_trip(msg: codecs.Request | codecs.Response) -> bytes:
    """encode(from_dict(to_dict(msg))): a full encode, no frame to copy from."""
    plain = codecs.to_dict(msg)
    if isinstance(msg, codecs.Request):
        return bytes(codecs.request_from_dict(plain).encode())
    return bytes(codecs.response_from_dict(
        plain, api_key=msg.api_key, api_version=msg.api_version).encode())


# -- 1. framing --------------------------------------------------------------------------


def test_q1_int32_size_prefix_and_responses_need_the_callers_api() -> None:
    frame = req_v1(18, 0, 5)
    assert codecs.size_prefixed(frame) == i32(len(frame)) + frame
    reader = codecs.FrameReader()
    reader.feed(codecs.size_prefixed(frame) * 2)
    assert reader.next_frame() == frame and reader.next_frame() == frame
    # A response does not say which API it answers: the same bytes, read for two APIs.
    body = i32(0) + i16(0)  # ThrottleTimeMs, ErrorCode
    resp = i32(5) + body
    add_offsets = codecs.decode_response(resp, 25, 0)  # AddOffsetsToTxn v0
    assert (add_offsets.body.throttle_time_ms, add_offsets.body.error_code) == (0, 0)
    with pytest.raises(codecs.RemoteProtocolError):
        codecs.decode_response(resp, 3, 0).body  # noqa: B018 - not a Metadata v0 response
    assert add_offsets.api_key == 25 and add_offsets.correlation_id == 5


# -- 2. header versions ------------------------------------------------------------------


def test_q2_request_header_v1_when_not_flexible() -> None:
    # Metadata v8 (not flexible): header v1, no tag section; body: topics null, then bools.
    frame = req_v1(3, 8, 7, "cli") + i32(-1) + b"\x01\x00\x00"
    req = codecs.decode_request(frame)
    assert req.header == codecs.RequestHeader(3, 8, 7, "cli", ())
    assert req.header_version == 1
    assert req.body.topics is None and req.body.allow_auto_topic_creation is True
    assert plain_round_trip(req) == frame


def test_q2_request_header_v2_when_flexible() -> None:
    # Metadata v12: header v2 = v1 + a tag section; here it carries an unknown tag 3.
    frame = req_v2(3, 12, 7, "cli", tags=b"\x01" + b"\x03\x02\xab\xcd") + b"\x00\x01\x00" + NO_TAGS
    req = codecs.decode_request(frame)
    assert req.header_version == 2
    assert req.header.unknown_tags == ((3, b"\xab\xcd"),)
    assert req.body.topics is None and req.body.allow_auto_topic_creation is True
    assert codecs.to_dict(req)["header"]["_unknown_tags"] == [[3, b"\xab\xcd"]]
    assert plain_round_trip(req) == frame


def test_q2_controlled_shutdown_v0_request_header_has_no_client_id() -> None:
    # ControlledShutdown v0: header v0 (api key, version, correlation id), then BrokerId.
    # Kafka 4 dropped the API from its specs, so the body is unknown; the header is not.
    assert 7 not in codecs.APIS
    frame = struct.pack(">hhi", 7, 0, 42) + i32(0x00050000)
    req = codecs.decode_request(frame)
    assert req.header == codecs.RequestHeader(7, 0, 42, None, ())
    assert req.header_version == 0 and not req.known
    assert req.encode() is frame  # forwarded untouched
    with pytest.raises(codecs.UnknownApi):
        req.body  # noqa: B018
    # v1 and later use header v1.
    v1 = req_v1(7, 1, 43, "broker-5") + i32(5)
    assert codecs.decode_request(v1).header.client_id == "broker-5"


def test_q2_response_header_v0_and_v1() -> None:
    # Metadata v8 response: header v0 (correlation id only).
    body8 = (i32(0) + i32(0) + s16(None) + i32(-1) + i32(0) + i32(-2147483648))
    v8 = codecs.decode_response(i32(9) + body8, 3, 8)
    assert v8.header == codecs.ResponseHeader(9, ()) and v8.header_version == 0
    assert v8.body.controller_id == -1 and v8.body.cluster_id is None
    assert plain_round_trip(v8) == i32(9) + body8
    # Metadata v12: header v1 (a tag section after the correlation id), here with a tag.
    body12 = i32(0) + carr(0) + cstr(None) + i32(1) + carr(0) + NO_TAGS
    frame = i32(9) + b"\x01\x00\x01\xee" + body12
    v12 = codecs.decode_response(frame, 3, 12)
    assert v12.header == codecs.ResponseHeader(9, ((0, b"\xee"),)) and v12.header_version == 1
    assert v12.body.controller_id == 1
    assert plain_round_trip(v12) == frame


@pytest.mark.parametrize("version", [3, 4])
def test_q2_api_versions_response_header_is_always_v0(version: int) -> None:
    # Flexible ApiVersions responses still use header v0: the error code follows the
    # correlation id directly (read as a tag section, its 0x00 would vanish).
    body = (i16(0) + carr(1) + i16(18) + i16(0) + i16(4) + NO_TAGS  # ApiKeys
            + i32(0) + NO_TAGS)  # ThrottleTimeMs, tags
    frame = i32(5) + body
    resp = codecs.decode_response(frame, 18, version)
    assert resp.api_version == version and resp.header_version == 0
    assert resp.header == codecs.ResponseHeader(5, ())
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.body.api_keys] == [(18, 0, 4)]
    assert plain_round_trip(resp) == frame
    assert codecs.api(18).request_header_version(version) == 2  # the request side is normal


# -- 3. ClientId -------------------------------------------------------------------------


def test_q3_client_id_is_int16_length_even_in_header_v2() -> None:
    long_id = "x" * 200  # a compact length would be the uvarint c9 01, not 00 c8
    frame = req_v2(3, 12, 1, long_id) + carr(None) + b"\x01\x00" + NO_TAGS
    assert frame[8:10] == b"\x00\xc8"
    req = codecs.decode_request(frame)
    assert req.header.client_id == long_id and req.body.topics is None
    assert plain_round_trip(req) == frame
    body = codecs.api(3).request.root.cls(topics=None)
    assert bytes(codecs.Request.build(3, 12, 1, "abc", body).encode())[8:14] == b"\x00\x03abc\x00"
    assert bytes(codecs.Request.build(3, 12, 1, None, body).encode())[8:11] == b"\xff\xff\x00"
    assert bytes(codecs.Request.build(3, 12, 1, "", body).encode())[8:11] == b"\x00\x00\x00"
    null = codecs.decode_request(req_v2(3, 12, 1, None) + carr(None) + b"\x01\x00" + NO_TAGS)
    assert null.header.client_id is None


# -- 4. tagged fields --------------------------------------------------------------------


def test_q4_unknown_tags_survive_byte_identical() -> None:
    # ApiVersions v3 request (no tagged fields of its own) with unknown tags 0 and 7.
    tags = b"\x02" + b"\x00\x02hi" + b"\x07\x01\xff"
    frame = req_v2(18, 3, 1) + cstr("rdk") + cstr("2.0") + tags
    req = codecs.decode_request(frame)
    assert req.body.unknown_tags == ((0, b"hi"), (7, b"\xff"))
    assert codecs.to_dict(req)["body"]["_unknown_tags"] == [[0, b"hi"], [7, b"\xff"]]
    assert plain_round_trip(req) == frame
    # Unknown tags inside a nested struct (a Metadata v12 broker) too.
    broker = i32(1) + cstr("h") + i32(9092) + cstr(None) + b"\x01\x05\x01\xaa"
    body = i32(0) + carr(1) + broker + cstr(None) + i32(1) + carr(0) + NO_TAGS
    resp = codecs.decode_response(i32(1) + NO_TAGS + body, 3, 12)
    assert resp.body.brokers[0].unknown_tags == ((5, b"\xaa"),)
    assert plain_round_trip(resp) == i32(1) + NO_TAGS + body


def test_q4_tags_are_written_sorted_known_and_unknown_together() -> None:
    spec = codecs.api(18).response
    feature = spec.structs["SupportedFeatureKey"].cls(name="f", min_version=1, max_version=2)
    body = spec.root.cls(
        error_code=0, api_keys=(), throttle_time_ms=0, supported_features=(feature,),
        finalized_features_epoch=7, unknown_tags=((9, b"y"), (4, b"x")),  # unsorted
    )
    frame = bytes(codecs.Response.build(18, 3, 1, body).encode())
    tag0 = carr(1) + cstr("f") + i16(1) + i16(2) + NO_TAGS
    expected_tags = (b"\x04" + b"\x00" + uv(len(tag0)) + tag0 + b"\x01\x08" + i64(7)
                     + b"\x04\x01x" + b"\x09\x01y")
    assert frame == i32(1) + i16(0) + carr(0) + i32(0) + expected_tags


def test_q4_tags_out_of_order_or_repeated_are_refused() -> None:
    base = req_v2(18, 3, 1) + cstr("rdk") + cstr("2.0")
    for tags in (b"\x02" + b"\x07\x01\xff" + b"\x00\x02hi",  # 7 then 0
                 b"\x02" + b"\x07\x01\xff" + b"\x07\x01\xff"):  # 7 twice
        with pytest.raises(codecs.RemoteProtocolError) as info:
            codecs.decode_request(base + tags).body  # noqa: B018
        err = info.value
        assert (err.api_key, err.api_version) == (18, 3)
        assert err.path == ("_tagged_fields",) and err.offset is not None
    # The same rule in a request header v2.
    with pytest.raises(codecs.RemoteProtocolError):
        codecs.decode_request(req_v2(18, 3, 1, tags=b"\x02\x05\x00\x01\x00"))


def test_q4_encoding_a_repeated_tag_fails() -> None:
    spec = codecs.api(18).response
    twice = spec.root.cls(unknown_tags=((4, b""), (4, b"")))
    clash = spec.root.cls(finalized_features_epoch=3, unknown_tags=((1, b""),))  # 1 is known
    for body in (twice, clash):
        with pytest.raises(codecs.LocalProtocolError):
            codecs.Response.build(18, 3, 1, body).encode()
    # Tags below the flexible versions cannot be written at all.
    with pytest.raises(codecs.LocalProtocolError):
        codecs.Response.build(18, 2, 1, spec.root.cls(unknown_tags=((4, b""),))).encode()


# -- 5. compact and classic encodings of null and empty ---------------------------------


FIND_COORDINATOR = 10


@pytest.mark.parametrize(("message", "encoded"), [(None, s16(None)), ("", s16("")), ("e", s16("e"))])
def test_q5_classic_nullable_string(message: str | None, encoded: bytes) -> None:
    frame = i32(1) + i32(0) + i16(0) + encoded + i32(2) + s16("h") + i32(9092)
    resp = codecs.decode_response(frame, FIND_COORDINATOR, 1)
    assert resp.body.error_message == message
    body = codecs.api(FIND_COORDINATOR).response.root.cls(
        error_message=message, node_id=2, host="h", port=9092)
    assert bytes(codecs.Response.build(FIND_COORDINATOR, 1, 1, body).encode()) == frame


@pytest.mark.parametrize(("message", "encoded"), [(None, b"\x00"), ("", b"\x01"), ("e", b"\x02e")])
def test_q5_compact_nullable_string(message: str | None, encoded: bytes) -> None:
    frame = i32(1) + NO_TAGS + i32(0) + i16(0) + encoded + i32(2) + b"\x02h" + i32(9092) + NO_TAGS
    resp = codecs.decode_response(frame, FIND_COORDINATOR, 3)
    assert resp.body.error_message == message
    body = codecs.api(FIND_COORDINATOR).response.root.cls(
        error_message=message, node_id=2, host="h", port=9092)
    assert bytes(codecs.Response.build(FIND_COORDINATOR, 3, 1, body).encode()) == frame


def test_q5_null_in_a_non_nullable_field() -> None:
    # FindCoordinator v3 Host is not nullable: 0x00 (compact null) is an error...
    frame = i32(1) + NO_TAGS + i32(0) + i16(0) + b"\x00" + i32(2) + b"\x00" + i32(9092) + NO_TAGS
    with pytest.raises(codecs.RemoteProtocolError) as info:
        codecs.decode_response(frame, FIND_COORDINATOR, 3).body  # noqa: B018
    assert info.value.path == ("Host",)
    assert info.value.offset == 17  # the length byte is at 16: the error is found after it
    # ... and so is writing None there.
    body = codecs.api(FIND_COORDINATOR).response.root.cls(host=None)
    with pytest.raises(codecs.LocalProtocolError):
        codecs.Response.build(FIND_COORDINATOR, 3, 1, body).encode()


@pytest.mark.parametrize(("version", "topics", "encoded"), [
    (8, None, i32(-1)), (8, (), i32(0)), (12, None, b"\x00"), (12, (), b"\x01"),
])
def test_q5_nullable_arrays(version: int, topics: tuple[Any, ...] | None, encoded: bytes) -> None:
    flexible = version >= 9
    head = req_v2(3, version, 1) if flexible else req_v1(3, version, 1)
    tail = b"\x01\x00" + (NO_TAGS if flexible else b"\x00")  # v8 has one more bool
    frame = head + encoded + tail
    req = codecs.decode_request(frame)
    assert req.body.topics == topics
    body = codecs.api(3).request.root.cls(topics=topics)
    assert bytes(codecs.Request.build(3, version, 1, "c", body).encode()) == frame


@pytest.mark.parametrize(("version", "data", "encoded"), [
    (8, None, i32(-1)), (8, b"", i32(0)), (8, b"abc", i32(3) + b"abc"),
    (9, None, b"\x00"), (9, b"", b"\x01"), (9, b"abc", b"\x04abc"),
])
def test_q5_nullable_records(version: int, data: bytes | None, encoded: bytes) -> None:
    if version >= 9:
        frame = (req_v2(0, version, 1) + cstr(None) + i16(1) + i32(1000)
                 + carr(1) + cstr("t") + carr(1) + i32(0) + encoded + NO_TAGS + NO_TAGS + NO_TAGS)
    else:
        frame = (req_v1(0, version, 1) + s16(None) + i16(1) + i32(1000)
                 + i32(1) + s16("t") + i32(1) + i32(0) + encoded)
    req = codecs.decode_request(frame)
    records_field = req.body.topic_data[0].partition_data[0].records
    assert (None if records_field is None else bytes(records_field)) == data
    assert plain_round_trip(req) == frame


def test_q5_records_are_null_only_where_the_spec_says() -> None:
    # FetchSnapshot v0 UnalignedRecords is not nullable: Kafka refuses null both ways.
    partition = {"index": 0, "error_code": 0, "snapshot_id": {"end_offset": 1, "epoch": 1},
                 "current_leader": {"leader_id": 1, "leader_epoch": 1}, "size": 0,
                 "position": 0, "unaligned_records": None}
    plain = {"header": {"correlation_id": 1},
             "body": {"throttle_time_ms": 0, "error_code": 0,
                      "topics": [{"name": "t", "partitions": [partition]}]}}
    with pytest.raises(codecs.LocalProtocolError, match="UnalignedRecords"):
        codecs.response_from_dict(plain, api_key=59, api_version=0).encode()
    partition["unaligned_records"] = b"ZZZ"
    frame = bytes(codecs.response_from_dict(plain, api_key=59, api_version=0).encode())
    assert frame.count(b"\x04ZZZ") == 1  # compact length 3 + 1, then the bytes
    null_records = frame.replace(b"\x04ZZZ", b"\x00")  # compact length 0 = null
    with pytest.raises(codecs.RemoteProtocolError, match="UnalignedRecords"):
        codecs.decode_response(null_records, 59, 0).body  # noqa: B018


def test_q5_bytes_classic_and_compact() -> None:
    # SaslAuthenticate v1 (classic bytes: int32 length) and v2 (compact: uvarint + 1).
    assert codecs.decode_request(req_v1(36, 1, 1) + i32(0)).body.auth_bytes == b""
    assert codecs.decode_request(req_v2(36, 2, 1) + b"\x01" + NO_TAGS).body.auth_bytes == b""
    # Envelope v0 RequestPrincipal is nullable bytes in a flexible version: 0x00 = null.
    frame = req_v2(58, 0, 1) + cbytes(b"rq") + cbytes(None) + cbytes(b"\x7f\x00\x00\x01") + NO_TAGS
    env = codecs.decode_request(frame)
    assert env.body.request_principal is None and env.body.request_data == b"rq"
    assert plain_round_trip(env) == frame


# -- 6. varints --------------------------------------------------------------------------


def test_q6_unsigned_varints_in_flexible_framing() -> None:
    token = bytes(range(200))  # length 200: compact length 201 = c9 01
    frame = req_v2(36, 2, 1) + b"\xc9\x01" + token + NO_TAGS
    req = codecs.decode_request(frame)
    assert req.body.auth_bytes == token
    assert bytes(codecs.Request.build(36, 2, 1, "c", req.body).encode()) == frame
    assert primitives.uvarint_bytes(300) == b"\xac\x02"
    assert primitives.read_uvarint(b"\xff\xff\xff\xff\x0f", 0) == (2**32 - 1, 5)
    with pytest.raises(codecs.RemoteProtocolError):
        primitives.read_uvarint(b"\xff\xff\xff\xff\xff\x01", 0)  # 6 bytes: too long
    with pytest.raises(codecs.RemoteProtocolError):
        primitives.read_uvarint(b"\x80", 0)  # truncated
    # A compact length that is not a varint of at most 5 bytes: an error, not a hang.
    with pytest.raises(codecs.RemoteProtocolError) as info:
        codecs.decode_request(req_v2(36, 2, 1) + b"\xff" * 6 + b"\x01").body  # noqa: B018
    assert info.value.path == ("AuthBytes",)


@pytest.mark.parametrize(("value", "encoded"), [
    (0, b"\x00"), (-1, b"\x01"), (1, b"\x02"), (63, b"\x7e"), (-64, b"\x7f"), (64, b"\x80\x01"),
    (2**31 - 1, b"\xfe\xff\xff\xff\x0f"), (-(2**31), b"\xff\xff\xff\xff\x0f"),
    (-(2**63), b"\xff" * 9 + b"\x01"),
])
def test_q6_zigzag_varints_of_records(value: int, encoded: bytes) -> None:
    # Vectors as in Kafka's ByteUtilsTest (zig-zag: 0, -1, 1, -2, 2, ...).
    assert primitives.varint_bytes(value) == encoded
    assert primitives.read_varlong(encoded, 0) == (value, len(encoded))
    if -(2**31) <= value < 2**31:
        assert primitives.read_varint(encoded, 0) == (value, len(encoded))


# -- 7. types ----------------------------------------------------------------------------


def test_q7_uuid() -> None:
    topic_id = uuid.UUID("6ba7b810-9dad-11d1-80b4-00c04fd430c8")
    topic = (i16(0) + cstr("t") + topic_id.bytes + b"\x00" + carr(0)
             + i32(-2147483648) + NO_TAGS)
    zero = i16(0) + cstr("z") + bytes(16) + b"\x00" + carr(0) + i32(-2147483648) + NO_TAGS
    frame = (i32(1) + NO_TAGS + i32(0) + carr(0) + cstr(None) + i32(1) + carr(2) + topic + zero
             + NO_TAGS)
    resp = codecs.decode_response(frame, 3, 12)
    assert resp.body.topics[0].topic_id == topic_id
    assert resp.body.topics[1].topic_id == uuid.UUID(int=0)  # all zero: "no id"
    assert codecs.to_dict(resp)["body"]["topics"][0]["topic_id"] == str(topic_id)
    assert plain_round_trip(resp) == frame


def test_q7_float64() -> None:
    def frame(value: bytes) -> bytes:
        entry = (i32(1) + s16("user") + s16("alice")  # Entity
                 + i32(1) + s16("producer_byte_rate") + value)  # Values
        return i32(1) + i32(0) + i16(0) + s16(None) + i32(1) + entry

    resp = codecs.decode_response(frame(struct.pack(">d", 1048576.5)), 48, 0)
    assert resp.body.entries[0].values[0].value == 1048576.5
    assert plain_round_trip(resp) == frame(struct.pack(">d", 1048576.5))
    negative_zero = frame(struct.pack(">d", -0.0))  # equal to 0.0, but not the same bytes
    assert plain_round_trip(codecs.decode_response(negative_zero, 48, 0)) == negative_zero


def _broker_registration(port: bytes) -> bytes:
    listener = cstr("PLAINTEXT") + cstr("h") + port + i16(0) + NO_TAGS
    return (req_v2(62, 0, 1) + i32(5) + cstr("cluster") + uuid.UUID(int=3).bytes
            + carr(1) + listener + carr(0) + cstr(None) + NO_TAGS)


def test_q7_uint16() -> None:
    frame = _broker_registration(u16(65535))
    req = codecs.decode_request(frame)
    assert req.body.listeners[0].port == 65535  # not -1
    assert plain_round_trip(req) == frame
    for bad in (65536, -1):
        listener = req.body.listeners[0].replace(port=bad)
        changed = req.replace(body=req.body.replace(listeners=(listener,)))
        with pytest.raises(codecs.LocalProtocolError):
            changed.encode()


@pytest.mark.parametrize("cursor", [None, ("t", 3)])
def test_q7_nullable_struct_cursor(cursor: tuple[str, int] | None) -> None:
    # DescribeTopicPartitions v0 Cursor: int8 marker (-1 = null, 1 = present), KIP-893.
    encoded = b"\xff" if cursor is None else b"\x01" + cstr(cursor[0]) + i32(cursor[1]) + NO_TAGS
    frame = req_v2(75, 0, 1) + carr(1) + cstr("t") + NO_TAGS + i32(2000) + encoded + NO_TAGS
    req = codecs.decode_request(frame)
    got = req.body.cursor
    assert (None if got is None else (got.topic_name, got.partition_index)) == cursor
    assert plain_round_trip(req) == frame
    # The response's NextCursor too.
    resp_frame = i32(1) + NO_TAGS + i32(0) + carr(0) + encoded + NO_TAGS
    resp = codecs.decode_response(resp_frame, 75, 0)
    assert (resp.body.next_cursor is None) == (cursor is None)
    assert plain_round_trip(resp) == resp_frame


def test_q7_records_are_left_untouched() -> None:
    batch = (i64(0) + i32(49 + 20) + i32(0) + b"\x02" + b"\xde\xad\xbe\xef" + i16(1)
             + i32(0) + i64(0) + i64(0) + i64(-1) + i16(-1) + i32(-1) + i32(1)
             + b"not really gzip data")  # attributes say gzip; nothing is decompressed
    frame = (req_v2(0, 9, 1) + cstr(None) + i16(-1) + i32(1000) + carr(1) + cstr("t") + carr(1)
             + i32(0) + uv(len(batch) + 1) + batch + NO_TAGS + NO_TAGS + NO_TAGS)
    req = codecs.decode_request(frame)
    data = req.body.topic_data[0].partition_data[0].records
    assert isinstance(data, memoryview) and data.readonly  # a slice of the frame, no copy
    assert bytes(data) == batch
    (only,) = records.iter_batches(data)
    assert isinstance(only, records.RecordBatch)
    assert only.compression == "gzip" and only.record_count == 1
    assert req.encode() is frame


# -- 8. Produce acks ---------------------------------------------------------------------


@pytest.mark.parametrize(("version", "transactional_id", "acks"), [
    (3, None, 0), (3, "tx-1", -1), (8, "tx", 1), (9, None, 0), (9, "tx-9", -1), (13, "t", 0),
])
def test_q8_acks_follow_the_transactional_id(version: int, transactional_id: str | None,
                                             acks: int) -> None:
    if version >= 9:
        frame = req_v2(0, version, 1) + cstr(transactional_id) + i16(acks) + i32(30000) + carr(0) + NO_TAGS
    else:
        frame = req_v1(0, version, 1) + s16(transactional_id) + i16(acks) + i32(30000) + i32(0)
    req = codecs.decode_request(frame)
    assert produce_acks(req) == acks
    assert not req.body_decoded  # found without decoding the body
    assert req.body.acks == acks and req.body.transactional_id == transactional_id


def test_q8_produce_v0_to_v2_acks_come_first() -> None:
    # Kafka 4 dropped Produce v0-2 from its specs (the tables take them from 3.9's):
    # no transactional id, the acks first.
    assert 2 in codecs.api(0).versions
    frame = req_v1(0, 2, 1) + i16(0) + i32(30000) + i32(0)
    decoded = codecs.decode_request(frame)
    assert produce_acks(decoded) == 0
    assert (decoded.body.acks, decoded.body.timeout_ms, decoded.body.topic_data) == (0, 30000, ())
    with pytest.raises(codecs.RemoteProtocolError):
        produce_acks(codecs.decode_request(req_v1(0, 9, 1) + b"\x05tx"))  # cut short


# -- 9. SASL -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1])
def test_q9_sasl_handshake(version: int) -> None:
    req_frame = req_v1(17, version, 1) + s16("SCRAM-SHA-256")
    assert codecs.decode_request(req_frame).body.mechanism == "SCRAM-SHA-256"
    resp_frame = i32(1) + i16(0) + i32(2) + s16("PLAIN") + s16("SCRAM-SHA-256")
    resp = codecs.decode_response(resp_frame, 17, version)
    assert resp.body.mechanisms == ("PLAIN", "SCRAM-SHA-256")
    assert plain_round_trip(resp) == resp_frame


def test_q9_sasl_authenticate() -> None:
    token = b"\x00user\x00secret"
    v0 = req_v1(36, 0, 1) + i32(len(token)) + token
    assert codecs.decode_request(v0).body.auth_bytes == token
    v2 = req_v2(36, 2, 1) + cbytes(token) + NO_TAGS
    assert codecs.decode_request(v2).body.auth_bytes == token
    r1 = i32(1) + i16(0) + s16(None) + i32(3) + b"srv" + i64(3_600_000)
    resp1 = codecs.decode_response(r1, 36, 1)
    assert (resp1.body.auth_bytes, resp1.body.session_lifetime_ms) == (b"srv", 3_600_000)
    r2 = i32(1) + NO_TAGS + i16(58) + cstr("bad password") + cbytes(b"") + i64(0) + NO_TAGS
    resp2 = codecs.decode_response(r2, 36, 2)
    assert (resp2.body.error_code, resp2.body.error_message) == (58, "bad password")
    for msg, frame in ((resp1, r1), (resp2, r2)):
        assert plain_round_trip(msg) == frame


# -- 10. ApiVersions answered in v0 --------------------------------------------------------


@pytest.mark.parametrize("requested", [1, 3, 4, 5])
def test_q10_unsupported_version_answer_is_read_as_v0(requested: int) -> None:
    body = i16(35) + i32(1) + i16(18) + i16(0) + i16(3)  # v0: error, [ApiKey, Min, Max]
    frame = i32(8) + body
    resp = codecs.decode_response(frame, 18, requested)
    assert resp.api_version == 0 and resp.body.error_code == 35
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.body.api_keys] == [(18, 0, 3)]
    assert resp.encode() is frame
    assert plain_round_trip(resp) == frame


def test_q10_normal_answers_keep_the_requested_version() -> None:
    v3 = i32(8) + i16(0) + carr(1) + i16(18) + i16(0) + i16(4) + NO_TAGS + i32(0) + NO_TAGS
    assert codecs.decode_response(v3, 18, 3).api_version == 3
    # Error 35 in the requested layout (not what Kafka sends, but well-formed): kept.
    v3_35 = i32(8) + i16(35) + carr(0) + i32(0) + NO_TAGS
    resp = codecs.decode_response(v3_35, 18, 3)
    assert resp.api_version == 3 and resp.body.error_code == 35
    # Neither layout fits: the error names the requested version.
    with pytest.raises(codecs.RemoteProtocolError) as info:
        codecs.decode_response(i32(8) + i16(35) + b"\x01", 18, 3).body  # noqa: B018
    assert info.value.api_version == 3


# -- 11. KIP-511 client software name and version -------------------------------------------


def test_q11_client_software_name_and_version_from_v3() -> None:
    frame = req_v2(18, 3, 1) + cstr("apache-kafka-java") + cstr("4.4.0") + NO_TAGS
    req = codecs.decode_request(frame)
    assert (req.body.client_software_name, req.body.client_software_version) == (
        "apache-kafka-java", "4.4.0")
    # v0-2 have an empty body; the fields are ignorable, so they are dropped there.
    v2 = req.api.request.root.cls(client_software_name="x", client_software_version="1")
    assert bytes(codecs.Request.build(18, 2, 1, "c", v2).encode()) == req_v1(18, 2, 1)


# -- 12. ApiVersions v4 features (tagged) ---------------------------------------------------


def test_q12_api_versions_features_are_tagged_and_kept() -> None:
    supported = carr(1) + cstr("transaction.version") + i16(0) + i16(2) + NO_TAGS
    finalized = carr(1) + cstr("transaction.version") + i16(2) + i16(2) + NO_TAGS
    tags = (b"\x04" + b"\x00" + uv(len(supported)) + supported + b"\x01\x08" + i64(12)
            + b"\x02" + uv(len(finalized)) + finalized + b"\x03\x01\x01")
    body = i16(0) + carr(1) + i16(0) + i16(3) + i16(13) + NO_TAGS + i32(0) + tags
    frame = i32(1) + body
    resp = codecs.decode_response(frame, 18, 4)
    b = resp.body
    assert [(f.name, f.min_version, f.max_version) for f in b.supported_features] == [
        ("transaction.version", 0, 2)]
    assert b.finalized_features_epoch == 12 and b.zk_migration_ready is True
    assert [(f.name, f.max_version_level) for f in b.finalized_features] == [("transaction.version", 2)]
    assert b.unknown_tags == ()  # all four are known tags
    plain = codecs.to_dict(resp)["body"]
    assert plain["finalized_features"][0]["min_version_level"] == 2
    assert plain_round_trip(resp) == frame
    # A rewrite of the api_keys keeps the features (spliced tag section).
    keys = (b.api_keys[0].replace(max_version=12),)
    rewritten = bytes(resp.replace(body=b.replace(api_keys=keys)).encode())
    assert rewritten == frame.replace(i16(13), i16(12), 1) and tags in rewritten


# -- 14. record batch v2 header ------------------------------------------------------------


def test_q14_record_batch_v2_header_layout_and_crc32c() -> None:
    after_crc = (i16(0x0013) + i32(4) + i64(1_700_000_000_000) + i64(1_700_000_000_999)
                 + i64(1234) + i16(5) + i32(77) + i32(5) + b"RECORDS")
    crc = records.crc32c(after_crc)
    batch_body = i32(9) + b"\x02" + struct.pack(">I", crc) + after_crc
    batch = i64(1000) + i32(len(batch_body)) + batch_body
    (b,) = records.iter_batches(batch)
    assert isinstance(b, records.RecordBatch)
    assert (b.base_offset, b.batch_length, b.partition_leader_epoch, b.magic, b.crc) == (
        1000, len(batch_body), 9, 2, crc)
    assert (b.attributes, b.last_offset_delta, b.base_timestamp, b.max_timestamp) == (
        0x13, 4, 1_700_000_000_000, 1_700_000_000_999)
    assert (b.producer_id, b.producer_epoch, b.base_sequence, b.record_count) == (1234, 5, 77, 5)
    assert (b.compression, b.is_transactional, b.timestamp_type, b.is_control) == (
        "lz4", True, "create_time", False)
    assert b.crc_ok(batch) and b.size == len(batch)
    assert records.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert records._crc32c(b"123456789") == 0xE3069283  # the Python one too
    assert zlib.crc32(after_crc) != crc  # not the legacy CRC-32
    # The C one (eight bytes a step) and the Python one agree at every length and
    # alignment, and go on from a CRC as it does.
    data = bytes(range(256)) * 3
    for start, end in ((0, 0), (1, 8), (3, 17), (5, 700), (0, 768)):
        part = memoryview(data)[start:end]
        assert records.crc32c(part) == records._crc32c(part)
        assert records.crc32c(data[end:], records.crc32c(part)) == records.crc32c(
            data[start:])


def test_q14_legacy_messages_use_crc32_from_the_magic_byte() -> None:
    rest = b"\x01" + b"\x01" + i64(5) + i32(-1) + i32(3) + b"abc"  # magic 1, gzip attribute
    crc = zlib.crc32(rest)
    message = i64(0) + i32(4 + len(rest)) + struct.pack(">I", crc) + rest
    (m,) = records.iter_batches(message)
    assert isinstance(m, records.LegacyMessage)
    assert (m.magic, m.crc, m.timestamp, m.compression) == (1, crc, 5, "gzip")
    assert m.crc_ok(message)
    assert records.crc32c(rest) != crc


# -- 15. topic ids ---------------------------------------------------------------------------


def test_q15_fetch_v13_carries_topic_ids_only() -> None:
    fetch = codecs.api(1).request
    topic = fetch.structs["FetchTopic"]
    assert {f.attr for f in topic.fields_in(12)} >= {"topic"} and "topic_id" not in {
        f.attr for f in topic.fields_in(12)}
    assert "topic_id" in {f.attr for f in topic.fields_in(13)}
    assert "topic" not in {f.attr for f in topic.fields_in(13)}
    for name in ("ShareFetch", "ShareAcknowledge"):
        api = codecs.api(name)
        fields = {f.attr for s in api.request.structs.values() for f in s.fields}
        assert "topic_id" in fields and "topic_name" not in fields


# -- 16. topic names without an entity type ----------------------------------------------------


def test_q16_entity_types_in_the_tables() -> None:
    # The consumer protocol's topic list has no entityType; a topic-name rewrite must
    # know it by name.  (ShareGroupHeartbeat's SubscribedTopicNames has gained one in 4.4.)
    assert codecs.MESSAGES["ConsumerProtocolSubscription"].root.field("Topics").entity is None
    assert codecs.api("ShareGroupHeartbeat").request.root.field("SubscribedTopicNames").entity == "topicName"
    assert codecs.api(3).request.structs["MetadataRequestTopic"].field("Name").entity == "topicName"


# -- 17. broker addresses: tagged NodeEndpoints -------------------------------------------------


def test_q17_node_endpoints_are_tagged_in_produce_and_fetch() -> None:
    for api_key, first in ((0, 10), (1, 16)):
        f = codecs.api(api_key).response.root.field("NodeEndpoints")
        assert f.tag == 0 and f.tagged.lo == first and f.tagged_in(first)
        assert not f.tagged_in(first - 1)
    endpoints = carr(1) + i32(2) + cstr("kafka-2.internal") + i32(9092) + cstr("r1") + NO_TAGS
    frame = i32(1) + NO_TAGS + carr(0) + i32(0) + b"\x01\x00" + uv(len(endpoints)) + endpoints
    resp = codecs.decode_response(frame, 0, 10)
    (node,) = resp.body.node_endpoints
    assert (node.node_id, node.host, node.port, node.rack) == (2, "kafka-2.internal", 9092, "r1")
    assert plain_round_trip(resp) == frame
    moved = resp.replace(body=resp.body.replace(node_endpoints=(node.replace(host="p", port=1),)))
    again = codecs.decode_response(bytes(moved.encode()), 0, 10)
    assert (again.body.node_endpoints[0].host, again.body.node_endpoints[0].port) == ("p", 1)


# -- 18. ignorable fields ---------------------------------------------------------------------


def test_q18_non_default_non_ignorable_field_missing_from_the_version_fails() -> None:
    # AllowAutoTopicCreation: Metadata v4+, not ignorable, default true.
    spec = codecs.api(3).request
    with pytest.raises(codecs.LocalProtocolError) as info:
        codecs.Request.build(3, 3, 1, "c", spec.root.cls(
            topics=(), allow_auto_topic_creation=False)).encode()
    assert "AllowAutoTopicCreation" in str(info.value)
    assert info.value.api_name == "Metadata" and info.value.api_version == 3
    ok = codecs.Request.build(3, 3, 1, "c", spec.root.cls(topics=()))  # default: fine
    assert bytes(ok.encode()) == req_v1(3, 3, 1) + i32(0)


def test_q18_ignorable_field_is_dropped() -> None:
    # RebalanceTimeoutMs: JoinGroup v1+, ignorable.
    spec = codecs.api(11).request
    body = spec.root.cls(group_id="g", session_timeout_ms=10, member_id="", protocol_type="consumer",
                         rebalance_timeout_ms=5000)
    frame = bytes(codecs.Request.build(11, 0, 1, "c", body).encode())
    assert frame == req_v1(11, 0, 1) + s16("g") + i32(10) + s16("") + s16("consumer") + i32(0)
    assert codecs.decode_request(frame).body.rebalance_timeout_ms == -1  # the default
    # A plain dict naming a field the version lacks is refused either way.
    with pytest.raises(codecs.LocalProtocolError):
        codecs.request_from_dict({"header": {"api_key": 11, "api_version": 0, "correlation_id": 1},
                                  "body": {"rebalance_timeout_ms": 5000}})


# -- 19. specs with comments --------------------------------------------------------------------


def test_q19_specs_with_line_comments_parse() -> None:
    text = (
        '// Licensed to the Apache Software Foundation\n'
        '{\n'
        '  "apiKey": 99, // trailing comment with "quotes"\n'
        '  "type": "request",\n'
        '  "name": "ExampleRequest",\n'
        '  // "validVersions": "0-9",\n'
        '  "validVersions": "0-1",\n'
        '  "flexibleVersions": "1+",\n'
        '  "fields": [\n'
        '    { "name": "Url", "type": "string", "versions": "0+",\n'
        '      "about": "http://example.com/a // not a comment \\" // still not"}\n'
        '  ]\n'
        '} // at the end, no newline'
    )
    stripped = generate.strip_comments(text)
    assert "Licensed" not in stripped and "trailing" not in stripped and "0-9" not in stripped
    assert 'http://example.com/a // not a comment \\" // still not' in stripped
    rendered = generate.render({"ExampleRequest.json": text}, "9.9.9", "test")
    namespace: dict[str, Any] = {}
    exec(compile(rendered, "<rendered>", "exec"), namespace)
    (table,) = namespace["MESSAGES"]
    assert (table["api_key"], table["valid"], table["flexible"]) == (99, "0-1", "1+")
    assert table["fields"][0][:3] == ("Url", "string", "0+")


# -- 20. version drift --------------------------------------------------------------------------


def test_q20_newer_versions_and_api_keys_are_in_the_tables() -> None:
    assert codecs.KAFKA_RELEASE == "4.4.0"
    assert 13 in codecs.api("Produce").versions and 18 in codecs.api("Fetch").versions
    assert set(range(88, 93)) <= set(codecs.APIS)
    # Produce v13 writes topic ids instead of names.
    topic = codecs.api(0).request.structs["TopicProduceData"]
    assert "topic_id" in {f.attr for f in topic.fields_in(13)}
    assert "name" not in {f.attr for f in topic.fields_in(13)}


def test_gzip_payload_is_not_inflated_by_summaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 14's "without decompressing": make any decompression attempt fail loudly."""
    def refuse(*args: Any, **kwargs: Any) -> bytes:
        raise AssertionError("the codec decompressed a batch")

    monkeypatch.setattr(gzip, "decompress", refuse)
    monkeypatch.setattr(zlib, "decompress", refuse)
    after_crc = i16(1) + i32(0) + i64(0) + i64(0) + i64(-1) + i16(-1) + i32(-1) + i32(1)
    payload = gzip.compress(b"x" * 100)
    body = i32(0) + b"\x02" + struct.pack(">I", records.crc32c(after_crc + payload)) + after_crc + payload
    batch = i64(0) + i32(len(body)) + body
    summary = records.summarize(batch)
    assert summary.compressions == frozenset({"gzip"}) and summary.records == 1
    assert next(records.iter_batches(batch)).crc_ok(batch)


def test_q20_versions_newer_than_the_tables_keep_their_header_layout() -> None:
    # Produce v14 does not exist yet; Produce is flexible from v9 on ("9+"), so a v14
    # request has header v2.  The body is unknown and forwarded as it came.
    frame = req_v2(0, 14, 3, "c", tags=b"\x01\x02\x01z") + b"future body"
    req = codecs.decode_request(frame)
    assert req.header == codecs.RequestHeader(0, 14, 3, "c", ((2, b"z"),))
    assert not req.known and req.encode() is frame
    with pytest.raises(codecs.UnknownApi):
        req.body  # noqa: B018
    resp_frame = i32(4) + b"\x01\x00\x01q" + b"future"
    resp = codecs.decode_response(resp_frame, 1, 19)  # Fetch v19: response header v1
    assert resp.header == codecs.ResponseHeader(4, ((0, b"q"),)) and resp.encode() is resp_frame
    # Versions the tables dropped (Produce v0-2) were never flexible: header v1.
    old = codecs.decode_request(req_v1(0, 2, 3) + b"\x00\x01")
    assert old.header == codecs.RequestHeader(0, 2, 3, "c", ()) and old.frame is not None


def test_q8_acks_of_a_produce_version_newer_than_the_tables() -> None:
    # Produce v14 (unknown body, known header layout v2): acks after the compact
    # TransactionalId, found without the body's schema.
    frame = req_v2(0, 14, 1, tags=b"\x01\x00\x02ab") + cstr("tx") + i16(0) + b"unknown rest"
    req = codecs.decode_request(frame)
    assert not req.known and produce_acks(req) == 0
    with pytest.raises(codecs.RemoteProtocolError) as info:
        produce_acks(codecs.decode_request(req_v2(0, 14, 1) + b"\x80"))  # broken varint
    assert info.value.api_name == "Produce" and info.value.path == ("acks",)


def test_where_a_responses_throttle_time_is() -> None:
    """The body's first field in most APIs (after the header's tags when flexible), so
    a proxy can set it without decoding; None where it comes later or is absent."""
    flexible = i32(7) + b"\x00" + i32(250) + i16(0)  # Fetch v12+: header tags, then it
    assert codecs.throttle_time_at(flexible, 1, 12) == 5
    tagged = i32(7) + b"\x01\x00\x02ab" + i32(250)  # a header tag before it
    assert codecs.throttle_time_at(tagged, 1, 17) == 9
    assert codecs.throttle_time_at(i32(7) + i32(250), 1, 11) == 4  # no header tags
    assert codecs.throttle_time_at(i32(7) + i32(250), 1, 0) is None  # Fetch v0 has none
    assert codecs.throttle_time_at(i32(7) + i32(250), 0, 9) is None  # Produce: after
    assert codecs.throttle_time_at(i32(7) + i32(250), 18, 3) is None  # ApiVersions: later
    assert codecs.throttle_time_at(i32(7) + b"\x00" + b"\x00\x01", 1, 12) is None  # cut off
    assert codecs.throttle_time_at(i32(7) + b"\x05", 1, 12) is None  # tags cut off
    for key in (3, 10, 11, 12, 19, 32, 60, 68, 78):  # all first, at their newest version
        assert codecs.throttle_time_at(i32(1) + b"\x00" + i32(0), key,
                                       max(codecs.APIS[key].versions)) == 5
