"""Record encryption (``encrypt_records``): values sealed as the rule's clients produce
them, opened as its clients fetch them; the brokers store and replicate ciphertext.

Envelope encryption, as a KMS does it.  A data key (DEK, AES-256) seals record values
with AES-256-GCM; the DEK itself is sealed under a key-encryption key (KEK) from the
rule's key file, and that sealed DEK (EDEK) travels in every record it sealed, so a
record opens with nothing but the KEK it names: any proxy holding the key file reads
it, after restarts and in every worker.  A DEK seals at most ``DEK_USES`` values, far
below the 2^32 NIST SP 800-38D allows a key, each under a nonce of its own (a random
4-byte salt of the DEK and a count of its uses: never repeated), and is replaced after
``DEK_SECONDS``; opened DEKs are kept (at most ``OPENED_DEKS``).

A sealed record carries the header ``gatehouse.encryption`` (its last) and a value of

    version (1) | flags (1) | KEK name length (1) | KEK name | EDEK length (1) | EDEK
    | nonce (12) | ciphertext and GCM tag (16)

where everything before the nonce is the value's associated data (a changed flag, KEK
name or EDEK fails the tag), and flag ``ZSTD`` says the plaintext was compressed with
zstd first (when the producer compressed its batch: ciphertext does not compress, so
the batch a sealed record is written in is not compressed).  Keys, null values
(tombstones), other headers, offsets and timestamps are left as they were: compaction,
partitioning and the consumers' offsets work as before.

The batch work here is pure (bytes in, bytes out; the records rewritten by
``codecs.records.rewrite_values``, in C where built); decompression and compression are
the caller's (``Decompress``/``Compress``), as in ``rules.records``.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gatehouse.codecs import Request, Response
from gatehouse.codecs.records import (
    FastCall,
    LegacyMessage,
    RecordBatch,
    iter_batches,
    rebuilt_batch,
    records_section,
    rewrite_values,
)
from gatehouse.configfile import ConfigError, Source, line_of, load_yaml_file
from gatehouse.rules.errors import (
    CORRUPT_MESSAGE,
    UNKNOWN_TOPIC_ID,
    UNSUPPORTED_FOR_MESSAGE_FORMAT,
)
from gatehouse.rules.produce import UNSEEN_ID, IdNames, client_topic_names, in_scope, topic_key
from gatehouse.rules.records import PartitionKey, PartitionVerdict

HEADER: Final = "gatehouse.encryption"
_HEADER_BYTES: Final = HEADER.encode()
VERSION: Final = 1
_MARK: Final = bytes((VERSION,))  # the header's value
ZSTD: Final = 0x01  # flags: the plaintext was compressed with zstd
KEY_BYTES: Final = 32  # AES-256
_NONCE: Final = 12
_TAG: Final = 16
DEK_USES: Final = 1 << 24
DEK_SECONDS: Final = 3600.0
OPENED_DEKS: Final = 1024
_COMPRESS_FROM: Final = 64  # bytes: smaller values are sealed as they are

Decompress = Callable[[str, Any, int], bytes]
Compress = Callable[[bytes], bytes]


# -- keys -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyRing:
    """The KEKs of a key file: name -> 32 bytes.  ``repr`` never shows a key."""

    path: str
    keys: Mapping[str, bytes] = field(repr=False)


def load_key_ring(path: Path) -> KeyRing:
    """A key file: YAML ``keys: {name: base64 of 32 random bytes}`` (a Kubernetes
    Secret mounted as a file, say).  Mistakes raise ``ConfigError`` with file:line; the
    error never quotes a key."""
    source = Source(str(path))
    data = load_yaml_file(path)  # its errors name the problem, never quote the text
    if not isinstance(data, dict) or not isinstance(data.get("keys"), dict):
        raise source.error("a key file holds `keys: {name: base64 of 32 bytes}`",
                           line_of(data))
    raw = data["keys"]
    extra = sorted(str(k) for k in data if k != "keys")
    if extra:
        raise source.error(f"a key file holds only `keys` (not {', '.join(extra)})",
                           line_of(data, extra[0]))
    keys: dict[str, bytes] = {}
    for name, text in raw.items():
        line = line_of(raw, name)
        if not isinstance(name, str) or not name or len(name.encode()) > 255:
            raise source.error(f"key name {name!r}: a name of 1 to 255 bytes", line)
        try:
            key = base64.b64decode(str(text), validate=True)
        except (binascii.Error, ValueError):
            raise source.error(f"key {name!r} is not base64", line) from None
        if len(key) != KEY_BYTES:
            raise source.error(f"key {name!r} is {len(key)} bytes: an AES-256 key is "
                               f"{KEY_BYTES} (`head -c 32 /dev/urandom | base64`)", line)
        keys[name] = key
    if not keys:
        raise source.error("the key file has no keys", line_of(data, "keys"))
    return KeyRing(str(path), keys)


@dataclass(frozen=True)
class RecordEncryption:
    """``encrypt_records``: the topics (as the client names them) whose record values
    the rule's clients' Produce requests have sealed under KEK ``key``, and whose Fetch
    answers they get opened with any key of ``ring``."""

    topics: tuple[re.Pattern[str], ...] | None  # None: every topic
    key: str
    ring: KeyRing
    max_decompressed: int

    def applies_to(self, topic: str) -> bool:
        return in_scope(self.topics, topic)

    @property
    def kek(self) -> bytes:
        return self.ring.keys[self.key]


# -- sealing and opening values -----------------------------------------------------------


class Undecryptable(Exception):
    """A sealed value that does not open: its KEK is not in the key file, or the value
    was changed, or it is not an envelope of a version this proxy reads."""


@dataclass
class _Dek:
    aead: AESGCM
    prefix: bytes  # version, flags 0, KEK name, EDEK: the envelope up to the nonce
    salt: bytes  # a nonce's first 4 bytes; the other 8 count its uses (never repeated)
    uses: int
    expires: float


class RecordCipher:
    """Seals and opens record values; holds the DEKs (thread-safe: large requests are
    sealed in threads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._deks: dict[tuple[str, bytes], _Dek] = {}
        self._opened: OrderedDict[tuple[str, bytes], AESGCM] = OrderedDict()
        self.deks_made = 0

    def _reserve(self, name: str, kek: bytes, count: int) -> tuple[_Dek, int]:
        """A DEK of KEK ``name`` with ``count`` uses taken, and the first of them."""
        key = (name, kek)
        with self._lock:
            dek = self._deks.get(key)
            if dek is None or dek.uses + count > DEK_USES or self.clock() >= dek.expires:
                secret = AESGCM.generate_key(bit_length=256)
                raw_name = name.encode()
                nonce = os.urandom(_NONCE)
                edek = nonce + AESGCM(kek).encrypt(nonce, secret, _edek_aad(raw_name))
                prefix = (bytes((VERSION, 0, len(raw_name))) + raw_name
                          + bytes((len(edek),)) + edek)
                dek = self._deks[key] = _Dek(AESGCM(secret), prefix, os.urandom(4), 0,
                                             self.clock() + DEK_SECONDS)
                self.deks_made += 1
            first = dek.uses
            dek.uses += count
        return dek, first

    def sealer(self, name: str, kek: bytes, count: int, compress: Compress | None = None
               ) -> Callable[[bytes], bytes]:
        """What seals ``count`` values (a batch's) under one DEK of KEK ``name``, each
        compressed first with ``compress`` (zstd) when given and it saves bytes."""
        dek, used = self._reserve(name, kek, count)
        aead, prefix, salt = dek.aead, dek.prefix, dek.salt
        packed_prefix = prefix[:1] + bytes((ZSTD,)) + prefix[2:]
        last = used + count

        def seal(value: bytes) -> bytes:
            nonlocal used
            if used >= last:
                raise RuntimeError("a sealer sealed more values than it reserved")
            nonce = salt + used.to_bytes(8, "big")
            used += 1
            head = prefix
            if compress is not None and len(value) >= _COMPRESS_FROM:
                packed = compress(value)
                if len(packed) < len(value):
                    value, head = packed, packed_prefix
            return b"".join((head, nonce, aead.encrypt(nonce, value, head)))

        return seal

    def seal(self, value: bytes, name: str, kek: bytes, compress: Compress | None = None
             ) -> bytes:
        """One value sealed (``sealer`` for one)."""
        return self.sealer(name, kek, 1, compress)(value)

    def open(self, envelope: bytes, keys: Mapping[str, bytes],
             decompress: Decompress, limit: int) -> bytes:
        """The plaintext of a sealed value, opened with ``keys`` (KEK name -> key)."""
        return _Opener(self, keys, decompress, limit).open(envelope)

    def opener(self, keys: Mapping[str, bytes], decompress: Decompress, limit: int
               ) -> _Opener:
        """What opens values with ``keys`` (a batch's, one after another)."""
        return _Opener(self, keys, decompress, limit)

    def _opened_dek(self, name: str, kek: bytes, raw_name: bytes, edek: bytes) -> AESGCM:
        key = (name, edek)
        with self._lock:
            aead = self._opened.get(key)
            if aead is not None:
                self._opened.move_to_end(key)
                return aead
        if len(edek) < _NONCE + _TAG:
            raise Undecryptable("not an envelope: its EDEK is too short")
        try:
            secret = AESGCM(kek).decrypt(edek[:_NONCE], edek[_NONCE:], _edek_aad(raw_name))
        except InvalidTag:
            raise Undecryptable(f"its DEK does not open under KEK {name!r} (another key of "
                                "that name?)") from None
        aead = AESGCM(secret)
        with self._lock:
            self._opened[key] = aead
            while len(self._opened) > OPENED_DEKS:
                self._opened.popitem(last=False)
        return aead


class _Opener:
    """Opens values one after another, the last DEK at hand (a batch's values share
    one); as a function, gives None for a value that does not open, counted, with why
    the first did not."""

    def __init__(self, cipher: RecordCipher, keys: Mapping[str, bytes],
                 decompress: Decompress, limit: int) -> None:
        self.cipher = cipher
        self.keys = keys
        self.decompress = decompress
        self.limit = limit
        self.failed = 0
        self.reason: str | None = None
        self._last: tuple[bytes, bytes, AESGCM] | None = None  # (name, EDEK, its DEK)
        # The last uncompressed envelope's head (up to the nonce) and its DEK: the
        # values of a batch share them, and open with three slices and the AES.
        self._head = b"\xff"  # no envelope starts so
        self._aead: AESGCM | None = None

    def fast(self) -> FastCall | None:
        """``rewrite_values``' shortcut to the AES for values under the last envelope
        head (the batch before's: most batches share their DEK)."""
        if self._aead is None:
            return None
        return (self._head, _NONCE, self._aead.decrypt)

    def __call__(self, envelope: bytes) -> bytes | None:
        head = self._head
        if envelope.startswith(head):
            at = len(head)
            try:
                return self._aead.decrypt(  # type: ignore[union-attr]
                    envelope[at : at + _NONCE], envelope[at + _NONCE :], head)
            except InvalidTag:
                pass  # said by open, below
        try:
            return self.open(envelope)
        except Undecryptable as exc:
            self.failed += 1
            self.reason = self.reason or str(exc)
            return None

    def open(self, envelope: bytes) -> bytes:
        try:
            version, flags, name_length = envelope[0], envelope[1], envelope[2]
            at = 3 + name_length
            raw_name = envelope[3:at]
            edek_length = envelope[at]
            edek = envelope[at + 1 : at + 1 + edek_length]
            at += 1 + edek_length
        except IndexError:
            raise Undecryptable("not an envelope: too short") from None
        if version != VERSION:
            raise Undecryptable(f"envelope version {version}, not {VERSION}")
        if flags & ~ZSTD:
            raise Undecryptable(f"unknown envelope flags {flags:#x}")
        if len(edek) != edek_length or len(envelope) < at + _NONCE + _TAG:
            raise Undecryptable("not an envelope: too short")
        last = self._last
        if last is not None and last[0] == raw_name and last[1] == edek:
            aead = last[2]
        else:
            name = raw_name.decode(errors="replace")
            kek = self.keys.get(name)
            if kek is None:
                raise Undecryptable(f"KEK {name!r} is not in the key file")
            aead = self.cipher._opened_dek(name, kek, raw_name, bytes(edek))
            self._last = (raw_name, edek, aead)
        try:
            plain = aead.decrypt(envelope[at : at + _NONCE], envelope[at + _NONCE :],
                                 envelope[:at])
        except InvalidTag:
            raise Undecryptable("the value does not open under its DEK (changed?)") from None
        if not flags:
            self._head, self._aead = envelope[:at], aead
        if flags & ZSTD:
            try:
                plain = self.decompress("zstd", plain, self.limit)
            except Exception as exc:  # the decompressor's own errors, limit included
                raise Undecryptable(f"its zstd plaintext: {exc}") from None
        return plain


def _edek_aad(raw_name: bytes) -> bytes:
    return bytes((VERSION,)) + raw_name


# -- whole records fields -------------------------------------------------------------------


class Unsealable(Exception):
    """A Produce partition whose records cannot be sealed: ``code`` answers it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _section(records: Any, batch: RecordBatch, decompress: Decompress, limit: int) -> Any:
    section = records_section(records, batch)
    if batch.compression == "none":
        return section
    return decompress(batch.compression, section, limit)


def seal_records(records: Any, encryption: RecordEncryption, cipher: RecordCipher,
                 decompress: Decompress, compress: Compress) -> tuple[bytes, int]:
    """A Produce partition's records field with every non-null value sealed, and how
    many were; ``Unsealable`` for records it cannot read (legacy message sets, batches
    that do not parse or decompress)."""
    if records is None:
        return b"", 0
    out: list[bytes] = []
    sealed = 0
    name, kek, limit = encryption.key, encryption.kek, encryption.max_decompressed
    taken = 0
    try:
        for batch in iter_batches(records):
            if isinstance(batch, LegacyMessage):
                raise Unsealable(UNSUPPORTED_FOR_MESSAGE_FORMAT,
                                 "legacy (magic 0/1) records cannot be encrypted: the "
                                 "producer must send record batches v2")
            taken = batch.position + batch.size
            if batch.is_control:
                out.append(bytes(memoryview(records)[batch.position : taken]))
                continue
            seal = cipher.sealer(name, kek, batch.record_count,
                                 compress if batch.compression != "none" else None)
            section, count = rewrite_values(_section(records, batch, decompress, limit),
                                            batch.record_count, seal,
                                            add=(_HEADER_BYTES, _MARK))
            sealed += count
            out.append(rebuilt_batch(batch, section))
    except Unsealable:
        raise
    except Exception as exc:  # the codec's and the decompressor's errors
        raise Unsealable(CORRUPT_MESSAGE, f"records that cannot be read to encrypt them: "
                         f"{str(exc)[:200]}") from None
    if taken != len(records):
        raise Unsealable(CORRUPT_MESSAGE, "a partial record batch at the end of the records")
    return b"".join(out), sealed


@dataclass
class Opened:
    """What ``open_records`` did to a partition's records."""

    records: bytes | None  # None: unchanged
    opened: int = 0
    failed: int = 0
    reason: str | None = None  # why the first that failed did


Repack = tuple[str, Compress]  # a codec name, and its compressor


def open_records(records: Any, keys: Mapping[str, bytes], cipher: RecordCipher,
                 decompress: Decompress, limit: int, repack: Repack | None = None
                 ) -> Opened:
    """A Fetch partition's records field with every sealed value opened: batches with
    none kept as they came, a partial batch at the end kept too (the client drops it);
    a value that does not open is left sealed (its header kept) and counted.  A batch
    that came compressed (the broker recompresses what the proxy writes uncompressed,
    under a topic's ``compression.type``) goes out compressed with ``repack``, so that
    an answer does not outgrow what the client expects of one; the others as they
    were, uncompressed."""
    if not records:
        return Opened(None)
    view = memoryview(records)
    out: list[Any] = []
    result = Opened(None)
    opener = cipher.opener(keys, decompress, limit)
    changed_any = False
    taken = 0
    for batch in iter_batches(records):
        start, taken = batch.position, batch.position + batch.size
        whole = view[start:taken]
        if isinstance(batch, LegacyMessage) or batch.is_control:
            out.append(whole)
            continue
        section = bytes(_section(records, batch, decompress, limit))
        if _HEADER_BYTES not in section:  # cheap: no record of it can be sealed
            out.append(whole)
            continue
        section, opened = rewrite_values(section, batch.record_count, opener,
                                         strip=_HEADER_BYTES, fast=opener.fast())
        if not opened:  # none opened: the batch as it came
            out.append(whole)
            continue
        result.opened += opened
        if batch.compression != "none" and repack is not None:
            out.append(rebuilt_batch(batch, repack[1](section), repack[0]))
        else:
            out.append(rebuilt_batch(batch, section))
        changed_any = True
    result.failed, result.reason = opener.failed, opener.reason
    if not changed_any:
        return result
    out.append(view[taken:])  # a partial batch at the end, as the broker cut it
    result.records = b"".join(out)
    return result


# -- requests and answers -------------------------------------------------------------------

Encryptions = Sequence[tuple[str, RecordEncryption]]  # (rule, its encrypt_records), in order


def _covering(encryptions: Encryptions, name: str | None
              ) -> tuple[str, RecordEncryption] | None:
    """The first rule's encryption that holds topic ``name`` (None: a name not known,
    which only an encryption of every topic holds)."""
    for rule, encryption in encryptions:
        if encryption.topics is None or (name is not None and encryption.applies_to(name)):
            return rule, encryption
    return None


@dataclass
class SealedRequest:
    """``seal_request``'s work: the request with its values sealed, the partitions it
    refuses (not sealed: a broker must not get them in the clear), and how many records
    each (rule, topic as the client names it) had sealed."""

    request: Request
    refused: dict[PartitionKey, PartitionVerdict]
    sealed: dict[tuple[str, str], int]


def seal_request(req: Request, encryptions: Encryptions, id_names: IdNames,
                 cipher: RecordCipher, decompress: Decompress, compress: Compress
                 ) -> SealedRequest:
    """A Produce request with the values of the topics ``encryptions`` hold sealed.  A
    topic named by an id not learned yet, while some encryption holds some topics only,
    is refused UNKNOWN_TOPIC_ID (retriable: the client's next Metadata teaches it)."""
    refused: dict[PartitionKey, PartitionVerdict] = {}
    sealed: dict[tuple[str, str], int] = {}
    topics = []
    changed = False
    for topic, name in client_topic_names(req.body, id_names):
        key = topic_key(topic)
        covering = _covering(encryptions, name)
        if covering is None:
            if name is None:  # it may be a topic to encrypt: not sent in the clear
                for p in topic.partition_data:
                    refused[(key, p.index)] = PartitionVerdict(UNKNOWN_TOPIC_ID, UNSEEN_ID)
            topics.append(topic)
            continue
        rule, encryption = covering
        partitions = []
        for p in topic.partition_data:
            try:
                records, count = seal_records(p.records, encryption, cipher, decompress,
                                              compress)
            except Unsealable as exc:
                refused[(key, p.index)] = PartitionVerdict(
                    exc.code, f"{exc.message} (rule {rule}, encrypt_records)")
                partitions.append(p)
                continue
            partitions.append(p.replace(records=records))
            where = (rule, name or "unknown")
            sealed[where] = sealed.get(where, 0) + count
        topics.append(topic.replace(partition_data=tuple(partitions)))
        changed = True
    if changed:
        req = req.replace(body=req.body.replace(topic_data=tuple(topics)))
    return SealedRequest(req, refused, sealed)


_FETCH: Final = 1


def answer_may_hold(req: Request, encryptions: Encryptions, id_names: IdNames) -> bool:
    """Whether the answer to a Fetch (ShareFetch) request may hold records of a topic
    ``encryptions`` hold, so must be read to open them: one that names such a topic, or
    one whose id is not learned yet; and any in a fetch session past its first request
    (KIP-227: it names only what changed, and is answered for every topic of the
    session; share sessions likewise)."""
    body = req.body
    if req.api_key != _FETCH or body.session_epoch > 0:
        return True
    for topic in body.topics:
        name = topic.topic or None
        if name is None:
            name = id_names(topic.topic_id.bytes)
        if name is None or _covering(encryptions, name) is not None:
            return True
    return False


@dataclass
class OpenedAnswer:
    """``open_answer``'s work: the answer with its values opened, and per (rule, topic)
    how many records opened and how many did not (with why the first did not)."""

    response: Response
    opened: dict[tuple[str, str], int]
    failed: dict[tuple[str, str], tuple[int, str]]


def open_answer(resp: Response, encryptions: Encryptions, id_names: IdNames,
                cipher: RecordCipher, decompress: Decompress,
                to_client: Callable[[str], str | None] | None = None,
                repack: Repack | None = None) -> OpenedAnswer:
    """A broker's Fetch or ShareFetch answer with the sealed values of the topics
    ``encryptions`` hold opened (a topic whose id is not known yet: opened with every
    key of theirs).  ``to_client``: a topic's name as the client knows it (a rule's
    rename or prefix), from the broker's; ``id_names`` gives the client's already."""
    every_key: dict[str, bytes] = {}
    for _, encryption in reversed(encryptions):
        every_key.update(encryption.ring.keys)  # the first rule's key wins a name
    limit = max(e.max_decompressed for _, e in encryptions)
    opened: dict[tuple[str, str], int] = {}
    failed: dict[tuple[str, str], tuple[int, str]] = {}
    topics = []
    changed = False
    for topic in resp.body.responses:
        name = getattr(topic, "topic", None) or None
        if name is not None and to_client is not None:
            name = to_client(name)
        elif name is None:
            topic_id = getattr(topic, "topic_id", None)
            name = None if topic_id is None else id_names(topic_id.bytes)
        covering = _covering(encryptions, name)
        if covering is None and name is not None:
            topics.append(topic)
            continue
        rule, keys = ((covering[0], covering[1].ring.keys) if covering is not None
                      else (encryptions[0][0], every_key))
        where = (rule, name or "unknown")
        partitions = []
        topic_changed = False
        for p in topic.partitions:
            try:
                found = open_records(p.records, keys, cipher, decompress, limit, repack)
            except Exception as exc:  # records that do not read: the client's to judge
                count, reason = failed.get(where, (0, f"records that do not read: {exc}"))
                failed[where] = (count + 1, reason)  # a partition's records, as one
                partitions.append(p)
                continue
            if found.opened:
                opened[where] = opened.get(where, 0) + found.opened
            if found.failed:
                count, reason = failed.get(where, (0, found.reason or ""))
                failed[where] = (count + found.failed, reason)
            if found.records is None:
                partitions.append(p)
            else:
                partitions.append(p.replace(records=found.records))
                topic_changed = True
        if topic_changed:
            topics.append(topic.replace(partitions=tuple(partitions)))
            changed = True
        else:
            topics.append(topic)
    if changed:
        resp = resp.replace(body=resp.body.replace(responses=tuple(topics)))
    return OpenedAnswer(resp, opened, failed)


__all__ = [
    "HEADER",
    "ConfigError",
    "Encryptions",
    "KeyRing",
    "Opened",
    "OpenedAnswer",
    "RecordCipher",
    "RecordEncryption",
    "SealedRequest",
    "Undecryptable",
    "Unsealable",
    "load_key_ring",
    "open_answer",
    "open_records",
    "seal_records",
    "seal_request",
]
