"""JSON Lines files on a thread of their own: the proxy never waits for the disk.

``offer`` puts a record into a bounded deque and returns at once; a full deque drops
the record and counts it (traffic keeps its speed when the disk stalls).  The writer
thread drains the deque in batches, encodes, writes, rotates by size and time, and
deletes this instance's oldest files when the total is above the budget.

A file being written is hidden (``.gatehouse-….open``: Spark skips names starting with
a dot) and renamed to its final name when closed, so a reader only ever sees whole
files.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gatehouse.capture.settings import CaptureSettings
from gatehouse.logs import log_event

logger = logging.getLogger("gatehouse.capture")

BATCH = 512  # records per write: one syscall, one encode loop
IDLE_WAIT = 0.05  # seconds the thread sleeps when the deque is empty
DROP_LOG_EVERY = 10.0  # seconds between "records dropped" log lines
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

Opener = Callable[[Path], IO[bytes]]


def _open_file(path: Path) -> IO[bytes]:
    return open(path, "xb")  # the writer owns its lifetime


@dataclass
class CaptureStats:
    offered: int = 0
    written: int = 0
    dropped: int = 0  # the deque was full: the disk is slower than the traffic
    write_errors: int = 0  # records lost to an error writing them (disk full, ...)
    sampled_out: int = 0  # filled in by the observer
    bytes_written: int = 0
    files_written: int = 0
    files_deleted: int = 0  # the disk budget at work
    queue_depth: int = 0


class CaptureWriter:
    """Records in (``offer``, never blocks), files out (on the ``gatehouse-capture`` thread)."""

    def __init__(self, settings: CaptureSettings, *, opener: Opener = _open_file) -> None:
        self.settings = settings
        self.opener = opener
        self.prefix = "gatehouse-" + _UNSAFE.sub("_", settings.instance) + "-"
        self.suffix = ".jsonl.gz" if settings.gzip else ".jsonl"
        self._queue: deque[dict[str, Any]] = deque()
        self._capacity = settings.queue
        self._wake_at = max(1, min(BATCH, settings.queue // 4))
        self._wake = threading.Event()
        self._stopping = False
        self._stats = CaptureStats()
        self._dropped_logged = 0
        self._drop_log_at = 0.0
        self._seq = 0
        self._raw: IO[bytes] | None = None
        self._out: IO[bytes] | gzip.GzipFile | None = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self._closed_bytes: list[tuple[Path, int]] = []  # this instance's files, oldest first
        settings.dir.mkdir(parents=True, exist_ok=True)
        self._recover()
        self._thread = threading.Thread(target=self._run, name="gatehouse-capture", daemon=True)
        self._thread.start()

    # -- the proxy's side (trio thread) -----------------------------------------------

    def offer(self, record: dict[str, Any]) -> bool:
        """Queue ``record`` for writing; False (and counted) if the queue is full."""
        stats = self._stats
        stats.offered += 1
        queue = self._queue
        if len(queue) >= self._capacity or self._stopping:
            stats.dropped += 1
            now = time.monotonic()
            if now >= self._drop_log_at:
                self._drop_log_at = now + DROP_LOG_EVERY
                log_event(logger, logging.WARNING, "capture queue full: records dropped",
                          dropped=stats.dropped - self._dropped_logged,
                          dropped_total=stats.dropped, queue=self._capacity)
                self._dropped_logged = stats.dropped
            return False
        queue.append(record)
        if len(queue) >= self._wake_at:
            self._wake.set()
        return True

    def statistics(self) -> CaptureStats:
        stats = self._stats
        stats.queue_depth = len(self._queue)
        return stats

    def close(self, timeout: float | None = 30.0) -> bool:
        """Write what is queued, close the file; False if the disk did not let us in time."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log_event(logger, logging.ERROR, "capture: the disk did not take the last records "
                      "in time", queued=len(self._queue), timeout_seconds=timeout)
            return False
        return True

    # -- the writer thread -----------------------------------------------------------

    def _run(self) -> None:
        queue = self._queue
        try:
            while True:
                if not queue:
                    if self._stopping:
                        break
                    self._wake.wait(IDLE_WAIT)
                    self._wake.clear()
                    if self._out is not None and self._expired():
                        self._close_file()  # the next record opens the next file
                    continue
                batch = [queue.popleft() for _ in range(min(BATCH, len(queue)))]
                self._write(batch)
        finally:
            self._close_file()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        dumps = json.dumps
        data = ("\n".join([dumps(r, separators=(",", ":")) for r in batch]) + "\n").encode()
        try:
            if self._out is None or self._expired():
                self._rotate()
            out = self._out
            assert out is not None
            out.write(data)
            out.flush()
        except OSError as exc:
            self._stats.write_errors += len(batch)
            log_event(logger, logging.ERROR, "capture: writing failed; records lost",
                      records=len(batch), error=str(exc), file=str(self._path))
            self._abandon_file()
            return
        self._stats.written += len(batch)
        self._stats.bytes_written += len(data)
        if self._size() >= self.settings.rotate_bytes:
            self._rotate()
        self._enforce_budget()

    def _expired(self) -> bool:
        return time.monotonic() - self._opened_at >= self.settings.rotate_seconds

    def _size(self) -> int:
        raw = self._raw
        return raw.tell() if raw is not None else 0

    def _rotate(self) -> None:
        self._close_file()
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        name = f"{self.prefix}{stamp}Z-{os.getpid()}-{self._seq:06d}{self.suffix}"
        path = self.settings.dir / f".{name}.open"
        raw = self.opener(path)
        self._raw, self._path, self._opened_at = raw, path, time.monotonic()
        if self.settings.gzip:
            self._out = gzip.GzipFile(filename=name, mode="wb", fileobj=raw, compresslevel=5)
        else:
            self._out = raw

    def _close_file(self) -> None:
        out, raw, path = self._out, self._raw, self._path
        self._out = self._raw = self._path = None
        if out is None or raw is None or path is None:
            return
        try:
            if out is not raw:
                out.close()
            size = raw.tell()
            raw.close()
            final = path.with_name(path.name[1:].removesuffix(".open"))
            path.rename(final)
        except OSError as exc:
            log_event(logger, logging.ERROR, "capture: closing a file failed", file=str(path),
                      error=str(exc))
            return
        self._stats.files_written += 1
        self._closed_bytes.append((final, size))

    def _abandon_file(self) -> None:
        raw, self._out, self._raw = self._raw, None, None
        if raw is not None:
            with contextlib.suppress(OSError):
                raw.close()
        # A file cut mid-write is left under its hidden name: readers never see it.
        self._path = None

    def _enforce_budget(self) -> None:
        budget = self.settings.max_total_bytes
        total = self._size() + sum(size for _, size in self._closed_bytes)
        while total > budget and self._closed_bytes:
            path, size = self._closed_bytes.pop(0)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log_event(logger, logging.ERROR, "capture: deleting an old file failed",
                          file=str(path), error=str(exc))
                continue
            total -= size
            self._stats.files_deleted += 1
            log_event(logger, logging.INFO, "capture: oldest file deleted (disk budget)",
                      file=path.name, budget_bytes=budget)

    def _recover(self) -> None:
        """Files this instance left behind: counted in the budget; unfinished ones named."""
        directory = self.settings.dir
        for path in sorted(directory.glob(f".{self.prefix}*.open")):
            if _writer_alive(path):
                continue  # another live process with the same instance name writes it
            final = path.with_name(path.name[1:].removesuffix(".open"))
            if final.name.endswith(".gz"):
                final = final.with_name(final.name + ".truncated")  # not a valid gzip stream
            with contextlib.suppress(OSError):
                path.rename(final)
        for path in sorted(directory.glob(f"{self.prefix}*{self.suffix}")):
            with contextlib.suppress(OSError):
                self._closed_bytes.append((path, path.stat().st_size))


def _writer_alive(path: Path) -> bool:
    """Whether the process named in a hidden file's name (``…Z-<pid>-<seq>``) still runs."""
    parts = path.name.removesuffix(".open").split("-")
    try:
        pid = int(parts[-2])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
