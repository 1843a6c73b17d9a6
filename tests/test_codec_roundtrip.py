"""Round trips for every API key x version x direction, with bodies generated from the tables.

For each case: build a message in code -> encode -> decode (header only, body lazily) ->
equal; ``to_dict`` -> ``*_from_dict`` -> encode is byte-identical; an unchanged decoded
message encodes as the very frame object it came from; and a message with one top-level
field replaced re-encodes (by splicing the untouched fields from the original bytes) to
exactly what a full encode of the same content gives.
"""

from __future__ import annotations

import random
import struct
import uuid
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from gatehouse import codecs
from tests.codec_strategies import (
    ALL_CASES,
    ALL_VERSIONS,
    INT32,
    build_message,
    case_id,
    decode_frame,
    few_examples,
    from_plain,
    header_tags,
    message_body,
    message_spec,
    random_body,
)

# Examples per (API, version, direction): ~620 cases, so a handful each keeps the file
# to seconds; the generated bodies differ on every run.  The values spliced in come from
# ``random_body`` (every field filled in), which is much cheaper to draw than a second
# hypothesis body.
EXAMPLES = 3
few = few_examples(EXAMPLES)

API_VERSIONS = 18


def _regular_top_level(spec: codecs.MessageSpec, version: int) -> list[codecs.FieldSpec]:
    return [f for f in spec.root.fields if version in f.versions and not f.tagged_in(version)]


def _tagged_top_level(spec: codecs.MessageSpec, version: int) -> list[codecs.FieldSpec]:
    return [f for f in spec.root.fields if f.tagged_in(version)]


@pytest.mark.parametrize(("api_key", "version", "direction"), ALL_CASES, ids=map(case_id, ALL_CASES))
def test_round_trip(api_key: int, version: int, direction: str) -> None:
    spec = message_spec(api_key, direction)
    flexible_header = (
        codecs.api(api_key).request_header_version(version) == 2
        if direction == "request"
        else codecs.api(api_key).response_header_version(version) == 1
    )

    @few
    @given(
        body=message_body(spec, version),
        seed=st.integers(0, 2**32),
        correlation_id=INT32,
        client_id=st.one_of(st.none(), st.text(max_size=8)),
        tags=header_tags(flexible_header),
    )
    def check(body: Any, seed: int, correlation_id: int, client_id: str | None,
              tags: tuple[tuple[int, bytes], ...]) -> None:
        other = random_body(spec, version, random.Random(seed))
        if api_key == API_VERSIONS and direction == "response":
            # UNSUPPORTED_VERSION makes the decoder try the v0 fallback layout first.
            assume(body.error_code != 35 and other.error_code != 35)
        msg = build_message(api_key, version, direction, body, correlation_id, client_id, tags)
        frame = bytes(msg.encode())

        # decode: the header at once, the body on first access
        back: Any = decode_frame(frame, api_key, version, direction)
        assert back.header == msg.header
        assert back.correlation_id == correlation_id
        assert back.api_key == api_key and back.api_version == version
        if not (api_key == API_VERSIONS and direction == "response"):
            assert not back.body_decoded  # lazy
        assert back.encode() is frame  # unchanged: the original object, not a copy
        assert back.body == body
        assert back.body_decoded
        assert back.encode() is frame  # still unchanged after reading the body
        assert back == msg

        # plain data and back, byte-identical
        plain = codecs.to_dict(back)
        assert set(plain) == {"header", "body"}
        assert plain["header"]["correlation_id"] == correlation_id
        again = from_plain(plain, api_key, version, direction)
        assert bytes(again.encode()) == frame
        assert codecs.to_dict(again) == plain

        # splice: change one top-level field at a time, compare with a full encode
        attrs = [f.attr for f in _regular_top_level(spec, version) + _tagged_top_level(spec, version)]
        if spec.is_flexible(version):
            attrs.append("unknown_tags")
        for attr in attrs:
            changed = back.replace(body=back.body.replace(**{attr: getattr(other, attr)}))
            spliced = bytes(changed.encode())
            full = bytes(from_plain(codecs.to_dict(changed), api_key, version, direction).encode())
            assert spliced == full, attr
            assert decode_frame(spliced, api_key, version, direction).body == changed.body

        # the whole body replaced, and the header changed with the body left alone
        whole = back.replace(body=other)
        assert bytes(whole.encode()) == bytes(
            build_message(api_key, version, direction, other, correlation_id, client_id, tags).encode()
        )
        renumbered = back.replace(header=back.header.replace(correlation_id=correlation_id ^ 1))
        expected = build_message(api_key, version, direction, body, correlation_id ^ 1, client_id, tags)
        assert bytes(renumbered.encode()) == bytes(expected.encode())

    check()


