"""codecs.fetch.response_scan against the full decoder: the same error codes, the same
records and bytes per topic, the same top-level tags, on random Fetch responses of every
flexible version; None (the decoder takes over) for anything else."""

from __future__ import annotations

from collections import Counter
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import ProtocolError, fetch
from gatehouse.metrics import error_codes
from tests.codec_strategies import build_message, examples, header_tags, message_body
from tests.support.walks import feed_in_pieces
from tests.test_metrics_produce import RECORDS, SETTINGS, batch, topic_counts

VERSIONS = [v for v in codecs.api(1).response.valid if v >= fetch.FIRST_VERSION]


def expected(resp: codecs.Response) -> Any:
    """What the scan must say, from the decoded response; None where the decoder (or the
    batch-header walk) refuses: the scan must give up too."""
    topics = []
    try:
        for topic in resp.body.responses:
            key = topic.topic_id.bytes if resp.api_version >= 13 else topic.topic
            topics.append(topic_counts(key, [p.partition_index for p in topic.partitions],
                                       [p.records for p in topic.partitions]))
    except ProtocolError:
        return None
    tags = (0,) if resp.api_version >= 16 and resp.body.node_endpoints else ()
    return dict(Counter(error_codes(resp))), tags, topics


def frame_of(version: int, body: Any, tags: Any = ()) -> bytes:
    return bytes(build_message(1, version, "response", body, tags=tags).encode())


# What a broker's answer holds: whole v2 batches, the last maybe cut short (at any byte:
# inside its header or after it), besides what RECORDS draws.
FETCHED_RECORDS = st.one_of(RECORDS, st.tuples(
    st.lists(st.builds(batch, st.integers(0, 500), st.just(2), st.integers(0, 200)), max_size=4),
    st.builds(batch, st.integers(1, 9), st.just(2), st.integers(0, 300)),
    st.integers(1, 400),
).map(lambda parts: b"".join(parts[0]) + parts[1][:min(parts[2], len(parts[1]) - 1)]))


def draw_response_frame(data: st.DataObject, version: int) -> bytes:
    """A Fetch response of ``version`` from the codec's strategies, its records fields
    drawn from FETCHED_RECORDS, its header tags drawn too."""
    body = data.draw(message_body(codecs.api(1).response, version))
    topics = []
    for topic in body.responses:
        parts = tuple(p.replace(records=data.draw(FETCHED_RECORDS)) for p in topic.partitions)
        topics.append(topic.replace(partitions=parts))
    body = body.replace(responses=tuple(topics))
    return frame_of(version, body, data.draw(header_tags(True)))


@pytest.mark.parametrize("version", VERSIONS)
@SETTINGS
@given(data=st.data())
def test_response_scan_matches_the_decoder(version: int, data: st.DataObject) -> None:
    frame = draw_response_frame(data, version)
    resp = codecs.decode_response(frame, 1, version)
    want = expected(resp)
    scan = fetch.response_scan(frame, version)
    if want is None:
        assert scan is None
    else:
        assert scan is not None
        # Unknown top-level tags (the strategy adds some) are named too: compare tag 0.
        assert (scan[0], 0 in scan[1], scan[2]) == (want[0], bool(want[1]), want[2])
        assert fetch.top_level_tags(frame, version) == scan[1]


def test_what_a_broker_sends_is_read_and_anything_else_falls_back() -> None:
    spec = codecs.api(1).response
    partition = spec.root.field("Responses").struct.field("Partitions").struct.cls(
        partition_index=0, error_code=0, high_watermark=10, last_stable_offset=10,
        log_start_offset=0, aborted_transactions=None, preferred_read_replica=-1,
        records=batch(7) + batch(3))
    topic = spec.root.field("Responses").struct.cls(
        topic="orders", partitions=(partition, partition.replace(partition_index=1,
                                                                error_code=6, records=None)))
    body = spec.root.cls(throttle_time_ms=0, error_code=0, session_id=5, responses=(topic,))
    frame = frame_of(12, body)
    size = len(batch(7) + batch(3))
    assert fetch.response_scan(frame, 12) == ({0: 2, 6: 1}, (), [("orders", [0, 1], 10, size)])
    for bad in (frame[:-1], frame + b"\x00"):
        assert fetch.response_scan(bad, 12) is None
    assert fetch.response_scan(frame, 11) is None  # not flexible: the decoder's
    # v16+: NodeEndpoints (KIP-951), the tag the proxy must rewrite, is named.
    node = spec.root.field("NodeEndpoints").struct.cls(node_id=2, host="k2", port=9092,
                                                       rack=None)
    topic_id = topic.replace(topic_id=codecs.schema.uuid.UUID(int=7))
    moved = body.replace(responses=(topic_id,), node_endpoints=(node,))
    scan = fetch.response_scan(frame_of(16, moved), 16)
    assert scan is not None and scan[1] == (0,)
    assert scan[2] == [(codecs.schema.uuid.UUID(int=7).bytes, [0, 1], 10, size)]
    # Without counting (the plain proxy: tags only), no batch header and no index is read.
    assert fetch.response_scan(frame, 12, count=False) == ({0: 2, 6: 1}, (), [("orders", [], 0, 0)])


