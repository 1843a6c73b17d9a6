"""Large answers go on to the client as their bytes arrive (cut-through), and a streamed
Fetch v16+ answer's leaders (KIP-951 NodeEndpoints) are rewritten in a tag section of
the same size, since its size prefix has already gone.  Large Produce requests go up
to the broker the same way when no rule reads or changes them."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import struct
import termios
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import fetch, produce
from gatehouse.codecs._scan import tag_fields
from gatehouse.proxy.config import Limits
from gatehouse.proxy.connection import _RECEIVE_SIZE, _SPLICE_READ
from gatehouse.proxy.fastio import FastStream
from gatehouse.proxy.hooks import CLIENT_CLOSED, Forward, Observer, Observers, Policy
from gatehouse.proxy.quotas import Bucket, Charge
from tests.support.fakebroker import frame_bytes, notsent_lowat, request, response_body
from tests.test_proxy_pumps import Harness, Recorder, proxied

FETCH_VERSION = 17
# Over memory streams the pumps read every byte; over real sockets a plain proxy moves a
# large answer's records socket to socket (splice): the same tests hold for both.
TRANSPORTS = pytest.mark.parametrize("tcp", [False, True], ids=["memory", "tcp"])
RECORDS = bytes(range(256)) * 4096  # 1 MiB: several receives through the proxy
# With the metrics on, which read what Fetch answers carry, a large one's records still
# go socket to socket, counted on the way: the same tests hold with and without them.
METERED = pytest.mark.parametrize("metered", [False, True], ids=["plain", "metered"])


def watching(metered: bool, recorder: Recorder | None = None) -> Observer:
    """The connection's observers: ``recorder`` (a new one by default), with the metrics
    where ``metered``."""
    from gatehouse.metrics import ProxyMetrics

    recorder = recorder or Recorder()
    return Observers([ProxyMetrics(), recorder]) if metered else recorder


def no_answer(req: codecs.Request) -> Any:
    return None  # the test sends the broker's bytes itself, in pieces


def fetch_answer(correlation_id: int, *, node_endpoints: list[dict[str, Any]] | None = None,
                 partition_error: int = 0, records: bytes = RECORDS,
                 version: int = FETCH_VERSION) -> bytes:
    partitions = [
        {"partition_index": 0, "error_code": 0, "high_watermark": 10, "last_stable_offset": 10,
         "log_start_offset": 0, "aborted_transactions": [], "preferred_read_replica": -1,
         "records": records},
        {"partition_index": 1, "error_code": partition_error, "high_watermark": -1,
         "last_stable_offset": -1, "log_start_offset": -1, "aborted_transactions": None,
         "preferred_read_replica": -1, "records": None,
         **({"current_leader": {"leader_id": 2, "leader_epoch": 7}} if partition_error else {})},
    ]
    topic = {"topic": "orders"} if version < 13 else {"topic_id": str(uuid.UUID(int=7))}
    leaders = {"node_endpoints": node_endpoints or []} if version >= 16 else {}
    body = response_body(1, version, throttle_time_ms=0, error_code=0, session_id=0,
                         responses=[{**topic, "partitions": partitions}], **leaders)
    return frame_bytes(codecs.Response.build(1, version, correlation_id, body).encode())


async def send_fetch(h: Harness, correlation_id: int, version: int = FETCH_VERSION) -> None:
    await h.client.send(request(1, version, correlation_id, max_wait_ms=0,
                                min_bytes=1, max_bytes=50 << 20, topics=[]).encode())


async def receive_bytes(h: Harness, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        got += await h.client.stream.receive_some(n - len(got))
    return bytes(got)


async def relay(h: Harness, *pieces: bytes) -> bytes:
    """The broker sends ``pieces`` while the client reads (real sockets hold only so
    much unread); what the client got."""
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            for piece in pieces:
                await h.broker.frames.send_raw(piece)

        nursery.start_soon(send)
        return await receive_bytes(h, sum(map(len, pieces)))


@METERED
@TRANSPORTS
async def test_a_large_answer_reaches_the_client_before_its_last_byte_leaves_the_broker(
        tcp: bool, metered: bool) -> None:
    recorder = Recorder()
    async with proxied(no_answer, observer=watching(metered, recorder), tcp=tcp) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1)
        half = len(wire) // 2
        broker = h.broker.frames
        await broker.send_raw(wire[:half])
        # Store-and-forward would wait here for the rest: the test would time out.
        with trio.fail_after(5):
            first = await receive_bytes(h, half)
        await broker.send_raw(wire[half:])
        with trio.fail_after(5):
            rest = await receive_bytes(h, len(wire) - half)
        assert first + rest == wire  # the very bytes the broker sent
        assert recorder.responses == [1]  # the observers still see the answer
        assert recorder.sizes == [len(wire) - 4]
        assert h.pumps.ctx.response_budget.held == 0  # its budget bytes are back
        assert h.pumps.conn.bytes_to_client == len(wire)
        assert_spliced(h, tcp)


SIOCOUTQNSD = 0x894B  # Linux: bytes in a TCP socket's send queue not yet sent


def queued(stream: Any, request: int) -> int:
    """Bytes waiting in a TCP socket: received, not yet read (FIONREAD), or given to
    it, not yet sent (SIOCOUTQNSD)."""
    got = fcntl.ioctl(stream.socket.fileno(), request, b"\0\0\0\0")
    return int(struct.unpack("i", got)[0])


async def test_a_large_answer_leaves_the_proxy_whole_before_the_client_reads() -> None:
    """Over sockets the proxy hands the kernel what it relays as a client's own socket
    takes it (not trio's 16 KiB TCP_NOTSENT_LOWAT): a 1 MiB answer goes into the
    client's socket whole while the client reads nothing yet, rather than a piece each
    time the client reads one, and then arrives byte for byte."""
    async with proxied(no_answer, tcp=True) as h:
        for stream in (h.pumps.client, h.pumps.upstream):
            assert notsent_lowat(stream) == 0
        await send_fetch(h, 1)
        wire = fetch_answer(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.broker.frames.send_raw, wire)
            with trio.fail_after(5):
                await trio.testing.wait_all_tasks_blocked()
            # All of it is in the kernel, none read yet: in the client's socket or
            # queued in the proxy's (none held in the proxy's pipe or waiting to be sent).
            assert queued(h.client.stream, termios.FIONREAD) + queued(
                h.pumps.client, SIOCOUTQNSD) == len(wire)
            with trio.fail_after(5):
                assert await receive_bytes(h, len(wire)) == wire
        assert_spliced(h, True)


@METERED
@TRANSPORTS
async def test_a_mid_sized_answer_is_spliced_and_one_the_walk_cannot_read_is_not(
        tcp: bool, metered: bool) -> None:
    """Over sockets an answer of 100 KiB is spliced too (its first 16 KiB read, the rest
    socket to socket); a Fetch answer newer than the codec is never spliced (the walk
    does not know its layout) nor streamed at 30 KiB: it goes through whole and
    untouched, the broker's leaders with it."""
    records = RECORDS[:100 * 1024]
    async with proxied(no_answer, observer=watching(metered), tcp=tcp) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1, records=records, version=16)
        with trio.fail_after(5):
            assert await relay(h, wire[:5000], wire[5000:]) == wire
        pipes = h.pumps.ctx.pipes
        assert pipes is not None
        assert (pipes.spliced >= len(records) - _SPLICE_READ) == tcp
        spliced = pipes.spliced
        version = max(codecs.APIS[1].versions) + 1
        await h.client.send(struct.pack(">hhih", 1, version, 2, 4) + b"test" + b"\x00")
        # Smaller than the tail a streamed Fetch answer holds back: not streamed at all.
        newer = fetch_answer(2, records=records[:30 * 1024], partition_error=6, node_endpoints=[
            {"node_id": 2, "host": "k2", "port": 9092, "rack": None}])
        with trio.fail_after(5):
            assert await relay(h, newer[:5000], newer[5000:]) == newer
        assert pipes.spliced == spliced
        assert h.pumps.close_reason == "client closed"


