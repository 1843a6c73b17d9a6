"""Capture files on a thread of their own: the proxy never waits for the disk.

``offer`` puts a record into a bounded deque and returns at once; a full deque drops
the record and counts it (traffic keeps its speed when the disk stalls).  The writer
thread drains the deque in batches, encodes, writes, rotates by size and time, and
deletes this instance's oldest files when the total is above the budget.

Two formats (``capture.format``): JSON Lines (the interchange format, one line per
record) and Parquet (columnar, for ``gatehouse report``: no JSON parse, ~20x smaller).
Parquet batches become Arrow record batches (``arrow_schema``: schema v1's fields and
types) and are written as row groups of ``ROW_GROUP_ROWS`` records; pyarrow is needed
only then (the ``parquet`` extra) and only imported then.

A file being written is hidden (``.gatehouse-….open``: Spark skips names starting with
a dot) and renamed to its final name when closed, so a reader only ever sees whole
files (a Parquet file is only readable once its footer is written, at close).
"""

from __future__ import annotations

import contextlib
import gzip
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

from gatehouse.capture.schema import (
    FIELDS,
    RULE_FIELDS,
    SCHEMA_VERSION,
    TOPIC_FIELDS,
    encode_lines,
)
from gatehouse.capture.settings import CaptureSettings
from gatehouse.logs import log_event

logger = logging.getLogger("gatehouse.capture")

BATCH = 512  # records per write: one syscall, one encode loop
IDLE_WAIT = 0.05  # seconds the thread sleeps when the deque is empty
DROP_LOG_EVERY = 10.0  # seconds between "records dropped" log lines
# Parquet: records per row group (~2 MB on disk; Spark splits files at row groups).
ROW_GROUP_ROWS = 65_536
PARQUET_COMPRESSION = "zstd"  # smaller and cheaper to write than snappy on capture records
# Records per pyarrow conversion call: it holds the GIL throughout (~7 us a record), so
# the proxy's thread waits at most ~1 ms for it; writing a row group releases the GIL.
ENCODE_CHUNK = 128
SUFFIXES = {"jsonl": ".jsonl", "parquet": ".parquet"}
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

Opener = Callable[[Path], IO[bytes]]


def _open_file(path: Path) -> IO[bytes]:
    return open(path, "xb")  # the writer owns its lifetime


def arrow_schema() -> Any:
    """Schema v1 as an Arrow schema (``pyarrow.Schema``), from ``capture.schema.FIELDS``:
    int is int32, long int64, double float64, lists and structs stay nested.  The file's
    metadata carries the version (``gatehouse.capture.v``)."""
    import pyarrow as pa

    scalars = {"string": pa.string(), "int": pa.int32(), "long": pa.int64(),
               "double": pa.float64()}
    structs = {"topic": TOPIC_FIELDS, "rule": RULE_FIELDS}

    def arrow_type(kind: str) -> Any:
        if kind.startswith("array<"):
            return pa.list_(arrow_type(kind[6:-1]))
        if kind in structs:
            return pa.struct([(name, arrow_type(sub)) for name, sub in structs[kind]])
        return scalars[kind]

    return pa.schema([(name, arrow_type(kind)) for name, kind in FIELDS],
                     metadata={"gatehouse.capture.v": str(SCHEMA_VERSION)})


