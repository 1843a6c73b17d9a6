"""Fetch responses read straight from their bytes: what the proxy, the metrics and the
observation log need of most of them, without decoding them.

A Fetch response is the biggest frame a proxy moves and the most frequent with Produce.
The proxy must know whether it names new leaders (KIP-951: the top-level NodeEndpoints
tag of v16+, rewritten to the proxy's addresses), and the metrics need each partition's
error code and each topic's records and bytes (from batch headers).  ``response_scan``
walks the frame for exactly that, checks that it consumed it exactly, and returns None
on anything unexpected: the caller then falls back to the full decoder, which reports
the error.

Layouts: Kafka's FetchResponse.json, flexible versions (v12+); older versions are left to
the decoder.  tests/test_fetch_scan.py holds the scan to the full decoder.
"""

from __future__ import annotations

import struct
from typing import Final

from gatehouse.codecs._native import speedups
from gatehouse.codecs._scan import I16 as _I16
from gatehouse.codecs._scan import (
    StepWalk,
    TopicCounts,
    Unexpected,
    fit_tag_section,
    last_tags,
    request_body_at,
    skip_tags,
    skip_tags_whole,
    tag_fields,
    uvarint,
)
from gatehouse.codecs.primitives import Buffer
from gatehouse.codecs.records import Uncounted, batch_step, count_records

FIRST_VERSION: Final = 12  # the first flexible version
TOPIC_IDS_SINCE: Final = 13
# PartitionIndex, ErrorCode, HighWatermark, LastStableOffset, LogStartOffset
_PARTITION_FIXED: Final = 4 + 2 + 8 + 8 + 8
_ABORTED_TRANSACTION: Final = 8 + 8  # ProducerId, FirstOffset (then its tag section)
_INDEX_CODE: Final = struct.Struct(">ih")  # PartitionIndex, ErrorCode
# A request's fields before its topics: ReplicaId (up to v14), MaxWaitMs, MinBytes,
# MaxBytes, IsolationLevel, SessionId, SessionEpoch.
_REQUEST_HEAD: Final = {False: 4 + 4 + 4 + 4 + 1 + 4 + 4, True: 4 + 4 + 4 + 1 + 4 + 4}
_REPLICA_STATE_SINCE: Final = 15  # ReplicaId moved into the tagged ReplicaState
# A request's partition: Partition, CurrentLeaderEpoch, FetchOffset, LastFetchedEpoch,
# LogStartOffset, PartitionMaxBytes (then its tag section).
_REQUEST_PARTITION: Final = 4 + 4 + 8 + 4 + 8 + 4
# ``_walk`` in C (gatehouse/codecs/_speedups.c), where built; and AnswerWalk's reads of
# a records field's batch headers.
_C_WALK: Final = None if speedups is None else speedups.fetch_walk
_C_BATCHES: Final = None if speedups is None else speedups.batches_feed

__all__ = [
    "AnswerWalk",
    "Unexpected",
    "fit_tag_section",
    "request_topic_ids",
    "response_scan",
    "tag_fields",
    "top_level_tag_fields",
    "top_level_tags",
]

def request_topic_ids(frame: Buffer, version: int) -> list[bytes] | None:
    """The 16 bytes of each topic id a Fetch request (v13+) fetches, in order, read from
    its bytes (from its api key on) without decoding it; its forgotten topics are not
    read.  None when the bytes are not what the reader expects (the caller decodes)."""
    if version < TOPIC_IDS_SINCE:
        return None
    view = memoryview(frame)
    try:
        pos = request_body_at(view, True) + _REQUEST_HEAD[version >= _REPLICA_STATE_SINCE]
        topics, pos = uvarint(view, pos)
        ids = []
        for _ in range(topics - 1):
            if pos + 16 > len(view):
                raise Unexpected
            ids.append(bytes(view[pos:pos + 16]))
            partitions, pos = uvarint(view, pos + 16)
            for _ in range(partitions - 1):
                pos += _REQUEST_PARTITION
                pos = skip_tags(view, pos) if view[pos] else pos + 1
            pos = skip_tags(view, pos) if view[pos] else pos + 1
        return ids
    except (Unexpected, struct.error, IndexError):
        return None


