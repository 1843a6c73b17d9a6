"""``codecs.consumer``: ConsumerProtocolSubscription / ConsumerProtocolAssignment payloads.

These are the opaque bytes of the group APIs (JoinGroup protocol metadata, SyncGroup
assignments, DescribeGroups members) when ``protocol_type == "consumer"``: an int16
version, then a non-flexible body.  Bytes here are written by hand, field by field as in
Kafka's ConsumerProtocol*.json.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.codecs import consumer


def i16(v: int) -> bytes:
    return struct.pack(">h", v)


def i32(v: int) -> bytes:
    return struct.pack(">i", v)


def s16(text: str | None) -> bytes:
    return i16(-1) if text is None else i16(len(text.encode())) + text.encode()


def nbytes(data: bytes | None) -> bytes:
    return i32(-1) if data is None else i32(len(data)) + data


def topic_partitions(items: list[tuple[str, list[int]]]) -> bytes:
    out = i32(len(items))
    for topic, parts in items:
        out += s16(topic) + i32(len(parts)) + b"".join(i32(p) for p in parts)
    return out


def subscription_bytes(version: int, topics: list[str], user_data: bytes | None,
                       owned: list[tuple[str, list[int]]], generation: int, rack: str | None) -> bytes:
    out = i16(version) + i32(len(topics)) + b"".join(s16(t) for t in topics) + nbytes(user_data)
    if version >= 1:
        out += topic_partitions(owned)
    if version >= 2:
        out += i32(generation)
    if version >= 3:
        out += s16(rack)
    return out


def assignment_bytes(version: int, assigned: list[tuple[str, list[int]]], user_data: bytes | None) -> bytes:
    return i16(version) + topic_partitions(assigned) + nbytes(user_data)


TP = consumer.SUBSCRIPTION.structs["TopicPartition"].cls
ATP = consumer.ASSIGNMENT.structs["TopicPartition"].cls
OWNED = [("orders", [0, 2]), ("payments", [1])]
ASSIGNED = [("orders", [0, 1, 2]), ("payments", [])]


def test_versions_known() -> None:
    assert consumer.SUBSCRIPTION.valid == codecs.Versions(0, 3)
    assert consumer.ASSIGNMENT.valid == codecs.Versions(0, 3)
    assert not consumer.SUBSCRIPTION.flexible and not consumer.ASSIGNMENT.flexible


@pytest.mark.parametrize("version", [0, 1, 2, 3])
@pytest.mark.parametrize("user_data", [None, b"", b"\x00sticky"])
def test_subscription_round_trip(version: int, user_data: bytes | None) -> None:
    data = subscription_bytes(version, ["orders", "payments"], user_data, OWNED, 7, "rack-1")
    sub = consumer.decode_subscription(data)
    assert sub.version == version and sub.trailing == b""
    b = sub.body
    assert b.topics == ("orders", "payments") and b.user_data == user_data
    if version >= 1:
        assert [(tp.topic, tp.partitions) for tp in b.owned_partitions] == [
            ("orders", (0, 2)), ("payments", (1,))]
    else:
        assert b.owned_partitions == ()
    assert b.generation_id == (7 if version >= 2 else -1)
    assert b.rack_id == ("rack-1" if version >= 3 else None)
    assert sub.encode() == data
    built = consumer.subscription(
        version, topics=("orders", "payments"), user_data=user_data,
        owned_partitions=tuple(TP(topic=t, partitions=tuple(p)) for t, p in OWNED),
        generation_id=7, rack_id="rack-1")
    assert built.encode() == data  # fields newer than the version are ignorable: dropped


@pytest.mark.parametrize("version", [0, 1, 2, 3])
@pytest.mark.parametrize("user_data", [None, b"", b"\x01\x02"])
def test_assignment_round_trip(version: int, user_data: bytes | None) -> None:
    data = assignment_bytes(version, ASSIGNED, user_data)
    asg = consumer.decode_assignment(data)
    assert asg.version == version
    assert [(tp.topic, tp.partitions) for tp in asg.body.assigned_partitions] == [
        ("orders", (0, 1, 2)), ("payments", ())]
    assert asg.body.user_data == user_data
    assert asg.encode() == data
    built = consumer.assignment(version, user_data=user_data, assigned_partitions=tuple(
        ATP(topic=t, partitions=tuple(p)) for t, p in ASSIGNED))
    assert built.encode() == data


@pytest.mark.parametrize("version", [4, 99, 32767])
def test_newer_versions_keep_their_trailing_bytes(version: int) -> None:
    # As Kafka does: read a newer version as the newest known, ignore what follows.
    tail = b"\x00\x00\x00\x2a" + s16("future-field")
    data = subscription_bytes(3, ["t"], None, [], 1, None)
    newer = i16(version) + data[2:] + tail
    sub = consumer.decode_subscription(newer)
    assert sub.version == version and sub.body.topics == ("t",) and sub.trailing == tail
    assert sub.encode() == newer
    renamed = sub.replace(body=sub.body.replace(topics=("renamed",)))
    assert renamed.encode() == i16(version) + subscription_bytes(3, ["renamed"], None, [], 1, None)[2:] + tail
    asg_data = i16(version) + assignment_bytes(3, [("t", [0])], b"u")[2:] + tail
    asg = consumer.decode_assignment(asg_data)
    assert asg.trailing == tail and asg.encode() == asg_data
    # A newer version with nothing new in it.
    plain = i16(version) + data[2:]
    assert consumer.decode_subscription(plain).trailing == b""
    assert consumer.decode_subscription(plain).encode() == plain


def test_malformed_payloads() -> None:
    good = subscription_bytes(3, ["t"], None, [], 1, None)
    with pytest.raises(codecs.RemoteProtocolError):
        consumer.decode_subscription(good + b"\x00")  # extra bytes in a known version
    with pytest.raises(codecs.RemoteProtocolError):
        consumer.decode_subscription(i16(-1) + good[2:])  # negative version
    for short in (b"", b"\x00"):
        with pytest.raises(codecs.RemoteProtocolError):
            consumer.decode_assignment(short)
    for cut in range(2, len(good)):
        with pytest.raises(codecs.RemoteProtocolError) as info:
            consumer.decode_subscription(good[:cut])
        err = info.value
        assert err.path and err.offset is not None and 2 <= err.offset <= cut
        assert err.api_name == "ConsumerProtocolSubscription" and err.api_version == 3
    with pytest.raises(codecs.RemoteProtocolError) as huge:
        consumer.decode_subscription(i16(0) + i32(2**31 - 1))
    assert huge.value.path == ("Topics",)


# -- embedded in the group APIs ---------------------------------------------------------------


def _join_group_v5(metadata: bytes) -> bytes:
    header = struct.pack(">hhih", 11, 5, 9, 1) + b"c"
    return (header + s16("group") + i32(10000) + i32(300000) + s16("") + s16(None)
            + s16("consumer") + i32(1) + s16("range") + nbytes(metadata))


def test_subscription_inside_a_join_group_request() -> None:
    metadata = subscription_bytes(1, ["orders"], b"ud", [("orders", [3])], -1, None)
    frame = _join_group_v5(metadata)
    req = codecs.decode_request(frame)
    assert req.body.protocol_type == consumer.CONSUMER_PROTOCOL_TYPE
    (protocol,) = req.body.protocols
    sub = consumer.decode_subscription(protocol.metadata)
    assert sub.version == 1 and sub.body.topics == ("orders",)
    # rename the topic inside, put the bytes back, re-encode the request
    owned = tuple(tp.replace(topic="prefix.orders") for tp in sub.body.owned_partitions)
    new_meta = sub.replace(body=sub.body.replace(topics=("prefix.orders",),
                                                 owned_partitions=owned)).encode()
    changed = req.replace(body=req.body.replace(protocols=(protocol.replace(metadata=new_meta),)))
    expected = _join_group_v5(subscription_bytes(1, ["prefix.orders"], b"ud",
                                                 [("prefix.orders", [3])], -1, None))
    assert bytes(changed.encode()) == expected


def test_subscription_inside_a_join_group_response() -> None:
    metadata = subscription_bytes(3, ["a", "b"], None, [], 5, "r")
    body = (i32(0) + i16(0) + i32(5) + s16("range") + s16("m-1") + s16("m-1")
            + i32(1) + s16("m-1") + s16(None) + nbytes(metadata))
    resp = codecs.decode_response(i32(9) + body, 11, 5)
    sub = consumer.decode_subscription(resp.body.members[0].metadata)
    assert (sub.body.topics, sub.body.generation_id, sub.body.rack_id) == (("a", "b"), 5, "r")


def _sync_group_response_v5(assignment: bytes) -> bytes:
    # flexible: response header v1 (tags), compact strings, compact bytes
    def cstr(text: str) -> bytes:
        return bytes([len(text) + 1]) + text.encode()

    return (i32(9) + b"\x00" + i32(0) + i16(0) + cstr("consumer") + cstr("range")
            + bytes([len(assignment) + 1]) + assignment + b"\x00")


def test_assignment_inside_a_sync_group_response() -> None:
    assignment = assignment_bytes(0, [("orders", [0, 1])], None)
    frame = _sync_group_response_v5(assignment)
    resp = codecs.decode_response(frame, 14, 5)
    asg = consumer.decode_assignment(resp.body.assignment)
    assert [(tp.topic, tp.partitions) for tp in asg.body.assigned_partitions] == [("orders", (0, 1))]
    moved = asg.replace(body=asg.body.replace(assigned_partitions=(
        asg.body.assigned_partitions[0].replace(topic="o2"),))).encode()
    changed = resp.replace(body=resp.body.replace(assignment=moved))
    assert bytes(changed.encode()) == _sync_group_response_v5(
        assignment_bytes(0, [("o2", [0, 1])], None))
    assert resp.encode() is frame


def test_assignments_inside_a_sync_group_request() -> None:
    spec = codecs.api(14).request
    assignments = tuple(
        spec.structs["SyncGroupRequestAssignment"].cls(
            member_id=f"m-{i}", assignment=consumer.assignment(
                3, assigned_partitions=(ATP(topic="t", partitions=(i,)),)).encode())
        for i in range(3))
    body = spec.root.cls(group_id="g", generation_id=1, member_id="m-0", protocol_type="consumer",
                         protocol_name="range", assignments=assignments)
    frame = bytes(codecs.Request.build(14, 5, 1, "c", body).encode())
    back = codecs.decode_request(frame)
    got = [consumer.decode_assignment(a.assignment) for a in back.body.assignments]
    assert [a.body.assigned_partitions[0].partitions for a in got] == [(0,), (1,), (2,)]
    assert [a.encode() for a in got] == [a.assignment for a in assignments]


def test_payloads_inside_describe_groups() -> None:
    spec = codecs.api(15).response
    sub = subscription_bytes(2, ["x"], None, [], 3, None)
    asg = assignment_bytes(2, [("x", [0])], None)
    member: Any = spec.structs["DescribedGroupMember"].cls(
        member_id="m", client_id="c", client_host="/10.0.0.1", member_metadata=sub,
        member_assignment=asg)
    group = spec.structs["DescribedGroup"].cls(
        group_id="g", group_state="Stable", protocol_type="consumer", protocol_data="range",
        members=(member,))
    frame = bytes(codecs.Response.build(15, 5, 1, spec.root.cls(groups=(group,))).encode())
    m = codecs.decode_response(frame, 15, 5).body.groups[0].members[0]
    assert consumer.decode_subscription(m.member_metadata).encode() == sub
    assert consumer.decode_assignment(m.member_assignment).encode() == asg
