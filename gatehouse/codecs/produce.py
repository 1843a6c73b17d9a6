"""Produce requests and responses read straight from their bytes: the hot path of the
metrics and of the observation log.

Every Produce request carries records and every response carries error codes.  Decoding
either into objects costs more than the proxy's own work per request, and the counters
and the log need only per topic (partitions, records, bytes) and per code counts.  These readers walk the frame
for exactly that, check that they consumed it exactly, and return None on anything
unexpected: the caller then falls back to the full decoder, which reports the error.

Layouts (Produce v3-v13; flexible from v9): Kafka's ProduceRequest.json and
ProduceResponse.json.  tests/test_metrics_produce.py holds them to the full decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Any, Final

from gatehouse.codecs._native import speedups
from gatehouse.codecs._scan import I16 as _I16
from gatehouse.codecs._scan import I32 as _I32
from gatehouse.codecs._scan import StepWalk, last_tags, request_body_at, skip_tags_whole
from gatehouse.codecs._scan import TopicCounts as TopicCounts  # re-exported
from gatehouse.codecs._scan import Unexpected as _Unexpected
from gatehouse.codecs._scan import array as _array
from gatehouse.codecs._scan import skip_string as _skip_string
from gatehouse.codecs._scan import skip_tags as _skip_tags
from gatehouse.codecs._scan import uvarint as _uvarint
from gatehouse.codecs.primitives import Buffer, uvarint_bytes
from gatehouse.codecs.records import (
    BATCH_OVERHEAD,
    LOG_OVERHEAD,
    V2_HEAD,
    batch_step,
    count_records,
    records_and_bytes,
)

_INDEX_AND_VARINT: Final = struct.Struct(">iBBB")
_INDEX_AND_LENGTH: Final = struct.Struct(">ii")
Unexpected = _Unexpected  # what a RequestWalk raises, re-exported
_READ_KEY: Final = "produce.request_topics"  # in Message.read_once's memory
TOPICS_READ_KEY: Final = _READ_KEY  # where the metrics' C counting finds it too
# A partition of a non-flexible version with the length, magic and record count of its
# first batch (where a partition is one batch, all of it), in one unpack.
_PLAIN_PARTITION: Final = struct.Struct(">ii8xi4xb40xi")
# A partition of a flexible version whose records' length is a three-byte varint, with
# its first batch's length, magic and record count, in one unpack.
_FLEXIBLE_PARTITION: Final = struct.Struct(">iBBB8xi4xb40xi")
FLEXIBLE_SINCE: Final = 9
TOPIC_IDS_SINCE: Final = 13
# The first version the byte readers read: v0-2 (3.x brokers, KIP-896) have no
# transactional id and go through the decoder.
FIRST_VERSION: Final = 3
# The bytes after the last records of a flexible request when its last partition's, last
# topic's and own tag sections are empty: one count of 0 each.  Three bytes cannot hold
# any tagged field (a count other than 0 needs a tag and a size after it), so a frame
# whose last records end three bytes before it does ends in those or is not well-formed
# (the broker's to refuse): the readers here take them as read, unlooked-at, which lets a
# walk end at the last batch's header and a proxy pass the rest on without peeking at it.
EMPTY_TAIL: Final = 3
# The same readers in C (gatehouse/codecs/_speedups.c), where built.
_C_REQUEST_TOPICS: Final = None if speedups is None else speedups.produce_request_topics
_C_RESPONSE_SCAN: Final = None if speedups is None else speedups.produce_response_scan
_C_WALK_FEED: Final = None if speedups is None else speedups.produce_walk_feed


def partitions_total(partitions: Iterable[Any]) -> tuple[int, int]:
    """(records, bytes) over the ``records`` fields of a topic's decoded partitions."""
    records_total = bytes_total = 0
    for partition in partitions:
        counted, size = records_and_bytes(partition.records)
        records_total += counted
        bytes_total += size
    return records_total, bytes_total


