"""Quota buckets shared by the workers of one supervisor (``workers: N``).

Each worker is its own process, so a bucket in one worker's memory would give a client
whose connections land on two workers twice its rate.  The supervisor makes one table
of buckets in shared memory (a memfd, passed to each worker) and every worker spends
from the same slot for the same (rule, kind, scope): a quota is the whole proxy's.

A slot is a key hash and the bucket's numbers (level, the time it was brought up to
date, rate).  Each read-modify-write holds a POSIX record lock on the slot's bytes
(``fcntl.lockf``), so two workers never interleave on one bucket.  Times are
``time.monotonic()``: one clock for every process (trio's clock is per process).  A
table that is full leaves new scopes to per-worker buckets (logged once).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from gatehouse.logs import log_event
from gatehouse.proxy.quotas import BURST_SECONDS, MAX_HOLD

logger = logging.getLogger("gatehouse.proxy")

SLOTS: Final = 16_384
_SLOT: Final = struct.Struct("<Qddd")  # key hash, level, at, rate
_PROBES: Final = 64


class SharedTable:
    """Buckets in shared memory, found by key (``slot``)."""

    def __init__(self, fd: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.fd = fd
        self.clock = clock
        self.memory = mmap.mmap(fd, SLOTS * _SLOT.size)
        self.full_logged = False

    @classmethod
    def create(cls) -> SharedTable:
        """A new, empty table (the supervisor's); its ``fd`` is passed to the workers."""
        fd = os.memfd_create("gatehouse-quotas")
        os.ftruncate(fd, SLOTS * _SLOT.size)
        return cls(fd)

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "memfd_create")

    @contextmanager
    def locked(self, index: int) -> Iterator[None]:
        start = index * _SLOT.size
        fcntl.lockf(self.fd, fcntl.LOCK_EX, _SLOT.size, start)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, _SLOT.size, start)

    def read(self, index: int) -> tuple[int, float, float, float]:
        return _SLOT.unpack_from(self.memory, index * _SLOT.size)

    def write(self, index: int, key: int, level: float, at: float, rate: float) -> None:
        _SLOT.pack_into(self.memory, index * _SLOT.size, key, level, at, rate)

    def slot(self, key: str, rate: float) -> SharedBucket | None:
        """The bucket for ``key`` (a full one at ``rate`` if it is new); None when the
        table has no room near its place."""
        digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                                "little") or 1
        for probe in range(_PROBES):
            index = (digest + probe) % SLOTS
            with self.locked(index):
                found, _, _, _ = self.read(index)
                if found == 0:
                    self.write(index, digest, rate * BURST_SECONDS, self.clock(), rate)
                    return SharedBucket(self, index)
            if found == digest:
                return SharedBucket(self, index)
        if not self.full_logged:
            self.full_logged = True
            log_event(logger, logging.WARNING, "shared quota table full: new scopes get "
                      "per-worker budgets", slots=SLOTS)
        return None


class SharedBucket:
    """``quotas.Bucket``'s behaviour over a slot of a ``SharedTable`` (the ``now`` the
    callers pass, trio's, is not used: the table keeps one clock for all processes)."""

    __slots__ = ("index", "table")

    def __init__(self, table: SharedTable, index: int) -> None:
        self.table = table
        self.index = index

    def _update(self, spend: float = 0.0, rate: float | None = None) -> tuple[float, float]:
        """Bring the bucket up to date, spend from it, maybe set its rate: (level, rate)."""
        table, index = self.table, self.index
        with table.locked(index):
            key, level, at, old_rate = table.read(index)
            now = table.clock()
            level = min(old_rate * BURST_SECONDS, level + max(0.0, now - at) * old_rate)
            new_rate = old_rate if rate is None else rate
            if rate is not None:
                level = min(level, rate * BURST_SECONDS)
            level = max(level - spend, -new_rate * MAX_HOLD)
            table.write(index, key, level, now, new_rate)
        return level, new_rate

    @property
    def rate(self) -> float:
        return self.table.read(self.index)[3]

    def spend(self, amount: float, now: float) -> None:
        self._update(spend=amount)

    def wait(self, now: float) -> float:
        level, rate = self._update()
        return 0.0 if level >= 0 else -level / rate

    def set_rate(self, rate: float, now: float) -> None:
        self._update(rate=rate)

    def idle(self, now: float) -> bool:
        level, rate = self._update()
        return level >= rate * BURST_SECONDS


__all__ = ["SLOTS", "SharedBucket", "SharedTable"]
