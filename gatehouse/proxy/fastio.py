"""Socket I/O for the pumps with fewer trips through trio's scheduler.

trio's ``SocketStream`` yields to the scheduler after every send and receive, even one
that completes at once: every await may switch tasks.  A request and its response make
four such calls in the pumps, and each round through the scheduler costs more than the
system call itself.  ``FastStream`` calls the socket directly while the kernel can take
or give bytes, waits (``wait_readable``/``wait_writable``) only when it would block, and
keeps trio's rules otherwise:

- cancellation: every call first checks for it (``checkpoint_if_cancelled``), so timeouts
  and shutdowns still stop a pump that always finds its socket ready; a receive that got
  bytes is not cancelled after it (they would be lost), and ``waiting`` says when a
  receive is waiting for bytes, the one moment cancelling it loses nothing;
- fairness: after ``_YIELD_EVERY`` calls without waiting it yields anyway, so one busy
  connection cannot keep the others from running;
- errors: as ``SocketStream``'s (``ClosedResourceError`` once the stream is closed,
  ``BrokenResourceError`` for a failed send or receive).

Its sockets queue what the proxy sends as the system's TCP defaults let them, not
trio's 16 KiB (``bulk_sends``): a proxy relays bulk bytes.

A TLS stream over TCP whose handshake is done is served the same way: its ``SSLObject``
decrypts what one read of the socket brought (up to ``_TLS_READ``) and encrypts what is
sent, with no trip through trio's ``SSLStream`` (its locks, its one 16 KiB record a
receive, its scheduler yields); trio's stream keeps the handshake and the close.
Anything else (the tests' memory streams) goes through its own methods unchanged.

``splice_to`` moves bytes from one socket to another through a pipe (Linux splice(2)):
they never enter user space, so a large answer's records cost the proxy neither the
copy in nor the copy out.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib
import os
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any, Final

import trio

from gatehouse.codecs._native import speedups

_YIELD_EVERY: Final = 16  # calls that did not wait, then one yield
# A frame this large goes out with its size prefix in one writev from where it lies; a
# smaller one is joined to it (a copy cheaper than the call's set-up).
_GATHER_MIN: Final = 16 * 1024
_SIZE: Final = struct.Struct(">i")
_SPLICE: Final = getattr(os, "splice", None)  # Linux, Python 3.10+
_SPLICE_FLAGS: Final = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_PIPE_SIZE: Final = 1024 * 1024  # asked for; the kernel may give less (pipe-max-size)
_F_SETPIPE_SZ: Final = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ: Final = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_SO_PEEK_OFF: Final = getattr(socket, "SO_PEEK_OFF", 42)  # Linux's number
_UNSUPPORTED: Final = (errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EINVAL)
# Whether TCP sockets take SO_PEEK_OFF here (learnt from the first try; None: not yet).
_PEEK_OFFSETS: bool | None = None
_TCP_NOTSENT_LOWAT: Final = getattr(socket, "TCP_NOTSENT_LOWAT", None)
# Read from a TLS stream's socket at a time: what a 1 MB request's records need in four.
_TLS_READ: Final = 256 * 1024
# A TLS record's most plaintext: a large frame's first record is its size prefix and
# this much less 4 of it, the rest sealed from where it lies.
_TLS_RECORD: Final = 16 * 1024
# Peeked at a time by ``peek_walk``: a batch's header and the parts around it (a longer
# part is read in more peeks).
PEEK_READ: Final = 512
# Where ``peek_walk`` stopped: the walk finished; no bytes there yet (or the system
# cannot peek that far); the socket at EOF; the frame ends inside a part.
WALKED, EMPTY, EOF, PAST_END = range(4)
# peek_walk's loop in C (_peeking.c), where built; off with the C byte readers
# (GATEHOUSE_PURE_PYTHON).  The Python loop below stays the reference.
_C_PEEK_WALK: Any = None
if speedups is not None:
    with contextlib.suppress(ImportError):  # not built here
        _C_PEEK_WALK = importlib.import_module("gatehouse.proxy._peeking").peek_walk


def peeks_at_offsets() -> bool:
    """Whether TCP sockets here can be peeked at past their first waiting byte
    (SO_PEEK_OFF, Linux 6.10+): tried once, on a loopback connection, unless a peek has
    already found out.  Where they cannot, a walk through a socket (``peek_walk``) sees
    one part at a time, moving the bytes before it first."""
    global _PEEK_OFFSETS
    if _PEEK_OFFSETS is None:
        try:
            with socket.create_server(("127.0.0.1", 0)) as server, \
                    socket.create_connection(server.getsockname()) as client:
                client.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, 0)
            _PEEK_OFFSETS = True
        except OSError:
            _PEEK_OFFSETS = False  # no such option for TCP here (or no loopback to try)
    return _PEEK_OFFSETS


class FastStream:
    """``receive_some`` and ``send_all`` of a ``trio.abc.Stream``, direct on TCP sockets.

    One task receives and one task sends at a time (the pumps' own discipline; trio's
    stream would raise ``BusyResourceError`` otherwise, this one does not check)."""

    __slots__ = ("_plain", "_ready_calls", "_tls", "_tls_object", "socket", "stream",
                 "waiting")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        # The trio socket, whose fileno() turns -1 when the stream is closed: checked
        # before every call, so a closed (and maybe reused) descriptor is never touched.
        self.socket: Any = stream.socket if type(stream) is trio.SocketStream else None
        # The standard library socket under trio's, for what trio does not offer
        # without a trip through its scheduler: recv with MSG_PEEK (peek_at).
        self._plain: Any = getattr(self.socket, "_sock", None)
        bulk_sends(stream)
        self._ready_calls = 0
        # True only while receive_some waits for bytes: cancelling it then loses none
        # (the connection's drain cancels a client's receive only then).
        self.waiting = False
        # The SSLObject under trio's TLS stream, whose receive_some hands over one TLS
        # record (16 KiB at most) a call and a trip through the scheduler: the records
        # already received are taken from it at once (_more_records).
        self._tls_object: Any = (getattr(stream, "_ssl_object", None)
                                 if isinstance(stream, trio.SSLStream) else None)
        # Over TCP, with the handshake done: the TLS stream's records read and written
        # here (_TlsState), trio's stream used for its close only.
        self._tls: _TlsState | None = _TlsState.take_over(stream)

    async def receive_some(self, max_bytes: int) -> bytes | bytearray:
        if self.socket is None:
            if self._tls is not None:
                return await self._tls_receive(max_bytes)
            self.waiting = True  # trio's streams lose nothing to a cancelled receive
            try:
                data = await self.stream.receive_some(max_bytes)
            finally:
                self.waiting = False
            if self._tls_object is not None and data and len(data) < max_bytes:
                return self._more_records(data, max_bytes)
            return data
        return await self._read(os.read, max_bytes)  # type: ignore[no-any-return]

    def _more_records(self, data: bytes | bytearray, max_bytes: int) -> bytes | bytearray:
        """``data`` (a TLS stream's first record) and the records after it that are
        already in hand, decrypted, up to ``max_bytes`` in all: a 1 MB request in some 16
        receives rather than 64 (librdkafka through a TLS listener: 3.4 times the MB/s at
        a fifth of the CPU).  Synchronous, between trio's own calls into the SSLObject,
        as its SSLStream does them.  What ends the run (no whole record left, the peer's
        close_notify, an error) is left where it is: the next receive_some meets it."""
        parts = [data]
        got = len(data)
        read = self._tls_object.read
        while got < max_bytes:
            try:
                more = read(max_bytes - got)
            except ssl.SSLError:  # SSLWantReadError above all: nothing whole in hand
                break
            if not more:
                break
            parts.append(more)
            got += len(more)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def receive_into(self, view: memoryview) -> int:
        """Like ``receive_some(len(view))``, into ``view``: the bytes land where the
        caller wants them (a large frame's own buffer), not in a new object to be joined
        later.  Returns how many came; 0 at EOF."""
        if self.socket is None:
            if self._tls is not None:
                return await self._tls_receive_into(view)
            data = await self.receive_some(len(view))
            view[:len(data)] = data
            return len(data)
        return await self._read(os.readv, (view,))  # type: ignore[no-any-return]

    @property
    def peeks(self) -> bool:
        """Whether ``peek_at`` can look at the socket's bytes."""
        return self._plain is not None

    def peek_at(self, offset: int, max_bytes: int) -> bytes | None:
        """Up to ``max_bytes`` of the bytes waiting on the socket from ``offset`` bytes
        after the next one to be received, left there (for a later receive or splice);
        None when there are none there yet, or the system cannot peek past the first
        byte (TCP's SO_PEEK_OFF came with Linux 6.10) and ``offset`` is not 0; b"" at
        EOF.  Never waits: ``wait_readable`` does.  Only where ``peeks``."""
        global _PEEK_OFFSETS
        plain = self._plain
        _fd(self.socket)  # ClosedResourceError once closed
        if _PEEK_OFFSETS is not False:
            try:
                # Set every time: a receive moves the offset back, a splice does not.
                plain.setsockopt(socket.SOL_SOCKET, _SO_PEEK_OFF, offset)
                _PEEK_OFFSETS = True
            except OSError as exc:
                if _PEEK_OFFSETS or exc.errno not in _UNSUPPORTED:
                    raise trio.BrokenResourceError(exc) from exc
                _PEEK_OFFSETS = False
        if offset and not _PEEK_OFFSETS:
            return None
        try:
            return plain.recv(max_bytes, socket.MSG_PEEK)  # type: ignore[no-any-return]
        except BlockingIOError:
            return None
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc

    def peek_walk(self, walk: Any, at: int, moved: int, total: int) -> tuple[int, int]:
        """Feeds ``walk`` (a ``StepWalk`` over a frame ``total`` bytes long, size prefix
        included, fed up to frame offset ``at``) the frame's next bytes where they lie in
        the socket, ``moved`` of the frame's bytes having been received from it: each
        part peeked at (``peek_at``), the records it calls ``opaque`` skipped, until the
        walk is finished (WALKED), nothing is there yet or the system cannot peek that
        far (EMPTY), the socket is at EOF (EOF), or the frame ends inside a part
        (PAST_END).  Returns the frame offset reached (where the walk ended, when it ends
        before the frame: a Fetch answer's top-level tag section) and which; raises what
        ``walk.feed`` raises.  Never waits.  Only where ``peeks``.  The loop in C
        (_peeking.c) ends the same way, the walk in the same state; it reads a counting
        walk's runs of whole batches itself (``batches_walked``)."""
        if _C_PEEK_WALK is not None and _PEEK_OFFSETS:
            try:
                return _C_PEEK_WALK(_fd(self.socket), walk, at, moved, total,  # type: ignore[no-any-return]
                                    PEEK_READ)
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
        while not walk.finished:
            if at >= total:
                return at, PAST_END
            if walk.opaque:  # records: looked past, moved later
                at += walk.opaque
                walk.skip(walk.opaque)
                continue
            # A long part (records that are no v2 batch, read whole) in ever larger peeks.
            data = self.peek_at(at - moved, min(total - at, max(PEEK_READ, walk.holding)))
            if data is None:
                return at, EMPTY
            if not data:
                return at, EOF
            at += walk.feed(data)  # all of it, unless the walk ends before the frame
        return at, WALKED

    async def wait_readable(self) -> None:
        """Until the socket has bytes (or EOF) to receive."""
        await trio.lowlevel.wait_readable(self.socket)
        self._ready_calls = 0

    async def _read(self, read: Callable[[int, Any], Any], arg: Any) -> Any:
        """``read(fd, arg)`` once the socket has bytes (or EOF): ``os.read`` or ``os.readv``."""
        sock = self.socket
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                got = read(_fd(sock), arg)
            except BlockingIOError:
                await self._wait_for_bytes(sock)
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
            await self._fair(bytes_in_hand=True)
            return got

    async def _wait_for_bytes(self, sock: Any) -> None:
        """Until ``sock`` has bytes (or EOF); ``waiting`` meanwhile."""
        self.waiting = True
        try:
            await trio.lowlevel.wait_readable(sock)
        finally:
            self.waiting = False
        self._ready_calls = 0

    async def send_all(self, data: Any) -> None:
        sock = self.socket
        if sock is None:
            if self._tls is not None:
                await self._tls_send((data,))
            else:
                await self.stream.send_all(data)
            return
        with memoryview(data) as view:
            await self._write_all(sock, [view])

    async def send_frame(self, frame: Any) -> None:
        """``frame`` after its 4-byte size prefix, as ``send_all`` would send the two
        joined, without the copy that joins a large one (a changed request or answer)."""
        prefix = _SIZE.pack(len(frame))
        sock = self.socket
        if sock is None and self._tls is not None and len(frame) >= _GATHER_MIN:
            # Two whole records' worth apart: no 4-byte record, no copy of the frame.
            with memoryview(frame) as view:
                head = _TLS_RECORD - len(prefix)
                await self._tls_send((b"".join((prefix, view[:head])), view[head:]))
            return
        if sock is None or len(frame) < _GATHER_MIN:
            await self.send_all(b"".join((prefix, frame)))
            return
        await self._write_all(sock, [prefix, memoryview(frame)])

    async def _write_all(self, sock: Any, parts: list[Any]) -> None:
        """Every byte of ``parts`` (buffers, in order) to ``sock``: one write, or one
        gathered writev for several, each time the kernel takes bytes; a wait when it
        would block.  ``parts`` is used up."""
        await trio.lowlevel.checkpoint_if_cancelled()
        sent = 0
        while True:
            while parts and sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            if not parts:
                break
            if sent:
                parts[0] = parts[0][sent:]
            fd = _fd(sock)
            try:
                sent = os.write(fd, parts[0]) if len(parts) == 1 else os.writev(fd, parts)
            except BlockingIOError:
                sent = 0
                await trio.lowlevel.wait_writable(sock)
                self._ready_calls = 0
            except OSError as exc:
                raise trio.BrokenResourceError(exc) from exc
        await self._fair()

    async def splice_to(self, dst: FastStream, n: int, pipe: Pipe,
                        moved: Callable[[int], None]) -> int:
        """Up to ``n`` bytes from this stream's socket to ``dst``'s through ``pipe``,
        never in user space; returns how many went: fewer only when this socket reached
        EOF.  ``moved(k)`` hears of each ``k`` bytes received.  Waits for whichever side
        holds things up: a slow ``dst`` stops the reads (the pipe is the only buffer)."""
        assert _SPLICE is not None and self.socket is not None and dst.socket is not None
        src, out = self.socket, dst.socket
        await trio.lowlevel.checkpoint_if_cancelled()
        left = n
        while left or pipe.held:
            progressed = False
            if left and pipe.held < pipe.size:
                try:
                    got = _SPLICE(_fd(src), pipe.write_fd, min(left, pipe.size - pipe.held),
                                  flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    got = -1
                except OSError as exc:
                    raise trio.BrokenResourceError(exc) from exc
                if got == 0:  # EOF: what is in the pipe goes on, then the caller hears
                    n -= left
                    left = 0
                elif got > 0:
                    left -= got
                    pipe.held += got
                    moved(got)
                    progressed = True
            if pipe.held:
                try:
                    put = _SPLICE(pipe.read_fd, _fd(out), pipe.held, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    put = 0
                except OSError as exc:
                    raise trio.BrokenResourceError(exc) from exc
                pipe.held -= put
                progressed = progressed or put > 0
            if progressed:
                await self._fair()
            elif pipe.held:
                await trio.lowlevel.wait_writable(out)
            elif left:
                await trio.lowlevel.wait_readable(src)
        return n

    async def _tls_receive(self, max_bytes: int) -> bytes | bytearray:
        """``receive_some`` of a TLS stream taken over: the records in hand, decrypted,
        up to ``max_bytes``; the socket read (and waited for) only when no whole record
        is.  b"" after the peer's close_notify; BrokenResourceError for a bad record or
        an EOF without close_notify (as trio's stream)."""
        tls = self._tls
        assert tls is not None
        data: bytes = await self._tls_read(tls, max_bytes)
        if data and len(data) < max_bytes:
            data = self._more_records(data, max_bytes)  # type: ignore[assignment]
        await self._tls_after_read(tls)
        return data

    async def _tls_receive_into(self, view: memoryview) -> int:
        """``receive_into`` of a TLS stream taken over: decrypted straight into ``view``."""
        tls = self._tls
        assert tls is not None
        want = len(view)
        got: int = await self._tls_read(tls, want, view)
        read: Any = tls.ssl.read  # with a buffer: how many bytes it took (typeshed: bytes)
        while got and got < want:  # the records after it already in hand
            try:
                more: int = read(want - got, view[got:])
            except ssl.SSLError:  # nothing whole in hand, or an error: the next call's
                break
            if not more:
                break
            got += more
        await self._tls_after_read(tls)
        return got

    async def _tls_read(self, tls: _TlsState, *args: Any) -> Any:
        """The ``SSLObject``'s ``read(*args)`` once it has a whole record (or the end) in
        hand, the socket read and waited for until it has."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            tls.check()
            try:
                return tls.ssl.read(*args)
            except ssl.SSLWantReadError:
                await self._tls_fill(tls)
            except ssl.SSLError as exc:
                tls.broken()
                raise trio.BrokenResourceError(exc) from exc

    async def _tls_fill(self, tls: _TlsState) -> None:
        """The socket's next bytes into the TLS stream's incoming buffer (its EOF too),
        waiting for them when there are none; what a read left to send (a renegotiation's
        answer, TLS 1.3's key update) goes first, or the peer may wait for it."""
        await self._tls_send_what_reads_made(tls)
        if tls.incoming.eof:  # SSLObject asks for more after the socket's EOF: never spin
            tls.broken()
            raise trio.BrokenResourceError("the TLS peer's connection ended inside a record")
        sock = tls.socket
        while True:
            try:
                raw = os.read(_fd(sock), _TLS_READ)
            except BlockingIOError:
                await self._wait_for_bytes(sock)
                continue
            except OSError as exc:
                tls.broken()
                raise trio.BrokenResourceError(exc) from exc
            if raw:
                tls.incoming.write(raw)
            else:
                tls.incoming.write_eof()  # the next read: close_notify's b"", or an error
            return

    async def _tls_after_read(self, tls: _TlsState) -> None:
        await self._tls_send_what_reads_made(tls)
        await self._fair(bytes_in_hand=True)

    async def _tls_send_what_reads_made(self, tls: _TlsState) -> None:
        """What a read sealed to send (see _tls_fill), sent now; while a send is under
        way, its task sends it too before it lets go of the lock."""
        if tls.outgoing.pending and not tls.lock.locked():
            await self._tls_flush(tls)

    async def _tls_send(self, parts: tuple[Any, ...]) -> None:
        """``parts`` sealed into records, in order, and sent."""
        tls = self._tls
        assert tls is not None
        await trio.lowlevel.checkpoint_if_cancelled()
        tls.check()
        try:
            for part in parts:
                if len(part):  # SSLObject.write(b"") would mean something else
                    tls.ssl.write(part)
        except ssl.SSLError as exc:
            tls.broken()
            raise trio.BrokenResourceError(exc) from exc
        await self._tls_flush(tls)

    async def _tls_flush(self, tls: _TlsState) -> None:
        """Every sealed byte to the socket, by one task at a time: the receiving task
        sends only what a read made (rare), and whoever holds the lock sends what the
        other sealed meanwhile too, so records leave in the order they were sealed.  A
        send cut short (cancelled, failed) leaves a record half sent: the stream is
        broken, as trio's is then."""
        lock = tls.lock
        try:
            lock.acquire_nowait()  # no yield when no one else sends (always, but rarely)
        except trio.WouldBlock:
            try:
                await lock.acquire()
            except BaseException:  # sealed records of ours may be left unsent
                tls.broken()
                raise
        try:
            while True:
                sealed = tls.outgoing.read()
                if tls.delayed is not None:  # TLS 1.3 session tickets, held by trio
                    sealed, tls.delayed = tls.delayed + sealed, None
                if not sealed:
                    break
                await self._write_all(tls.socket, [sealed])
        except BaseException:
            tls.broken()
            raise
        finally:
            lock.release()

    async def _fair(self, bytes_in_hand: bool = False) -> None:
        """One yield every ``_YIELD_EVERY`` calls that did not wait; after a receive
        (``bytes_in_hand``) a shielded one: a cancellation then would lose the bytes
        received (trio's own receive does the same)."""
        self._ready_calls += 1
        if self._ready_calls >= _YIELD_EVERY:
            self._ready_calls = 0
            if bytes_in_hand:
                await trio.lowlevel.cancel_shielded_checkpoint()
            else:
                await trio.lowlevel.checkpoint()


class _TlsState:
    """What ``FastStream`` needs of a trio ``SSLStream`` it reads and writes itself: the
    ``SSLObject``, its two memory buffers and the TCP socket under them."""

    __slots__ = ("delayed", "incoming", "lock", "outgoing", "socket", "ssl", "stream")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.ssl: ssl.SSLObject = stream._ssl_object
        self.incoming: ssl.MemoryBIO = stream._incoming
        self.outgoing: ssl.MemoryBIO = stream._outgoing
        self.socket: Any = stream.transport_stream.socket
        # A TLS 1.3 server's session tickets, which trio holds back from the handshake
        # until the first send (its issue 819): sent before the first record here.
        self.delayed: bytes | None = stream._delayed_outgoing
        stream._delayed_outgoing = None
        self.lock = trio.StrictFIFOLock()

    @classmethod
    def take_over(cls, stream: trio.abc.Stream) -> _TlsState | None:
        """The state of ``stream``, a TLS stream over TCP whose handshake is done (the
        proxy's always are by then); None for any other, or where this trio keeps its
        state otherwise (its own methods then serve)."""
        if not isinstance(stream, trio.SSLStream):
            return None
        if (type(stream.transport_stream) is not trio.SocketStream
                or not getattr(getattr(stream, "_handshook", None), "done", False)
                or not all(hasattr(stream, name) for name in _SSLSTREAM_STATE)):
            return None
        return cls(stream)

    def check(self) -> None:
        """trio's stream's state: ClosedResourceError once closed, BrokenResourceError
        once broken (here or there)."""
        state = self.stream._state.name
        if state == "CLOSED":
            raise trio.ClosedResourceError("the TLS stream was closed")
        if state == "BROKEN":
            raise trio.BrokenResourceError("the TLS stream is broken")

    def broken(self) -> None:
        """Marks trio's stream broken: its close then sends no close_notify after a
        record cut short, and every later call here fails."""
        state = self.stream._state
        if state.name == "OK":
            self.stream._state = type(state).BROKEN


# The attributes of trio's SSLStream that _TlsState reads (trio 0.25 to 0.35 at least).
_SSLSTREAM_STATE: Final = ("_ssl_object", "_incoming", "_outgoing", "_delayed_outgoing",
                           "_state")


def bulk_sends(stream: trio.abc.Stream) -> None:
    """The TCP socket under ``stream`` (a TLS stream's too) takes what it is given up
    to its send buffer again.  trio's ``SocketStream`` sets TCP_NOTSENT_LOWAT to 16 KiB
    (its issue #72: latency for interactive streams), so the socket reports itself
    writable only while less than that is waiting to go: relaying bulk bytes, the proxy
    then woke and sent 64-128 KiB at a time, eight trips through the scheduler for a
    1 MB Produce request whose broker reads more slowly than the client writes.  0 is
    the system's own setting (net.ipv4.tcp_notsent_lowat, no limit unless an operator
    set one); the send buffer the kernel sizes and bounds is the limit, as for a client
    connected to its broker directly."""
    while not isinstance(stream, trio.SocketStream):
        inner = getattr(stream, "transport_stream", None)
        if inner is None:
            return  # not over TCP (the tests' memory streams)
        stream = inner
    if _TCP_NOTSENT_LOWAT is not None:
        with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to undo
            stream.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, 0)


def _fd(sock: Any) -> int:
    """The socket's descriptor; ClosedResourceError once the stream was closed (the
    number may belong to another file by then)."""
    fd: int = sock.fileno()
    if fd == -1:
        raise trio.ClosedResourceError("the stream was closed")
    return fd


class Pipe:
    """A non-blocking pipe for ``FastStream.splice_to``; ``held``: bytes in it now."""

    __slots__ = ("held", "read_fd", "size", "write_fd")

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # above pipe-max-size: the default will do
            fcntl.fcntl(self.write_fd, _F_SETPIPE_SZ, _PIPE_SIZE)
        self.size: int = fcntl.fcntl(self.write_fd, _F_GETPIPE_SZ)
        self.held = 0

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


class PipePool:
    """Pipes kept between splices (two descriptors each, at most ``keep`` idle ones);
    a pipe that still holds bytes (a splice cut short) is closed, never reused."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._idle: list[Pipe] = []
        self.spliced = 0  # bytes moved through the pool's pipes (for tests and stats)

    @staticmethod
    def supported() -> bool:
        return _SPLICE is not None

    def take(self) -> Pipe | None:
        """An idle pipe or a new one; None when none can be made (out of descriptors):
        the caller's bytes then go through its buffers instead."""
        if self._idle:
            return self._idle.pop()
        try:
            return Pipe()
        except OSError:
            return None

    def give(self, pipe: Pipe) -> None:
        if pipe.held or len(self._idle) >= self.keep:
            pipe.close()
        else:
            self._idle.append(pipe)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