def request_topics_of(req: Any) -> TopicCounts | None:
    """``request_topics`` of a decoded Produce request's frame, read once for all who ask
    (the metrics and the observation log)."""
    # Message.read_once, inlined: this runs for every Produce request.
    found: dict[str, Any] | None = getattr(req, "_read", None)
    if found is None:
        found = req._read = {}
    elif _READ_KEY in found:
        return found[_READ_KEY]  # type: ignore[no-any-return]
    frame = req.frame
    topics = found[_READ_KEY] = (None if frame is None
                                 else request_topics(frame, req.api_version))
    return topics


def request_topics(frame: Buffer, version: int, spans: list[tuple[int, int]] | None = None,
                   count: bool = True) -> TopicCounts | None:
    """Per topic: (name, or the 16 topic id bytes from v13; partition indexes; records;
    record bytes).  ``spans`` gets where each name is, its length prefix included;
    without ``count`` the records are skipped, not counted (0 records, 0 bytes).  The
    three bytes that end a flexible frame right after its last records are its empty
    tag sections, not read (EMPTY_TAIL)."""
    if version < FIRST_VERSION:
        return None
    if _C_REQUEST_TOPICS is not None:
        found = _C_REQUEST_TOPICS(frame, version >= FLEXIBLE_SINCE, version >= TOPIC_IDS_SINCE,
                                  count, spans)
        if found is not NotImplemented:
            return found  # type: ignore[no-any-return]
    return _request_topics(frame, version, spans, count)


