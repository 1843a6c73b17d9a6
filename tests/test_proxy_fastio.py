"""FastStream over real TCP sockets: the bytes, the waits, the errors, cancellation and
fairness of trio's SocketStream, with fewer trips through the scheduler."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import uuid
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import fetch, produce
from gatehouse.proxy import fastio
from gatehouse.proxy.connection import _WALKED_PRODUCE_VERSIONS
from gatehouse.proxy.fastio import _GATHER_MIN, _YIELD_EVERY, FastStream, PipePool
from tests.codec_strategies import examples
from tests.support.fakebroker import (
    frame_bytes,
    notsent_lowat,
    request,
    response_body,
    tcp_pair,
)
from tests.test_proxy_stream import RECORDS, record_batch


async def test_bytes_arrive_whole_past_the_socket_buffers() -> None:
    """8 MiB in one send_all: far more than the kernel buffers hold, so the sender
    waits for the reader (wait_writable) and every byte arrives in order."""
    a, b = await tcp_pair()
    sender, receiver = FastStream(a), FastStream(b)
    assert sender.socket is not None  # the direct path, not the stream's own
    payload = bytes(range(256)) * (32 * 1024)
    got = bytearray()

    async def read_all() -> None:
        while len(got) < len(payload):
            chunk = await receiver.receive_some(65536)
            assert chunk
            got.extend(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await sender.send_all(payload)
    assert got == payload
    await a.aclose()
    assert await receiver.receive_some(10) == b""  # EOF, as SocketStream says it
    await b.aclose()


async def test_closed_and_broken_streams_raise_trio_errors() -> None:
    a, b = await tcp_pair()
    fast_a = FastStream(a)
    await a.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await fast_a.receive_some(10)
    with pytest.raises(trio.ClosedResourceError):
        await fast_a.send_all(b"x")
    # A peer that resets: the next send fails as SocketStream's would.
    c, d = await tcp_pair()
    d.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    await d.aclose()  # RST
    fast_c = FastStream(c)
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(100):  # the first write may still be accepted locally
            await fast_c.send_all(b"x" * 65536)
            await trio.sleep(0.01)
    await c.aclose()
    await b.aclose()


async def test_a_waiting_receive_is_woken_by_close() -> None:
    a, b = await tcp_pair()
    fast_b = FastStream(b)
    raised: list[BaseException] = []

    async def receive() -> None:
        try:
            await fast_b.receive_some(10)
        except trio.ClosedResourceError as exc:
            raised.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await trio.testing.wait_all_tasks_blocked()
        await b.aclose()
    assert len(raised) == 1
    await a.aclose()


async def test_cancellation_is_seen_even_when_bytes_are_ready() -> None:
    a, b = await tcp_pair()
    await a.send_all(b"ready")
    fast_b = FastStream(b)
    with trio.CancelScope() as scope:
        scope.cancel()
        await fast_b.receive_some(10)
    assert scope.cancelled_caught  # the bytes wait for the next receive
    assert await fast_b.receive_some(10) == b"ready"
    await a.aclose()
    await b.aclose()


async def test_waiting_is_true_only_while_a_receive_waits_for_bytes() -> None:
    a, b = await tcp_pair()
    fast_b = FastStream(b)
    got: list[bytes | bytearray] = []

    async def receive() -> None:
        got.append(await fast_b.receive_some(10))

    assert not fast_b.waiting
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await trio.testing.wait_all_tasks_blocked()
        assert fast_b.waiting  # blocked on the empty socket
        await a.send_all(b"hi")
    assert got == [b"hi"] and not fast_b.waiting
    await a.aclose()
    await b.aclose()


async def test_bytes_received_are_not_lost_to_a_cancel_at_the_fairness_yield() -> None:
    """Every _YIELD_EVERY-th ready receive yields with the bytes in hand: a cancel
    arriving then is left for the next call, the bytes are returned."""
    a, b = await tcp_pair()
    fast_b = FastStream(b)
    fast_b._ready_calls = _YIELD_EVERY - 1  # the next ready receive yields
    await a.send_all(b"kept")
    with trio.CancelScope() as scope:

        async def cancel_soon() -> None:
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_soon)  # runs during the receive's yield
            data = await fast_b.receive_some(10)
            assert data == b"kept"
            await trio.lowlevel.checkpoint()  # the cancel is seen here, not before
            pytest.fail("the cancel was lost")
    assert scope.cancelled_caught
    await a.aclose()
    await b.aclose()


async def test_a_ready_stream_still_lets_other_tasks_run() -> None:
    """Sends that never wait yield every few calls: another task runs meanwhile."""
    a, b = await tcp_pair()
    fast_a = FastStream(a)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)  # runs only when this task yields
        for _ in range(_YIELD_EVERY * 4):
            await fast_a.send_all(b"x")  # 1 byte: the kernel always takes it at once
        assert 3 <= ticks <= 5  # a yield every _YIELD_EVERY sends, not one per send
        nursery.cancel_scope.cancel()
    await a.aclose()
    await b.aclose()


async def test_other_streams_use_their_own_methods() -> None:
    left, right = trio.testing.memory_stream_pair()
    fast_left, fast_right = FastStream(left), FastStream(right)
    assert fast_left.socket is None
    await fast_left.send_all(b"hello")
    assert await fast_right.receive_some(10) == b"hello"


@pytest.mark.parametrize("direct", [True, False])
async def test_receive_into_fills_the_callers_buffer_past_the_socket_buffers(
        direct: bool) -> None:
    """8 MiB received straight into one buffer, never past the end of the view given,
    then EOF as 0 and a closed stream as trio's error; the same over a stream that is
    not a plain socket (a memory stream: copied in)."""
    payload = bytes(range(256)) * (32 * 1024)
    if direct:
        a, b = await tcp_pair()
        sender: trio.abc.Stream = a
        receiver = FastStream(b)
        assert receiver.socket is not None
    else:
        sender_stream, receiving = trio.testing.memory_stream_pair()
        sender, receiver = sender_stream, FastStream(receiving)
        assert receiver.socket is None
    whole = bytearray(len(payload) + 3)
    view = memoryview(whole)
    got = 0

    async def read_all() -> None:
        nonlocal got
        while got < len(payload):
            n = await receiver.receive_into(view[got:len(payload)])
            assert 0 < n <= len(payload) - got
            got += n

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await sender.send_all(payload + b"end")  # the tail stays for the next read
    assert whole[:len(payload)] == payload and whole[len(payload):] == b"\x00" * 3
    rest = bytearray(10)
    n = await receiver.receive_into(memoryview(rest))
    assert rest[:n] == b"end"[:n] and n >= 1
    await sender.aclose()
    while (n := await receiver.receive_into(memoryview(rest))) != 0:
        pass  # what remained of "end", then EOF
    await receiver.stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive_into(memoryview(rest))


@pytest.mark.parametrize("size", [0, 100, _GATHER_MIN, 8 * 1024 * 1024 + 7])
@pytest.mark.parametrize("direct", [True, False])
async def test_send_frame_sends_the_size_prefix_and_the_frame(direct: bool, size: int) -> None:
    """A frame with its size prefix, byte for byte; 8 MiB is far past the socket
    buffers, so the gathered write is cut short many times and resumed where it stopped,
    in the prefix or in the frame."""
    frame = bytearray((i * 7 + 3) % 251 for i in range(size))
    if direct:
        a, b = await tcp_pair()
        a.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sending: trio.abc.Stream = a
        receiver: trio.abc.Stream = b
    else:
        sending, receiver = trio.testing.memory_stream_pair()
    sender = FastStream(sending)
    assert (sender.socket is not None) is direct
    got = bytearray()

    async def read_all() -> None:
        while len(got) < 4 + size:
            chunk = await receiver.receive_some(3 if len(got) < 8 else 65536)
            assert chunk
            got.extend(chunk)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await sender.send_frame(memoryview(frame))
    assert got == struct.pack(">i", size) + frame
    frame.append(0)  # the frame is no longer exported: it can be resized
    await sending.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await sender.send_frame(bytes(_GATHER_MIN))
    await receiver.aclose()


async def test_splice_moves_exactly_n_bytes_socket_to_socket_at_the_readers_pace() -> None:
    """2 MiB through a 64 KiB pipe (several times the sockets' buffers): the sender's
    splice waits for the slow reader (wait_writable) and for the source (wait_readable);
    exactly n bytes move, the byte after them stays in the source for the next reader,
    and the pipe is left empty, so the pool keeps it."""
    src_far, src = await tcp_pair()
    dst, dst_far = await tcp_pair()
    dst.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    pool = PipePool()
    pipe = pool.take()
    fcntl.fcntl(pipe.write_fd, 1031, 65536)  # F_SETPIPE_SZ: a pipe smaller than the move
    pipe.size = 65536
    payload = bytes(range(256)) * (8 * 1024)
    got = bytearray()
    heard: list[int] = []

    async def feed() -> None:
        await src_far.send_all(payload + b"!")

    async def read_slowly() -> None:
        while len(got) < len(payload):
            got.extend(await dst_far.receive_some(100_000))
            await trio.sleep(0)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            nursery.start_soon(read_slowly)
            moved = await FastStream(src).splice_to(FastStream(dst), len(payload), pipe,
                                                    heard.append)
    assert moved == len(payload) and bytes(got) == payload
    assert sum(heard) == len(payload)
    assert await src.receive_some(10) == b"!"  # nothing read past the n bytes
    assert pipe.held == 0
    pool.give(pipe)
    assert pool.take() is pipe  # an empty pipe is kept for the next splice
    pool.close()


async def test_splice_stops_short_at_eof_and_a_pipe_left_holding_bytes_is_closed() -> None:
    src_far, src = await tcp_pair()
    dst, dst_far = await tcp_pair()
    pool = PipePool()
    pipe = pool.take()
    await src_far.send_all(b"x" * 1000)
    await src_far.aclose()
    with trio.fail_after(5):
        moved = await FastStream(src).splice_to(FastStream(dst), 5000, pipe, lambda n: None)
    assert moved == 1000  # EOF: what came went on, and the caller hears it was short
    assert await dst_far.receive_some(5000) == b"x" * 1000
    # A splice cancelled with bytes still in its pipe: the pipe is not reused.
    pipe.held = 1
    pool.give(pipe)
    with pytest.raises(OSError):
        os.fstat(pipe.read_fd)
    pool.close()


def test_whether_sockets_peek_past_their_first_byte_is_tried_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``peeks_at_offsets`` tries TCP SO_PEEK_OFF on a loopback connection the first time
    (this kernel takes it: Linux 6.10+), and after that, or after a peek found out,
    says what was found."""
    from gatehouse.proxy import fastio

    monkeypatch.setattr(fastio, "_PEEK_OFFSETS", None)
    assert fastio.peeks_at_offsets() is True and fastio._PEEK_OFFSETS is True
    monkeypatch.setattr(fastio, "_PEEK_OFFSETS", False)
    assert fastio.peeks_at_offsets() is False
    monkeypatch.setattr(fastio, "_PEEK_OFFSETS", None)
    monkeypatch.setattr(fastio, "_SO_PEEK_OFF", 0x7FFF)  # an option no system has
    assert fastio.peeks_at_offsets() is False and fastio._PEEK_OFFSETS is False


@pytest.mark.parametrize("offsets", [True, False], ids=["peek-offsets", "first-byte-only"])
async def test_peek_at_looks_ahead_and_leaves_every_byte_in_the_socket(
        offsets: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``peek_at`` reads bytes at an offset without taking them: the next receive and
    splice still get every byte, in order.  Nothing there yet is None, EOF is b"".  On a
    system without TCP SO_PEEK_OFF only the first bytes can be peeked at (offset 0)."""
    from gatehouse.proxy import fastio

    if not offsets:
        monkeypatch.setattr(fastio, "_PEEK_OFFSETS", False)
    far, near = await tcp_pair()
    stream = FastStream(near)
    assert stream.peeks
    assert stream.peek_at(0, 10) is None  # nothing sent yet
    await far.send_all(bytes(range(100)))
    with trio.fail_after(5):
        await stream.wait_readable()
    assert stream.peek_at(0, 5) == bytes(range(5))
    assert stream.peek_at(0, 5) == bytes(range(5))  # still there
    if offsets:
        assert fastio._PEEK_OFFSETS is True  # this kernel takes it (Linux 6.10+)
        assert stream.peek_at(90, 50) == bytes(range(90, 100))
        assert stream.peek_at(100, 5) is None  # past what has come
    else:
        assert stream.peek_at(90, 50) is None
    # A receive after peeks past it, then a peek from the same offset: relative to the
    # next byte to be received, as the caller counts it.
    assert await stream.receive_some(20) == bytes(range(20))
    if offsets:
        assert stream.peek_at(10, 5) == bytes(range(30, 35))
    dst, dst_far = await tcp_pair()
    pool = PipePool()
    pipe = pool.take()
    with trio.fail_after(5):
        assert await stream.splice_to(FastStream(dst), 30, pipe, lambda n: None) == 30
        assert await dst_far.receive_some(100) == bytes(range(20, 50))
    assert stream.peek_at(0, 100) == bytes(range(50, 100))
    await far.aclose()
    assert await stream.receive_some(100) == bytes(range(50, 100))
    assert stream.peek_at(0, 10) == b""  # EOF
    pool.give(pipe)
    pool.close()
    await near.aclose()
    with pytest.raises(trio.ClosedResourceError):
        stream.peek_at(0, 10)


def tls_contexts(name: str) -> tuple[Any, Any]:
    """A server context with a certificate for ``name`` from a new CA, and a client
    context that trusts that CA."""
    import ssl

    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    return server_ctx, client_ctx


async def test_a_fast_stream_gives_its_tcp_socket_the_systems_send_queue() -> None:
    """trio's SocketStream caps what waits unsent at 16 KiB (TCP_NOTSENT_LOWAT); the
    proxy's streams, plain or TLS over TCP, take the system's setting back (0)."""
    a, b = await tcp_pair()
    assert notsent_lowat(a) == 16384  # trio's own, which the proxy undoes
    FastStream(a)
    assert notsent_lowat(a) == 0
    # TLS: the socket under the TLS stream.
    _, client_ctx = tls_contexts("broker.test")
    c, d = await tcp_pair()
    tls = trio.SSLStream(c, client_ctx, server_hostname="broker.test")
    assert notsent_lowat(c) == 16384
    FastStream(tls)
    assert notsent_lowat(c) == 0
    FastStream(trio.testing.memory_stream_pair()[0])  # no socket under it: nothing to do
    for stream in (a, b, c, d):
        await stream.aclose()


async def tls_pair(over_tcp: bool = False) -> tuple[trio.SSLStream[Any], trio.SSLStream[Any]]:
    """A TLS client and server, handshake done, over memory streams (what the client
    sends is in the server's hands at once, nothing on the way) or over loopback TCP
    (the proxy's own: FastStream reads and writes the records itself)."""
    server_ctx, client_ctx = tls_contexts("proxy.test")
    near: trio.abc.Stream
    far: trio.abc.Stream
    near, far = await tcp_pair() if over_tcp else trio.testing.memory_stream_pair()
    client = trio.SSLStream(near, client_ctx, server_hostname="proxy.test")
    server = trio.SSLStream(far, server_ctx, server_side=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.do_handshake)
        nursery.start_soon(server.do_handshake)
    return client, server


async def test_a_tls_receive_takes_every_record_already_in_hand() -> None:
    """trio's TLS stream hands over one TLS record (16 KiB) a receive; the proxy's takes
    the records already received with it, up to what it asked for: a large request in
    a few receives, not one a record (librdkafka through a TLS listener: 3.4 times the MB/s)."""
    payload = bytes(range(256)) * 800  # 204,800 bytes: 13 records
    client, server = await tls_pair()
    stream = FastStream(server)
    await client.send_all(payload)
    assert await stream.receive_some(len(payload) * 2) == payload  # all of it, at once
    await client.send_all(payload)
    first = await stream.receive_some(50_000)  # no more than asked: a record cut short
    assert first == payload[:50_000]
    rest = await stream.receive_some(len(payload))
    assert first + rest == payload
    await client.aclose()  # its close_notify: the end, after every byte
    assert await stream.receive_some(1000) == b""


async def test_a_bad_tls_record_after_good_ones_breaks_the_stream_after_them() -> None:
    """The records before a forged one are handed over; the next receive fails, as
    trio's own TLS stream fails on it."""
    client, server = await tls_pair()
    stream = FastStream(server)
    payload = b"k" * 40_000  # 3 records
    await client.send_all(payload)
    forged = b"\x17\x03\x03\x00\x20" + bytes(32)  # application data no key sealed
    await client.transport_stream.send_all(forged)
    assert await stream.receive_some(len(payload) * 2) == payload
    with pytest.raises(trio.BrokenResourceError):
        await stream.receive_some(1000)


async def receive_exactly(stream: Any, n: int) -> bytes:
    parts = []
    while n:
        data = await stream.receive_some(n)
        assert data, "EOF before the bytes expected"
        parts.append(data)
        n -= len(data)
    return b"".join(parts)


async def test_a_tls_stream_over_tcp_is_read_and_written_by_the_fast_stream() -> None:
    """Over TCP, once the handshake is done, the proxy seals and opens the records
    itself (trio's stream only closes): both ways at once, byte for byte, a large frame
    sent from where it lies, and the server's TLS 1.3 session tickets (which trio holds
    back from the handshake) sent before its first record."""
    client, server = await tls_pair(over_tcp=True)
    stream = FastStream(server)
    assert stream._tls is not None  # taken over
    assert FastStream((await tls_pair())[1])._tls is None  # over memory streams: trio's
    up = os.urandom(3 * 1024 * 1024 + 17)
    down = os.urandom(5 * 1024 * 1024 + 3)
    frame = os.urandom(300_000)
    got: dict[str, bytes] = {}

    async def client_sends() -> None:
        await client.send_all(up)

    async def client_receives() -> None:
        got["down"] = await receive_exactly(client, len(down) + 4 + len(frame))

    async def proxy_receives() -> None:
        got["up"] = await receive_exactly(stream, len(up))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client_sends)
            nursery.start_soon(client_receives)
            nursery.start_soon(proxy_receives)
            await stream.send_all(down)
            await stream.send_frame(frame)
    assert got["up"] == up
    assert got["down"] == down + struct.pack(">i", len(frame)) + frame
    assert client._ssl_object.version() == "TLSv1.3"
    assert client._ssl_object.session.has_ticket  # the held-back tickets went first
    # Into a buffer: a frame's own, decrypted where it lies.
    await client.send_all(frame)
    buffer = bytearray(len(frame))
    with memoryview(buffer) as view:
        at = 0
        while at < len(frame):
            at += await stream.receive_into(view[at:])
    assert buffer == frame
    await client.aclose()  # close_notify: the end, after every byte
    assert await stream.receive_some(1000) == b""
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some(1000)


async def test_a_tls_peer_that_closes_without_close_notify_or_forges_a_record_breaks_it() -> None:
    """An EOF without close_notify, and a record no key sealed after good ones: the
    good bytes are handed over, then BrokenResourceError (as trio's stream)."""
    client, server = await tls_pair(over_tcp=True)
    stream = FastStream(server)
    await client.send_all(b"k" * 40_000)
    await client.transport_stream.aclose()  # TCP's FIN, no close_notify
    assert await receive_exactly(stream, 40_000) == b"k" * 40_000
    with pytest.raises(trio.BrokenResourceError):
        await stream.receive_some(1000)
    with pytest.raises(trio.BrokenResourceError):  # and it stays broken
        await stream.send_all(b"x")
    await server.aclose()  # no close_notify after a broken stream: just closed

    client, server = await tls_pair(over_tcp=True)
    stream = FastStream(server)
    await client.send_all(b"k" * 40_000)
    await client.transport_stream.send_all(b"\x17\x03\x03\x00\x20" + bytes(32))
    assert await receive_exactly(stream, 40_000) == b"k" * 40_000
    with pytest.raises(trio.BrokenResourceError):
        await stream.receive_some(1000)
    await client.aclose()
    await server.aclose()


async def test_a_cancelled_tls_receive_loses_nothing_and_a_cancelled_send_breaks_it() -> None:
    """A receive cancelled while it waits for bytes (the connection's drain does that)
    loses none; a send cancelled while the peer does not read has left part of a
    record on the wire: the stream is broken and closes without a close_notify."""
    client, server = await tls_pair(over_tcp=True)
    stream = FastStream(server)
    with trio.move_on_after(0.05) as scope:
        await stream.receive_some(1000)
    assert scope.cancelled_caught and not stream.waiting
    await client.send_all(b"after")
    assert await stream.receive_some(1000) == b"after"

    far = server.transport_stream
    far.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    with trio.move_on_after(0.5) as scope:
        await stream.send_all(b"y" * (16 * 1024 * 1024))  # the client reads nothing
    assert scope.cancelled_caught
    with pytest.raises(trio.BrokenResourceError):
        await stream.send_all(b"z")
    await server.aclose()
    await client.aclose()


async def test_a_tls_1_2_client_that_renegotiates_mid_connection_is_answered() -> None:
    """A read that makes records to send (a TLS 1.2 renegotiation: the client's new
    ClientHello, read as data is awaited, makes the server's answer) sends them before
    it waits for the client's next flight, which never comes otherwise.  The client is
    OpenSSL's own s_client (Python's ssl cannot renegotiate), its "R" command."""
    import ssl
    import subprocess

    import trustme

    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("proxy.test").configure_cert(ctx)
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= 0x100  # SSL_OP_ALLOW_CLIENT_RENEGOTIATION (off by default in OpenSSL 3)
    with ca.cert_pem.tempfile() as ca_file:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]
        client = await trio.lowlevel.open_process(
            ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername",
             "proxy.test", "-CAfile", ca_file, "-tls1_2"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert client.stdin is not None and client.stdout is not None
        try:
            with trio.fail_after(20):
                server = trio.SSLStream(await listener.accept(), ctx, server_side=True)
                await server.do_handshake()
                stream = FastStream(server)
                assert stream._tls is not None
                await client.stdin.send_all(b"before\n")
                assert await receive_exactly(stream, 7) == b"before\n"
                printed = b""

                async def printed_by_the_client(text: bytes) -> None:
                    nonlocal printed
                    while text not in printed:
                        more = await client.stdout.receive_some(65536)
                        assert more, printed[-2000:]
                        printed += more

                await client.stdin.send_all(b"R\n")  # s_client: renegotiate
                # Its next line only then: one read of "R\nafter\n" would drop the rest.
                await printed_by_the_client(b"RENEGOTIATING")
                await client.stdin.send_all(b"after\n")
                assert await receive_exactly(stream, 6) == b"after\n"
                await stream.send_all(b"answered\n")
                await printed_by_the_client(b"answered")
        finally:
            client.kill()
            await client.wait()
            await listener.aclose()


async def test_a_large_send_goes_to_the_kernel_whole_while_the_peer_does_not_read() -> None:
    """512 KiB to a peer that reads nothing yet: FastStream's send completes (the send
    buffer takes it, as a client's own socket would), where trio's 16 KiB cap stops
    the same send at the peer's receive window and makes the sender wake for every
    piece the peer reads."""
    payload = b"x" * (512 * 1024)
    a, b = await tcp_pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    with trio.fail_after(10):
        await FastStream(a).send_all(payload)  # never waits for the peer
    c, d = await tcp_pair()
    d.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    done = False

    async def send_with_trios_cap() -> None:
        nonlocal done
        await c.send_all(payload)
        done = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_with_trios_cap)
        await trio.testing.wait_all_tasks_blocked()
        assert not done  # waiting for the peer to read
        nursery.cancel_scope.cancel()
    got = 0
    while got < len(payload):  # and the first one's bytes are all there, in order
        chunk = await b.receive_some(65536)
        assert chunk == b"x" * len(chunk)
        got += len(chunk)
    for stream in (a, b, c, d):
        await stream.aclose()


async def frame_in_socket(sent: bytes, close: bool = False) -> tuple[Any, Any, FastStream]:
    """A TCP connection whose receiving end (the FastStream) holds ``sent``, a frame or its
    first bytes, every byte arrived and its size prefix taken; with ``close`` the sending
    end closed after them."""
    far, near = await tcp_pair()
    near.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)  # the whole frame
    stream = FastStream(near)
    await far.send_all(sent)
    if close:
        await far.aclose()
    assert await stream.receive_some(4) == sent[:4]  # the size prefix: moved
    # Every byte sent has arrived (no event says so: the socket is asked).
    while stream.peek_at(len(sent) - 5, 1) is None and not close:
        await trio.sleep(0.001)
    return far, near, stream


def _slots_state(walk: Any) -> dict[str, Any]:
    """Every field of a walk (its step, a bound method, by name)."""
    state: dict[str, Any] = {}
    for cls in type(walk).__mro__:
        for name in getattr(cls, "__slots__", ()):
            value = getattr(walk, name)
            state[name] = (value.__name__ if name == "_step"
                           else bytes(value) if isinstance(value, bytearray) else value)
    return state


@pytest.mark.parametrize("version", [8, 12])
@pytest.mark.parametrize("shape", ["batches", "noise"])
async def test_peek_walk_walks_a_request_where_it_lies_in_c_as_in_python(
        version: int, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``peek_walk`` feeds a Produce request's walk the parts around its records from the
    socket, taking nothing from it: as far as the bytes have come (EMPTY), to the walk's
    end (WALKED), to EOF, or to a frame that ends inside a part (PAST_END); a walk's
    refusal is raised.  The C loop and the Python one end in the same place, the walk
    in the same state, for each; then every byte is still there to be received."""
    from gatehouse.codecs import produce
    from gatehouse.proxy import fastio
    from tests.test_proxy_stream import RECORDS, produce_wire, record_batch

    c_loop = fastio._C_PEEK_WALK
    assert c_loop is not None  # built here (Linux 6.10+, a C compiler)
    sets = ((record_batch(700, 200_000), record_batch(5, 90_000)) if shape == "batches"
            else (RECORDS[:150_000], RECORDS[:3_000]))
    wire = produce_wire(5, topics=("orders", "audit"), version=version, records=sets)
    topics_at = wire.index(b"\x00\x06orders") - 4 if version < 9 else -1
    lying = (wire[:topics_at] + b"\x00\x00\x00\x03" + wire[topics_at + 4:]) if version < 9 else None
    refused = (wire[:topics_at] + b"\xff\xff\xff\xfe" + wire[topics_at + 4:]) if version < 9 else None
    cases = [(wire[:120_000], False, fastio.EMPTY), (wire, False, fastio.WALKED),
             (wire[:120_000], True, fastio.EOF)]
    if lying is not None and refused is not None:
        cases += [(lying, False, fastio.PAST_END), (refused, False, "refused")]

    async def walk_with(loop: str, sent: bytes, close: bool) -> tuple[Any, ...]:
        monkeypatch.setattr(fastio, "_C_PEEK_WALK", None if loop == "python" else c_loop)
        with trio.fail_after(5):
            far, near, stream = await frame_in_socket(sent, close)
            walk = produce.RequestWalk(version, len(wire) - 4)
            try:
                outcome: Any = stream.peek_walk(walk, 4, 4, len(wire))
            except produce.Unexpected:
                outcome = "refused"
            left = b""
            while len(left) < len(sent) - 4:
                left += await stream.receive_some(1 << 20)
        assert left == sent[4:]  # nothing taken
        if not close:
            await far.aclose()
        await near.aclose()
        return outcome, _slots_state(walk), walk.topics()

    for sent, close, reached in cases:
        c = await walk_with("c", sent, close)
        assert fastio._PEEK_OFFSETS is True
        python = await walk_with("python", sent, close)
        assert c == python
        outcome, _, topics = c
        assert outcome == "refused" if reached == "refused" else outcome[1] == reached
        if reached == fastio.WALKED:
            assert outcome[0] <= len(wire)
            assert topics == produce.request_topics(wire[4:], version) is not None
        if reached in (fastio.EMPTY, fastio.EOF):
            # Stopped at the first part not there (records before it skipped unseen).
            assert 4 < outcome[0] < len(wire) and topics is None


@pytest.mark.parametrize("version", [12, 16])
async def test_peek_walk_counts_an_answers_batches_in_c_as_in_python(
        version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Fetch answer's counting walk through a socket: the C loop takes runs of whole
    batches itself (their headers peeked at, the walk told once: ``batches_walked``), the
    Python loop feeds each header; wherever the bytes stop (inside a batch's header, at
    its end, inside the batch cut short that ends the records), both stop at the same
    place, the walk in the same state, and at the end the walk's scan is the whole
    frame's (``response_scan``)."""
    from gatehouse.codecs import fetch
    from gatehouse.proxy import fastio
    from tests.test_proxy_stream import FETCHED, fetch_answer, record_batch

    c_loop = fastio._C_PEEK_WALK
    assert c_loop is not None  # built here (Linux 6.10+, a C compiler)
    wire = fetch_answer(1, records=FETCHED, version=version, partition_error=6)
    first = wire.index(FETCHED[:61])
    cuts = [first + 30, first + 40_000, first + 40_000 + 61, first + 5 * 40_000 + 7,
            first + 29 * 40_000 + 10, len(wire)]
    runs: list[int] = []
    batches_walked = fetch.AnswerWalk.batches_walked

    def counting(walk: Any, walked: int, records: int, size: int, left: int) -> None:
        runs.append(walked)
        batches_walked(walk, walked, records, size, left)

    monkeypatch.setattr(fetch.AnswerWalk, "batches_walked", counting)

    async def walk_with(loop: str, sent: bytes) -> tuple[Any, ...]:
        monkeypatch.setattr(fastio, "_C_PEEK_WALK", None if loop == "python" else c_loop)
        with trio.fail_after(5):
            far, near, stream = await frame_in_socket(sent)
            walk = fetch.AnswerWalk(version, len(wire) - 4, count=True)
            outcome = stream.peek_walk(walk, 4, 4, len(wire))
        await far.aclose()
        await near.aclose()
        state = _slots_state(walk)
        tail = wire[4 + walk.tags_at:] if walk.finished else b""
        return outcome, state, walk.scan(tail)

    for cut in cuts:
        runs.clear()
        c = await walk_with("c", wire[:cut])
        walked_in_c = list(runs)
        python = await walk_with("python", wire[:cut])
        assert runs == walked_in_c  # the Python loop never calls it
        assert c == python
        assert c[0][1] == (fastio.WALKED if cut == len(wire) else fastio.EMPTY)
        # The first batch's header comes in the walk's first peek, with the answer's
        # head; the C loop takes the batches after it whose headers are all there.
        whole = max(0, min(cut - first - 61, 29 * 40_000 - 61) // 40_000)
        assert sum(walked_in_c) == whole * 40_000
    assert c[2] == fetch.response_scan(wire[4:], version) is not None
    assert c[2][2][0][2:] == (435, 29 * 40_000)
    # Not a batch it takes (a magic other than 2): left to the walk's own step.
    odd = record_batch(5, 40_000)
    odd = odd[:16] + b"\x01" + odd[17:]
    wire = fetch_answer(1, records=odd + FETCHED, version=version)
    runs.clear()
    c = await walk_with("c", wire)
    assert runs == [] and c[0][1] == fastio.WALKED
    assert c == await walk_with("python", wire)


# --- peek_walk's two loops on random and mutated frames ----------------------------------


def _sync_frame_in_socket(sent: bytes, head: int, close: bool) -> tuple[socket.socket, FastStream]:
    """``frame_in_socket`` without trio's loop: a loopback TCP connection whose receiving
    end holds ``sent`` past its first ``head`` bytes (received), every byte arrived; the
    sending end closed after them with ``close``.  Returns the sending end (open or not)
    and the receiving end as a FastStream."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        # Room for the whole frame, from the handshake on (the window scale is set there).
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        far = socket.create_connection(server.getsockname())
        near, _ = server.accept()
    far.sendall(sent)
    if close:
        far.shutdown(socket.SHUT_WR)
    assert near.recv(head, socket.MSG_WAITALL) == sent[:head]
    stream = FastStream(trio.SocketStream(trio.socket.from_stdlib_socket(near)))
    # Until every byte sent is there (no event says so: the socket is asked).
    while len(_waiting(stream)) < len(sent) - head:
        pass
    return far, stream


def _waiting(stream: FastStream) -> bytes:
    """The bytes waiting in ``stream``'s socket, left there."""
    return stream.peek_at(0, 1 << 22) or b""


@st.composite
def _record_sets(draw: st.DrawFn) -> bytes | None:
    """A records field: whole v2 batches (some cut short, some of another magic), noise,
    empty or null."""
    shape = draw(st.sampled_from(["batches", "batches", "batches", "noise", "empty", "null"]))
    if shape == "null":
        return None
    if shape == "noise":
        return RECORDS[:draw(st.integers(0, 3000))]
    if shape == "empty":
        return b""
    batches = b""
    for _ in range(draw(st.integers(1, 5))):
        batch = record_batch(draw(st.integers(-2, (1 << 31) - 1)),
                             draw(st.sampled_from([61, 62, 200, 4096, 16_384, 40_000])))
        if draw(st.integers(0, 9)) == 0:
            batch = batch[:16] + bytes([draw(st.integers(0, 3))]) + batch[17:]
        batches += batch
    if draw(st.booleans()) and draw(st.booleans()):
        batches = batches[:draw(st.integers(0, len(batches)))]
    return batches


@st.composite
def _walked_frames(draw: st.DrawFn) -> tuple[str, int, bytes]:
    """A Produce request or a Fetch answer as the proxy walks them: ("produce" | "fetch",
    version, the frame with its size prefix)."""
    kind = draw(st.sampled_from(["produce", "fetch"]))
    topics = draw(st.integers(1, 3))
    if kind == "produce":
        version = draw(st.sampled_from(list(_WALKED_PRODUCE_VERSIONS)))
        key = ((lambda i: {"topic_id": str(uuid.UUID(int=i + 1))})
               if version >= produce.TOPIC_IDS_SINCE else (lambda i: {"name": f"topic-{i}"}))
        msg = request(0, version, 7, transactional_id=None, acks=-1, timeout_ms=1000,
                      topic_data=[{**key(i), "partition_data": [
                          {"index": p, "records": draw(_record_sets())}
                          for p in range(draw(st.integers(1, 3)))]} for i in range(topics)])
        return kind, version, frame_bytes(msg.encode())
    version = draw(st.integers(fetch.FIRST_VERSION, 18))
    key = ((lambda i: {"topic_id": str(uuid.UUID(int=i + 1))})
           if version >= fetch.TOPIC_IDS_SINCE else (lambda i: {"topic": f"topic-{i}"}))
    body = response_body(1, version, throttle_time_ms=0, error_code=0, session_id=0,
                         responses=[{**key(i), "partitions": [
                             {"partition_index": p, "error_code": draw(st.sampled_from([0, 0, 6])),
                              "high_watermark": 10, "last_stable_offset": 10,
                              "log_start_offset": 0, "aborted_transactions": [],
                              "preferred_read_replica": -1, "records": draw(_record_sets())}
                             for p in range(draw(st.integers(1, 3)))]} for i in range(topics)])
    return kind, version, frame_bytes(codecs.Response.build(1, version, 7, body).encode())


def _batches_at(wire: bytes) -> list[int]:
    """Where the v2 batches ``record_batch`` makes begin in ``wire`` (their first 8 and
    their leader epoch's 4 bytes 0, magic 2)."""
    at, found = 0, []
    while (at := wire.find(b"\x00\x00\x00\x00\x02", at + 1)) >= 0:
        if at >= 12 and wire[at - 12:at - 4] == bytes(8):
            found.append(at - 12)
    return found


_REACHED = {fastio.WALKED: "walked", fastio.EMPTY: "empty", fastio.EOF: "eof",
            fastio.PAST_END: "past the end"}


@settings(max_examples=examples(500), deadline=None)
@given(frame=_walked_frames(), data=st.data())
def test_peek_walk_in_c_and_in_python_agree_on_random_and_mutated_frames(
        frame: tuple[str, int, bytes], data: st.DataObject) -> None:
    """The C loop (_peeking.c) reads sizes a client or a broker wrote: on random frames,
    some with bytes overwritten (lengths, counts, magics), cut anywhere or followed by
    the next one's first bytes, the sender open or closed, walked from after a head
    already received, it ends where the Python loop ends, with the same outcome or the
    same exception, the walk in the same state, and every byte still in the socket."""
    c_loop = fastio._C_PEEK_WALK
    assert c_loop is not None and fastio.peeks_at_offsets()  # built here (Linux 6.10+, a C compiler)
    kind, version, wire = frame
    batches = _batches_at(wire)
    # The last of a records field's batches, whose length can run past the field's end.
    lasts = [at for at in batches if at + 12 + struct.unpack_from(">i", wire, at + 8)[0]
             not in batches] or batches
    mutated = bytearray(wire)
    for _ in range(data.draw(st.sampled_from([0, 0, 1, 2, 4]))):
        if batches and data.draw(st.integers(0, 2)):  # a batch's length a little off
            at = data.draw(st.sampled_from(data.draw(st.sampled_from([batches, lasts])))) + 8
            (length,) = struct.unpack_from(">i", mutated, at)
            struct.pack_into(">i", mutated, at, length + data.draw(st.sampled_from([-1, 1, 1, 61])))
            continue
        at = data.draw(st.integers(4, len(wire) - 1))
        patch = data.draw(st.sampled_from([b"\x00", b"\xff", b"\x02", b"\x7f\xff\xff\xff",
                                           b"\x00\x00\x00\x3d", b"\xff\xff\xff\xff"]))
        mutated[at:at + len(patch)] = patch
    sent = bytes(mutated[:len(wire)])
    near_a_batch = (st.builds(lambda at, k: min(len(sent), max(5, at + k)),
                              st.sampled_from(batches), st.sampled_from([-1, 0, 1, 60, 61, 62]))
                    if batches else st.nothing())
    cut = data.draw(st.one_of(st.just(len(sent)), st.integers(5, len(sent)), near_a_batch))
    head = data.draw(st.sampled_from([4, 4, min(cut, 4 + data.draw(st.integers(1, 64)))]))
    # Behind a frame all there, the next one's first bytes (pipelined): never the walk's.
    after = b""
    if cut == len(sent):
        after = data.draw(st.sampled_from([b"", b"\x00\x00\x01\x00" + RECORDS[:200]]))
    close = data.draw(st.booleans())
    count = kind == "produce" or data.draw(st.integers(0, 3)) > 0  # a Fetch answer's walk counts or not

    def walk_with(loop: Any) -> tuple[Any, dict[str, Any], Any]:
        far, stream = _sync_frame_in_socket(sent[:cut] + after, head, close)
        try:
            walk = (produce.RequestWalk(version, len(sent) - 4) if kind == "produce"
                    else fetch.AnswerWalk(version, len(sent) - 4, count=count))
            fastio._C_PEEK_WALK = loop
            try:
                at = 4 + walk.feed(memoryview(sent)[4:head])
                outcome: Any = stream.peek_walk(walk, at, head, len(sent))
            except (produce.Unexpected, fetch.Unexpected, ValueError) as exc:
                outcome = (type(exc).__name__, str(exc))
            finally:
                fastio._C_PEEK_WALK = c_loop
            assert _waiting(stream) == sent[head:cut] + after  # nothing taken
            result = (walk.topics() if kind == "produce" else
                      walk.scan(sent[4 + walk.tags_at:]) if walk.finished else None)
            return outcome, _slots_state(walk), result
        finally:
            far.close()
            stream._plain.close()

    c = walk_with(c_loop)
    python = walk_with(None)
    assert c == python
    outcome = c[0]
    event(f"{kind}: {outcome[0] if isinstance(outcome[0], str) else _REACHED[outcome[1]]}")
    if sent == wire and cut == len(wire):
        # The frame as built, all there: walked to its end and read as the frame's
        # readers read it, or refused where they give nothing (a batch's magic not 2).
        whole = (produce.request_topics(wire[4:], version) if kind == "produce"
                 else fetch.response_scan(wire[4:], version) if count else None)
        if isinstance(outcome[0], str):
            assert whole is None
        else:
            assert outcome[1] == fastio.WALKED and c[2] == whole