class ParquetEncoder:
    """Record dicts to Arrow record batches, and row groups into one Parquet file.

    Batches are held until ``ROW_GROUP_ROWS`` records (or ``max_pending_bytes`` of Arrow
    memory) are pending, then written as one row group: many small row groups would make
    the files slow to read.
    """

    def __init__(self, max_pending_bytes: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa, self._pq = pa, pq
        self.schema = arrow_schema()
        self.max_pending_bytes = max_pending_bytes
        self.pending: list[Any] = []
        self.pending_rows = 0
        self._pending_bytes = 0
        self._file: Any = None  # pyarrow.parquet.ParquetWriter

    def encode(self, batch: list[dict[str, Any]]) -> list[Any]:
        """Record batches (``pyarrow.ArrowException`` when a record does not fit)."""
        from_pylist, schema = self._pa.RecordBatch.from_pylist, self.schema
        return [from_pylist(batch[i:i + ENCODE_CHUNK], schema=schema)
                for i in range(0, len(batch), ENCODE_CHUNK)]

    def open(self, raw: IO[bytes]) -> None:
        self._file = self._pq.ParquetWriter(raw, self.schema, compression=PARQUET_COMPRESSION)

    def add(self, batches: list[Any]) -> bool:
        """Hold ``batches``; True when a row group's worth is pending."""
        self.pending.extend(batches)
        self.pending_rows += sum(b.num_rows for b in batches)
        self._pending_bytes += sum(b.nbytes for b in batches)
        return (self.pending_rows >= ROW_GROUP_ROWS
                or self._pending_bytes >= self.max_pending_bytes)

    def flush(self, final: bool = False) -> int:
        """Write the pending rows in row groups of ``ROW_GROUP_ROWS`` (the last one may
        be smaller), keeping the rows past the last whole group pending for the next
        (``final``: write them all); returns how many were written (OSError: still
        pending, for ``discard`` to count).  The writer thread takes records in batches
        of any size, so the pending rows may pass the mark by part of a batch."""
        rows = self.pending_rows
        if not rows:
            return 0
        table = self._pa.Table.from_batches(self.pending, schema=self.schema)
        rest = None
        if rows > ROW_GROUP_ROWS and rows % ROW_GROUP_ROWS and not final:
            whole = rows - rows % ROW_GROUP_ROWS
            table, rest = table.slice(0, whole), table.slice(whole)
        self._file.write_table(table, row_group_size=ROW_GROUP_ROWS)
        if rest is None:
            self.pending, self.pending_rows, self._pending_bytes = [], 0, 0
        else:
            self.pending, self.pending_rows = rest.to_batches(), rest.num_rows
            self._pending_bytes = rest.nbytes
        return int(table.num_rows)

    def close(self) -> None:
        """The footer: the file is readable from here on."""
        parquet_file, self._file = self._file, None
        if parquet_file is not None:
            parquet_file.close()

    def discard(self) -> int:
        """Forget the open file and what is pending (after a failed write)."""
        rows = self.pending_rows
        self.pending, self.pending_rows, self._pending_bytes, self._file = [], 0, 0, None
        return rows


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


class RecordInbox:
    """The proxy's side of a sink: ``offer`` appends to a bounded deque and returns at once;
    a full deque drops the record, counts it and says so (at most every DROP_LOG_EVERY s).
    The sink's own thread waits on ``_wake`` and drains ``_queue``."""

    def _open_inbox(self, capacity: int, wake_at: int, full_message: str) -> None:
        self._queue: deque[dict[str, Any]] = deque()
        self._capacity = capacity
        self._wake_at = wake_at
        self._full_message = full_message
        self._wake = threading.Event()
        self._stopping = False
        self._stats = CaptureStats()
        self._dropped_logged = 0
        self._drop_log_at = 0.0

    def offer(self, record: dict[str, Any]) -> bool:
        """Queue ``record``; False (and counted) if the queue is full."""
        stats = self._stats
        stats.offered += 1
        queue = self._queue
        if len(queue) >= self._capacity or self._stopping:
            stats.dropped += 1
            now = time.monotonic()
            if now >= self._drop_log_at:
                self._drop_log_at = now + DROP_LOG_EVERY
                log_event(logger, logging.WARNING, self._full_message,
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


class CaptureWriter(RecordInbox):
    """Records in (``offer``, never blocks), files out (on the ``gatehouse-capture`` thread)."""

    def __init__(self, settings: CaptureSettings, *, opener: Opener = _open_file) -> None:
        self.settings = settings
        self.opener = opener
        self.prefix = "gatehouse-" + _UNSAFE.sub("_", settings.instance) + "-"
        self.suffix = SUFFIXES[settings.format] + (".gz" if settings.gzip else "")
        # Parquet only (pyarrow is imported only then): rows wait here for a row group.
        self._parquet = (ParquetEncoder(settings.rotate_bytes)
                         if settings.format == "parquet" else None)
        self._open_inbox(settings.queue, max(1, min(BATCH, settings.queue // 4)),
                         "capture queue full: records dropped")
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
                    if self._raw is not None and self._expired():
                        self._close_file()  # the next record opens the next file
                    continue
                batch = [queue.popleft() for _ in range(min(BATCH, len(queue)))]
                if self._parquet is not None:
                    self._write_parquet(self._parquet, batch)
                else:
                    self._write(batch)
        finally:
            self._close_file()

    def _write_parquet(self, encoder: ParquetEncoder, batch: list[dict[str, Any]]) -> None:
        try:
            rows = encoder.encode(batch)
        except Exception as exc:  # pyarrow.ArrowException: a record the schema cannot hold
            self._stats.write_errors += len(batch)
            log_event(logger, logging.ERROR, "capture: records do not fit the schema; lost",
                      records=len(batch), error=str(exc).splitlines()[0][:200])
            return
        held = False
        try:
            if self._raw is None or self._expired():
                self._rotate()
            held = True
            if not encoder.add(rows):
                return
            self._flush_row_group(encoder)
        except OSError as exc:
            self._parquet_failed(encoder, exc, 0 if held else len(batch))
            return
        if self._size() >= self.settings.rotate_bytes:
            self._close_file()  # the next batch opens the next file
        self._enforce_budget()

    def _flush_row_group(self, encoder: ParquetEncoder, final: bool = False) -> None:
        before = self._size()
        self._stats.written += encoder.flush(final)
        self._stats.bytes_written += self._size() - before

    def _parquet_failed(self, encoder: ParquetEncoder, exc: OSError, unheld: int = 0) -> None:
        lost = encoder.discard() + unheld
        self._stats.write_errors += lost
        log_event(logger, logging.ERROR, "capture: writing failed; records lost",
                  records=lost, error=str(exc), file=str(self._path))
        self._abandon_file()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        data = encode_lines(batch)
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
            self._close_file()  # the next batch opens the next file
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
        if self._parquet is not None:
            self._parquet.open(raw)
        elif self.settings.gzip:
            self._out = gzip.GzipFile(filename=name, mode="wb", fileobj=raw, compresslevel=5)
        else:
            self._out = raw

    def _close_file(self) -> None:
        encoder = self._parquet
        if encoder is not None and self._raw is not None:
            try:
                self._flush_row_group(encoder, final=True)
                encoder.close()
            except OSError as exc:
                self._parquet_failed(encoder, exc)
                return
        out, raw, path = self._out, self._raw, self._path
        self._out = self._raw = self._path = None
        if raw is None or path is None:
            return
        try:
            if out is not None and out is not raw:
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
        self._enforce_budget()  # a Parquet file grows at close (last row group, footer)

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
            if final.name.endswith((".gz", ".parquet")):
                # Not a valid gzip stream / no Parquet footer: readers skip the name.
                final = final.with_name(final.name + ".truncated")
            with contextlib.suppress(OSError):
                path.rename(final)
        # Every format counts in the budget (the format may have changed since).
        mine = [path for suffix in (".jsonl", ".jsonl.gz", ".parquet")
                for path in directory.glob(f"{self.prefix}*{suffix}")]
        for path in sorted(mine, key=lambda p: p.name):  # names sort by start time
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