def _request_topics(frame: Buffer, version: int, spans: list[tuple[int, int]] | None,
                    count: bool) -> TopicCounts | None:
    """``request_topics`` in Python (where the C reader is not built, and the reference
    it is held to)."""
    view = frame if type(frame) is memoryview else memoryview(frame)
    flexible = version >= FLEXIBLE_SINCE
    ids = version >= TOPIC_IDS_SINCE
    # This runs for every Produce request the metrics or the log see: one-byte varints,
    # empty tag sections and one batch per partition (nearly all of them) are read inline,
    # and a partition's index, records length and first batch header in one or two unpacks.
    try:
        topics, pos = _topics_at(view, flexible)
        end = len(view)
        out: TopicCounts = []
        tail = False  # the last three bytes taken as read (EMPTY_TAIL)
        for t in range(topics):
            key: str | bytes
            if ids:
                key = bytes(view[pos:pos + 16])
                pos += 16
            else:
                start = pos
                key, pos = _topic_name(view, pos, flexible)
                if spans is not None:
                    spans.append((start, pos))
            if flexible and view[pos] < 0x80:
                partitions = view[pos] - 1
                pos += 1
                if partitions < 0:
                    raise _Unexpected
            else:
                partitions, pos = _array(view, pos, flexible)
            records = size = 0
            indexes = []
            last_topic = topics - t == 1
            for i in range(partitions):
                if flexible and pos + _FLEXIBLE_PARTITION.size <= end:
                    # The index, the records' length and the first batch's header at once,
                    # where the length is a three-byte varint (a batch of 16 KiB-2 MiB:
                    # what producers send); other lengths are read again below.
                    (index, n, b1, b2, length, magic,
                     counted) = _FLEXIBLE_PARTITION.unpack_from(view, pos)
                    if n >= 0x80 and b1 >= 0x80 and b2 < 0x80:
                        n = (n & 0x7F) | ((b1 & 0x7F) << 7) | (b2 << 14)
                        pos += 7
                        unread = False
                    else:
                        if n < 0x80:
                            pos += 5
                        elif b1 < 0x80:
                            n = (n & 0x7F) | (b1 << 7)
                            pos += 6
                        else:
                            n, pos = _uvarint(view, pos + 4)
                        unread = True
                    n -= 1
                elif flexible:
                    # The index and the first three bytes of the records' length at once
                    # (a partition is followed by at least three tag counts).
                    index, n, b1, b2 = _INDEX_AND_VARINT.unpack_from(view, pos)
                    if n < 0x80:
                        pos += 5
                    elif b1 < 0x80:
                        n = (n & 0x7F) | (b1 << 7)
                        pos += 6
                    elif b2 < 0x80:
                        n = (n & 0x7F) | ((b1 & 0x7F) << 7) | (b2 << 14)
                        pos += 7
                    else:
                        n, pos = _uvarint(view, pos + 4)
                    n -= 1
                    unread = True  # the first batch's header
                elif pos + _PLAIN_PARTITION.size <= end:
                    index, n, length, magic, counted = _PLAIN_PARTITION.unpack_from(view, pos)
                    pos += 8
                    unread = False
                else:  # too short for a batch: no records, or bytes the counter reports
                    index, n = _INDEX_AND_LENGTH.unpack_from(view, pos)
                    pos += 8
                    unread = True
                if n > 0:
                    if pos + n > end:
                        raise _Unexpected
                    if count:
                        if n >= BATCH_OVERHEAD:
                            if unread:
                                length, magic, counted = V2_HEAD.unpack_from(view, pos)
                            sized = n
                            if magic != 2 or length + LOG_OVERHEAD != n:  # not one v2 batch
                                counted, sized = count_records(view, pos, pos + n)
                        else:
                            counted, sized = count_records(view, pos, pos + n)
                        records += counted
                        size += sized
                    pos += n
                if flexible:
                    if pos + EMPTY_TAIL == end and last_topic and partitions - i == 1:
                        pos = end
                        tail = True
                    else:
                        pos = _skip_tags(view, pos) if view[pos] else pos + 1
                indexes.append(index)
            if flexible and not tail:
                pos = _skip_tags(view, pos) if view[pos] else pos + 1
            out.append((key, indexes, records, size))
        if flexible and not tail:
            pos = _skip_tags(view, pos) if view[pos] else pos + 1
        if pos != end:
            raise _Unexpected
        return out
    except (_Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None


def remember_request_topics(req: Any, topics: TopicCounts | None) -> None:
    """Gives ``request_topics_of(req)`` its answer, read elsewhere: from a ``RequestWalk``
    over a request whose records went by unread, whose ``req`` holds only its first bytes."""
    found: dict[str, Any] | None = getattr(req, "_read", None)
    if found is None:
        found = req._read = {}
    found[_READ_KEY] = topics


# Where a RequestWalk is: what the next part is.
_HEAD, _TOPIC, _PARTITION, _BATCH, _PARTITION_TAGS, _TOPIC_TAGS, _TOP = range(7)


class RequestWalk(StepWalk):
    """Follows a Produce request as its bytes come, reading each batch's header and none
    of its records: what lets a proxy pass a large request's records on socket to socket
    (splice(2)) and still count them for the metrics and the log.

    Fed from the api key on (see ``StepWalk``); ``opaque`` bytes (the rest of a batch
    after its header) may go by unread.  ``topics()`` is then what ``request_topics``
    says of the whole frame: the same counts, or None where it gives None (a records
    field it does not count, a frame that does not end where its parts do); bytes that
    cannot be a Produce request raise ``Unexpected`` as they come.
    """

    __slots__ = ("_bytes", "_flexible", "_ids", "_indexes", "_key", "_left", "_out",
                 "_partitions", "_records", "_state", "_topics")

    def __init__(self, version: int, size: int) -> None:
        if version < FIRST_VERSION:
            raise ValueError(f"Produce v{version} is not walked")
        super().__init__(size, self._parts)
        self._flexible = version >= FLEXIBLE_SINCE
        self._ids = version >= TOPIC_IDS_SINCE
        self._state = _HEAD
        self._topics = 0  # topics left
        self._partitions = 0  # partitions left in the current topic
        self._left = 0  # bytes of the current records field not yet counted
        self._key: str | bytes = ""
        self._indexes: list[int] = []
        self._records = self._bytes = 0
        self._out: TopicCounts = []

    def feed(self, data: Buffer) -> int:
        """``StepWalk.feed``: the usual parts (the head, topic keys, partitions of one v2
        batch, empty tag sections) read in C where it is built, any other in Python."""
        if _C_WALK_FEED is None:
            return StepWalk.feed(self, data)
        taken: int = _C_WALK_FEED(self, data)
        if taken < len(data) and (self.opaque or not self.finished):
            taken += StepWalk.feed(self, memoryview(data)[taken:])
        return taken

    def topics(self) -> TopicCounts | None:
        """Per topic, as ``request_topics``: once every part of the frame but the records
        of its last batch has been walked (they end it)."""
        if self.finished and self._at + self.opaque == self._size:
            return self._out
        return None

    def _parts(self, view: memoryview) -> int:
        """The step: as many whole parts from the start of ``view`` as it holds, up to
        records or the frame's end; their length.  Each part changes the walk only once
        it is all there (IndexError/struct.error when the first is not)."""
        flexible = self._flexible
        pos = 0  # the end of the last whole part
        try:
            while not (self.opaque or self.finished):
                state = self._state
                if state == _PARTITION and self._one_batch(view, pos):
                    pos += (_FLEXIBLE_PARTITION if flexible else _PLAIN_PARTITION).size
                elif state == _PARTITION_TAGS and view[pos] == 0:  # no tagged fields
                    pos += 1
                    self._partition_done()
                elif state == _PARTITION:
                    (index,) = _I32.unpack_from(view, pos)
                    if flexible:
                        n, end = _uvarint(view, pos + 4)
                        n -= 1
                    else:
                        (n,) = _I32.unpack_from(view, pos + 4)
                        end = pos + 8
                    if n > 0 and self._at + end + n > self._size:
                        raise _Unexpected  # records past the frame's end
                    self._indexes.append(index)
                    if n > 0:
                        self._left = n
                        self._state = _BATCH
                    else:
                        self._records_done(self._at + end)
                    pos = end
                elif state == _BATCH:
                    pos = self._batch(view, pos)
                elif state in (_PARTITION_TAGS, _TOPIC_TAGS, _TOP):
                    pos = skip_tags_whole(view, pos)
                    if state == _PARTITION_TAGS:
                        self._partition_done()
                    elif state == _TOPIC_TAGS:
                        self._next_topic()
                    else:
                        self.finished = True
                elif state == _TOPIC:
                    pos = self._topic(view, pos)
                else:
                    pos = self._head(view)
        except (IndexError, struct.error):
            if not pos:
                raise  # short: held until the rest comes
        return pos

    def _one_batch(self, view: memoryview, pos: int) -> bool:
        """A partition whose records are one v2 batch (what clients send), its index,
        records length (a three-byte varint in flexible versions: 16 KiB-2 MiB) and
        batch header read in one unpack, as ``request_topics`` reads them; False (the
        walk reads it part by part) for any other, or when its header is not all here."""
        flexible = self._flexible
        layout = _FLEXIBLE_PARTITION if flexible else _PLAIN_PARTITION
        if pos + layout.size > len(view):
            return False
        if flexible:
            index, n, b1, b2, length, magic, counted = layout.unpack_from(view, pos)
            if n < 0x80 or b1 < 0x80 or b2 >= 0x80:
                return False
            n = ((n & 0x7F) | ((b1 & 0x7F) << 7) | (b2 << 14)) - 1
            end = pos + 7
        else:
            index, n, length, magic, counted = layout.unpack_from(view, pos)
            end = pos + 8
        if magic != 2 or length + LOG_OVERHEAD != n or self._at + end + n > self._size:
            return False
        self._indexes.append(index)
        self._records += counted
        self._bytes += n
        self.opaque = n - BATCH_OVERHEAD
        self._records_done(self._at + end + n)
        return True

    def _head(self, view: memoryview) -> int:
        flexible = self._flexible
        pos = request_body_at(view, flexible)
        pos = _skip_string(view, pos, flexible) + 6  # TransactionalId, Acks, TimeoutMs
        n, pos = _array(view, pos, flexible)
        self._topics = n
        if n:
            self._state = _TOPIC
        else:
            self._topics_done()
        return pos

    def _topic(self, view: memoryview, pos: int) -> int:
        key: str | bytes
        if self._ids:
            end = pos + 16
            if len(view) < end:
                raise IndexError
            key = bytes(view[pos:end])
        else:
            try:
                key, end = _topic_name(view, pos, self._flexible)
            except UnicodeDecodeError:
                raise _Unexpected from None
        n, end = _array(view, end, self._flexible)
        self._key = key
        self._partitions = n
        self._indexes = []
        self._records = self._bytes = 0
        if n:
            self._state = _PARTITION
        else:
            self._topic_done()
        return end

    def _batch(self, view: memoryview, pos: int) -> int:
        """The next batch's header (its records go by as ``opaque``) or, where the rest of
        the records field is not a v2 batch, all of it (``records.batch_step``)."""
        pos, records, size, self.opaque, self._left = batch_step(view, pos, self._left)
        self._records += records
        self._bytes += size
        if not self._left:
            self._records_done(self._at + pos + self.opaque)
        return pos

    def _records_done(self, end: int) -> None:
        """A partition's records field walked (``end``: where it ends in the frame).
        Where the frame's last three bytes follow the last one, the walk ends here, those
        bytes skipped with the records (EMPTY_TAIL), as ``request_topics`` does."""
        self._left = 0
        if not self._flexible:
            self._partition_done()
        elif (self._partitions == 1 and self._topics == 1
                and end + EMPTY_TAIL == self._size):
            self.opaque += EMPTY_TAIL
            self._partition_done()
            self._next_topic()
            self.finished = True
        else:
            self._state = _PARTITION_TAGS

    def _partition_done(self) -> None:
        self._partitions -= 1
        if self._partitions:
            self._state = _PARTITION
        else:
            self._topic_done()

    def _topic_done(self) -> None:
        self._out.append((self._key, self._indexes, self._records, self._bytes))
        if self._flexible:
            self._state = _TOPIC_TAGS
        else:
            self._next_topic()

    def _next_topic(self) -> None:
        self._topics -= 1
        if self._topics:
            self._state = _TOPIC
        else:
            self._topics_done()

    def _topics_done(self) -> None:
        if self._flexible:
            self._state = _TOP
        else:
            self.finished = True


def _topics_at(view: memoryview, flexible: bool) -> tuple[int, int]:
    """A Produce request's number of topics and where the first begins (the frame from
    its api key on; v3+)."""
    pos = request_body_at(view, flexible)
    if flexible and view[pos] == 0:
        pos += 1  # a null TransactionalId: the usual case
    else:
        pos = _skip_string(view, pos, flexible)  # TransactionalId
    pos += 6  # Acks, TimeoutMs
    if flexible and (topics := view[pos] - 1) >= 0 and topics < 0x7F:
        return topics, pos + 1
    return _array(view, pos, flexible)


def _topic_name(view: memoryview, pos: int, flexible: bool) -> tuple[str, int]:
    """The topic name at ``pos`` (not null) and where it ends; IndexError when ``view``
    ends inside it (a walk then waits for more)."""
    if flexible:
        n = view[pos]
        if n < 0x80:
            pos += 1
        else:
            n, pos = _uvarint(view, pos)
        n -= 1
    else:
        (n,) = _I16.unpack_from(view, pos)
        pos += 2
    if n < 0:
        raise _Unexpected
    if pos + n > len(view):
        raise IndexError
    return str(view[pos:pos + n], "utf-8"), pos + n


# Error code -> how often; the numbers of the top-level tagged fields (v9+: NodeEndpoints
# is tag 0, and only a broker that moved leaders sends it); whether any partition has
# an error message or record errors (text a topic rename may have to rewrite).
ResponseScan = tuple[dict[int, int], tuple[int, ...], bool]


def response_scan(frame: Buffer, version: int,
                  names: list[tuple[int, int, str]] | None = None) -> ResponseScan | None:
    """The error codes of a Produce response, the tags of its top-level tagged fields and
    whether it holds error text, read from its bytes (``frame`` from the correlation id
    on).  ``names`` gets each topic name before v13 and where it is (length included)."""
    if version < FIRST_VERSION:
        return None
    if _C_RESPONSE_SCAN is not None:
        found = _C_RESPONSE_SCAN(frame, version, names)
        if found is not NotImplemented:
            return found  # type: ignore[no-any-return]
    return _response_scan(frame, version, names)


def _response_scan(frame: Buffer, version: int,
                   names: list[tuple[int, int, str]] | None) -> ResponseScan | None:
    """``response_scan`` in Python (see ``_request_topics``)."""
    view = memoryview(frame)
    flexible = version >= FLEXIBLE_SINCE
    try:
        # CorrelationId (, the header's tags: nearly always none)
        pos = (_skip_tags(view, 4) if view[4] else 5) if flexible else 4
        topics, pos = _array(view, pos, flexible)
        codes: dict[int, int] = {}
        messages = False
        fixed = 4 + 2 + 8 + 8 + (8 if version >= 5 else 0)  # Index .. LogStartOffset
        for _ in range(topics):
            if version >= TOPIC_IDS_SINCE:
                pos += 16
            elif names is None:
                pos = _skip_string(view, pos, flexible)
            else:
                start = pos
                name, pos = _topic_name(view, pos, flexible)
                names.append((start, pos, name))
            partitions, pos = _array(view, pos, flexible)
            for _ in range(partitions):
                (code,) = _I16.unpack_from(view, pos + 4)
                codes[code] = codes.get(code, 0) + 1
                pos += fixed
                if flexible and view[pos] == 1 and view[pos + 1] == 0:
                    pos += 2  # no RecordErrors, a null ErrorMessage: the usual case
                elif version >= 8:
                    errors, pos = _array(view, pos, flexible)  # RecordErrors
                    for _ in range(errors):
                        pos = _skip_string(view, pos + 4, flexible)
                        if flexible:
                            pos = _skip_tags(view, pos)
                    null = view[pos] == 0 if flexible else _I16.unpack_from(view, pos)[0] < 0
                    messages = messages or errors > 0 or not null
                    pos = _skip_string(view, pos, flexible)  # ErrorMessage
                if flexible:
                    pos = _skip_tags(view, pos) if view[pos] else pos + 1
            if flexible:
                pos = _skip_tags(view, pos) if view[pos] else pos + 1
        pos += 4  # ThrottleTimeMs
        if flexible:
            return codes, last_tags(view, pos), messages
        if pos != len(view):
            raise _Unexpected
        return codes, (), messages
    except (_Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None


# -- topic names changed in the bytes (topic renames and prefixes) ------------------------


def rename_request_topics(frame: Buffer, version: int, rename: Callable[[str], str],
                          rename_transaction: Callable[[str], str] | None = None
                          ) -> Buffer | None:
    """A Produce request frame with every topic name ``rename``d (and its transactional
    id, if any, ``rename_transaction``ed): the records and the rest are copied as they
    are, nothing decoded.  ``frame`` itself when no name changes; None when the bytes
    are not what the reader expects (the caller decodes instead), or name topics by id
    and there is no transactional id to rename."""
    if version < FIRST_VERSION:
        return None
    flexible = version >= FLEXIBLE_SINCE
    try:
        changes, _ = _transaction_change(memoryview(frame), version, rename_transaction)
    except (_Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None
    if version >= TOPIC_IDS_SINCE:
        return None if rename_transaction is None else _spliced(frame, changes, flexible)
    spans: list[tuple[int, int]] = []
    topics = request_topics(frame, version, spans, count=False)
    if topics is None:
        return None
    for (start, end), (name, *_) in zip(spans, topics, strict=True):
        new = rename(str(name))
        if new != name:
            changes.append((start, end, new))
    return _spliced(frame, changes, version >= FLEXIBLE_SINCE)


def rename_request_head(head: Buffer, version: int, rename: Callable[[str], str],
                        rename_transaction: Callable[[str], str] | None = None
                        ) -> tuple[bytes, int] | None:
    """The beginning of a Produce request that names one topic, with that name
    ``rename``d (and its transactional id, if any, ``rename_transaction``ed), read from
    ``head``: the request's first bytes (from its api key on), as many as have arrived.
    Returns the bytes that stand for ``head[:end]`` and ``end``; everything after goes on
    as it is, so the request can be sent on as it arrives.  A request naming topics by
    id (v13) has only its transactional id to rename, whatever its topics.  None when
    the request names more or fewer than one topic, or names them by id and there is
    no transactional id to rename, or what is to be renamed is not all in ``head``, or
    the bytes are not what the reader expects: the caller reads the whole request."""
    if version < FIRST_VERSION or (version >= TOPIC_IDS_SINCE and rename_transaction is None):
        return None
    view = memoryview(head)
    flexible = version >= FLEXIBLE_SINCE
    try:
        changes, end = _transaction_change(view, version, rename_transaction)
        if version < TOPIC_IDS_SINCE:
            topics, start = _topics_at(view, flexible)
            if topics != 1:
                return None
            name, end = _topic_name(view, start, flexible)
            new = rename(name)
            if new != name:
                changes.append((start, end, new))
    except (_Unexpected, struct.error, IndexError, UnicodeDecodeError):
        return None
    return bytes(_spliced(view[:end], changes, flexible)), end


def _transaction_change(view: memoryview, version: int,
                        rename: Callable[[str], str] | None
                        ) -> tuple[list[tuple[int, int, str]], int]:
    """The change (as ``_spliced`` takes them) of a Produce request's transactional id
    ``rename``d (none when it is null, unchanged or ``rename`` is None), and where the
    id ends."""
    flexible = version >= FLEXIBLE_SINCE
    pos = request_body_at(view, flexible)
    if flexible:
        length, start = _uvarint(view, pos)
        length -= 1
    else:
        (length,) = _I16.unpack_from(view, pos)
        start = pos + 2
    if length < 0:
        return [], start
    end = start + length
    if end > len(view):
        raise _Unexpected
    if rename is None:
        return [], end
    name = str(view[start:end], "utf-8")
    new = rename(name)
    return ([(pos, end, new)] if new != name else []), end


def request_head_topic_id(head: Buffer, version: int) -> bytes | None:
    """The 16 bytes of the one topic id a Produce request (v13+) names, read from
    ``head``: its first bytes (from its api key on), as many as have arrived.  None when
    it names more or fewer than one topic, or names them by name (before v13), or the id
    is not all in ``head``, or the bytes are not what the reader expects."""
    if version < TOPIC_IDS_SINCE:
        return None
    view = memoryview(head)
    try:
        topics, start = _topics_at(view, True)
    except (_Unexpected, struct.error, IndexError):
        return None
    if topics != 1 or start + 16 > len(view):
        return None
    return bytes(view[start:start + 16])


def rename_response_topics(frame: Buffer, version: int,
                           rename: Callable[[str], str | None]) -> Buffer | None:
    """A Produce response frame (from the correlation id on) with every topic name
    ``rename``d in its bytes; ``frame`` itself when no name changes (from v13, which
    names topics by id, whenever it holds no error text).  None when that cannot be done
    in the bytes: error text to map as well, a name ``rename`` hides (None), or bytes
    the reader does not expect."""
    names: list[tuple[int, int, str]] = []
    scan = response_scan(frame, version, names)
    if scan is None or scan[2]:
        return None
    changes = []
    for start, end, name in names:
        new = rename(name)
        if new is None:
            return None
        if new != name:
            changes.append((start, end, new))
    return _spliced(frame, changes, version >= FLEXIBLE_SINCE)


def _spliced(frame: Buffer, changes: list[tuple[int, int, str]], flexible: bool) -> Buffer:
    """``frame`` with the strings at each (start, end) replaced by new ones (one copy)."""
    if not changes:
        return frame
    view = memoryview(frame)
    parts: list[Buffer] = []
    last = 0
    for start, end, text in changes:
        data = text.encode()
        parts.append(view[last:start])
        parts.append(uvarint_bytes(len(data) + 1) if flexible else _I16.pack(len(data)))
        parts.append(data)
        last = end
    parts.append(view[last:])
    return b"".join(parts)
