"""The Produce fast path reads what the full decoder reads, for every version, or gives up.

Bodies come from the codec's own Hypothesis strategies (every field, unknown tagged
fields, nullable values); records are real batch headers, partial batches, or noise.
"""

from __future__ import annotations

import struct
from collections import Counter
from functools import partial
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import ProtocolError, produce, records
from gatehouse.codecs._native import speedups
from gatehouse.metrics import error_codes
from tests.codec_strategies import build_message, examples, header_tags, message_body
from tests.support.walks import feed_in_pieces

VERSIONS = list(codecs.api(0).request.valid)
SETTINGS = settings(max_examples=examples(80), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def batch(count: int, magic: int = 2, payload: int = 8) -> bytes:
    """A record batch header claiming ``count`` records (the counters read headers only)."""
    if magic == 2:
        body = struct.pack(">hiqqqhii", 0, 0, 0, 0, -1, -1, -1, count) + b"\x00" * payload
        return struct.pack(">qii", 0, 9 + len(body), 0) + b"\x02" + struct.pack(">I", 0) + body
    rest = b"\x00" * (payload + (8 if magic == 1 else 0))
    return struct.pack(">qiIbb", 0, 6 + len(rest), 0, magic, 0) + rest


RECORDS = st.one_of(
    st.none(),
    st.binary(max_size=40),
    # One v2 batch whose length takes 2, 3 or 4 varint bytes (flexible versions).
    st.builds(batch, st.integers(0, 500), st.just(2), st.sampled_from([100, 16_400, 2_097_200])),
    st.lists(st.builds(batch, st.integers(0, 500), st.sampled_from([0, 1, 2]),
                       st.integers(0, 30)), max_size=3).map(b"".join),
    st.tuples(st.builds(batch, st.integers(1, 9)), st.binary(min_size=1, max_size=70)).map(
        lambda parts: parts[0] + parts[1]),  # a partial batch at the end (or noise)
)


def topic_counts(key: Any, indexes: list[int], record_sets: list[Any]
                 ) -> tuple[Any, list[int], int, int]:
    """What a byte reader must say of one topic (``codecs.produce.TopicCounts``), from its
    decoded partitions' indexes and records fields, by the batch-header summaries."""
    summaries = [records.summarize(data) for data in record_sets]
    return key, indexes, sum(s.records for s in summaries), sum(s.bytes for s in summaries)


def expected_topics(req: codecs.Request) -> list[tuple[Any, list[int], int, int]] | None:
    out = []
    try:
        for topic in req.body.topic_data:
            key = topic.topic_id.bytes if req.api_version >= 13 else topic.name
            out.append(topic_counts(key, [p.index for p in topic.partition_data],
                                    [p.records for p in topic.partition_data]))
    except ProtocolError:
        return None  # the full decoder refuses: the fast path must give up too
    return out


def draw_request_frame(data: st.DataObject, version: int) -> bytes:
    """A Produce request of ``version`` from the codec's strategies, its records fields
    drawn from RECORDS, its client id and header tags drawn too."""
    body = data.draw(message_body(codecs.api(0).request, version))
    topics = []
    for topic in body.topic_data:
        parts = tuple(p.replace(records=data.draw(RECORDS)) for p in topic.partition_data)
        topics.append(topic.replace(partition_data=parts))
    body = body.replace(topic_data=tuple(topics))
    client_id = data.draw(st.one_of(st.none(), st.text(max_size=8)))
    tags = data.draw(header_tags(version >= 9))
    return bytes(build_message(0, version, "request", body, client_id=client_id,
                               tags=tags).encode())

# The versions the byte readers read (v0-2, which Kafka 4.0 removed and 3.x brokers
# serve, go to the decoder).
WALKED = [v for v in VERSIONS if v >= produce.FIRST_VERSION]


@pytest.mark.parametrize("version", WALKED)
@SETTINGS
@given(data=st.data())
def test_request_topics_match_the_decoder(version: int, data: st.DataObject) -> None:
    frame = draw_request_frame(data, version)
    req = codecs.decode_request(frame)
    assert produce.request_topics(frame, version) == expected_topics(req)


@pytest.mark.parametrize("version", [v for v in VERSIONS if v < produce.FIRST_VERSION])
def test_versions_before_the_byte_readers_go_to_the_decoder(version: int) -> None:
    """Produce v0-2 have no transactional id before the acks: the byte readers leave
    them to the decoder (None), which reads them."""
    request = codecs.request_from_dict({
        "header": {"api_key": 0, "api_version": version, "correlation_id": 1,
                   "client_id": "old"},
        "body": {"acks": 1, "timeout_ms": 1000, "topic_data": [
            {"name": "orders", "partition_data": [{"index": 0, "records": None}]}]}})
    frame = bytes(request.encode())
    assert produce.request_topics(frame, version) is None
    assert produce.rename_request_topics(frame, version, str.upper, str.upper) is None
    assert produce.rename_request_head(frame, version, str.upper) is None
    assert codecs.decode_request(frame).body.topic_data[0].name == "orders"
    answer = bytes(codecs.response_from_dict(
        {"header": {"correlation_id": 1}, "body": {"responses": [
            {"name": "orders", "partition_responses": [{"index": 0, "error_code": 0}]}]}},
        api_key=0, api_version=version).encode())
    assert produce.response_scan(answer, version) is None
    assert produce.rename_response_topics(answer, version, str.upper) is None


@pytest.mark.parametrize("version", WALKED)
@SETTINGS
@given(data=st.data())
def test_a_walk_that_skips_records_counts_what_the_reader_counts(
        version: int, data: st.DataObject) -> None:
    """A Produce request walked in pieces, its batches' records skipped at random, says
    what ``request_topics`` says of the whole frame, and what it skipped holds nothing
    the reader reads (the same frame with those bytes changed reads the same)."""
    frame = draw_request_frame(data, version)
    expected = produce.request_topics(frame, version)
    try:
        walk = produce.RequestWalk(version, len(frame))
        _, skipped = feed_in_pieces(walk, frame, data)
    except records.Uncounted:  # produce's Unexpected: what the reader gives up on too
        assert expected is None
        return
    assert walk.topics() == expected
    if expected is not None:
        assert walk.finished and not walk.opaque
    mangled = bytearray(frame)
    for start, end in skipped:
        mangled[start:end] = b"\x5a" * (end - start)
    assert produce.request_topics(bytes(mangled), version) == expected


@pytest.mark.parametrize("version", WALKED)
def test_a_walk_of_a_frame_cut_short_or_padded_counts_nothing(version: int) -> None:
    topic_id = codecs.schema.uuid.UUID(int=5)
    batch_bytes = batch(7, payload=500)
    frame = bytes(codecs.request_from_dict({
        "header": {"api_key": 0, "api_version": version, "correlation_id": 1,
                   "client_id": "app"},
        "body": {"transactional_id": None, "acks": -1, "timeout_ms": 1000,
                 "topic_data": [{**({"topic_id": str(topic_id)} if version >= 13
                                    else {"name": "t"}),
                                 "partition_data": [{"index": 3, "records": batch_bytes}]}]},
    }).encode())
    key = topic_id.bytes if version >= 13 else "t"
    expected = [(key, [3], 7, len(batch_bytes))]
    assert produce.request_topics(frame, version) == expected
    skipping = produce.RequestWalk(version, len(frame))
    pos = skipping.feed(frame[:-400])  # the batch's header and some of its records
    assert pos == len(frame) - 400 and skipping.opaque > 0
    pos += skipping.opaque
    skipping.skip(skipping.opaque)
    assert skipping.feed(frame[pos:]) == len(frame) - pos
    assert skipping.topics() == expected
    short = produce.RequestWalk(version, len(frame) + 1)  # the frame said it was longer
    assert short.feed(frame) == len(frame) and short.topics() is None
    with pytest.raises(records.Uncounted):  # records past the frame's end
        produce.RequestWalk(version, len(frame) - 100).feed(frame)
    with pytest.raises(ValueError):
        produce.RequestWalk(version, len(frame)).skip(1)  # no records to skip yet
    with pytest.raises(ValueError):
        produce.RequestWalk(2, len(frame))  # too old to walk


@pytest.mark.parametrize("version", [v for v in WALKED if v >= produce.FLEXIBLE_SINCE])
@pytest.mark.parametrize("reader", ["c", "python"])
def test_a_flexible_walk_ends_at_the_last_batch_header(version: int, reader: str) -> None:
    """In flexible versions the walk ends at the header of the last topic's last
    partition's batch, the frame's three last bytes (its empty tag sections) skipped with
    the records: nothing after the records is read, so a proxy need not peek past them.
    ``request_topics`` takes those three bytes as read too, well-formed or not (the
    broker's to refuse), and reads a longer tail as ever."""
    if reader == "c" and speedups is None:
        pytest.skip("the C readers are not built here")
    topics = [{**({"topic_id": str(codecs.schema.uuid.UUID(int=n))} if version >= 13
                  else {"name": name}),
               "partition_data": [{"index": i, "records": batch(7 + i, payload=900)}
                                  for i in range(n)]}
              for n, name in ((2, "a"), (1, "b"))]
    frame = bytes(codecs.request_from_dict({
        "header": {"api_key": 0, "api_version": version, "correlation_id": 1,
                   "client_id": "app"},
        "body": {"transactional_id": None, "acks": -1, "timeout_ms": 1000,
                 "topic_data": topics},
    }).encode())
    assert frame[-3:] == b"\x00\x00\x00"
    reads = ((lambda f: produce._request_topics(f, version, None, True)) if reader == "python"
             else (lambda f: produce.request_topics(f, version)))
    expected = reads(frame)
    assert expected is not None and [t[2] for t in expected] == [15, 7]
    last = len(frame) - 3 - (len(batch(7, payload=900)) - records.BATCH_OVERHEAD)
    walk = produce.RequestWalk(version, len(frame))
    feed = walk.feed if reader == "c" else partial(produce.StepWalk.feed, walk)
    at = 0
    for _ in range(3):  # the parts between the records, the records skipped
        at += feed(frame[at:last])
        if walk.finished:
            break
        at += walk.opaque
        walk.skip(walk.opaque)
    assert walk.finished and at == last and walk.opaque == len(frame) - last  # the last records and tail
    walk.skip(walk.opaque)
    assert walk.topics() == expected
    for tail in (b"\x01\x00\x00", b"\xff\xff\xff"):  # not well-formed: not looked at
        assert reads(frame[:-3] + tail) == expected
    assert reads(frame + b"\x00") is None  # four bytes after the records: read, refused
    tagged = frame[:-1] + b"\x01\x05\x01\x00"  # a tagged field of its own: read
    assert reads(tagged) == expected
    assert reads(tagged[:-1] + b"\x02\x00") is None


@pytest.mark.parametrize("version", WALKED)
@SETTINGS
@given(data=st.data())
def test_response_codes_match_the_decoder(version: int, data: st.DataObject) -> None:
    body = data.draw(message_body(codecs.api(0).response, version))
    tags = data.draw(header_tags(version >= 9))
    frame = bytes(build_message(0, version, "response", body, tags=tags).encode())
    resp = codecs.decode_response(frame, 0, version)
    scan = produce.response_scan(frame, version)
    assert scan is not None and scan[0] == dict(Counter(error_codes(resp)))
    # Error text (what a topic rename rewrites) is seen wherever the decoder finds it.
    partitions = [p for topic in resp.body.responses for p in topic.partition_responses]
    assert scan[2] == any(p.error_message is not None or p.record_errors for p in partitions)


@pytest.mark.parametrize("version", VERSIONS)
@SETTINGS
@given(data=st.data())
def test_a_renamed_head_and_the_rest_as_it_came_make_the_renamed_request(
        version: int, data: st.DataObject) -> None:
    """``rename_request_head`` over any first bytes of a request: where it answers, its
    bytes and the rest of the request as it came are the whole request renamed (topic
    names, and the transactional id if one is to be renamed too); it answers for every
    request naming one topic by name (or, with a transactional id to rename, naming
    topics by id) once what it renames has arrived."""
    body = data.draw(message_body(codecs.api(0).request, version))
    if data.draw(st.booleans()):
        body = body.replace(topic_data=body.topic_data[:1])
    tags = data.draw(header_tags(version >= 9))
    frame = bytes(build_message(0, version, "request", body, tags=tags).encode())
    prefix = data.draw(st.text(max_size=300))

    def rename(name: str) -> str:
        return prefix + name

    transaction = rename if data.draw(st.booleans()) else None
    whole = produce.rename_request_topics(frame, version, rename, transaction)
    one_by_name = whole is not None and (
        (len(body.topic_data) == 1 and version < 13)
        or (version >= 13 and transaction is not None))
    answered = []
    for cut in sorted({len(frame), *data.draw(st.lists(st.integers(0, len(frame))))}):
        head = produce.rename_request_head(frame[:cut], version, rename, transaction)
        if head is not None:
            new, end = head
            assert one_by_name and end <= cut
            assert new + frame[end:] == bytes(whole)  # type: ignore[arg-type]
        answered.append(head is not None)
    assert answered[-1] == one_by_name  # the whole request: answered if it can be
    assert answered == sorted(answered)  # more bytes never take an answer back


@pytest.mark.parametrize("version", WALKED)
def test_truncated_or_padded_frames_fall_back(version: int) -> None:
    body = codecs.api(0).request.root.cls(
        transactional_id=None, acks=-1, timeout_ms=1000, topic_data=())
    frame = bytes(build_message(0, version, "request", body).encode())
    assert produce.request_topics(frame, version) == []
    for bad in (frame[:-1], frame + b"\x00"):
        assert produce.request_topics(bad, version) is None
    resp = codecs.api(0).response.root.cls(responses=(), throttle_time_ms=0)
    answer = bytes(build_message(0, version, "response", resp).encode())
    assert produce.response_scan(answer, version) == ({}, (), False)
    assert produce.response_scan(answer[:-1], version) is None


@SETTINGS
@given(data=RECORDS, mangle=st.integers(0, 80), to=st.integers(0, 255))
def test_records_and_bytes_count_what_summarize_counts(data: bytes | None, mangle: int,
                                                       to: int) -> None:
    # The reader of the Fetch counters and of the capture: the same counts as the full
    # batch-header walk, and the same refusals (a byte changed anywhere in the first
    # headers included).
    if data and mangle < len(data):
        data = data[:mangle] + bytes([to]) + data[mangle + 1:]
    try:
        summary = records.summarize(data)
    except ProtocolError:
        with pytest.raises(ProtocolError):
            records.records_and_bytes(data)
        return
    assert records.records_and_bytes(data) == (summary.records, summary.bytes)


@pytest.mark.parametrize("version", [10, 12, 13])
def test_response_scan_names_the_top_level_tags(version: int) -> None:
    """NodeEndpoints (tag 0, KIP-951) is what the proxy must rewrite: the scan says when
    a Produce response carries it."""
    spec = codecs.api(0).response
    plain = spec.root.cls(responses=(), throttle_time_ms=0)
    frame = bytes(build_message(0, version, "response", plain).encode())
    assert produce.response_scan(frame, version) == ({}, (), False)
    node = spec.root.field("NodeEndpoints").struct.cls(node_id=2, host="k2", port=9092, rack=None)
    moved = plain.replace(node_endpoints=(node,))
    frame = bytes(build_message(0, version, "response", moved).encode())
    assert produce.response_scan(frame, version) == ({}, (0,), False)
