"""Fuzzing the decoders: random bytes and mutated valid frames, for every API.

Whatever the bytes, decoding raises nothing but ``codecs.ProtocolError`` (subclasses
allowed) -- never struct.error, IndexError, MemoryError, RecursionError, never a hang --
and the error says where: API key and version, field path and byte offset.  A mutated
frame that still decodes must be re-encodable, and its re-encoding is a fixed point.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import consumer, records
from tests.codec_strategies import (
    ALL_CASES,
    ALL_VERSIONS,
    build_message,
    case_id,
    decode_frame,
    examples,
    from_plain,
    message_spec,
    random_body,
)

API_VERSIONS = 18
MUTATIONS = 24  # per valid frame; two frames per (API, version, direction)

HUGE_INT32 = (b"\x7f\xff\xff\xff", b"\xff\xff\xff\xff", b"\x80\x00\x00\x00", b"\x00\x10\x00\x00")
HUGE_VARINTS = (b"\xff\xff\xff\xff\x0f", b"\xfe\xff\xff\xff\x07", b"\x80\x80\x80\x80\x80\x01")


def mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    kind = rng.randrange(8)
    if kind == 0:  # flip 1-3 bits
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        del data[rng.randrange(len(data)):]
    elif kind == 2:  # an int32 length (or anything) set huge / negative
        pos = rng.randrange(len(data))
        data[pos:pos + 4] = rng.choice(HUGE_INT32)
    elif kind == 3:  # an int16 length set huge / negative
        pos = rng.randrange(len(data))
        data[pos:pos + 2] = rng.choice((b"\x7f\xff", b"\xff\xfe", b"\x80\x00"))
    elif kind == 4:  # a huge (or over-long) varint in place of a byte
        pos = rng.randrange(len(data))
        data[pos:pos + 1] = rng.choice(HUGE_VARINTS)
    elif kind == 5:  # insert random bytes
        pos = rng.randrange(len(data) + 1)
        data[pos:pos] = rng.randbytes(rng.randint(1, 6))
    elif kind == 6:  # delete a few bytes in the middle
        pos = rng.randrange(len(data))
        del data[pos:pos + rng.randint(1, 6)]
    else:  # one byte set to a boundary value
        data[rng.randrange(len(data))] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF))
    return bytes(data)


def check_error(err: codecs.ProtocolError, frame: bytes, api_key: int) -> None:
    """The error names the API and version, the field and the byte."""
    assert isinstance(err, codecs.ProtocolError)
    assert str(err)  # renders
    if isinstance(err, codecs.UnknownApi):
        assert err.api_key is not None and err.api_version is not None
        return
    if err.api_key is not None:  # not before the API is known (a frame of < 8 bytes)
        assert err.api_key == api_key
        assert err.api_version is not None
        assert err.api_name or api_key not in codecs.APIS
        assert err.path or "after the body" in err.reason, err
        assert all(isinstance(p, str) and p for p in err.path)
    assert err.offset is not None, err
    assert 0 <= err.offset <= len(frame), (err.offset, len(frame), err)


def decode_fully(frame: bytes, api_key: int, version: int, direction: str) -> Any:
    """Decode header and body; ProtocolError is checked and re-raised."""
    header_key = api_key
    if direction == "request" and len(frame) >= 2:
        header_key = struct.unpack_from(">h", frame)[0]
    try:
        msg = decode_frame(frame, api_key, version, direction)
        msg.body  # noqa: B018
    except codecs.ProtocolError as err:
        check_error(err, frame, header_key)
        raise
    return msg


def check_canonical(msg: Any, api_key: int, direction: str) -> None:
    """A frame that decodes can be written back, and the rewrite is a fixed point."""
    plain = codecs.to_dict(msg)
    key = msg.api_key if direction == "request" else api_key
    once = bytes(from_plain(plain, key, msg.api_version, direction).encode())
    back = decode_frame(once, key, msg.api_version, direction)
    twice = bytes(from_plain(codecs.to_dict(back), key, back.api_version, direction).encode())
    assert once == twice


def fuzz_one(data: bytes, api_key: int, version: int, direction: str) -> bool:
    """Decode; on success check the message is re-encodable.  Whether it decoded."""
    try:
        msg = decode_fully(data, api_key, version, direction)
    except codecs.ProtocolError:
        return False
    if msg.known:
        check_canonical(msg, api_key, direction)
    return True


@pytest.mark.parametrize(("api_key", "version", "direction"), ALL_CASES, ids=map(case_id, ALL_CASES))
def test_mutated_frames(api_key: int, version: int, direction: str) -> None:
    rng = random.Random(f"{api_key}/{version}/{direction}")
    spec = message_spec(api_key, direction)
    for _ in range(2):
        body = random_body(spec, version, rng)
        frame = bytes(build_message(api_key, version, direction, body).encode())
        for _ in range(MUTATIONS):
            fuzz_one(mutate(frame, rng), api_key, version, direction)


@pytest.mark.parametrize(("api_key", "version"), ALL_VERSIONS[::3])
def test_every_truncation_fails(api_key: int, version: int) -> None:
    """Cut anywhere, a frame cannot decode (the parse needs the bytes it had)."""
    rng = random.Random(api_key * 1000 + version)
    for direction in ("request", "response"):
        body = random_body(message_spec(api_key, direction), version, rng)
        frame = bytes(build_message(api_key, version, direction, body).encode())
        for cut in range(len(frame)):
            if direction == "response" and api_key == API_VERSIONS:
                with pytest.raises(codecs.ProtocolError):  # may fit v0: then not at all
                    decode_fully(frame[:cut], api_key, version, direction)
                    raise codecs.ProtocolError("fits the v0 fallback layout")
                continue
            with pytest.raises(codecs.ProtocolError):
                decode_fully(frame[:cut], api_key, version, direction)


# -- random bytes --------------------------------------------------------------------------


fuzz_settings = settings(max_examples=examples(300), deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))


@fuzz_settings
@given(st.binary(max_size=120))
def test_random_bytes_as_a_request(data: bytes) -> None:
    fuzz_one(data, 0, 0, "request")


@fuzz_settings
@given(st.sampled_from(ALL_VERSIONS), st.binary(max_size=120))
def test_random_body_after_a_valid_request_header(api: tuple[int, int], body: bytes) -> None:
    api_key, version = api
    header = struct.pack(">hhih", api_key, version, 1, 1) + b"c"
    if codecs.api(api_key).request_header_version(version) == 2:
        header += b"\x00"
    fuzz_one(header + body, api_key, version, "request")


@fuzz_settings
@given(st.sampled_from(ALL_VERSIONS), st.binary(max_size=120))
def test_random_bytes_as_a_response(api: tuple[int, int], data: bytes) -> None:
    api_key, version = api
    fuzz_one(data, api_key, version, "response")


@pytest.mark.parametrize(("api_key", "version"), ALL_VERSIONS)
def test_random_bytes_as_every_response(api_key: int, version: int) -> None:
    rng = random.Random(f"resp/{api_key}/{version}")
    for _ in range(20):
        data = struct.pack(">i", 1) + rng.randbytes(rng.randrange(60))
        fuzz_one(data, api_key, version, "response")


def test_decode_response_of_an_unknown_api() -> None:
    resp = codecs.decode_response(b"\x00\x00\x00\x01abc", 9999, 0)
    assert resp.correlation_id == 1 and not resp.known
    with pytest.raises(codecs.UnknownApi) as info:
        resp.body  # noqa: B018
    assert (info.value.api_key, info.value.api_version) == (9999, 0)
    for short in (b"", b"\x00", b"\x00\x00\x00"):
        with pytest.raises(codecs.RemoteProtocolError) as err:
            codecs.decode_response(short, 3, 12)
        assert err.value.offset == 0
        with pytest.raises(codecs.RemoteProtocolError):
            codecs.decode_request(short)


# -- lengths that lie ------------------------------------------------------------------------


def _req(api_key: int, version: int, body: bytes) -> bytes:
    header = struct.pack(">hhih", api_key, version, 1, 1) + b"c"
    if codecs.api(api_key).request_header_version(version) == 2:
        header += b"\x00"
    return header + body


LYING_LENGTHS: list[tuple[str, bytes, tuple[str, ...]]] = [
    # Metadata v9: a compact topics array claiming a million entries in 3 bytes
    ("compact array", _req(3, 9, b"\xc1\x84\x3d\x00"), ("Topics",)),
    # Metadata v8: int32 array count 2**31 - 1
    ("int32 array", _req(3, 8, b"\x7f\xff\xff\xff\x01\x00\x00"), ("Topics",)),
    # Metadata v8: one topic whose name claims 32767 bytes
    ("int16 string", _req(3, 8, b"\x00\x00\x00\x01\x7f\xff" + b"ab"), ("Topics", "Name")),
    # Produce v8: records claiming 2 GiB
    ("int32 records", _req(0, 8, b"\xff\xff" + b"\x00\x01" + b"\x00\x00\x03\xe8"
                                     + b"\x00\x00\x00\x01" + b"\x00\x01t" + b"\x00\x00\x00\x01"
                                     + b"\x00\x00\x00\x00" + b"\x7f\xff\xff\xff"),
     ("TopicData", "PartitionData", "Records")),
    # SaslAuthenticate v2: compact bytes of 2**32 - 2
    ("uvarint bytes", _req(36, 2, b"\xff\xff\xff\xff\x0f" + b"\x00"), ("AuthBytes",)),
    # Metadata v0 (topics not nullable): int32 array count -2
    ("negative count", _req(3, 0, b"\xff\xff\xff\xfe"), ("Topics",)),
    # ... and -1, null, where null is not allowed
    ("null count", _req(3, 0, b"\xff\xff\xff\xff"), ("Topics",)),
    # ApiVersions v3: a tagged field claiming more bytes than are left
    ("tag size", _req(18, 3, b"\x01\x01" + b"\x01" + b"\x05\x10ab"), ("_tagged_fields",)),
]


@pytest.mark.parametrize(("what", "frame", "path"), LYING_LENGTHS, ids=[c[0] for c in LYING_LENGTHS])
def test_lengths_larger_than_the_frame_are_errors(what: str, frame: bytes,
                                                  path: tuple[str, ...]) -> None:
    req = codecs.decode_request(frame)
    with pytest.raises(codecs.RemoteProtocolError) as info:
        req.body  # noqa: B018
    err = info.value
    assert (err.api_key, err.api_version) == (req.api_key, req.api_version)
    assert err.api_name == req.api.name
    assert err.path == path
    assert err.offset is not None and req._body_offset <= err.offset <= len(frame)


def test_any_negative_length_is_null_where_null_is_allowed() -> None:
    """As Kafka's generated readers do (``if (length < 0) x = null``)."""
    req = codecs.decode_request(_req(3, 8, b"\xff\xff\xff\xfe\x01\x00\x00"))
    assert req.body.topics is None
    assert bytes(codecs.request_from_dict(codecs.to_dict(req)).encode()) == _req(
        3, 8, b"\xff\xff\xff\xff\x01\x00\x00")  # written back as the canonical -1


