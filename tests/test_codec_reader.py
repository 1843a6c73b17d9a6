"""``codecs.FrameReader``: size-prefixed frames out of a byte stream, h11 style.

Fed whole, one byte at a time, split at every byte boundary and in random chunks, the
reader yields the same frames; it returns None when it needs more data; it refuses an
oversized or negative size as soon as the 4-byte prefix is in, without buffering the
announced payload; and ``check_eof`` complains about a frame cut off by the end of stream.
"""

from __future__ import annotations

import itertools
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs.reader import VIEW_SIZE, FrameReader
from tests.codec_strategies import examples


def prefixed(frame: bytes) -> bytes:
    return struct.pack(">i", len(frame)) + frame


FRAMES = [
    b"",  # an empty frame is a frame
    b"a",
    bytes(range(256)) * 3,
    b"\x00\x00\x00\x05",  # a frame that looks like a size prefix
    b"xyz" * 1000,
    bytes(codecs.Request.build(18, 3, 7, "c", codecs.api(18).request.root.cls(
        client_software_name="gatehouse", client_software_version="1")).encode()),
]
STREAM = b"".join(prefixed(f) for f in FRAMES)


def drain(reader: FrameReader) -> list[bytes]:
    out = []
    while (frame := reader.next_frame()) is not None:
        out.append(frame)
    return out


def read_in_chunks(data: bytes, sizes: list[int], reader: FrameReader | None = None) -> list[bytes]:
    reader = reader or FrameReader()
    got: list[bytes] = []
    pos = 0
    for size in sizes:
        reader.feed(data[pos:pos + size])
        pos += size
        got += drain(reader)
    reader.feed(data[pos:])
    got += drain(reader)
    reader.check_eof()
    return got


def test_whole_stream() -> None:
    reader = FrameReader()
    reader.feed(STREAM)
    assert drain(reader) == FRAMES
    assert reader.buffered == 0
    reader.check_eof()


def test_one_byte_at_a_time() -> None:
    assert read_in_chunks(STREAM, [1] * len(STREAM)) == FRAMES


def test_split_at_every_byte_boundary() -> None:
    for cut in range(len(STREAM) + 1):
        assert read_in_chunks(STREAM, [cut]) == FRAMES, cut


def test_split_in_three_around_every_frame_boundary() -> None:
    boundaries = [0]
    for f in FRAMES:
        boundaries.append(boundaries[-1] + 4 + len(f))
    cuts = sorted({max(0, min(len(STREAM), b + d)) for b in boundaries for d in range(-5, 6)})
    for a in cuts:
        for b in cuts:
            if a <= b:
                assert read_in_chunks(STREAM, [a, b - a]) == FRAMES


@settings(max_examples=examples(200), deadline=None, database=None)
@given(st.lists(st.integers(0, 700), max_size=40))
def test_random_chunkings(sizes: list[int]) -> None:
    assert read_in_chunks(STREAM, sizes) == FRAMES


def test_many_frames_past_the_compaction_point() -> None:
    """Frames totalling far more than the reader's 64 KiB compaction threshold."""
    rng = random.Random(5)
    frames = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(200)]
    data = b"".join(prefixed(f) for f in frames)
    sizes = [rng.randrange(1, 20000) for _ in range(200)]
    reader = FrameReader()
    assert read_in_chunks(data, sizes, reader) == frames
    assert reader.buffered == 0


def test_accepts_bytearray_and_memoryview_and_returns_bytes() -> None:
    reader = FrameReader()
    reader.feed(bytearray(prefixed(b"abc")))
    reader.feed(memoryview(prefixed(b"de")))
    scratch = bytearray(prefixed(b"f"))
    reader.feed(scratch)
    scratch[4] = ord("X")  # the caller reuses its buffer: the reader took a copy
    frames = drain(reader)
    assert frames == [b"abc", b"de", b"f"]
    assert all(type(f) is bytes for f in frames)


def test_need_more_data_returns_none() -> None:
    reader = FrameReader()
    assert reader.next_frame() is None
    reader.feed(b"\x00\x00")
    assert reader.next_frame() is None and reader.expected_size is None
    reader.feed(b"\x00\x05")
    assert reader.next_frame() is None and reader.expected_size == 5
    reader.feed(b"abcd")
    assert reader.next_frame() is None and reader.buffered == 8
    reader.feed(b"e" + b"\x00\x00")
    assert reader.next_frame() == b"abcde"
    assert reader.next_frame() is None and reader.buffered == 2
    assert reader.expected_size is None