async def test_with_no_pipe_to_be_had_large_frames_go_through_the_buffers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors for a pipe (EMFILE), a spliceable answer and request go through
    the proxy's buffers instead: whole, the same bytes, nothing spliced, the connection
    kept."""
    import os

    def no_pipe(flags: int) -> tuple[int, int]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "pipe2", no_pipe)
    async with proxied(produce_answer, tcp=True) as h:
        wire = produce_wire(5)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_pieces, h, wire[:1000], wire[1000:])
                answer = await h.client.receive()
        assert answer is not None and h.broker.received == [wire[4:]]
        h.broker.handler = no_answer
        await send_fetch(h, 6)
        big = fetch_answer(6)
        with trio.fail_after(5):
            assert await relay(h, big[:300_000], big[300_000:]) == big
        pipes = h.pumps.ctx.pipes
        assert pipes is not None and pipes.spliced == 0
        assert h.pumps.close_reason == "client closed"


@METERED
async def test_a_spliced_answer_that_is_no_fetch_answer_closes_the_connection(metered: bool) -> None:
    """A broker whose large Fetch answer turns out malformed after its first bytes went
    on (here: the answer ends inside its records, with a size that says so): the
    connection closes with a line naming the broker, and the client sees the close."""
    async with proxied(no_answer, observer=watching(metered), tcp=True) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1)
        cut = wire[4:len(wire) - 100_000]  # records of 1 MiB in an answer too short for them
        bad = struct.pack(">i", len(cut)) + cut
        # The proxy may close the broker's connection before all of it is sent.
        with contextlib.suppress(trio.BrokenResourceError):
            await h.broker.frames.send_raw(bad)
        with trio.fail_after(5):
            await h.done.wait()
        assert "broker broker:9092 sent an answer that is not a Fetch response" in (
            h.pumps.close_reason)
        assert h.pumps.close_level == logging.WARNING
        got = bytearray()
        with trio.fail_after(5):
            try:  # EOF, or a reset: the proxy closed with the client's request unread
                while chunk := await h.client.stream.receive_some(1 << 20):
                    got += chunk
            except trio.BrokenResourceError:
                pass
        assert len(got) < len(bad)  # never a whole answer


def assert_spliced(h: Harness, tcp: bool) -> None:
    """Over real sockets the records went socket to socket (all but what the first read
    brought in, at most _RECEIVE_SIZE bytes); over memory streams, through the pumps."""
    pipes = h.pumps.ctx.pipes
    assert pipes is not None
    assert (pipes.spliced >= len(RECORDS) - _RECEIVE_SIZE) == tcp
    assert pipes.spliced <= len(RECORDS)


@TRANSPORTS
async def test_answers_behind_a_streamed_one_follow_it_in_order(tcp: bool) -> None:
    async with proxied(no_answer, tcp=tcp) as h:
        for correlation_id in (1, 2, 3):
            await send_fetch(h, correlation_id)
        big, small = fetch_answer(1), frame_bytes(codecs.Response.build(
            1, FETCH_VERSION, 2, codecs.api(1).response.root.cls()).encode())
        wires = big + small + fetch_answer(3)
        # Pieces that end inside frames and hold the end of one and the start of the next.
        cuts = [0, 100, len(big) - 5, len(big) + 3, len(big) + len(small) + 10, len(wires)]

        async def send_pieces() -> None:  # while the client reads: sockets fill up
            for start, end in itertools.pairwise(cuts):
                await h.broker.frames.send_raw(wires[start:end])

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_pieces)
                assert await receive_bytes(h, len(wires)) == wires


@METERED
@TRANSPORTS
async def test_a_broker_gone_in_the_middle_of_a_streamed_answer_closes_the_client(
        tcp: bool, metered: bool) -> None:
    async with proxied(no_answer, observer=watching(metered), tcp=tcp) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1)
        await h.broker.frames.send_raw(wire[:300_000])
        with trio.fail_after(5):
            assert await receive_bytes(h, 300_000) == wire[:300_000]
        await h.broker.frames.stream.aclose()
        with trio.fail_after(5):
            await h.done.wait()
        assert "closed the connection in the middle of an answer" in h.pumps.close_reason
        assert await h.client.stream.receive_some(1) == b""  # the client sees the close


@TRANSPORTS
async def test_a_fetch_answer_newer_than_the_codec_streams_through_untouched(tcp: bool) -> None:
    version = max(codecs.APIS[1].versions) + 1
    async with proxied(no_answer, tcp=tcp) as h:
        # Request header v2 of a version the codec does not know: forwarded as it is.
        header = struct.pack(">hhih", 1, version, 1, 4) + b"test" + b"\x00"
        await h.client.send(header)
        wire = fetch_answer(1, partition_error=6, node_endpoints=[
            {"node_id": 2, "host": "k2", "port": 9092, "rack": None}])  # v17 bytes
        with trio.fail_after(5):
            assert await relay(h, wire[:300_000], wire[300_000:]) == wire
        assert h.pumps.close_reason == "client closed"  # still open, nothing refused


LONG_HOST = "broker-2.kafka.internal.example.com"  # longer than the proxy's address


@METERED
@TRANSPORTS
async def test_a_streamed_fetch_answers_leaders_are_rewritten_in_a_section_of_the_same_size(
        tcp: bool, metered: bool) -> None:
    async with proxied(no_answer, observer=watching(metered), tcp=tcp) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1, partition_error=6, node_endpoints=[
            {"node_id": 2, "host": LONG_HOST, "port": 9092, "rack": "r1"}])
        with trio.fail_after(5):
            got = await relay(h, wire[:300_000], wire[300_000:])
        assert got[:4] == wire[:4]  # the size that went first holds
        body = codecs.decode_response(got[4:], 1, FETCH_VERSION).body
        assert [(e.node_id, e.host, e.port, e.rack) for e in body.node_endpoints] == [
            (2, "proxy.example", 19002, "r1")]
        assert body.responses[0].partitions[0].records == RECORDS
        assert [a.node_id for a in h.seen] == [2]  # its listener opened before the client heard
        # The room the shorter address left is an unknown tag of zeros after it.
        at, fields = fetch.top_level_tag_fields(got[4:], FETCH_VERSION) or (0, [])
        assert [tag for tag, _ in fields] == [0, 1] and set(fields[1][1]) <= {0}
        assert got[4:4 + at] == wire[4:4 + at]  # and nothing before the tags changed
        assert_spliced(h, tcp)


@METERED
@TRANSPORTS
async def test_leaders_that_do_not_fit_are_left_out_and_the_answer_keeps_its_size(
        tcp: bool, metered: bool) -> None:
    async with proxied(no_answer, observer=watching(metered), tcp=tcp) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1, partition_error=6, node_endpoints=[
            {"node_id": 2, "host": "k2", "port": 9092, "rack": None}])
        with trio.fail_after(5):
            got = await relay(h, wire[:300_000], wire[300_000:])
        body = codecs.decode_response(got[4:], 1, FETCH_VERSION).body
        # Never the broker's own address: the client asks for Metadata (rewritten) instead.
        assert body.node_endpoints == ()
        assert body.responses[0].partitions[1].current_leader.leader_id == 2
        assert body.responses[0].partitions[0].records == RECORDS
        assert_spliced(h, tcp)


def section_size(fields: list[tuple[int, bytes]]) -> int:
    """The bytes of a tag section of these fields (fewer than 128; tags under 128)."""
    return 1 + sum(2 + (len(value) >= 128) + len(value) for _, value in fields)


@st.composite
def tag_sections(draw: st.DrawFn) -> tuple[list[tuple[int, bytes]], int]:
    tags = sorted(draw(st.sets(st.integers(0, 60), max_size=4)))
    fields = [(tag, draw(st.binary(max_size=300))) for tag in tags]
    return fields, section_size(fields) + draw(st.integers(-3, 700))


@given(tag_sections(), st.integers(0, 70))
def test_a_tag_section_is_made_exactly_the_size_asked(
        case: tuple[list[tuple[int, bytes]], int], unknown_from: int) -> None:
    fields, size = case
    base = section_size(fields)
    made = fetch.fit_tag_section(fields, size, unknown_from)
    if size < base or size == base + 1:  # less room, or one byte: no field is that small
        assert made is None
        return
    assert made is not None and len(made) == size
    parsed = tag_fields(memoryview(made), 0)
    assert parsed[:len(fields)] == fields  # the fields, then fillers of zeros
    tags = [tag for tag, _ in parsed]
    assert tags == sorted(set(tags))
    assert all(not any(value) for _, value in parsed[len(fields):])
    assert all(tag >= unknown_from for tag, _ in parsed[len(fields):])


class Keeper(Recorder):
    """An observer that keeps every answer it is shown (as the capture may)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Any] = []

    def response(self, conn: Any, pending: Any, size: int, elapsed: float,
                 frame: Any = None) -> None:
        super().response(conn, pending, size, elapsed, frame)
        self.kept.append(frame)