def test_error_offsets_inside_tagged_fields_are_frame_offsets() -> None:
    # ApiVersions v3 response, SupportedFeatures (tag 0) holding a name that is not UTF-8.
    feature = b"\x02" + b"\x03\xff\xfe" + b"\x00\x00\x00\x01" + b"\x00"
    body = b"\x00\x00" + b"\x01" + b"\x00\x00\x00\x00" + b"\x01\x00" + bytes([len(feature)]) + feature
    frame = b"\x00\x00\x00\x01" + body
    with pytest.raises(codecs.RemoteProtocolError) as info:
        codecs.decode_response(frame, 18, 3).body  # noqa: B018
    err = info.value
    assert err.path == ("SupportedFeatures", "Name") and err.offset is not None
    assert frame[err.offset:err.offset + 2] == b"\xff\xfe"  # where the bad string starts


# -- the other decoders ----------------------------------------------------------------------


DECODERS: list[tuple[str, Callable[[bytes], Any]]] = [
    ("subscription", consumer.decode_subscription),
    ("assignment", consumer.decode_assignment),
    ("records.summarize", records.summarize),
    ("records.iter_batches", lambda data: list(records.iter_batches(data))),
]


@pytest.mark.parametrize(("name", "decode"), DECODERS, ids=[d[0] for d in DECODERS])
@settings(max_examples=examples(150), deadline=None, database=None)
@given(data=st.binary(max_size=100))
def test_other_decoders_raise_only_protocol_errors(name: str, decode: Callable[[bytes], Any],
                                                   data: bytes) -> None:
    try:
        decode(data)
    except codecs.ProtocolError as err:
        assert err.offset is not None or name in ("subscription", "assignment")


@pytest.mark.parametrize("spec", [consumer.SUBSCRIPTION, consumer.ASSIGNMENT], ids=lambda s: s.name)
def test_mutated_consumer_protocol_payloads(spec: codecs.MessageSpec) -> None:
    rng = random.Random(spec.name)
    decode = consumer.decode_subscription if spec is consumer.SUBSCRIPTION else consumer.decode_assignment
    for version in spec.valid:
        data = consumer.ConsumerProtocolData(spec, version, random_body(spec, version, rng)).encode()
        for _ in range(200):
            mutated = mutate(data, rng)
            try:
                decoded = decode(mutated)
            except codecs.ProtocolError as err:
                assert err.offset is not None and 0 <= err.offset <= len(mutated)
                continue
            again = decoded.encode()
            assert decode(again).encode() == again