def test_every_api_version_is_covered() -> None:
    keys = {k for k, _ in ALL_VERSIONS}
    assert keys == set(codecs.APIS)
    assert len(ALL_CASES) == 2 * sum(len(list(a.versions)) for a in codecs.APIS.values())
    assert len(ALL_CASES) > 600  # Kafka 4.4.0: 91 APIs, 309 versions


def test_decode_accepts_bytes_bytearray_and_memoryview() -> None:
    body = codecs.api(3).request.root.cls(topics=None)
    frame = bytes(codecs.Request.build(3, 12, 9, "c", body).encode())
    for buf in (frame, bytearray(frame), memoryview(frame)):
        req = codecs.decode_request(buf)
        assert req.header.correlation_id == 9 and req.body == body
        assert bytes(req.encode()) == frame
    scratch = bytearray(frame)
    req = codecs.decode_request(scratch)
    scratch[-2] ^= 0xFF  # a caller reusing its buffer must not change a decoded message
    assert req.body == body


# -- splicing, on a Metadata response as a proxy rewrites it ----------------------------


def _metadata_plain(topics: int = 20) -> dict[str, Any]:
    return {"header": {"correlation_id": 4}, "body": {
        "throttle_time_ms": 5, "cluster_id": "cluster", "controller_id": 1,
        "brokers": [{"node_id": 1, "host": "kafka-1.internal", "port": 9092, "rack": None},
                    {"node_id": 2, "host": "kafka-2.internal", "port": 9092, "rack": "r2"}],
        "topics": [{"error_code": 0, "name": f"t{i}", "topic_id": str(uuid.UUID(int=i + 1)),
                    "is_internal": False, "topic_authorized_operations": -2147483648,
                    "partitions": [{"error_code": 0, "partition_index": p, "leader_id": 1,
                                    "leader_epoch": 3, "replica_nodes": [1, 2],
                                    "isr_nodes": [1, 2], "offline_replicas": []}
                                   for p in range(3)]}
                   for i in range(topics)]}}


@pytest.mark.parametrize("version", [12, 13])
def test_splice_metadata_brokers_and_throttle(version: int) -> None:
    plain = _metadata_plain()
    frame = bytes(codecs.response_from_dict(plain, api_key=3, api_version=version).encode())
    resp = codecs.decode_response(frame, 3, version)
    brokers = tuple(b.replace(host=f"proxy-{b.node_id}.example", port=19092)
                    for b in resp.body.brokers)
    rewritten = resp.replace(body=resp.body.replace(brokers=brokers, throttle_time_ms=0))
    for b in plain["body"]["brokers"]:
        b.update(host=f"proxy-{b['node_id']}.example", port=19092)
    plain["body"]["throttle_time_ms"] = 0
    full = codecs.response_from_dict(plain, api_key=3, api_version=version).encode()
    assert bytes(rewritten.encode()) == bytes(full)
    assert resp.encode() is frame  # the original is untouched by replace()
    back = codecs.decode_response(bytes(rewritten.encode()), 3, version).body
    assert [(b.host, b.port) for b in back.brokers] == [("proxy-1.example", 19092),
                                                        ("proxy-2.example", 19092)]
    assert back.throttle_time_ms == 0 and back.topics == resp.body.topics


def test_splice_copies_untouched_fields_verbatim() -> None:
    """Splicing copies the original bytes of unchanged fields, it does not re-encode them.

    The frame is a Metadata v12 response written by hand with a non-canonical bool
    (``IsInternal`` = 0x02, which Kafka reads as true).  After the brokers are rewritten,
    the topics keep their original bytes; a full re-encode would write 0x01.
    """
    topic = (b"\x00\x00" + b"\x02t" + uuid.UUID(int=7).bytes + b"\x02"  # IsInternal = 2
             + b"\x01" + struct.pack(">i", -2147483648) + b"\x00")
    body = (struct.pack(">i", 0)  # ThrottleTimeMs
            + b"\x02" + struct.pack(">i", 1) + b"\x02h" + struct.pack(">i", 9092) + b"\x00" + b"\x00"
            + b"\x00"  # ClusterId null
            + struct.pack(">i", 1)  # ControllerId
            + b"\x02" + topic
            + b"\x00")
    frame = struct.pack(">i", 77) + b"\x00" + body
    resp = codecs.decode_response(frame, 3, 12)
    assert resp.body.topics[0].is_internal is True
    new = resp.body.brokers[0].replace(host="proxy")
    spliced = bytes(resp.replace(body=resp.body.replace(brokers=(new,))).encode())
    assert topic in spliced  # copied, 0x02 and all
    full = bytes(codecs.response_from_dict(codecs.to_dict(resp), api_key=3, api_version=12).encode())
    assert topic not in full and topic.replace(uuid.UUID(int=7).bytes + b"\x02",
                                               uuid.UUID(int=7).bytes + b"\x01") in full