def test_default_max_frame_size_is_100_mib() -> None:
    assert codecs.DEFAULT_MAX_FRAME_SIZE == 100 * 1024 * 1024
    assert FrameReader().max_frame_size == codecs.DEFAULT_MAX_FRAME_SIZE
    reader = FrameReader()
    reader.feed(struct.pack(">i", codecs.DEFAULT_MAX_FRAME_SIZE))  # exactly the limit: fine
    assert reader.next_frame() is None
    over = FrameReader()
    over.feed(struct.pack(">i", codecs.DEFAULT_MAX_FRAME_SIZE + 1))
    with pytest.raises(codecs.FrameTooLarge):
        over.next_frame()


@pytest.mark.parametrize("prefix", [
    struct.pack(">i", 2**31 - 1),  # ~2 GiB
    struct.pack(">I", 2**31),  # 2 GiB: negative as an int32
    struct.pack(">i", -1),
    struct.pack(">i", -5),
    b"\xff\xff\xff\xff",
])
def test_huge_or_negative_size_is_refused_from_the_prefix_alone(prefix: bytes) -> None:
    reader = FrameReader()
    reader.feed(prefix)  # nothing of the payload yet
    with pytest.raises(codecs.FrameTooLarge) as info:
        reader.next_frame()
    assert isinstance(info.value, codecs.RemoteProtocolError)
    assert reader.buffered == 4  # nothing was allocated for the announced size
    # The same with a little payload behind it, and after a complete frame.
    later = FrameReader()
    later.feed(prefixed(b"ok") + prefix + b"junk")
    assert later.next_frame() == b"ok"
    with pytest.raises(codecs.FrameTooLarge):
        later.next_frame()


def test_custom_max_frame_size() -> None:
    reader = FrameReader(max_frame_size=10)
    reader.feed(prefixed(b"x" * 10))
    assert reader.next_frame() == b"x" * 10
    reader.feed(struct.pack(">i", 11))
    with pytest.raises(codecs.FrameTooLarge):
        reader.next_frame()
    for bad in (0, -1):
        with pytest.raises(ValueError):
            FrameReader(max_frame_size=bad)


@pytest.mark.parametrize("partial", [b"\x00", b"\x00\x00\x00", b"\x00\x00\x00\x05", b"\x00\x00\x00\x05abcd"])
def test_check_eof_with_a_partial_frame_raises(partial: bytes) -> None:
    reader = FrameReader()
    reader.feed(prefixed(b"done") + partial)
    assert reader.next_frame() == b"done"
    assert reader.next_frame() is None
    with pytest.raises(codecs.RemoteProtocolError) as info:
        reader.check_eof()
    assert "middle of a frame" in str(info.value)


def test_check_eof_between_frames_is_fine() -> None:
    reader = FrameReader()
    reader.check_eof()
    reader.feed(prefixed(b"a") + prefixed(b""))
    assert drain(reader) == [b"a", b""]
    reader.check_eof()


def test_frames_decode_as_requests() -> None:
    reader = FrameReader()
    reader.feed(codecs.size_prefixed(FRAMES[-1]) * 3)
    requests = [codecs.decode_request(f) for f in drain(reader)]
    assert [r.header.correlation_id for r in requests] == [7, 7, 7]
    assert requests[0].body.client_software_name == "gatehouse"


def test_wire_frames_keep_the_prefix_and_a_whole_chunk_is_not_copied() -> None:
    reader = FrameReader()
    whole = prefixed(b"x" * 70_000)
    reader.feed(whole)
    assert reader.next_wire_frame() is whole  # forwarded as received: zero copies
    reader.feed(STREAM)
    wires = []
    while (wire := reader.next_wire_frame()) is not None:
        wires.append(wire)
    assert wires == [prefixed(f) for f in FRAMES]
    assert reader.buffered == 0