def one_partition_answer(index: int, topic_id: int) -> bytes:
    """A Fetch v17 answer: one topic, one partition holding a batch of 7 records."""
    spec = codecs.api(1).response
    partition = spec.root.field("Responses").struct.field("Partitions").struct.cls(
        partition_index=index, error_code=0, high_watermark=10, last_stable_offset=10,
        log_start_offset=0, aborted_transactions=None, preferred_read_replica=-1,
        records=batch(7))
    topic = spec.root.field("Responses").struct.cls(
        topic_id=codecs.schema.uuid.UUID(int=topic_id), partitions=(partition,))
    return frame_of(17, spec.root.cls(throttle_time_ms=0, error_code=0, session_id=0,
                                      responses=(topic,)))


def test_the_proxy_scans_a_fetch_answer_once_for_itself_and_its_observers() -> None:
    """With an observer that reads what moved (metrics, capture), the proxy's look at the
    top-level tags is the whole scan, kept for the observers; without, records are not
    counted and nothing is kept."""
    from gatehouse.capture.observer import CaptureObserver
    from gatehouse.metrics import ProxyMetrics
    from gatehouse.proxy.hooks import Observer, Observers, Pending, top_level_tags

    assert not Observers([Observer()]).reads_scans
    assert Observers([Observer(), ProxyMetrics()]).reads_scans
    assert CaptureObserver.reads_scans
    # The same observers count Produce requests' records, and read no more of them: a
    # large one's records are counted on their way socket to socket.
    assert not Observers([Observer()]).counts_request_records
    assert Observers([Observer(), ProxyMetrics()]).counts_request_records
    assert CaptureObserver.counts_request_records
    assert not Observers([Observer(), ProxyMetrics()]).reads_request_bodies
    assert not CaptureObserver.reads_request_bodies
    frame = one_partition_answer(4, 9)
    plain, observed = Pending(1, 1, 17, 0.0), Pending(1, 1, 17, 0.0)
    assert top_level_tags(plain, frame) == top_level_tags(observed, frame, whole=True) == ()
    assert plain.scan is None
    assert observed.scan == ({0: 2}, (), [(codecs.schema.uuid.UUID(int=9).bytes, [4], 7,
                                           len(batch(7)))])


WALK_SETTINGS = settings(SETTINGS, max_examples=examples(40))


def walk_in_pieces(frame: bytes, version: int, data: st.DataObject, size: int | None = None
                   ) -> tuple[fetch.AnswerWalk, list[tuple[int, int]]]:
    """``frame`` (of an answer of ``size`` bytes, its length by default) fed to an
    AnswerWalk in random pieces, records skipped or fed at random, as a proxy would,
    until the walk reaches the top-level tags or the bytes end; the walk and the
    skipped spans."""
    walk = fetch.AnswerWalk(version, len(frame) if size is None else size)
    taken, skipped = feed_in_pieces(walk, frame, data)
    assert not walk.finished or walk.tags_at == taken
    return walk, skipped


def record_spans(version: int, body: Any, tags: Any) -> list[tuple[int, int]]:
    """Where each partition's records lie in the frame of ``body``: the bytes that change
    when every records field is replaced by its complement (same lengths, so nothing
    else moves). Searching for the records' bytes instead finds a short one's bytes in
    the header too."""
    def flipped(p: Any) -> Any:
        return p.replace(records=None if p.records is None
                         else bytes(b ^ 0xFF for b in p.records))
    other = body.replace(responses=tuple(
        t.replace(partitions=tuple(flipped(p) for p in t.partitions)) for t in body.responses))
    a, b = frame_of(version, body, tags), frame_of(version, other, tags)
    assert len(a) == len(b)
    spans: list[tuple[int, int]] = []
    for i in (i for i in range(len(a)) if a[i] != b[i]):
        if spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    assert [a[start:end] for start, end in spans] == [
        bytes(p.records) for t in body.responses for p in t.partitions if p.records]
    return spans


@pytest.mark.parametrize("version", VERSIONS)
@WALK_SETTINGS
@given(data=st.data())
def test_a_walk_fed_in_pieces_finds_the_tags_and_skips_only_records(
        version: int, data: st.DataObject) -> None:
    body = data.draw(message_body(codecs.api(1).response, version))
    topics = []
    for topic in body.responses:
        parts = tuple(p.replace(records=data.draw(st.one_of(st.none(), st.binary(max_size=600))))
                      for p in topic.partitions)
        topics.append(topic.replace(partitions=parts))
    body = body.replace(responses=tuple(topics))
    tags = data.draw(header_tags(True))
    frame = frame_of(version, body, tags)
    walk, skipped = walk_in_pieces(frame, version, data)
    found = fetch.top_level_tag_fields(frame, version)
    assert found is not None and walk.tags_at == found[0]  # reached before the bytes end
    spans = record_spans(version, body, tags)
    for start, end in skipped:  # every skipped byte is a record's
        assert any(s <= start and end <= e for s, e in spans), (start, end, spans)
    # The head is the answer up to its topics: with no topics and the same tags it is
    # an answer the decoder reads (what the proxy decodes to rewrite leaders).
    assert frame.startswith(walk.head)
    alone = codecs.decode_response(walk.head + b"\x01" + frame[walk.tags_at:], 1, version)
    assert alone.body.responses == ()
    assert alone.body.throttle_time_ms == body.throttle_time_ms
    # A whole answer in hand says the same (the proxy's buffered path).
    assert fetch.head_and_tags_at(frame, version) == (len(walk.head), walk.tags_at)