def test_splice_request_keeps_trailing_bytes() -> None:
    """Bytes after a request body (librdkafka sends some) are forwarded as they came."""
    body = codecs.api(3).request.root.cls(topics=None)
    frame = bytes(codecs.Request.build(3, 12, 1, "c", body).encode()) + b"\x00\x01\x02"
    req = codecs.decode_request(frame)
    assert req.body == body and req.trailing == b"\x00\x01\x02"
    changed = req.replace(body=body.replace(allow_auto_topic_creation=False))
    assert bytes(changed.encode()).endswith(b"\x00\x01\x02")
    # to_dict is the message's content: the stray bytes are not part of it
    assert bytes(codecs.request_from_dict(codecs.to_dict(req)).encode()) == frame[:-3]


def test_replace_cannot_change_api_of_a_decoded_request() -> None:
    frame = bytes(codecs.Request.build(
        3, 12, 1, "c", codecs.api(3).request.root.cls(topics=None)).encode())
    req = codecs.decode_request(frame)
    with pytest.raises(codecs.LocalProtocolError):
        req.replace(header=req.header.replace(api_version=11))


def test_header_is_read_without_touching_a_broken_body() -> None:
    frame = struct.pack(">hhih", 3, 12, 99, 1) + b"c" + b"\x00" + b"\xff\xff\xff\xff\xff"
    req = codecs.decode_request(frame)  # the header alone: no error yet
    assert req.header == codecs.RequestHeader(3, 12, 99, "c", ())
    assert codecs.decode_request_header(frame) == req.header
    assert req.encode() is frame  # forwarded as it came
    with pytest.raises(codecs.RemoteProtocolError):
        req.body  # noqa: B018
    resp = codecs.decode_response(struct.pack(">i", 99) + b"\x00" + b"\x80", 3, 12)
    assert resp.correlation_id == 99 and not resp.body_decoded


BAD_PLAIN: list[tuple[str, dict[str, Any]]] = [
    ("not a message", {"body": {}}),
    ("missing api key", {"header": {"api_version": 0, "correlation_id": 1}, "body": {}}),
    ("unknown api", {"header": {"api_key": 9999, "api_version": 0, "correlation_id": 1}, "body": {}}),
    ("unknown field", {"header": {"api_key": 3, "api_version": 12, "correlation_id": 1},
                       "body": {"no_such_field": 1}}),
    ("field not in version", {"header": {"api_key": 3, "api_version": 3, "correlation_id": 1},
                              "body": {"allow_auto_topic_creation": True}}),
    ("string expected", {"header": {"api_key": 17, "api_version": 1, "correlation_id": 1},
                         "body": {"mechanism": 5}}),
    ("int expected", {"header": {"api_key": 3, "api_version": 12, "correlation_id": 1},
                      "body": {"allow_auto_topic_creation": 1}}),
    ("list expected", {"header": {"api_key": 3, "api_version": 12, "correlation_id": 1},
                       "body": {"topics": "t"}}),
    ("uuid expected", {"header": {"api_key": 3, "api_version": 12, "correlation_id": 1},
                       "body": {"topics": [{"name": "t", "topic_id": "nope"}]}}),
    ("bad tags", {"header": {"api_key": 18, "api_version": 3, "correlation_id": 1},
                  "body": {"_unknown_tags": [[1, 5]]}}),
    ("bad header tags", {"header": {"api_key": 18, "api_version": 3, "correlation_id": 1,
                                    "_unknown_tags": [["x", b""]]}, "body": {}}),
    ("int out of range", {"header": {"api_key": 3, "api_version": 12, "correlation_id": 2**31},
                          "body": {}}),
    ("client id not a string", {"header": {"api_key": 3, "api_version": 12, "correlation_id": 1,
                                           "client_id": 7}, "body": {}}),
]


@pytest.mark.parametrize(("what", "plain"), BAD_PLAIN, ids=[b[0] for b in BAD_PLAIN])
def test_from_dict_refuses_what_it_cannot_encode(what: str, plain: dict[str, Any]) -> None:
    with pytest.raises(codecs.LocalProtocolError):
        codecs.request_from_dict(plain).encode()