async def test_streamed_answers_reuse_their_buffer_unless_someone_kept_the_answer() -> None:
    """A streamed answer is received into a pooled buffer; the next one reuses it, but
    never while an observer still holds a view of the last: what it kept stays intact."""
    wires = [fetch_answer(1), fetch_answer(2, partition_error=6)]
    for observer in (None, Keeper()):
        async with proxied(no_answer, observer=observer) as h:
            pool = h.pumps.ctx.frame_buffers
            for correlation_id, wire in enumerate(wires, 1):
                await send_fetch(h, correlation_id)
                await h.broker.frames.send_raw(wire[:300_000])
                await h.broker.frames.send_raw(wire[300_000:])
                with trio.fail_after(5):
                    assert await receive_bytes(h, len(wire)) == wire
                if observer is None:
                    assert pool.kept >= len(wire)  # back in the pool for the next one
                else:
                    assert pool.kept == 0  # still in the observer's hands
            if isinstance(observer, Keeper):
                assert [bytes(f) for f in observer.kept] == [w[4:] for w in wires]


def metadata_answer(correlation_id: int, topics: int = 3000) -> bytes:
    """A Metadata v12 answer naming one broker and ``topics`` topics (3000: ~100 KiB)."""
    body = response_body(3, 12, brokers=[{"node_id": 1, "host": "kafka-1.internal",
                                          "port": 9092}],
                         topics=[{"name": f"topic-{i:05d}", "topic_id": str(uuid.UUID(int=i + 1)),
                                  "partitions": []} for i in range(topics)])
    return frame_bytes(codecs.Response.build(3, 12, correlation_id, body).encode())


