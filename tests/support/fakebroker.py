"""In-process stand-ins for a client and a broker, speaking real frames over trio streams.

For the proxy's unit tests (memory streams, autojump clock).  The real-broker tests
live in tests/integration.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

import trio

from gatehouse import codecs
from gatehouse.codecs import Request, Response

SIZE = struct.Struct(">i")

# request -> response body (or None: no answer, like acks=0), or raw bytes to send as is
Handler = Callable[[Request], Any]


def frame_bytes(frame: Any) -> bytes:
    data = bytes(frame)
    return SIZE.pack(len(data)) + data


def request(api_key: int, version: int, correlation_id: int, body: Any = None,
            client_id: str | None = "test-client", **fields: Any) -> Request:
    spec = codecs.api(api_key).request
    if body is None:
        body = codecs.request_from_dict({
            "header": {"api_key": api_key, "api_version": version,
                       "correlation_id": correlation_id, "client_id": client_id},
            "body": fields,
        }).body if fields else spec.root.cls()
    return Request.build(api_key, version, correlation_id, client_id, body)


def response_body(api_key: int, version: int, **fields: Any) -> Any:
    plain = {"header": {"correlation_id": 0}, "body": fields}
    return codecs.response_from_dict(plain, api_key=api_key, api_version=version).body


class FrameStream:
    """Frames over a trio stream: ``send(frame)`` and ``receive() -> frame | None``."""

    def __init__(self, stream: trio.abc.Stream, max_frame: int = codecs.DEFAULT_MAX_FRAME_SIZE):
        self.stream = stream
        self.reader = codecs.FrameReader(max_frame)

    async def send(self, frame: Any) -> None:
        await self.stream.send_all(frame_bytes(frame))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive(self) -> bytes | None:
        while True:
            frame = self.reader.next_frame()
            if frame is not None:
                return frame
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            self.reader.feed(data)


class FakeBroker:
    """Answers each request with ``handler(request)``; records what it received."""

    def __init__(self, stream: trio.abc.Stream, handler: Handler) -> None:
        self.frames = FrameStream(stream)
        self.handler = handler
        self.received: list[bytes] = []
        self.raw_mode = 0

    async def serve(self) -> None:
        while True:
            frame = await self.frames.receive()
            if frame is None:
                return
            self.received.append(frame)
            if self.raw_mode:
                self.raw_mode -= 1
                await self.frames.send(b"raw-answer:" + frame)
                continue
            req = codecs.decode_request(frame)
            answer = self.handler(req)
            if answer is None:
                continue
            if isinstance(answer, bytes | bytearray):
                await self.frames.send(answer)
                continue
            if isinstance(answer, Response):
                await self.frames.send(answer.encode())
                continue
            resp = Response.build(req.api_key, req.api_version, req.correlation_id, answer)
            await self.frames.send(resp.encode())


async def tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """Two ends of a real loopback TCP connection."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    server, _ = await listener.accept()
    listener.close()
    return trio.SocketStream(client), trio.SocketStream(server)


def notsent_lowat(stream: trio.SocketStream) -> int:
    """The socket's TCP_NOTSENT_LOWAT: trio sets 16384, the proxy gives back 0."""
    option = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's number
    return int(stream.getsockopt(socket.IPPROTO_TCP, option))