def test_large_record_sets_are_joined_in_place() -> None:
    # Record sets of 16 KiB and more are referenced by the encoder and joined once at the
    # end; small and large ones mixed must land exactly where they belong.
    sizes = [70_000, 5, 16 * 1024, 0, 200_000, 16 * 1024 - 1]
    plain = {"header": {"correlation_id": 3}, "body": {
        "throttle_time_ms": 0, "error_code": 0, "session_id": 0, "responses": [
            {"topic_id": uuid.UUID(int=i + 1), "partitions": [
                {"partition_index": p, "error_code": 0, "high_watermark": size,
                 "last_stable_offset": size, "log_start_offset": 0, "aborted_transactions": None,
                 "preferred_read_replica": -1,
                 "records": bytes([p + 1]) * size}
                for p, size in enumerate(sizes)]}
            for i in range(2)]}}
    resp = codecs.response_from_dict(plain, api_key=1, api_version=17)
    frame = bytes(resp.encode())
    assert len(frame) > 2 * sum(sizes)
    back = codecs.decode_response(frame, 1, 17)
    got = [bytes(p.records) for t in back.body.responses for p in t.partitions]
    assert got == [bytes([p + 1]) * size for _ in range(2) for p, size in enumerate(sizes)]
    assert bytes(codecs.response_from_dict(codecs.to_dict(back), api_key=1,
                                           api_version=17).encode()) == frame


def test_splice_keeps_large_untouched_spans_in_place() -> None:
    # A Fetch response whose NodeEndpoints change (the proxy's KIP-951 rewrite): the 3 MB
    # of partitions before them are spliced by reference and must come out unchanged.
    records = [bytes([i]) * (100_000 + i) for i in range(3)]
    plain = {"header": {"correlation_id": 5}, "body": {
        "throttle_time_ms": 0, "error_code": 0, "session_id": 0, "responses": [
            {"topic_id": uuid.UUID(int=7), "partitions": [
                {"partition_index": p, "error_code": 0, "high_watermark": 1,
                 "last_stable_offset": 1, "log_start_offset": 0, "aborted_transactions": None,
                 "preferred_read_replica": -1, "records": data}
                for p, data in enumerate(records)]}],
        "node_endpoints": [{"node_id": 1, "host": "broker-1", "port": 9092, "rack": None}]}}
    frame = bytes(codecs.response_from_dict(plain, api_key=1, api_version=17).encode())
    resp = codecs.decode_response(frame, 1, 17)
    moved = resp.replace(body=resp.body.replace(node_endpoints=(
        resp.body.node_endpoints[0].replace(host="proxy", port=19092),)))
    spliced = bytes(moved.encode())
    plain["body"]["node_endpoints"][0].update(host="proxy", port=19092)
    assert spliced == bytes(codecs.response_from_dict(plain, api_key=1, api_version=17).encode())
    back = codecs.decode_response(spliced, 1, 17)
    assert [bytes(p.records) for p in back.body.responses[0].partitions] == records


@pytest.mark.parametrize(("field", "value"), [
    ("partition_index", 2**31), ("error_code", -2**15 - 1), ("high_watermark", 2**63),
    ("log_start_offset", "0"),
])
def test_a_refused_number_in_a_packed_run_is_named(field: str, value: Any) -> None:
    # Fetch's PartitionData starts with five numbers written by one pack; the error
    # still names the field whose value was refused, not the run's first.
    spec = codecs.api(1).response
    partition = spec.structs["PartitionData"].cls(**{field: value})
    topic = spec.structs["FetchableTopicResponse"].cls(partitions=(partition,))
    body = spec.root.cls(responses=(topic,))
    with pytest.raises(codecs.LocalProtocolError) as info:
        codecs.Response.build(1, 18, 7, body).encode()
    name = "".join(part.title() for part in field.split("_"))
    assert name in str(info.value)


def test_tagged_fields_equal_to_their_defaults_but_not_the_same_objects_encode_alike() -> None:
    spec = codecs.api(1).response
    structs = spec.structs
    default = structs["PartitionData"].cls()
    fresh = default.replace(diverging_epoch=structs["EpochEndOffset"].cls(epoch=-1, end_offset=-1),
                            records=b"")
    assert fresh.diverging_epoch == default.diverging_epoch
    assert fresh.diverging_epoch is not default.diverging_epoch
    moved = fresh.replace(diverging_epoch=structs["EpochEndOffset"].cls(epoch=3, end_offset=9))

    def frame(partition: Any) -> bytes:
        topic = structs["FetchableTopicResponse"].cls(partitions=(partition,))
        return bytes(codecs.Response.build(1, 18, 7, spec.root.cls(responses=(topic,))).encode())

    assert frame(fresh) == frame(default.replace(records=b""))
    again = codecs.decode_response(frame(moved), 1, 18).body.responses[0].partitions[0]
    assert (again.diverging_epoch.epoch, again.diverging_epoch.end_offset) == (3, 9)