def wires_in_chunks(stream: bytes, sizes: list[int], view: bool) -> list[bytes]:
    """The frames of ``stream`` fed in pieces of ``sizes`` (then the rest), by
    ``next_wire_view`` or ``next_wire_frame``; the reader's count checked at each step."""
    reader = FrameReader()
    pos, got = 0, []
    for size in [*sizes, len(stream)]:
        reader.feed(stream[pos:pos + size])
        pos += size
        while (wire := reader.next_wire_view() if view else reader.next_wire_frame()) is not None:
            got.append(bytes(wire))
        assert reader.buffered == min(pos, len(stream)) - sum(map(len, got))
    reader.check_eof()
    return got


@settings(max_examples=examples(200), deadline=None, database=None)
@given(st.lists(st.integers(1, 2000), max_size=40))
def test_wire_frames_from_random_chunks(sizes: list[int]) -> None:
    assert wires_in_chunks(STREAM, sizes, view=False) == [prefixed(f) for f in FRAMES]


def test_a_trickled_frame_costs_its_size_in_memory() -> None:
    # A client sending a 1 MB frame two bytes at a time must not pin an object per read.
    import tracemalloc

    frame = prefixed(bytes(range(256)) * 4096)
    reader = FrameReader()
    tracemalloc.start()
    try:
        for i in range(0, len(frame) - 2, 2):
            reader.feed(frame[i:i + 2])
            assert reader.next_wire_frame() is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(frame), f"{peak} bytes held for a {len(frame)}-byte frame"
    reader.feed(frame[len(frame) - 2:])  # the frame has an even length
    assert reader.next_wire_frame() == frame


def test_wire_views_of_big_frames_share_their_chunk_and_small_ones_are_copied() -> None:
    small, big = prefixed(b"s" * 10), prefixed(b"b" * VIEW_SIZE)
    chunk = small + big + big[:100]
    reader = FrameReader()
    reader.feed(chunk)
    first = reader.next_wire_view()
    assert type(first) is bytes and first == small  # small: a copy, the chunk may go
    second = reader.next_wire_view()
    assert isinstance(second, memoryview) and second.obj is chunk  # no copy
    assert second.readonly and second == big
    assert reader.next_wire_view() is None
    reader.feed(big[100:])
    third = reader.next_wire_view()  # spread over two chunks: joined
    assert type(third) is bytes and third == big
    assert reader.buffered == 0


@settings(max_examples=examples(200), deadline=None, database=None)
@given(st.lists(st.integers(1, 3 * VIEW_SIZE), max_size=20))
def test_wire_views_from_random_chunks(sizes: list[int]) -> None:
    frames = [b"x" * n for n in (5, VIEW_SIZE, VIEW_SIZE - 1, 2 * VIEW_SIZE, 0, 300)]
    stream = b"".join(prefixed(f) for f in frames)
    assert wires_in_chunks(stream, sizes, view=True) == [prefixed(f) for f in frames]


def test_peek_partial_leaves_the_bytes_for_take_partial() -> None:
    reader = FrameReader()
    frame = struct.pack(">i", 100_000) + bytes(range(256)) * 40
    with pytest.raises(ValueError):
        reader.peek_partial(10)  # no frame begun
    cuts = [0, 3, 3000, 6000, 9000, len(frame)]  # chunks small and large
    for start, end in itertools.pairwise(cuts):
        reader.feed(frame[start:end])
    assert reader.next_wire_frame() is None and reader.expected_size == 100_000
    assert reader.peek_partial(7000) == frame[:7000]  # across chunks
    assert reader.peek_partial(1 << 20) == frame  # no more than there is
    assert reader.take_partial() == frame
    assert reader.buffered == 0


def test_a_chunk_that_is_exactly_one_frame_is_handed_back_whole() -> None:
    frame = prefixed(b"abcdef")
    reader = FrameReader(max_frame_size=6)
    assert reader.whole_frame(frame) is frame  # itself: no copy
    assert reader.buffered == 0
    # Anything else is left to feed: part of a frame, more than one, bytes already
    # buffered, a mutable buffer (the caller may reuse it), a size over the limit.
    assert reader.whole_frame(frame[:-1]) is None
    assert reader.whole_frame(frame + prefixed(b"")) is None
    assert reader.whole_frame(bytearray(frame)) is None
    assert reader.whole_frame(b"\x00\x00") is None
    assert FrameReader(max_frame_size=5).whole_frame(frame) is None
    reader.feed(b"\x00")
    assert reader.whole_frame(frame) is None
    reader.feed(frame[1:])
    assert reader.next_frame() == b"abcdef"