# Error codes -> how often (the top-level one and every partition's); the numbers of the
# top-level tagged fields (NodeEndpoints is tag 0); per topic (its name at v12, its id
# from v13) what moved.
ResponseScan = tuple[dict[int, int], tuple[int, ...], TopicCounts]


def top_level_tags(frame: Buffer, version: int) -> tuple[int, ...] | None:
    """The numbers of a Fetch response's top-level tagged fields, from its bytes: all the
    proxy needs to know of most Fetch responses (records are skipped, not counted)."""
    scan = response_scan(frame, version, count=False)
    return None if scan is None else scan[1]


def response_scan(frame: Buffer, version: int, count: bool = True) -> ResponseScan | None:
    """What a Fetch response says, from its bytes (``frame`` from the correlation id on);
    ``count=False``: records and bytes are left at 0 and the partition lists empty (the
    batch headers are not read)."""
    if version < FIRST_VERSION:
        return None
    view = memoryview(frame)
    try:
        codes, pos, topics = _walk(view, version, count)
        return codes, last_tags(view, pos), topics
    except (Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None


def top_level_tag_fields(frame: Buffer, version: int) -> tuple[int, list[tuple[int, bytes]]] | None:
    """Where a Fetch response's top-level tag section starts in ``frame`` (from the
    correlation id on), and its (tag, value bytes); None as ``response_scan``."""
    if version < FIRST_VERSION:
        return None
    view = memoryview(frame)
    try:
        _, pos, _ = _walk(view, version, False)
        return pos, tag_fields(view, pos)
    except (Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None


def head_and_tags_at(frame: Buffer, version: int) -> tuple[int, int] | None:
    """Where a Fetch response's topics begin (its head ends: the header, throttle time,
    error code and session id) and where its top-level tag section begins, in ``frame``
    (from the correlation id on); None as ``response_scan``."""
    if version < FIRST_VERSION:
        return None
    view = memoryview(frame)
    try:
        _, pos, _ = _walk(view, version, False)
        return _head_end(view), pos
    except (Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None


def _head_end(view: memoryview) -> int:
    pos = skip_tags(view, 4) if view[4] else 5  # CorrelationId, header tags
    return pos + 4 + 2 + 4  # ThrottleTimeMs, ErrorCode, SessionId


def _walk(view: memoryview, version: int, count: bool) -> tuple[dict[int, int], int, TopicCounts]:
    """The error codes, the offset of the top-level tag section, the topics' counts."""
    if _C_WALK is not None:
        found = _C_WALK(view, version >= TOPIC_IDS_SINCE, count)
        if found is None:
            raise Unexpected
        if found is not NotImplemented:
            return found  # type: ignore[no-any-return]
    return _walk_python(view, version, count)


def _walk_python(view: memoryview, version: int,
                 count: bool) -> tuple[dict[int, int], int, TopicCounts]:
    """``_walk`` in Python (where the C reader is not built, and the reference it is held
    to)."""
    ids = version >= TOPIC_IDS_SINCE
    pos = _head_end(view)
    (_, top_code) = _INDEX_CODE.unpack_from(view, pos - 10)  # ThrottleTimeMs, ErrorCode
    codes = {top_code: 1}
    n_topics, pos = uvarint(view, pos)
    if n_topics < 1:
        raise Unexpected  # a null array: not in a broker's answer
    topics: TopicCounts = []
    for _ in range(n_topics - 1):
        key: str | bytes
        if ids:
            key = bytes(view[pos:pos + 16])
            pos += 16
        else:
            n, pos = uvarint(view, pos)
            if n < 1:
                raise Unexpected  # a null topic name: not in a broker's answer
            key = str(view[pos:pos + n - 1], "utf-8")
            pos += n - 1
        records = size = 0
        indexes: list[int] = []
        n_partitions, pos = uvarint(view, pos)
        if n_partitions < 1:
            raise Unexpected
        for _ in range(n_partitions - 1):
            index, code = _INDEX_CODE.unpack_from(view, pos)
            codes[code] = codes.get(code, 0) + 1
            if count:
                indexes.append(index)
            pos += _PARTITION_FIXED
            n, pos = uvarint(view, pos)  # AbortedTransactions, nullable
            for _ in range(n - 1):
                pos += _ABORTED_TRANSACTION
                pos = skip_tags(view, pos) if view[pos] else pos + 1
            pos += 4  # PreferredReadReplica (v11+)
            n, pos = uvarint(view, pos)  # Records, nullable
            n -= 1
            if n > 0:
                end = pos + n
                if end > len(view):
                    raise Unexpected
                if count:
                    batch_records, counted = count_records(view, pos, end)
                    records += batch_records
                    size += counted
                pos = end
            pos = skip_tags(view, pos) if view[pos] else pos + 1  # DivergingEpoch...
        pos = skip_tags(view, pos) if view[pos] else pos + 1
        topics.append((key, indexes, records, size))
    return codes, pos, topics


class AnswerWalk(StepWalk):
    """Follows a Fetch response (flexible versions) as its bytes come, keeping none of its
    records: what lets a proxy pass the records on without reading them (splice(2)) and
    still find the top-level tag section, where KIP-951 names new leaders.

    ``feed(data)`` takes the frame's next bytes (from the correlation id on) and returns
    how many it took: all of them, until the walk reaches the top-level tag section,
    whose offset is then ``tags_at`` (the bytes from there on are the caller's).
    ``opaque`` is how many of the bytes after those fed are records: they may go by
    unread (``skip``) or be fed.  ``head`` is the frame up to its topics array (the
    correlation id, header tags, throttle time, error code, session id).

    With ``count``, the walk also reads what ``response_scan`` reads: every error code
    and each batch's header (only the rest of a batch is ``opaque``), so that ``scan``
    of the tag section gives what ``response_scan`` gives of the whole frame.

    A short part (a partition header split between reads) is held until the rest comes;
    bytes that cannot be a Fetch response of ``size`` bytes raise ``Unexpected``.
    """

    __slots__ = ("_bytes", "_codes", "_count", "_ids", "_indexes", "_key", "_left", "_out",
                 "_partitions", "_records", "_topics", "head", "tags_at", "uncounted")

    def __init__(self, version: int, size: int, count: bool = False) -> None:
        if version < FIRST_VERSION:
            raise ValueError(f"Fetch v{version} is not flexible")
        super().__init__(size, self._head)
        self._ids = version >= TOPIC_IDS_SINCE
        self._count = count
        self._topics = 0  # topics left, then partitions left in the current one
        self._partitions = 0
        self.tags_at: int | None = None
        self.head = b""
        # What ``count`` reads: the codes, the current topic's key, partitions, records
        # and bytes, the records field's bytes not yet walked, the topics done.
        self._codes: dict[int, int] = {}
        self._key: str | bytes = b""
        self._indexes: list[int] = []
        self._records = self._bytes = self._left = 0
        self._out: TopicCounts = []
        # A records field or topic name ``response_scan`` would not take: no scan then.
        self.uncounted = False

    def feed(self, data: Buffer) -> int:
        """``StepWalk.feed``: in a records field (``count``), its batches' headers read in
        C where it is built (``records.batch_step`` over as many as ``data`` holds), any
        other part in Python."""
        if not self._left or self._held or _C_BATCHES is None:
            return StepWalk.feed(self, data)
        taken: int
        taken, records, size, self._left, self.opaque = _C_BATCHES(data, self._left,
                                                                   self.opaque)
        self._at += taken
        self._counted(records, size)
        if taken < len(data):
            taken += StepWalk.feed(self, memoryview(data)[taken:])
        return taken

    def batches_walked(self, walked: int, records: int, size: int, left: int) -> None:
        """Whole v2 batches of the current records field (``count``) went by, ``walked``
        bytes holding ``records`` records, their headers read by the caller (the proxy's
        peek loop in C, which reads them where they lie in a socket): as if their headers
        had been fed and the rest skipped, ``left`` bytes of the field to go."""
        if self.opaque or self._held or not 0 < walked <= self._left or left != self._left - walked:
            raise ValueError(f"{walked} bytes of batches walked, {self._left} of the field left")
        self._at += walked
        self._left = left
        self._counted(records, size)

    def scan(self, tail: Buffer) -> ResponseScan | None:
        """With ``count``, once the walk reached the tag section (``tail``, the frame's
        last bytes): what ``response_scan`` says of the whole frame; None where it says
        None (or without ``count``)."""
        if not (self._count and self.finished) or self.uncounted:
            return None
        try:
            return self._codes, last_tags(memoryview(tail), 0), self._out
        except (Unexpected, IndexError):
            return None

    # Each step reads one part from the start of ``view`` and returns its length, or
    # raises IndexError/struct.error when ``view`` ends inside it.

    def _head(self, view: memoryview) -> int:
        pos = skip_tags_whole(view, 4)  # CorrelationId, header tags
        pos += 4 + 2 + 4  # ThrottleTimeMs, ErrorCode, SessionId
        n, end = _count(view, pos)
        self.head = bytes(view[:pos])
        if self._count:
            self._codes[_I16.unpack_from(view, pos - 6)[0]] = 1
        self._topics = n
        self._step = self._topic if n else self._top
        return end

    def _topic(self, view: memoryview) -> int:
        start = 0  # the name's or id's first byte
        if self._ids:
            pos = 16
        else:
            n, start = uvarint(view, 0)
            if n < 1:
                raise Unexpected  # a null topic name: not in a broker's answer
            pos = start + n - 1
        n, end = _count(view, pos)
        if self._count:
            try:
                self._key = bytes(view[start:pos]) if self._ids else str(view[start:pos], "utf-8")
            except UnicodeDecodeError:
                self.uncounted = True
            self._indexes = []
            self._records = self._bytes = 0
        self._partitions = n
        self._step = self._partition if n else self._topic_end
        return end

    def _partition(self, view: memoryview) -> int:
        pos = _PARTITION_FIXED
        n, pos = uvarint(view, pos)  # AbortedTransactions, nullable
        for _ in range(n - 1):
            pos = skip_tags_whole(view, pos + _ABORTED_TRANSACTION)
        pos += 4  # PreferredReadReplica
        n, pos = uvarint(view, pos)  # Records, nullable
        if pos > len(view):
            raise IndexError
        n = max(n - 1, 0)
        self._step = self._partition_end
        if self._count:
            index, code = _INDEX_CODE.unpack_from(view, 0)
            codes = self._codes
            codes[code] = codes.get(code, 0) + 1
            self._indexes.append(index)
            if n:
                if self._at + pos + n > self._size:
                    raise Unexpected  # records past the frame's end
                self._left = n
                self._step = self._batch
                return pos
        self.opaque = n
        return pos

    def _batch(self, view: memoryview) -> int:
        """With ``count``: the next batch's header of a records field (the rest of the
        batch is ``opaque``), or the rest of the field (``records.batch_step``)."""
        left = self._left
        try:
            pos, records, size, self.opaque, self._left = batch_step(view, 0, left)
        except Uncounted:
            # Not a records field response_scan counts: the rest of it goes by unread.
            self.uncounted = True
            pos = min(len(view), left)
            self.opaque, self._left = left - pos, 0
            records = size = 0
        self._counted(records, size)
        return pos

    def _counted(self, records: int, size: int) -> None:
        """Batches of the current records field read (by ``_batch`` or in C): their
        records and bytes added; the partition's end next once the field's are all read."""
        self._records += records
        self._bytes += size
        if not self._left:
            self._step = self._partition_end

    def _partition_end(self, view: memoryview) -> int:
        pos = skip_tags_whole(view, 0)  # DivergingEpoch, CurrentLeader, SnapshotId
        self._partitions -= 1
        self._step = self._partition if self._partitions else self._topic_end
        return pos

    def _topic_end(self, view: memoryview) -> int:
        pos = skip_tags_whole(view, 0)
        self._topics -= 1
        if self._count:
            self._out.append((self._key, self._indexes, self._records, self._bytes))
        self._step = self._topic if self._topics else self._top
        return pos

    def _top(self, view: memoryview) -> int:
        self.tags_at = self._at
        self.finished = True
        return 0


def _count(view: memoryview, pos: int) -> tuple[int, int]:
    """A compact array's length (not null: a broker's answers have none here)."""
    n, pos = uvarint(view, pos)
    if n < 1:
        raise Unexpected
    return n - 1, pos