@TRANSPORTS
async def test_a_large_answer_that_changes_is_received_whole_into_a_pooled_buffer(
        tcp: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large answer the proxy must read whole (its body may change: a Metadata
    answer's brokers) is received straight into a pooled buffer, in reads as long as
    what is left of it, then answered rewritten; the next reuses the buffer, and what an
    observer kept of the last stays intact."""
    wires = [metadata_answer(1), metadata_answer(2, 2500)]
    assert all(len(w) > 64 * 1024 for w in wires)
    reads: list[tuple[FastStream, int]] = []
    real = FastStream.receive_into

    async def receive_into(stream: FastStream, view: memoryview) -> int:
        reads.append((stream, len(view)))
        return await real(stream, view)

    monkeypatch.setattr(FastStream, "receive_into", receive_into)
    for observer in (None, Keeper()):
        async with proxied(no_answer, observer=observer, tcp=tcp) as h:
            pool = h.pumps.ctx.frame_buffers
            reads.clear()
            for correlation_id, wire in enumerate(wires, 1):
                await h.client.send(request(3, 12, correlation_id).encode())
                await h.broker.frames.send_raw(wire[:20_000])
                await h.broker.frames.send_raw(wire[20_000:])
                with trio.fail_after(5):
                    frame = await h.client.receive()
                answer = codecs.decode_response(frame, 3, 12)
                assert answer.header.correlation_id == correlation_id
                assert [(b.host, b.port) for b in answer.body.brokers] == [
                    ("proxy.example", 19001)]
                assert len(answer.body.topics) == (3000 if correlation_id == 1 else 2500)
                # Back in the pool for the next one: the observers were shown the
                # answer rewritten, a frame of its own.
                assert pool.kept >= len(wire)
            upstream = [n for stream, n in reads if stream is h.pumps.upstream_io]
            assert upstream and upstream[0] > 64 * 1024  # what was left of it, at once
            assert h.pumps.ctx.response_budget.held == 0
            if isinstance(observer, Keeper):
                kept = [codecs.decode_response(memoryview(bytes(f)), 3, 12) for f in
                        observer.kept]
                assert [len(k.body.topics) for k in kept] == [3000, 2500]
                assert [k.body.brokers[0].host for k in kept] == ["proxy.example"] * 2


@TRANSPORTS
async def test_a_broker_gone_in_the_middle_of_an_answer_read_whole_closes_the_client(
        tcp: bool) -> None:
    """Nothing of an answer read whole goes on before its end: a broker gone in its
    middle closes the client's connection, which got none of it."""
    asked = trio.Event()

    def handler(req: codecs.Request) -> Any:
        asked.set()  # the proxy forwarded it: an answer has a place in its line
        return None

    async with proxied(handler, tcp=tcp) as h:
        await h.client.send(request(3, 12, 1).encode())
        with trio.fail_after(5):
            await asked.wait()
        await h.broker.frames.send_raw(metadata_answer(1)[:80_000])
        await h.broker.frames.stream.aclose()
        with trio.fail_after(5):
            await h.done.wait()
        assert "closed the connection in the middle of an answer" in h.pumps.close_reason
        assert await h.client.stream.receive_some(1) == b""  # the close, and nothing else
        assert h.pumps.ctx.response_budget.held == 0


def test_a_buffer_pool_keeps_only_unviewed_buffers_within_its_limit() -> None:
    from gatehouse.proxy.budget import BufferPool

    pool = BufferPool(limit=1000)
    first = pool.take(600)
    assert len(first) == 600
    view = memoryview(first)[10:20]
    pool.give(first)  # a view is alive: not kept
    assert pool.kept == 0
    view.release()
    pool.give(first)
    assert pool.kept == 600 and len(first) == 600
    assert pool.take(500) is first and pool.kept == 0  # a larger one serves
    pool.give(first)
    pool.give(bytearray(500))  # past the limit: dropped
    assert pool.kept == 600
    assert pool.take(700) is not first and pool.kept == 600


class CountingStream(trio.abc.Stream):
    """The proxy's side of its upstream connection, counting what the proxy sends."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.sent = 0
        self.waiters: list[tuple[int, trio.Event]] = []

    async def send_all(self, data: Any) -> None:
        await self.stream.send_all(data)
        self.sent += len(data)
        for n, event in self.waiters:
            if self.sent >= n:
                event.set()

    async def sent_at_least(self, n: int) -> None:
        event = trio.Event()
        self.waiters.append((n, event))
        if self.sent >= n:
            event.set()
        await event.wait()

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


class Counting:
    """``proxied(upstream=...)``: wraps the proxy's upstream side in a CountingStream."""

    stream: CountingStream

    def __call__(self, stream: trio.abc.Stream) -> trio.abc.Stream:
        self.stream = CountingStream(stream)
        return self.stream


def produce_wire(correlation_id: int, *, acks: int = -1, topics: tuple[str, ...] = ("orders",),
                 version: int = 9, records: tuple[bytes, ...] = ()) -> bytes:
    """A Produce request with ``records`` for its topics, by default RECORDS for the first
    (a few bytes for the others)."""
    return frame_bytes(request(0, version, correlation_id, transactional_id=None, acks=acks,
                               timeout_ms=1000, topic_data=[
                                   {"name": topic, "partition_data": [
                                       {"index": 0, "records": records[i] if records
                                        else RECORDS[:1000] if i else RECORDS}]}
                                   for i, topic in enumerate(topics)]).encode())


def record_batch(count: int, size: int) -> bytes:
    """A v2 record batch of ``size`` bytes whose header claims ``count`` records (what the
    proxy counts; its records are noise it never reads)."""
    body = struct.pack(">hiqqqhii", 0, 0, 0, 0, -1, -1, -1, count)
    body += RECORDS[:size - 21 - len(body)]
    return struct.pack(">qii", 0, 9 + len(body), 0) + b"\x02" + struct.pack(">I", 0) + body


def produce_answer(req: codecs.Request) -> Any:
    if req.api_key != 0:
        return req.api.response.root.default
    if req.body.acks == 0:
        return None
    return response_body(0, req.api_version, responses=[
        {"name": t.name, "partition_responses": [{"index": 0, "error_code": 0, "base_offset": 0}]}
        for t in req.body.topic_data], throttle_time_ms=0)


def rename_orders() -> Policy:
    """The rules of a proxy that renames the topic "orders" to "prod.orders"."""
    from gatehouse.configfile import load_yaml_text
    from gatehouse.proxy.policy import RulesPolicy
    from gatehouse.rules import parse_rules

    return RulesPolicy(parse_rules(load_yaml_text(
        "- name: alias\n  rename_topics: {orders: prod.orders}\n", "rules.yaml"), "rules.yaml"))


async def stream_up(h: Harness, upstream: CountingStream, wire: bytes) -> None:
    """Sends ``wire`` in two halves and checks the first is at the broker before the
    second leaves the client (store-and-forward would wait for it: the test times out)."""
    half, before, whole = len(wire) // 2, upstream.sent, len(h.broker.received)
    await h.client.send_raw(wire[:half])
    with trio.fail_after(5):
        await upstream.sent_at_least(before + half)
    assert len(h.broker.received) == whole  # not whole there yet
    await h.client.send_raw(wire[half:])


async def held_whole(h: Harness, upstream: CountingStream, wire: bytes) -> bytes:
    """Sends ``wire`` in two halves, checks that nothing of it went up before the second
    (received whole, then decided), and returns the answer."""
    await h.client.send_raw(wire[:len(wire) // 2])
    await trio.testing.wait_all_tasks_blocked()
    assert upstream.sent == 0  # held: the rules or the policy have not seen it yet
    await h.client.send_raw(wire[len(wire) // 2:])
    with trio.fail_after(5):
        answer = await h.client.receive()
    assert answer is not None
    return answer


async def test_a_large_produce_request_reaches_the_broker_before_its_last_byte_leaves_the_client(
) -> None:
    recorder = Recorder()
    counted = Counting()
    async with proxied(produce_answer, observer=recorder, upstream=counted) as h:
        wire = produce_wire(5)
        await stream_up(h, counted.stream, wire)
        with trio.fail_after(5):
            answer = await h.client.receive()
        assert answer is not None and struct.unpack_from(">i", answer)[0] == 5
        assert h.broker.received == [wire[4:]]  # the very bytes the client sent
        assert recorder.requests == [(0, 9)] and recorder.responses == [5]
        assert h.conn.requests == 1 and h.conn.bytes_from_client == len(wire)
        assert h.pumps.ctx.request_budget.held == 0
        assert h.pumps.ctx.frame_buffers.kept >= len(wire)  # back in the pool

        # An acks=0 request streams too, with no answer owed.
        quiet = produce_wire(6, acks=0)
        await stream_up(h, counted.stream, quiet)
        await h.client.send(request(3, 12, 7, topics=[]).encode())
        with trio.fail_after(5):
            answer = await h.client.receive()
        assert answer is not None and struct.unpack_from(">i", answer)[0] == 7
        assert h.broker.received[1] == quiet[4:]


async def send_pieces(h: Harness, *pieces: bytes) -> None:
    for piece in pieces:
        await h.client.send_raw(piece)


@pytest.mark.parametrize("reader", [None, "bodies", "rename"])
async def test_over_sockets_a_large_request_no_one_reads_goes_up_spliced(
        reader: str | None) -> None:
    """Over real sockets, a large Produce request no rule or observer reads goes up with
    its records socket to socket, after its first bytes (renamed, if a rule renames its
    one topic); the observers hear of it (its header) first.  One that an observer reads
    whole goes through the proxy."""
    recorder = Recorder()
    observer = Observers([recorder] + ([TopicsSeen()] if reader == "bodies" else []))
    policy = rename_orders() if reader == "rename" else None
    async with proxied(produce_answer, observer=observer, policy=policy, tcp=True) as h:
        wire = produce_wire(5)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:  # while the broker reads
                nursery.start_soon(send_pieces, h, wire[:1000], wire[1000:])
                answer = await h.client.receive()
        assert answer is not None and struct.unpack_from(">i", answer)[0] == 5
        if reader == "rename":  # the very bytes of the request naming the broker's topic
            assert h.broker.received == [produce_wire(5, topics=("prod.orders",))[4:]]
            resp = codecs.decode_response(answer, api_key=0, api_version=9)
            assert [t.name for t in resp.body.responses] == ["orders"]  # named back
        else:
            assert h.broker.received == [wire[4:]]  # the very bytes the client sent
        assert recorder.requests == [(0, 9)] and recorder.responses == [5]
        assert h.conn.requests == 1 and h.conn.bytes_from_client == len(wire)
        assert h.pumps.ctx.request_budget.held == 0
        pipes = h.pumps.ctx.pipes
        assert pipes is not None
        if reader == "bodies":
            assert pipes.spliced == 0
        else:
            assert pipes.spliced >= len(RECORDS) - _RECEIVE_SIZE


async def test_over_sockets_after_a_spliced_request_only_the_next_ones_first_bytes_are_read(
) -> None:
    """Large requests one after the other: after one whose records went socket to
    socket, the proxy reads only the first bytes of the next (the rest is spliced, not
    copied in and out); after a whole small one, it reads as much as it can again."""
    async with proxied(produce_answer, tcp=True) as h:
        pipes = h.pumps.ctx.pipes
        assert pipes is not None
        wires = [produce_wire(correlation_id) for correlation_id in (5, 6)]
        first = 0
        for correlation_id, wire in zip((5, 6), wires, strict=True):
            first = pipes.spliced  # before this request
            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:  # while the broker reads
                    nursery.start_soon(send_pieces, h, wire)
                    answer = await h.client.receive()
            assert answer is not None
            assert struct.unpack_from(">i", answer)[0] == correlation_id
        assert h.broker.received == [wire[4:] for wire in wires]
        assert pipes.spliced - first >= len(wires[1]) - _SPLICE_READ
        assert h.pumps.client_read == _SPLICE_READ
        await h.client.send(request(3, 12, 7, topics=[]).encode())
        with trio.fail_after(5):
            assert await h.client.receive() is not None
        assert h.pumps.client_read == _RECEIVE_SIZE


# How the proxy peeks at a socket's bytes: past the first waiting byte with the loop in
# C (_peeking.c) or in Python, or (a system without TCP SO_PEEK_OFF) at the first only.
PEEKS = pytest.mark.parametrize("offsets", ["c", "python", False],
                                ids=["peek-offsets-c", "peek-offsets-python", "first-byte-only"])


def peek_as(offsets: str | bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's peeks as ``PEEKS`` names them, from the connection's first frame on."""
    from gatehouse.proxy import fastio

    if not offsets:
        monkeypatch.setattr(fastio, "_PEEK_OFFSETS", False)
        return
    assert fastio._C_PEEK_WALK is not None
    monkeypatch.setattr(fastio, "_PEEK_OFFSETS", True)
    if offsets == "python":
        monkeypatch.setattr(fastio, "_C_PEEK_WALK", None)


class SendsCounted:
    """The proxy's side of a connection, its ``send_all`` bytes added to ``seen.sent``."""

    def __init__(self, io: Any, seen: CountsSeen) -> None:
        self.io = io
        self.seen = seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.io, name)

    async def send_all(self, data: Any) -> None:
        self.seen.sent += len(data)
        await self.io.send_all(data)


class CountsSeen(Recorder):
    """Records what ``produce.request_topics_of`` says of the Produce requests it hears
    of, as the metrics and the log read them, and how many of the request's bytes had
    gone up by then (``watch``: sent or spliced)."""

    counts_request_records = True

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[Any] = []
        self.sent = 0
        self.gone_up: list[int] = []
        self.pipes: Any = None

    def watch(self, h: Harness) -> None:
        self.pipes = h.pumps.ctx.pipes
        h.pumps.upstream_io = SendsCounted(h.pumps.upstream_io, self)  # type: ignore[assignment]

    def request(self, conn: Any, req: codecs.Request, size: int) -> None:
        super().request(conn, req, size)
        if req.api_key == 0:
            self.counts.append(produce.request_topics_of(req))
            self.gone_up.append(self.sent + self.pipes.spliced)


async def produce_through(h: Harness, wire: bytes) -> None:
    """``wire`` (a Produce request, correlation id 5) sent in two pieces while the broker
    reads; its answer reaches the client, and the broker got the very bytes sent."""
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:  # while the broker reads
            nursery.start_soon(send_pieces, h, wire[:1000], wire[1000:])
            answer = await h.client.receive()
    assert answer is not None and struct.unpack_from(">i", answer)[0] == 5
    assert h.broker.received == [wire[4:]]  # the very bytes the client sent


@pytest.mark.parametrize("version", [3, 8, 9, 12])
@pytest.mark.parametrize("shape", ["batches", "noise"])
@PEEKS
async def test_over_sockets_a_large_request_the_metrics_count_goes_up_spliced_and_counted(
        version: int, shape: str, offsets: str | bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large Produce request whose records the metrics count (and nothing reads more
    of) goes up with each batch's records socket to socket, its batch headers read on
    the way: the broker gets the very bytes the client sent, and the observers hear of
    it with the counts the whole frame gives, before its last bytes go up.  Records
    that are no batches are counted as the reader counts them (and spliced too).  On a
    system that cannot peek past the first waiting byte, the same, in more splices."""
    from gatehouse.metrics import ProxyMetrics

    peek_as(offsets, monkeypatch)
    metrics, seen = ProxyMetrics(), CountsSeen()
    sets = ((record_batch(700, 600_000), record_batch(5, 300_000)) if shape == "batches"
            else (RECORDS[:400_000], RECORDS[:200_000]))
    async with proxied(produce_answer, observer=Observers([metrics, seen]), tcp=True) as h:
        seen.watch(h)
        wire = produce_wire(5, topics=("orders", "audit"), version=version, records=sets)
        await produce_through(h, wire)
        expected = produce.request_topics(wire[4:], version)
        assert expected is not None and seen.counts == [expected]
        assert 0 < seen.gone_up[0] < len(wire)  # heard of before its last bytes went up
        assert seen.responses == [5]
        assert h.conn.bytes_from_client == len(wire)
        pipes = h.pumps.ctx.pipes
        assert pipes is not None
        # All but the first read of the frame went socket to socket.
        assert pipes.spliced >= len(wire) - _RECEIVE_SIZE
        if shape == "batches":
            assert expected == [("orders", [0], 700, len(sets[0])), ("audit", [0], 5, len(sets[1]))]
            value = metrics.registry.get_sample_value
            assert value("gatehouse_topic_records_total",
                         {"topic": "orders", "direction": "produce"}) == 700
            assert value("gatehouse_topic_bytes_total",
                         {"topic": "audit", "direction": "produce"}) == len(sets[1])
            # And on the connection, for /connections.
            assert h.conn.produced == {"orders": [700, len(sets[0])],
                                       "audit": [5, len(sets[1])]}
        else:
            assert h.conn.produced == {}
        assert h.conn.api_requests == {0: 1}


@pytest.mark.parametrize("version", [8, 9, 12])
@PEEKS
async def test_over_sockets_a_large_request_for_one_partition_is_counted_from_its_first_read(
        version: int, offsets: str | bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large Produce request for one partition (what a producer sends a topic of one
    partition): its batch's header comes in the first read and nothing after its records
    but the frame's three empty tag sections (flexible versions: produce.EMPTY_TAIL), so
    the observers hear of it counted before any of it goes up, and the rest goes up in
    one splice, nothing peeked at."""
    from gatehouse.metrics import ProxyMetrics
    from gatehouse.proxy import fastio

    peek_as(offsets, monkeypatch)
    peeks: list[int] = []
    peek_walk = fastio.FastStream.peek_walk

    def counting(stream: Any, walk: Any, at: int, moved: int, total: int) -> tuple[int, int]:
        peeks.append(at)
        return peek_walk(stream, walk, at, moved, total)

    monkeypatch.setattr(fastio.FastStream, "peek_walk", counting)
    metrics, seen = ProxyMetrics(), CountsSeen()
    async with proxied(produce_answer, observer=Observers([metrics, seen]), tcp=True) as h:
        seen.watch(h)
        sets = (record_batch(700, 600_000),)
        wire = produce_wire(5, version=version, records=sets)
        await produce_through(h, wire)
        assert seen.counts == [[("orders", [0], 700, len(sets[0]))]]
        assert seen.gone_up == [0]  # counted before any of it went up
        assert peeks == []
        assert metrics.registry.get_sample_value(
            "gatehouse_topic_records_total", {"topic": "orders", "direction": "produce"}) == 700
        pipes = h.pumps.ctx.pipes
        assert pipes is not None and pipes.spliced >= len(wire) - _RECEIVE_SIZE


async def test_over_sockets_a_large_request_the_walk_cannot_follow_goes_up_uncounted(
) -> None:
    """A large Produce request whose topic count says one more topic than its bytes hold:
    the walk reaches the frame's end inside a part, so the request goes up as it came,
    uncounted (the broker answers for it), and the connection carries on."""
    from gatehouse.metrics import ProxyMetrics

    def answer(req: codecs.Request) -> Any:
        return None if req.api_key == 0 else req.api.response.root.default

    seen = CountsSeen()
    async with proxied(answer, observer=Observers([ProxyMetrics(), seen]), tcp=True) as h:
        seen.watch(h)
        wire = produce_wire(5, acks=0, records=(record_batch(10, 300_000),), version=8)
        head = b"\x00\x00" + b"\x00\x00\x03\xe8" + b"\x00\x00\x00\x01"  # acks 0, 1 topic
        at = wire.index(head) + len(head) - 1
        lying = wire[:at] + b"\x02" + wire[at + 1:]  # 2 topics: the second never comes
        assert produce.request_topics(lying[4:], 8) is None
        with trio.fail_after(5):
            await send_pieces(h, lying[:1000], lying[1000:])
            await h.client.send(request(3, 12, 7, topics=[]).encode())
            answered = await h.client.receive()
        assert answered is not None and struct.unpack_from(">i", answered)[0] == 7
        assert h.broker.received[0] == lying[4:]
        assert seen.counts == [None]  # heard of, uncounted
        assert h.pumps.close_reason == CLIENT_CLOSED  # still open


@pytest.mark.parametrize("metered", [False, True], ids=["plain", "metered"])
async def test_over_sockets_a_client_gone_in_the_middle_of_a_spliced_request_closes_it(
        metered: bool) -> None:
    from gatehouse.metrics import ProxyMetrics

    observer = ProxyMetrics() if metered else None  # metered: the walk peeks ahead
    async with proxied(produce_answer, tcp=True, observer=observer) as h:
        wire = produce_wire(5, records=(record_batch(3, 900_000),) if metered else ())
        await h.client.send_raw(wire[:300_000])
        await h.client.stream.aclose()
        with trio.fail_after(5):
            await h.done.wait()
        assert h.pumps.close_reason == (f"client closed the connection in the middle of a "
                                        f"{len(wire) - 4}-byte request")
        assert h.broker.received == []  # never whole at the broker


class TopicsSeen(Recorder):
    """Records the topic names of the Produce requests the observers hear of."""

    def __init__(self) -> None:
        super().__init__()
        self.topics: list[list[str]] = []

    reads_request_bodies = True  # as the metrics do: they see the request whole

    def request(self, conn: Any, req: codecs.Request, size: int) -> None:
        super().request(conn, req, size)
        if req.api_key == 0:
            self.topics.append([t.name for t in req.body.topic_data])


@pytest.mark.parametrize("version", [3, 8, 9, 12])
async def test_a_large_produce_request_for_one_topic_a_rule_renames_streams_renamed(
        version: int) -> None:
    """Its first bytes go up with the topic's new name and its new size, the rest as it
    arrives; the observers see the request as the client sent it, and the answer names
    the topic back."""
    seen = TopicsSeen()
    counted = Counting()
    async with proxied(produce_answer, policy=rename_orders(), observer=seen,
                       upstream=counted) as h:
        pool = h.pumps.ctx.frame_buffers
        sent = 0
        for correlation_id in (5, 6):
            wire = produce_wire(correlation_id, version=version)
            await stream_up(h, counted.stream, wire)
            sent += len(wire)
            with trio.fail_after(5):
                answer = await h.client.receive()
            assert answer is not None
            renamed = produce_wire(correlation_id, topics=("prod.orders",), version=version)
            assert h.broker.received[-1] == renamed[4:]
            resp = codecs.decode_response(answer, api_key=0, api_version=version)
            assert resp.header.correlation_id == correlation_id
            assert [t.name for t in resp.body.responses] == ["orders"]  # named back
            assert pool.kept >= len(wire)  # the pooled buffer is back
        assert seen.topics == [["orders"], ["orders"]]
        assert h.conn.requests == 2 and h.conn.bytes_from_client == sent
        assert counted.stream.sent == 2 * len(renamed)
        assert h.pumps.ctx.request_budget.held == 0


@TRANSPORTS
async def test_the_observation_log_gives_a_streamed_renamed_request_its_rule_and_broker_name(
        tmp_path: Path, tcp: bool) -> None:
    """The rule's decision on a request that streams is taken from its first bytes, but
    reported after its observers see it whole: the observation log's record of it names
    the rule and the topic's broker-side name and counts its records, and no other record
    gets that outcome.  Over sockets its records go up spliced, counted on the way."""
    from gatehouse.capture.observer import CaptureObserver
    from gatehouse.capture.settings import CaptureSettings
    from tests.test_capture import read_records

    policy = rename_orders()
    capture = CaptureObserver(CaptureSettings(dir=tmp_path))
    capture.attach(policy)
    batch = (record_batch(321, 700_000),)
    async with proxied(produce_answer, policy=policy, observer=capture, tcp=tcp) as h:
        await h.client.send(request(3, 12, 4, topics=[{"name": "orders"}]).encode())
        with trio.fail_after(5):
            assert await h.client.receive() is not None
            await send_pieces(h, (wire := produce_wire(5, records=batch))[:1000], wire[1000:])
            assert await h.client.receive() is not None
        assert h.broker.received[-1] == produce_wire(5, topics=("prod.orders",),
                                                     records=batch)[4:]
        pipes = h.pumps.ctx.pipes
        assert (pipes is not None and pipes.spliced > len(batch[0]) - _RECEIVE_SIZE) == tcp
    assert capture.close(10)
    produced = next(r for r in read_records(tmp_path) if r["correlation_id"] == 5)
    assert [(t["records"], t["bytes"]) for t in produced["topics"]] == [(321, len(batch[0]))]
    records = {r["correlation_id"]: r for r in read_records(tmp_path)}
    for correlation_id, api in ((4, "Metadata"), (5, "Produce")):
        record = records[correlation_id]
        assert record["api"] == api
        assert [r["rule"] for r in record["rules"]] == ["alias"]  # its own, once
        assert [(t["name"], t["broker"]) for t in record["topics"]] == [("orders",
                                                                         "prod.orders")]


class Sequence(Recorder):
    """What the observers hear and the rules report, in order."""

    def __init__(self, policy: Any, reads_bodies: bool) -> None:
        super().__init__()
        self.reads_request_bodies = reads_bodies
        self.events: list[str] = []
        policy.outcome_listeners.append(lambda o: self.events.append(f"rule {o.rule}"))

    def request(self, conn: Any, req: codecs.Request, size: int) -> None:
        self.events.append(f"request {req.header.correlation_id}")


@TRANSPORTS
async def test_a_streamed_requests_decision_is_reported_after_its_observers_hear_of_it(
        tcp: bool) -> None:
    """Over sockets with no observer reading bodies, the renamed request is spliced and
    its observers hear of it (its header) before its bytes go up; over memory streams
    they see it whole at its end.  Either way its rule's outcome follows, as it follows
    a request decided whole."""
    policy = rename_orders()
    seen = Sequence(policy, reads_bodies=not tcp)
    async with proxied(produce_answer, policy=policy, observer=seen, tcp=tcp) as h:
        with trio.fail_after(5):
            for correlation_id in (5, 6):
                await send_pieces(h, (wire := produce_wire(correlation_id))[:1000],
                                  wire[1000:])
                assert await h.client.receive() is not None
        pipes = h.pumps.ctx.pipes
        assert (pipes is not None and pipes.spliced > 0) == tcp
    assert seen.events == ["request 5", "rule alias", "request 6", "rule alias"]


async def test_a_large_produce_request_for_two_topics_a_rule_renames_is_renamed_whole(
) -> None:
    """The second name lies past the first topic's records: the request is received
    whole, then renamed, before a byte of it goes up."""
    counted = Counting()
    async with proxied(produce_answer, policy=rename_orders(), upstream=counted) as h:
        wire = produce_wire(5, topics=("orders", "audit"))
        answer = await held_whole(h, counted.stream, wire)
        assert h.broker.received == [produce_wire(5, topics=("prod.orders", "audit"))[4:]]
        resp = codecs.decode_response(answer, api_key=0, api_version=9)
        assert [t.name for t in resp.body.responses] == ["orders", "audit"]
        assert h.pumps.ctx.frame_buffers.kept >= len(wire)  # received into the pool
        assert h.pumps.ctx.request_budget.held == 0


RENAMED = pytest.mark.parametrize("renamed", [False, True], ids=["as-is", "renamed"])


@RENAMED
async def test_a_client_gone_in_the_middle_of_a_streamed_request_closes_the_connection(
        renamed: bool) -> None:
    counted = Counting()
    policy = rename_orders() if renamed else None
    async with proxied(produce_answer, upstream=counted, policy=policy) as h:
        wire = produce_wire(5)
        await h.client.send_raw(wire[:300_000])
        with trio.fail_after(5):
            await counted.stream.sent_at_least(200_000)
        await h.client.stream.aclose()
        with trio.fail_after(5):
            await h.done.wait()
        assert "client closed the connection in the middle of a" in h.pumps.close_reason
        assert h.broker.received == []  # the broker never saw it whole: its connection closes


async def test_a_client_gone_in_the_middle_of_a_request_to_rename_closes_the_connection(
) -> None:
    """A large request received whole before it goes up (a rule renames its topics): the
    client leaving half-way closes its connection with a reason that says so, and not
    one byte of it reaches the broker."""
    policy = rename_orders()
    counted = Counting()
    async with proxied(produce_answer, policy=policy, upstream=counted) as h:
        wire = produce_wire(5, topics=("orders", "audit"))
        await h.client.send_raw(wire[:300_000])
        await trio.testing.wait_all_tasks_blocked()
        await h.client.stream.aclose()
        with trio.fail_after(5):
            await h.done.wait()
        assert (f"client closed the connection in the middle of a {len(wire) - 4}-byte request"
                in h.pumps.close_reason)
        assert counted.stream.sent == 0 and h.broker.received == []
        assert h.pumps.ctx.request_budget.held == 0


@RENAMED
async def test_a_broker_gone_in_the_middle_of_a_streamed_request_closes_the_client(
        renamed: bool) -> None:
    counted = Counting()
    policy = rename_orders() if renamed else None
    async with proxied(produce_answer, upstream=counted, policy=policy) as h:
        wire = produce_wire(5)
        half = len(wire) // 2
        await h.client.send_raw(wire[:half])
        with trio.fail_after(5):
            await counted.stream.sent_at_least(half)
        await h.broker.frames.stream.aclose()
        await h.client.send_raw(wire[half:])
        with trio.fail_after(5):
            await h.done.wait()
        assert h.pumps.close_reason == ("broker broker:9092 closed the connection with 1 "
                                        "request(s) in flight")
        assert await h.client.receive() is None  # the client sees the close, no answer
        assert h.pumps.ctx.request_budget.held == 0


async def test_a_client_stalled_in_the_middle_of_a_streamed_request_meets_the_idle_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    """Its bytes went up as they came, but only a whole request is activity (slowloris):
    the connection, and the broker's side of it, close at the idle timeout."""
    counted = Counting()
    async with proxied(produce_answer, upstream=counted, limits=Limits(idle_timeout=30)) as h:
        wire = produce_wire(5)
        await h.client.send_raw(wire[:300_000])
        await counted.stream.sent_at_least(300_000 - 1024)
        await h.done.wait()
        assert h.pumps.close_reason == "idle timeout"
        assert 30 <= trio.current_time() <= 31
        assert h.broker.received == []  # never whole at the broker
        assert h.pumps.ctx.request_budget.held == 0


async def test_a_broker_stalled_in_the_middle_of_a_streamed_answer_meets_the_idle_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    """Every piece of an answer is activity, so a broker trickling one keeps the connection;
    one that stops in the middle meets the idle timeout and the client sees the close."""
    async with proxied(no_answer, limits=Limits(idle_timeout=30)) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1)
        pieces = [wire[i:i + 100_000] for i in range(0, 500_000, 100_000)]
        for piece in pieces:  # one piece every 20 s: never 30 s without a byte
            await h.broker.frames.send_raw(piece)
            await trio.sleep(20)
        assert await receive_bytes(h, 500_000) == wire[:500_000]
        assert not h.done.is_set()
        last = trio.current_time() - 20
        await h.done.wait()
        assert h.pumps.close_reason == "idle timeout"
        assert last + 30 <= trio.current_time() <= last + 31
        assert await h.client.stream.receive_some(1) == b""


async def test_a_drain_lets_a_streamed_request_finish_and_be_answered() -> None:
    draining = trio.Event()
    counted = Counting()
    async with proxied(produce_answer, draining=draining, upstream=counted) as h:
        wire = produce_wire(5)
        half = len(wire) // 2
        await h.client.send_raw(wire[:half])
        with trio.fail_after(5):
            await counted.stream.sent_at_least(half - 1024)
        draining.set()
        await trio.testing.wait_all_tasks_blocked()
        await h.client.send_raw(wire[half:])
        with trio.fail_after(5):
            answer = await h.client.receive()
            await h.done.wait()
        assert answer is not None and struct.unpack_from(">i", answer)[0] == 5
        assert h.broker.received == [wire[4:]]
        assert h.pumps.close_reason == "proxy shutting down"


class DropEmptyTopics(Policy):
    """Decides by the body: a Produce request naming no topic is answered here."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_request(self, conn: Any, req: codecs.Request) -> Any:
        if req.api_key == 0:
            self.seen.append(len(req.body.topic_data))  # the whole body, decoded
        return Forward(req)


async def test_a_policy_that_reads_bodies_gets_large_requests_whole() -> None:
    """A Policy subclass with its own on_request and no forwards_unread is never bypassed:
    its large Produce requests are received whole, then decided."""
    policy = DropEmptyTopics()
    counted = Counting()
    async with proxied(produce_answer, policy=policy, upstream=counted) as h:
        wire = produce_wire(5)
        await held_whole(h, counted.stream, wire)
        assert policy.seen == [1]
        assert h.broker.received == [wire[4:]]


class FetchQuota(Policy):
    """Every connection under one enforced Fetch quota of 100 kB/s."""

    def __init__(self) -> None:
        self.charge = Charge("readers", "enforce", "fetch_bytes", Bucket(100_000), 100_000)

    def quota_charges(self, conn: Any, now: float) -> tuple[Charge, ...]:
        return (self.charge,)


@METERED
@TRANSPORTS
async def test_a_streamed_answer_over_a_quota_asks_the_client_to_wait(
        tcp: bool, metered: bool) -> None:
    """A 1 MiB Fetch answer under a 100 kB/s quota: its bytes are spent as it starts,
    and its throttle_time_ms, the first field, is written in its first bytes before they
    go (streamed, or spliced over sockets); every other byte is the broker's."""
    policy = FetchQuota()
    async with proxied(no_answer, policy=policy, observer=watching(metered), tcp=tcp) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1)
        with trio.fail_after(5):
            got = await relay(h, wire[:5000], wire[5000:])
        at = 4 + codecs.throttle_time_at(wire[4:], 1, FETCH_VERSION)  # type: ignore[operator]
        (throttle,) = struct.unpack_from(">i", got, at)
        # (1 MiB + the frame's size prefix - a second's burst) at 100 kB/s.
        debt = (len(wire) - 100_000) / 100_000
        assert abs(throttle - debt * 1000) < 100, (throttle, debt)
        assert got[:at] + got[at + 4:] == wire[:at] + wire[at + 4:]
        assert_spliced(h, tcp)


class ScansSeen(Recorder):
    """Records, for each Fetch answer, what the observers that read what answers carry
    find of it (``scanned_response``), and whether its bytes came with it."""

    reads_scans = True

    def __init__(self) -> None:
        super().__init__()
        self.scans: list[Any] = []
        self.framed: list[bool] = []

    def response(self, conn: Any, pending: Any, size: int, elapsed: float,
                 frame: Any = None) -> None:
        from gatehouse.proxy.hooks import scanned_response

        super().response(conn, pending, size, elapsed, frame)
        self.scans.append(scanned_response(pending, frame))
        self.framed.append(frame is not None)


# 29 batches of 40,000 bytes (435 records), then a batch cut short (a broker's answer
# may end inside one): the records field of a partition in a consumer's answer.
FETCHED = b"".join(record_batch(n, 40_000) for n in range(1, 30)) + record_batch(99, 50_000)[:20_000]


@pytest.mark.parametrize("version", [12, 13, 16, FETCH_VERSION])
@pytest.mark.parametrize("shape", ["batches", "noise"])
@PEEKS
async def test_over_sockets_a_large_fetch_answer_the_metrics_count_goes_on_spliced_and_counted(
        version: int, shape: str, offsets: str | bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large Fetch answer, with the metrics on, goes to the client with its records
    socket to socket, each batch's header read on the way where it lies in the broker's
    socket: the client gets the very bytes the broker sent, and the observers find what
    the whole frame's scan gives (every error code, each topic's records and bytes) and
    count it.  Records that are no batches are read as the scan reads them (and spliced
    too).  On a system that cannot peek past the first waiting byte (a splice for every
    batch), the answer goes through the proxy's buffers instead, counted the same."""
    from gatehouse.metrics import ProxyMetrics

    peek_as(offsets, monkeypatch)
    metrics, seen = ProxyMetrics(), ScansSeen()
    records = FETCHED if shape == "batches" else RECORDS
    async with proxied(no_answer, observer=Observers([metrics, seen]), tcp=True) as h:
        await send_fetch(h, 1, version)
        wire = fetch_answer(1, records=records, version=version, partition_error=6)
        with trio.fail_after(5):
            assert await relay(h, wire[:5000], wire[5000:]) == wire  # the very bytes
        expected = fetch.response_scan(wire[4:], version)
        assert expected is not None and seen.scans == [expected]
        pipes = h.pumps.ctx.pipes
        assert pipes is not None
        if offsets:
            assert seen.framed == [False]  # its bytes went by unread
            assert pipes.spliced >= len(records) - _SPLICE_READ
        else:
            assert seen.framed == [True] and pipes.spliced == 0
        assert h.pumps.conn.bytes_to_client == len(wire)
        value = metrics.registry.get_sample_value
        assert value("gatehouse_responses_total", {"api": "Fetch", "error": "NONE"}) == 2
        assert value("gatehouse_responses_total",
                     {"api": "Fetch", "error": "NOT_LEADER_OR_FOLLOWER"}) == 1
        topic = {"topic": "orders" if version < 13 else "unknown", "direction": "fetch"}
        if shape == "batches":
            size = 29 * 40_000  # the cut batch's bytes are not a whole batch's: uncounted
            assert expected[2][0][1:] == ([0, 1], 435, size)
            assert value("gatehouse_topic_records_total", topic) == 435
            assert value("gatehouse_topic_bytes_total", topic) == size
            assert h.pumps.conn.fetched == {topic["topic"]: [435, size]}  # /connections
        else:
            assert expected[2][0][1:] == ([0, 1], 0, 0)
            assert value("gatehouse_topic_records_total", topic) is None
            assert h.pumps.conn.fetched == {}
        # The connection goes on: the next answer, small, comes whole to the observers.
        await send_fetch(h, 2, version)
        small = fetch_answer(2, records=record_batch(3, 500), version=version)
        with trio.fail_after(5):
            assert await relay(h, small) == small
        assert seen.framed[1:] == [True] and seen.scans[1][2][0][2] == 3


async def test_over_sockets_a_large_fetch_answer_the_walk_cannot_count_goes_on_uncounted(
) -> None:
    """A large Fetch answer whose records the scan does not count (a batch whose length
    is shorter than a batch header): it goes to the client as it came, its bytes
    counted but not its records or codes (the observers find no scan), and the
    connection carries on."""
    from gatehouse.metrics import ProxyMetrics

    metrics, seen = ProxyMetrics(), ScansSeen()
    bad = bytearray(FETCHED)
    bad[40_000 + 8:40_000 + 12] = (20).to_bytes(4, "big")  # the second batch's length
    async with proxied(no_answer, observer=Observers([metrics, seen]), tcp=True) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1, records=bytes(bad))
        assert fetch.response_scan(wire[4:], FETCH_VERSION) is None
        with trio.fail_after(5):
            assert await relay(h, wire[:5000], wire[5000:]) == wire
        assert seen.scans == [None] and seen.framed == [False]
        value = metrics.registry.get_sample_value
        assert value("gatehouse_responses_total", {"api": "Fetch", "error": "NONE"}) is None
        assert value("gatehouse_bytes_total", {"direction": "proxy_to_client"}) == len(wire)
        await send_fetch(h, 2)
        small = fetch_answer(2)
        with trio.fail_after(5):
            assert await relay(h, small[:5000], small[5000:]) == small
        assert seen.scans[1] == fetch.response_scan(small[4:], FETCH_VERSION)
        assert h.pumps.close_reason == CLIENT_CLOSED  # still open


async def test_over_sockets_with_the_metrics_on_a_large_answer_of_another_api_comes_whole(
) -> None:
    """With the metrics on, only Fetch answers are spliced (counted on the way): a large
    answer of another API goes through the proxy's buffers, so the observers get its
    bytes and count its error codes."""
    from gatehouse.metrics import ProxyMetrics

    metrics, seen = ProxyMetrics(), ScansSeen()
    async with proxied(no_answer, observer=Observers([metrics, seen]), tcp=True) as h:
        await h.client.send(request(32, 4, 1, resources=[], include_synonyms=False,
                                    include_documentation=False).encode())
        big = response_body(32, 4, throttle_time_ms=0, results=[
            {"error_code": 0, "error_message": None, "resource_type": 2, "resource_name": "a",
             "configs": [{"name": "x", "value": "v" * 200_000, "read_only": False,
                          "config_source": 1, "is_sensitive": False, "synonyms": [],
                          "config_type": 2, "documentation": None}]},
            {"error_code": 29, "error_message": None, "resource_type": 2, "resource_name": "b",
             "configs": []}])
        wire = frame_bytes(codecs.Response.build(32, 4, 1, big).encode())
        with trio.fail_after(5):
            assert await relay(h, wire[:5000], wire[5000:]) == wire
        assert seen.framed == [True]
        pipes = h.pumps.ctx.pipes
        assert pipes is not None and pipes.spliced == 0
        value = metrics.registry.get_sample_value
        assert value("gatehouse_responses_total",
                     {"api": "DescribeConfigs", "error": "TOPIC_AUTHORIZATION_FAILED"}) == 1


@pytest.mark.parametrize("python", [False, True], ids=["c", "python"])
async def test_over_sockets_the_observation_log_records_a_spliced_fetch_answers_topics(
        python: bool, tmp_path: Path) -> None:
    """The observation log, which reads what Fetch answers carry, lets a large one go
    socket to socket too: its record has the answer's topics, partitions, records and
    bytes as counted on the way, and its error codes (with the log's usual record in C,
    or its Python methods)."""
    from tests.test_capture_records import observer

    capture = observer(tmp_path, {}, python=python)
    async with proxied(no_answer, observer=capture, tcp=True) as h:
        await send_fetch(h, 1)
        wire = fetch_answer(1, records=FETCHED, partition_error=6)
        with trio.fail_after(5):
            assert await relay(h, wire[:5000], wire[5000:]) == wire
        pipes = h.pumps.ctx.pipes
        assert pipes is not None and pipes.spliced >= len(FETCHED) - _SPLICE_READ
    (record,) = [r for r in capture.writer.records if r["api_key"] == 1]  # type: ignore[attr-defined]
    assert record["response_bytes"] == len(wire) - 4
    assert record["errors"] == [6] and record["error_count"] == 1
    assert record["topics"] == [{"name": None, "broker": None, "id": str(uuid.UUID(int=7)),
                                 "partitions": [0, 1], "records": 435, "bytes": 29 * 40_000}]
