"""A byte budget shared by every connection: how much frame data the proxy holds at once.

Each connection holds little by itself (bounded channels), but a frame may be up to
``limits.max_frame_bytes`` and a thousand connections may each be assembling one.  Like
Kafka's ``queued.max.request.bytes``, the proxy reserves a frame's declared size before
it reads the rest of it, and gives the bytes back once the frame has been passed on;
when the budget is spent, readers stop reading (TCP pushes back on the peers) instead
of the process growing.  Requests and responses have separate budgets: a broker may
stop reading a connection's requests until its last response has been read, so a
response must never wait for request bytes to drain.

Waiters are served in order (a large frame is not starved by a stream of small ones); a
frame larger than the whole budget takes the whole budget.
"""

from __future__ import annotations

from collections import deque

import trio


class ByteBudget:
    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"a byte budget must be positive, not {total}")
        self.total = total
        self.held = 0
        self.waits = 0  # reservations that had to wait: the budget was spent
        self._waiters: deque[tuple[int, trio.Event]] = deque()

    async def take(self, size: int) -> int:
        """Reserve ``size`` bytes (at most the whole budget); returns what was reserved.

        Returns without a checkpoint when the bytes are free: this is on every read path.
        """
        size = min(size, self.total)
        if not self._waiters and self.held + size <= self.total:
            self.held += size
            return size
        self.waits += 1
        entry = (size, trio.Event())
        self._waiters.append(entry)
        try:
            await entry[1].wait()
        except BaseException:
            if entry[1].is_set():
                self.give(size)  # granted just as we were cancelled
            else:
                self._waiters.remove(entry)
                self._grant()  # a large waiter leaving may unblock smaller ones
            raise
        return size

    def give(self, size: int) -> None:
        self.held -= size
        self._grant()

    def _grant(self) -> None:
        waiters = self._waiters
        while waiters and self.held + waiters[0][0] <= self.total:
            size, event = waiters.popleft()
            self.held += size
            event.set()


class BufferPool:
    """Buffers for large frames streamed through (``ProxyConnection._stream_response``
    and ``_stream_request``), kept for the next one: a new bytearray is zero-filled, and
    often faulted in page by page, for every 3 MB Fetch answer otherwise.  A buffer comes
    back only when nothing holds a view of it any more (an observer that kept a frame
    keeps its buffer), and the pool keeps at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = 0
        self._free: list[bytearray] = []

    def take(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes (its old contents are not cleared)."""
        free = self._free
        for i, buf in enumerate(free):
            if len(buf) >= size:
                del free[i]
                self.kept -= len(buf)
                return buf
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        if not buf or self.kept + len(buf) > self.limit:
            return
        try:
            del buf[-1]  # a bytearray with views on it cannot change size
        except BufferError:
            return
        buf.append(0)  # back to its size (within its allocation: no copy)
        self._free.append(buf)
        self.kept += len(buf)
