"""Open connections per client address, for ``limits.max_connections_per_ip``, and in
all, for ``limits.max_connections``.

One process counts in a dict.  The workers of one supervisor (``workers: N``) count in a
table in shared memory (a memfd the supervisor makes and passes to each worker), so a
client's connections count against its limit whichever workers the kernel spreads them
over: the limit is the whole proxy's, as a quota is.  So is ``max_connections``: the
table's last slot, past those of the addresses, counts every connection.

A slot holds an address's key (a hash) and one count per worker: each worker changes
only its own, and the supervisor zeroes a dead worker's counts before it starts the
next one, so a worker that dies with connections open leaks none.  A slot whose counts
are all zero is free for another address.  Every look at the table holds one POSIX
record lock on it (``fcntl.lockf``): connections open and close far less often than
requests come, so one lock is simpler than one per slot and costs nothing measurable.
A table that is full leaves new addresses to the worker's own count (logged once).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from gatehouse.logs import log_event

logger = logging.getLogger("gatehouse.proxy")

SLOTS: Final = 16_384
_PROBES: Final = 64
_KEY: Final = struct.Struct("<Q")


class HostCounts:
    """Open connections per client address in this process."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self.total_open = 0  # this process's connections

    def admit_total(self, limit: int) -> bool:
        """Counts a connection unless the proxy has ``limit`` open already."""
        if self.total_open >= limit:
            return False
        self.total_open += 1
        return True

    def release_total(self) -> None:
        """A connection counted by ``admit_total`` closed."""
        self.total_open = max(0, self.total_open - 1)

    def admit(self, host: str, limit: int | None) -> bool:
        """Counts a connection of ``host`` unless it has ``limit`` open already."""
        count = self.open.get(host, 0)
        if limit is not None and count >= limit:
            return False
        self.open[host] = count + 1
        return True

    def release(self, host: str) -> None:
        """A connection of ``host`` closed."""
        left = self.open.pop(host, 1) - 1
        if left > 0:
            self.open[host] = left


class SharedHostCounts(HostCounts):
    """Open connections per client address over all the workers of a supervisor,
    counted in ``table`` as worker ``index`` (``open`` keeps this worker's, for the
    addresses the table had no room for)."""

    def __init__(self, table: HostTable, index: int) -> None:
        super().__init__()
        self.table = table
        self.index = index
        self.slots: dict[str, int] = {}  # host -> its slot, while it has connections here
        self.full_logged = False

    def admit(self, host: str, limit: int | None) -> bool:
        if host in self.open:  # counted here: the table had no room for it
            return super().admit(host, limit)
        admitted = self.table.admit(_key(host), self.index, limit, self.slots.get(host))
        if admitted is None:
            if not self.full_logged:
                self.full_logged = True
                log_event(logger, logging.WARNING, "shared connection table full: new "
                          "addresses are limited per worker", slots=SLOTS)
            return super().admit(host, limit)
        slot, ok = admitted
        if ok:
            self.slots[host] = slot
        return ok

    def admit_total(self, limit: int) -> bool:
        if not self.table.admit_total(self.index, limit):
            return False
        self.total_open += 1
        return True

    def release_total(self) -> None:
        if self.total_open > 0:
            self.total_open -= 1
            self.table.release(SLOTS, self.index)

    def release(self, host: str) -> None:
        slot = self.slots.get(host)
        if slot is None:
            super().release(host)
            return
        if self.table.release(slot, self.index) == 0:
            del self.slots[host]


class HostTable:
    """The slots in shared memory: a key, then a count per worker (``workers``); SLOTS
    for addresses, then one for all connections (key 0, never probed)."""

    def __init__(self, fd: int, workers: int) -> None:
        self.fd = fd
        self.workers = workers
        self.slot = struct.Struct(f"<Q{workers}I")
        self.size = (SLOTS + 1) * self.slot.size
        self.memory = mmap.mmap(fd, self.size)

    @classmethod
    def create(cls, workers: int) -> HostTable:
        """A new, empty table (the supervisor's); its ``fd`` is passed to the workers."""
        fd = os.memfd_create("gatehouse-connections")
        os.ftruncate(fd, (SLOTS + 1) * struct.calcsize(f"<Q{workers}I"))
        return cls(fd, workers)

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "memfd_create")

    @contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.lockf(self.fd, fcntl.LOCK_EX, self.size, 0)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, self.size, 0)

    def _read(self, index: int) -> tuple[int, ...]:
        return self.slot.unpack_from(self.memory, index * self.slot.size)

    def _find(self, key: int) -> int | None:
        """The slot of ``key``, else the first free one on its probe path; None when
        neither is there (held by the lock)."""
        free = None
        for probe in range(_PROBES):
            index = (key + probe) % SLOTS
            found, *counts = self._read(index)
            if found == key:
                return index
            if free is None and (found == 0 or not any(counts)):
                free = index
            if found == 0:
                break  # never used: the key is not further along
        return free

    def admit(self, key: int, worker: int, limit: int | None, known: int | None
              ) -> tuple[int, bool] | None:
        """(slot, whether admitted): counts a connection of ``key`` for ``worker`` unless
        the address has ``limit`` open over all workers; ``known``: its slot, when this
        worker has connections of it open.  None: no room in the table."""
        with self.locked():
            index = known if known is not None else self._find(key)
            if index is None:
                return None
            found, *counts = self._read(index)
            if found != key:
                counts = [0] * self.workers  # a free slot, taken for this address
            if limit is not None and sum(counts) >= limit:
                return index, False
            counts[worker] += 1
            self.slot.pack_into(self.memory, index * self.slot.size, key, *counts)
            return index, True

    def admit_total(self, worker: int, limit: int) -> bool:
        """Counts a connection for ``worker`` unless ``limit`` are open over all
        workers."""
        with self.locked():
            _, *counts = self._read(SLOTS)
            if sum(counts) >= limit:
                return False
            counts[worker] += 1
            self.slot.pack_into(self.memory, SLOTS * self.slot.size, 0, *counts)
            return True

    def release(self, index: int, worker: int) -> int:
        """A connection closed: ``worker``'s count at ``index`` down by one; its count
        left."""
        with self.locked():
            key, *counts = self._read(index)
            counts[worker] = max(0, counts[worker] - 1)
            self.slot.pack_into(self.memory, index * self.slot.size, key, *counts)
            return counts[worker]

    def forget(self, worker: int) -> None:
        """Zero ``worker``'s counts (the supervisor, before starting it again): the
        connections the dead one held are gone."""
        offset = _KEY.size + 4 * worker
        with self.locked():
            for index in range(SLOTS + 1):
                struct.pack_into("<I", self.memory, index * self.slot.size + offset, 0)

    def total(self, key: int | None = None) -> int:
        """Connections of ``key`` (None: of every address) open over all workers (for the
        tests)."""
        with self.locked():
            if key is None:
                return sum(self._read(SLOTS)[1:])
            index = self._find(key)
            if index is None:
                return 0
            found, *counts = self._read(index)
            return sum(counts) if found == key else 0


def _key(host: str) -> int:
    return int.from_bytes(hashlib.blake2b(host.encode(), digest_size=8).digest(),
                          "little") or 1


__all__ = ["SLOTS", "HostCounts", "HostTable", "SharedHostCounts"]