@pytest.mark.parametrize("version", [12, 17])
@WALK_SETTINGS
@given(data=st.data())
def test_a_walk_of_bytes_that_are_no_fetch_answer_says_so(version: int, data: st.DataObject) -> None:
    """Garbage, a cut answer or a size that lies: Unexpected, or a walk that never
    reaches the tags within the bytes it was given; never another error."""
    frame = data.draw(st.binary(max_size=400))
    size = data.draw(st.integers(len(frame), len(frame) + 50))
    try:
        walk, _ = walk_in_pieces(frame, version, data, size)
    except fetch.Unexpected:
        return
    assert walk.tags_at is None or walk.tags_at <= size


def test_a_walk_refuses_records_or_parts_past_the_frames_end() -> None:
    frame = one_partition_answer(0, 7)
    whole = fetch.AnswerWalk(17, len(frame))
    assert whole.feed(frame) == len(frame) - 1 and whole.tags_at == len(frame) - 1
    short = fetch.AnswerWalk(17, len(frame) - len(batch(7)))  # records past the end
    with pytest.raises(fetch.Unexpected):
        short.feed(frame)
    with pytest.raises(ValueError):
        fetch.AnswerWalk(11, len(frame))  # not flexible: not walked
    with pytest.raises(ValueError):
        fetch.AnswerWalk(17, len(frame)).skip(1)  # no records to skip yet


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("batches_in_c", [True, False], ids=["c", "python"])
@WALK_SETTINGS
@given(data=st.data())
def test_a_counting_walk_that_skips_records_says_what_the_scan_says(
        version: int, batches_in_c: bool, data: st.DataObject) -> None:
    """An answer walked with ``count`` in pieces, the rest of each batch skipped at
    random, says what ``response_scan`` says of the whole frame (its codes, tags and
    counts; None where the scan gives up), and what it skipped holds nothing the scan
    reads (the same frame with those bytes changed scans the same); with the batch
    headers read in C (``_speedups.batches_feed``) or in Python."""
    if batches_in_c:
        assert fetch._C_BATCHES is not None
    frame = draw_response_frame(data, version)
    expected = fetch.response_scan(frame, version)
    walk = fetch.AnswerWalk(version, len(frame), count=True)
    try:
        with mock.patch.object(fetch, "_C_BATCHES", fetch._C_BATCHES if batches_in_c else None):
            taken, skipped = feed_in_pieces(walk, frame, data)
    except fetch.Unexpected:
        assert expected is None  # not an answer's structure: the scan gives up too
        return
    assert walk.finished and walk.tags_at == taken and not walk.opaque
    assert walk.scan(frame[taken:]) == expected
    if expected is not None:
        mangled = bytearray(frame)
        for start, end in skipped:
            mangled[start:end] = b"\x5a" * (end - start)
        assert fetch.response_scan(bytes(mangled), version) == expected
    # Without ``count`` the walk reaches the same place and scans nothing.
    plain = fetch.AnswerWalk(version, len(frame))
    assert plain.feed(frame) == taken and plain.scan(frame[taken:]) is None


def test_a_counting_walk_reads_batch_headers_and_skips_the_rest_of_each_batch() -> None:
    frame = one_partition_answer(4, 9)
    records = batch(7)
    start = frame.index(records)
    walk = fetch.AnswerWalk(17, len(frame), count=True)
    assert walk.feed(frame[:start + 61]) == start + 61  # up to the batch's header's end
    assert walk.opaque == len(records) - 61  # the rest of the batch: not read
    walk.skip(walk.opaque)
    assert walk.feed(frame[start + len(records):]) == len(frame) - start - len(records) - 1
    assert walk.scan(frame[walk.tags_at:]) == fetch.response_scan(frame, 17) == (
        {0: 2}, (), [(codecs.schema.uuid.UUID(int=9).bytes, [4], 7, len(records))])
    assert walk.scan(b"") is None and walk.scan(b"\x00\x00") is None  # not the tag section
    # Records the scan does not count (a batch shorter than its header): no scan, and
    # the walk goes on past them to the tags.
    bad = bytearray(frame)
    bad[start + 8:start + 12] = (20).to_bytes(4, "big")
    odd = fetch.AnswerWalk(17, len(bad), count=True)
    assert odd.feed(bytes(bad)) == len(bad) - 1 and odd.uncounted
    assert odd.scan(b"\x00") is None and fetch.response_scan(bytes(bad), 17) is None
