"""Record encryption (``encrypt_records``): values sealed as the rule's clients produce
them, opened as its clients fetch them; the brokers store and replicate ciphertext.

Envelope encryption, as a KMS does it.  A data key (DEK, AES-256) seals record values
with AES-256-GCM; the DEK itself is sealed under a key-encryption key (KEK): one of the
rule's key file, or one held by a KMS that never lets it out (``Kek``; the KMS client
is the proxy's, ``gatehouse.proxy.kms``), and that sealed DEK (EDEK) travels in every
record it sealed, so a record opens with nothing but the KEK it names: any proxy
holding the key file (or allowed to use the KMS key) reads it, after restarts and in
every worker.  A KMS is asked only in threads: for a new DEK before a Produce request
is sealed (``RecordCipher.prepare``), for an EDEK not opened before when an answer is
opened.  A DEK seals at most ``DEK_USES`` values, far below the 2^32 NIST SP 800-38D
allows a key, each under a nonce of its own (a random 4-byte salt of the DEK and a
count of its uses: never repeated), and is replaced after ``DEK_SECONDS``; opened DEKs
are kept (at most ``OPENED_DEKS``).

A sealed record carries the header ``gatehouse.encryption`` (its last) and a value of

    version (1) | flags (1) | KEK name length (1) | KEK name | EDEK length (1, or 2
    with flag ``WIDE``) | EDEK | nonce (12) | ciphertext and GCM tag (16)

where everything before the nonce is the value's associated data (a changed flag, KEK
name or EDEK fails the tag), flag ``WIDE`` says the EDEK is longer than 255 bytes (a
KMS's may be), and flag ``ZSTD`` says the plaintext was compressed with zstd first
(when the producer compressed its batch: ciphertext does not compress, so the batch a
sealed record is written in is not compressed).  Keys, null values (tombstones), other
headers, offsets and timestamps are left as they were: compaction, partitioning and the
consumers' offsets work as before.

The batch work here is pure (bytes in, bytes out; the records rewritten by
``codecs.records.rewrite_values``, in C where built, their values sealed and opened
there by OpenSSL where ``_aead.c`` was built); decompression and compression are the
caller's (``Decompress``/``Compress``), as in ``rules.records``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gatehouse.codecs import Request, Response
from gatehouse.codecs.errors import ProtocolError
from gatehouse.codecs.primitives import read_varint, read_varlong
from gatehouse.codecs.records import (
    FastCall,
    LegacyMessage,
    RecordBatch,
    iter_batches,
    open_batches,
    rebuilt_batch_parts,
    records_and_bytes,
    records_section,
    rewrite_values,
    seal_batches,
    seals_batches,
)
from gatehouse.configfile import ConfigError, Source, line_of, load_yaml_file
from gatehouse.rules.errors import (
    CORRUPT_MESSAGE,
    POLICY_VIOLATION,
    REQUEST_TIMED_OUT,
    UNKNOWN_SERVER_ERROR,
    UNKNOWN_TOPIC_ID,
    UNSUPPORTED_FOR_MESSAGE_FORMAT,
)
from gatehouse.rules.produce import UNSEEN_ID, IdNames, client_topic_names, in_scope, topic_key
from gatehouse.rules.records import PartitionKey, PartitionVerdict

# AES-256-GCM opening in C with the system's OpenSSL (_aead.c, built where its headers
# are), unless GATEHOUSE_PURE_PYTHON is set; else cryptography's AESGCM, per value.
_gcm_opener: Callable[[bytes], object] | None = None
_gcm_sealer: Callable[[bytes, bytes, int, int], object] | None = None
if not os.environ.get("GATEHOUSE_PURE_PYTHON"):
    try:
        from gatehouse.rules._aead import gcm_opener as _gcm_opener
        from gatehouse.rules._aead import gcm_sealer as _gcm_sealer
    except ImportError:  # not built here
        _gcm_opener = _gcm_sealer = None

HEADER: Final = "gatehouse.encryption"
_HEADER_BYTES: Final = HEADER.encode()
VERSION: Final = 1
_MARK: Final = bytes((VERSION,))  # the header's value
ZSTD: Final = 0x01  # flags: the plaintext was compressed with zstd
WIDE: Final = 0x02  # flags: the EDEK's length takes two bytes
_FLAGS: Final = ZSTD | WIDE
TOPIC_PLACEHOLDER: Final = "{topic}"  # in a KMS key's name: the topic's (as the client's)
KEY_BYTES: Final = 32  # AES-256
_NONCE: Final = 12
_TAG: Final = 16
DEK_USES: Final = 1 << 24
DEK_SECONDS: Final = 3600.0
# A KMS's DEK is made again before it runs out (``RecordCipher.prepare``), so that
# requests sealed on the event loop never wait for the KMS.
_RENEW_SECONDS: Final = 300.0
_RENEW_USES: Final = DEK_USES // 4
# After a KMS failed, it is not asked again for this long (per KEK): while it is down,
# requests are answered at once (retriably) rather than each waiting out its timeout.
KMS_BACKOFF_SECONDS: Final = 2.0
OPENED_DEKS: Final = 1024
_COMPRESS_FROM: Final = 64  # bytes: smaller values are sealed as they are

Decompress = Callable[[str, Any, int], bytes]
Compress = Callable[[bytes], bytes]


# -- keys -------------------------------------------------------------------------------


class Kek(Protocol):
    """A key-encryption key, by the name envelopes give it: makes DEKs, opens EDEKs."""

    @property
    def name(self) -> str: ...

    @property
    def remote(self) -> bool:
        """Its work is a KMS's (network I/O): done only in threads."""
        ...

    def new_dek(self) -> tuple[bytes, bytes]:
        """A new DEK (32 bytes) and its EDEK; ``KmsUnavailable`` when it cannot."""
        ...

    def unwrap(self, edek: bytes) -> bytes:
        """The DEK an EDEK seals: ``Undecryptable`` when it does not open (changed,
        another key's), ``KmsUnavailable`` when the KMS cannot be asked."""
        ...


class KmsUnavailable(Exception):
    """A KMS could not be asked or refused to answer (down, slow, throttling, no
    permission on the key, the key disabled): nothing is sealed or opened with it, and
    the clients are answered with a retriable error meanwhile."""


class KmsNeeded(KmsUnavailable):
    """The KMS must be asked, and the caller may not wait for it (the event loop)."""


@dataclass(frozen=True)
class LocalKek:
    """A KEK of a key file."""

    name: str
    key: bytes = field(repr=False)

    @property
    def remote(self) -> bool:
        return False

    def new_dek(self) -> tuple[bytes, bytes]:
        secret = AESGCM.generate_key(bit_length=256)
        nonce = os.urandom(_NONCE)
        return secret, nonce + AESGCM(self.key).encrypt(nonce, secret,
                                                        _edek_aad(self.name.encode()))

    def unwrap(self, edek: bytes) -> bytes:
        if len(edek) < _NONCE + _TAG:
            raise Undecryptable("not an envelope: its EDEK is too short")
        try:
            return AESGCM(self.key).decrypt(edek[:_NONCE], edek[_NONCE:],
                                            _edek_aad(self.name.encode()))
        except InvalidTag:
            raise Undecryptable(f"its DEK does not open under KEK {self.name!r} (another "
                                "key of that name?)") from None


@dataclass(frozen=True)
class KmsSpec:
    """``encrypt_records.kms``: a KMS that holds the KEK, and the key new DEKs are
    made under.  Its envelopes name it ``<type>-kms:<key>``."""

    type: str  # "aws": AWS KMS (or its API); "vault": a Vault transit secrets engine
    # aws: a key id, ARN, alias name or alias ARN; vault: a transit key's name;
    # ``{topic}``: one key per topic
    key: str
    region: str | None = None  # aws; None: the AWS SDK's own (AWS_REGION, the profile...)
    endpoint: str | None = None  # aws: None, the region's; vault: its address (required)
    timeout: float = 5.0  # seconds a KMS call may take, retries included
    mount: str = "transit"  # vault: the transit engine's mount path
    token_file: str | None = None  # vault: a file holding the token; None: VAULT_TOKEN
    namespace: str | None = None  # vault: X-Vault-Namespace (Enterprise, HCP)
    ca_file: str | None = None  # vault: CA bundle for https (None: the system's)

    @property
    def prefix(self) -> str:
        return f"{self.type}-kms:"

    @property
    def kek_name(self) -> str:
        return self.prefix + self.key

    @property
    def per_topic(self) -> bool:
        """Each topic's values sealed under a key of its own (``{topic}`` in ``key``):
        the topic's records made unreadable by deleting its key alone."""
        return TOPIC_PLACEHOLDER in self.key

    def kek_name_for(self, topic: str) -> str:
        return self.prefix + self.key.replace(TOPIC_PLACEHOLDER, topic)


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
    key: str  # the KEK's name: a key of ``ring``, or ``kms``' (``KmsSpec.kek_name``)
    ring: KeyRing | None
    max_decompressed: int
    kms: KmsSpec | None = None

    def applies_to(self, topic: str) -> bool:
        return in_scope(self.topics, topic)


@dataclass(frozen=True)
class EncryptionKeys:
    """An encryption's KEKs: the one it seals under (or each topic's), and the one an
    envelope names."""

    sealing: Kek | None  # None: one per topic, or a key not in the key file
    find: Callable[[str], Kek | None]
    per_topic: Callable[[str], Kek] | None = None  # a topic's, where each has its own

    def sealing_for(self, topic: str | None) -> Kek | None:
        """The KEK a topic's values are sealed under (None: a topic whose name is not
        known, where each topic has its own)."""
        if self.per_topic is None:
            return self.sealing
        return None if topic is None else self.per_topic(topic)


def local_keys(encryption: RecordEncryption) -> EncryptionKeys:
    """The KEKs of an encryption's key file (a KMS's are the proxy's to add)."""
    keys = encryption.ring.keys if encryption.ring is not None else {}

    def find(name: str) -> Kek | None:
        key = keys.get(name)
        return None if key is None else LocalKek(name, key)

    return EncryptionKeys(find(encryption.key), find)


KeysOf = Callable[[RecordEncryption], EncryptionKeys]


# -- sealing and opening values -----------------------------------------------------------


class Undecryptable(Exception):
    """A sealed value that does not open: its KEK is not in the key file, or the value
    was changed, or it is not an envelope of a version this proxy reads."""


@dataclass
class _Dek:
    aead: AESGCM
    secret: bytes = field(repr=False)
    prefix: bytes  # version, flags (WIDE or 0), KEK name, EDEK: the envelope to the nonce
    salt: bytes  # a nonce's first 4 bytes; the other 8 count its uses (never repeated)
    uses: int
    expires: float


class RecordCipher:
    """Seals and opens record values; holds the DEKs (thread-safe: large requests are
    sealed in threads, and a KMS is asked in threads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._deks: dict[Kek, _Dek] = {}
        self._makers: dict[Kek, threading.Lock] = {}  # one DEK made at a time per KEK
        # (KEK, EDEK) -> its DEK, as an AESGCM and as the key itself: by the KEK itself,
        # not its name, so that a rule never opens what another's key of that name did.
        self._opened: OrderedDict[tuple[Kek, bytes], tuple[AESGCM, bytes]] = OrderedDict()
        self.deks_made = 0
        self.kms_calls = 0
        # KEK name -> when its KMS last failed, and why (``KMS_BACKOFF_SECONDS``).
        self.failures: dict[str, tuple[float, str]] = {}

    def _usable(self, dek: _Dek | None, count: int, margin: bool = False) -> bool:
        if dek is None:
            return False
        uses, seconds = (_RENEW_USES, _RENEW_SECONDS) if margin else (0, 0.0)
        return dek.uses + count + uses <= DEK_USES and self.clock() < dek.expires - seconds

    def ready(self, kek: Kek) -> bool:
        """Whether ``kek`` has a DEK that will not run out soon (``prepare``'s)."""
        with self._lock:
            return self._usable(self._deks.get(kek), 0, margin=True)

    def prepare(self, kek: Kek) -> None:
        """A DEK of ``kek`` made ahead, unless it has one that will not run out soon:
        asks a KMS (in a thread: it blocks); ``KmsUnavailable`` when it cannot."""
        with self._maker(kek):
            if not self.ready(kek):
                self._install(kek, *self._ask(kek, kek.new_dek))

    def _ask(self, kek: Kek, call: Callable[[], Any]) -> Any:
        """``call``, a request to ``kek``'s KMS, unless it failed in the last
        ``KMS_BACKOFF_SECONDS``; its failure kept, with why."""
        why = self._backoff(kek)
        if why is not None:
            raise KmsUnavailable(f"not asked again yet: {why}")
        try:
            result = call()
        except KmsUnavailable as exc:
            self.failed(kek, str(exc))
            raise
        self.failures.pop(kek.name, None)
        return result

    def backing_off(self, kek: Kek) -> bool:
        """Whether ``kek``'s KMS failed too recently to be asked again."""
        return self._backoff(kek) is not None

    def _backoff(self, kek: Kek) -> str | None:
        """Why ``kek``'s KMS is not to be asked again yet (None: it may be)."""
        failure = self.failures.get(kek.name)  # once: threads change it
        if kek.remote and failure is not None and self.clock() - failure[0] < KMS_BACKOFF_SECONDS:
            return failure[1]
        return None

    def failed(self, kek: Kek, why: str) -> None:
        """``kek``'s KMS failed (or took too long): not asked again for a while."""
        self.failures[kek.name] = (self.clock(), why)

    def _maker(self, kek: Kek) -> threading.Lock:
        with self._lock:
            lock = self._makers.get(kek)
            if lock is None:
                lock = self._makers[kek] = threading.Lock()
            return lock

    def _install(self, kek: Kek, secret: bytes, edek: bytes) -> None:
        raw_name = kek.name.encode()
        flags = WIDE if len(edek) > 255 else 0
        prefix = b"".join((bytes((VERSION, flags, len(raw_name))), raw_name,
                           len(edek).to_bytes(2 if flags else 1, "big"), edek))
        dek = _Dek(AESGCM(secret), secret, prefix, os.urandom(4), 0,
                   self.clock() + DEK_SECONDS)
        with self._lock:
            self._deks[kek] = dek
            self.deks_made += 1
            self.kms_calls += kek.remote
            self._keep_opened((kek, edek), (dek.aead, secret))  # what it seals opens

    def _reserve(self, kek: Kek, count: int, block: bool) -> tuple[_Dek, int]:
        """A DEK of ``kek`` with ``count`` uses taken, and the first of them; a new DEK
        is made when none can serve them, unless that means asking a KMS and the caller
        may not ``block`` (``KmsNeeded``)."""
        while True:
            with self._lock:
                dek = self._deks.get(kek)
                if self._usable(dek, count):
                    assert dek is not None
                    first = dek.uses
                    dek.uses += count
                    return dek, first
            if kek.remote and not block:
                failure = self.failures.get(kek.name)
                raise KmsNeeded(f"no data key of {kek.name} made yet"
                                + (f" ({failure[1]})" if failure else ""))
            with self._maker(kek):
                with self._lock:
                    dek = self._deks.get(kek)
                    if self._usable(dek, count):
                        continue  # another thread made one meanwhile
                if count > DEK_USES:
                    raise ValueError(f"{count} values under one data key")
                self._install(kek, *self._ask(kek, kek.new_dek))

    def sealer(self, kek: Kek, count: int, compress: Compress | None = None,
               block: bool = True) -> Callable[[bytes], bytes]:
        """What seals ``count`` values (a batch's) under one DEK of ``kek``, each
        compressed first with ``compress`` (zstd) when given and it saves bytes."""
        dek, used = self._reserve(kek, count, block)
        return self._sealer(dek, used, count, compress)

    def batch_sealer(self, kek: Kek, count: int, compress: Compress | None = None,
                     block: bool = True
                     ) -> tuple[Callable[[bytes], bytes], tuple[bytes, object] | None]:
        """``sealer``, and for ``rewrite_values`` in C the same sealing done there
        (``sealer``: head, capsule; None where not built, or values are compressed
        first), by the same DEK and nonces: one of the two is used."""
        dek, used = self._reserve(kek, count, block)
        in_c = None
        if compress is None and _gcm_sealer is not None:
            in_c = (dek.prefix, _gcm_sealer(dek.secret, dek.salt, used, count))
        return self._sealer(dek, used, count, compress), in_c

    def _sealer(self, dek: _Dek, used: int, count: int, compress: Compress | None
                ) -> Callable[[bytes], bytes]:
        aead, prefix, salt = dek.aead, dek.prefix, dek.salt
        packed_prefix = prefix[:1] + bytes((prefix[1] | ZSTD,)) + prefix[2:]
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

    def seal(self, value: bytes, kek: Kek, compress: Compress | None = None) -> bytes:
        """One value sealed (``sealer`` for one)."""
        return self.sealer(kek, 1, compress)(value)

    def open(self, envelope: bytes, find: Callable[[str], Kek | None],
             decompress: Decompress, limit: int) -> bytes:
        """The plaintext of a sealed value, opened with the KEK ``find`` gives for the
        name it holds."""
        return _Opener(self, find, decompress, limit).open(envelope)

    def opener(self, find: Callable[[str], Kek | None], decompress: Decompress, limit: int,
               block: bool = True) -> _Opener:
        """What opens values with the KEKs ``find`` gives (a batch's, one after
        another); not ``block``: an EDEK a KMS must open raises ``KmsNeeded``."""
        return _Opener(self, find, decompress, limit, block)

    def _opened_dek(self, kek: Kek, edek: bytes, block: bool) -> tuple[AESGCM, bytes]:
        key = (kek, edek)
        with self._lock:
            found = self._opened.get(key)
            if found is not None:
                self._opened.move_to_end(key)
                return found
        if kek.remote and not block:
            why = self._backoff(kek)
            if why is not None:  # not worth a thread
                raise KmsUnavailable(f"not asked again yet: {why}")
            raise KmsNeeded(f"a data key of {kek.name} not opened before")
        secret = self._ask(kek, lambda: kek.unwrap(edek))
        opened = (AESGCM(secret), secret)
        with self._lock:
            self.kms_calls += kek.remote
            self._keep_opened(key, opened)
        return opened

    def _keep_opened(self, key: tuple[Kek, bytes], opened: tuple[AESGCM, bytes]) -> None:
        self._opened[key] = opened
        while len(self._opened) > OPENED_DEKS:
            self._opened.popitem(last=False)


class _Opener:
    """Opens values one after another, the last DEK at hand (a batch's values share
    one); as a function, gives None for a value that does not open, counted, with why
    the first did not.  ``KmsUnavailable`` (and ``KmsNeeded``) go through: the values
    are not judged, they wait for the KMS."""

    def __init__(self, cipher: RecordCipher, find: Callable[[str], Kek | None],
                 decompress: Decompress, limit: int, block: bool = True) -> None:
        self.cipher = cipher
        self.find = find
        self.decompress = decompress
        self.limit = limit
        self.block = block
        self.failed = 0
        self.reason: str | None = None
        # (name, EDEK, its DEK as an AESGCM and as the key)
        self._last: tuple[bytes, bytes, tuple[AESGCM, bytes]] | None = None
        # The last uncompressed envelope's head (up to the nonce) and its DEK: the
        # values of a batch share them, and open with three slices and the AES.
        self._head = b"\xff"  # no envelope starts so
        self._aead: AESGCM | None = None
        self._secret = b""
        self._capsule: tuple[bytes, object] | None = None  # (key, its C opener)

    def fast(self) -> FastCall | None:
        """``rewrite_values``' shortcut to the AES for values under the last envelope
        head (the batch before's: most batches share their DEK), in C where built."""
        if self._aead is None:
            return None
        capsule = None
        if _gcm_opener is not None:
            if self._capsule is None or self._capsule[0] is not self._secret:
                self._capsule = (self._secret, _gcm_opener(self._secret))
            capsule = self._capsule[1]
        return (self._head, _NONCE, self._aead.decrypt, capsule)

    def learn(self, envelope: bytes | None) -> None:
        """The fast path's head taken from ``envelope`` (a batch's first value), if it
        opens; nothing counted: the batch's values are opened next."""
        if envelope:
            with contextlib.suppress(Undecryptable):
                self.open(envelope)

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
            if flags & WIDE:
                edek_length = int.from_bytes(envelope[at : at + 2], "big")
                at += 2
            else:
                edek_length = envelope[at]
                at += 1
            edek = envelope[at : at + edek_length]
            at += edek_length
        except IndexError:
            raise Undecryptable("not an envelope: too short") from None
        if version != VERSION:
            raise Undecryptable(f"envelope version {version}, not {VERSION}")
        if flags & ~_FLAGS:
            raise Undecryptable(f"unknown envelope flags {flags:#x}")
        if len(edek) != edek_length or len(envelope) < at + _NONCE + _TAG:
            raise Undecryptable("not an envelope: too short")
        last = self._last
        if last is not None and last[0] == raw_name and last[1] == edek:
            aead, secret = last[2]
        else:
            name = raw_name.decode(errors="replace")
            kek = self.find(name)
            if kek is None:
                raise Undecryptable(f"KEK {name!r} is not in the key file")
            aead, secret = found = self.cipher._opened_dek(kek, bytes(edek), self.block)
            self._last = (raw_name, edek, found)
        try:
            plain = aead.decrypt(envelope[at : at + _NONCE], envelope[at + _NONCE :],
                                 envelope[:at])
        except InvalidTag:
            raise Undecryptable("the value does not open under its DEK (changed?)") from None
        if flags & ZSTD:
            try:
                plain = self.decompress("zstd", plain, self.limit)
            except Exception as exc:  # the decompressor's own errors, limit included
                raise Undecryptable(f"its zstd plaintext: {exc}") from None
        else:
            self._head, self._aead, self._secret = envelope[:at], aead, secret
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


def _first_value(section: Any) -> bytes | None:
    """The value of the first record of a records section (None: null, or records that
    do not read, which ``rewrite_values`` then reports)."""
    try:
        _, at = read_varint(section, 0)  # the record's length
        at += 1  # attributes
        _, at = read_varlong(section, at)  # timestamp delta
        _, at = read_varint(section, at)  # offset delta
        length, at = read_varint(section, at)  # the key
        at += max(length, 0)
        length, at = read_varint(section, at)
    except ProtocolError:
        return None
    return bytes(section[at : at + length]) if length >= 0 else None


def _section(records: Any, batch: RecordBatch, decompress: Decompress, limit: int) -> Any:
    section = records_section(records, batch)
    if batch.compression == "none":
        return section
    return decompress(batch.compression, section, limit)


def seal_records(records: Any, encryption: RecordEncryption, cipher: RecordCipher,
                 decompress: Decompress, compress: Compress,
                 kek: Kek | None = None, block: bool = True) -> tuple[bytes | None, int]:
    """A Produce partition's records field with every non-null value sealed under
    ``kek`` (default: the key file's key the encryption names), and how many were;
    ``Unsealable`` for records it cannot read (legacy message sets, batches that do not
    parse or decompress), or when a KMS gives no DEK (REQUEST_TIMED_OUT: retriable;
    not ``block``: when it would have to be asked)."""
    if records is None:  # null stays null (the broker answers it as it would)
        return None, 0
    if kek is None:
        kek = local_keys(encryption).sealing
    if kek is None:
        raise Unsealable(REQUEST_TIMED_OUT, f"KEK {encryption.key!r} cannot be used")
    out: list[Any] = []
    sealed = 0
    limit = encryption.max_decompressed
    taken = 0
    try:
        # The usual case, whole uncompressed batches, sealed in C in one call under one
        # run of nonces reserved for all their records (those it leaves go unused).
        plain = sum(b.record_count for b in iter_batches(records)
                    if isinstance(b, RecordBatch) and not b.is_control
                    and b.compression == "none")
        run = (cipher.batch_sealer(kek, plain, None, block)[1]
               if 0 < plain <= DEK_USES and _gcm_sealer is not None and seals_batches()
               else None)
        handed_back = -1  # where seal_batches last stopped: that batch is taken here
        batches = iter_batches(records)
        while (batch := next(batches, None)) is not None:
            if isinstance(batch, LegacyMessage):
                raise Unsealable(UNSUPPORTED_FOR_MESSAGE_FORMAT,
                                 "legacy (magic 0/1) records cannot be encrypted: the "
                                 "producer must send record batches v2")
            taken = batch.position + batch.size
            if batch.is_control:
                out.append(bytes(memoryview(records)[batch.position : taken]))
                continue
            if run is not None and batch.position != handed_back:
                done = seal_batches(records, batch.position, run, (_HEADER_BYTES, _MARK))
                if done is not None and done[1] > batch.position:
                    sealed_bytes, taken, count = done
                    out.append(sealed_bytes)
                    sealed += count
                    handed_back = taken
                    batches = iter_batches(records, taken)
                    continue
            seal, in_c = cipher.batch_sealer(
                kek, batch.record_count, compress if batch.compression != "none" else None,
                block)
            section, count = rewrite_values(_section(records, batch, decompress, limit),
                                            batch.record_count, seal,
                                            add=(_HEADER_BYTES, _MARK), sealer=in_c)
            sealed += count
            out.extend(rebuilt_batch_parts(batch, section))
    except Unsealable:
        raise
    except KmsUnavailable as exc:
        raise Unsealable(REQUEST_TIMED_OUT, f"no data key from the KMS: {exc}") from None
    except Exception as exc:  # the codec's and the decompressor's errors
        raise Unsealable(CORRUPT_MESSAGE, f"records that cannot be read to encrypt them: "
                         f"{str(exc)[:200]}") from None
    if taken != len(records):
        raise Unsealable(CORRUPT_MESSAGE, "a partial record batch at the end of the records")
    # One part (the usual: every batch sealed in C): no copy to join it.
    return out[0] if len(out) == 1 and isinstance(out[0], bytes) else b"".join(out), sealed


@dataclass
class Opened:
    """What ``open_records`` did to a partition's records."""

    records: bytes | None  # None: unchanged
    opened: int = 0
    failed: int = 0
    reason: str | None = None  # why the first that failed did


Repack = tuple[str, Compress]  # a codec name, and its compressor


def open_records(records: Any, find: Callable[[str], Kek | None], cipher: RecordCipher,
                 decompress: Decompress, limit: int, repack: Repack | None = None,
                 block: bool = True) -> Opened:
    """A Fetch partition's records field with every sealed value opened: batches with
    none kept as they came, a partial batch at the end kept too (the client drops it);
    a value that does not open is left sealed (its header kept) and counted.  A batch
    that came compressed (the broker recompresses what the proxy writes uncompressed,
    under a topic's ``compression.type``) goes out compressed with ``repack``, so that
    an answer does not outgrow what the client expects of one; the others as they
    were, uncompressed.  ``KmsUnavailable`` when an EDEK needs a KMS that cannot be
    asked (not ``block``: ``KmsNeeded`` when it would have to be)."""
    if not records:
        return Opened(None)
    view = memoryview(records)
    out: list[Any] = []
    result = Opened(None)
    opener = cipher.opener(find, decompress, limit, block)
    changed_any = False
    taken = 0
    handed_back = -1  # where open_batches last stopped: that batch is taken here
    batches = iter_batches(records)
    while (batch := next(batches, None)) is not None:
        start, taken = batch.position, batch.position + batch.size
        whole = view[start:taken]
        if isinstance(batch, LegacyMessage) or batch.is_control:
            out.append(whole)
            continue
        fast = opener.fast()
        in_c = batch.compression == "none" and start != handed_back
        if in_c and fast is None:  # the data key learnt from the first value
            opener.learn(_first_value(records_section(records, batch)))
            fast = opener.fast()
        if in_c and fast is not None:
            # The usual case, batch after batch under the data key learnt: in C.
            done = open_batches(records, start, fast, _HEADER_BYTES)
            if done is not None and done[1] > start:
                opened_bytes, taken, count = done
                out.append(opened_bytes)
                result.opened += count
                changed_any = changed_any or count > 0
                handed_back = taken
                batches = iter_batches(records, taken)
                continue
        section = _section(records, batch, decompress, limit)
        if opener.fast() is None:
            opener.learn(_first_value(section))  # so that the whole batch takes it
        section, opened = rewrite_values(section, batch.record_count, opener,
                                         strip=_HEADER_BYTES, fast=opener.fast())
        if not opened:  # none opened: the batch as it came
            out.append(whole)
            continue
        result.opened += opened
        if batch.compression != "none" and repack is not None:
            out.extend(rebuilt_batch_parts(batch, repack[1](section), repack[0]))
        else:
            out.extend(rebuilt_batch_parts(batch, section))
        changed_any = True
    result.failed, result.reason = opener.failed, opener.reason
    if not changed_any:
        return result
    if taken < len(view):
        out.append(view[taken:])  # a partial batch at the end, as the broker cut it
    # One part (the usual: every batch opened in C): no copy to join it.
    result.records = out[0] if len(out) == 1 and isinstance(out[0], bytes) else b"".join(out)
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
    # Of those refused, how many records had no DEK from their KMS, per (rule, topic).
    kms_unavailable: dict[tuple[str, str], int] = field(default_factory=dict)


def seal_request(req: Request, encryptions: Encryptions, id_names: IdNames,
                 cipher: RecordCipher, decompress: Decompress, compress: Compress,
                 keys_of: KeysOf = local_keys, block: bool = True) -> SealedRequest:
    """A Produce request with the values of the topics ``encryptions`` hold sealed
    under their KEKs (``keys_of``).  A topic named by an id not learned yet, while some
    encryption holds some topics only, is refused UNKNOWN_TOPIC_ID (retriable: the
    client's next Metadata teaches it); partitions a KMS gives no DEK for (or, not
    ``block``, would have to be asked for) REQUEST_TIMED_OUT."""
    result = SealedRequest(req, {}, {})
    refused, sealed = result.refused, result.sealed
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
        kek = keys_of(encryption).sealing_for(name)
        refusal = None
        if kek is None and name is None:  # each topic has its own key: not known yet
            refusal = PartitionVerdict(UNKNOWN_TOPIC_ID, UNSEEN_ID)
        elif kek is not None and len(kek.name.encode()) > 255:
            refusal = PartitionVerdict(POLICY_VIOLATION, f"the key name {kek.name!r} is "
                                       f"longer than 255 bytes (rule {rule}, encrypt_records)")
        if refusal is not None:
            for p in topic.partition_data:
                refused[(key, p.index)] = refusal
            topics.append(topic)
            continue
        partitions = []
        for p in topic.partition_data:
            try:
                records, count = seal_records(p.records, encryption, cipher, decompress,
                                              compress, kek, block)
            except Unsealable as exc:
                refused[(key, p.index)] = PartitionVerdict(
                    exc.code, f"{exc.message} (rule {rule}, encrypt_records)")
                partitions.append(p)
                if exc.code == REQUEST_TIMED_OUT:
                    where = (rule, name or "unknown")
                    result.kms_unavailable[where] = (result.kms_unavailable.get(where, 0)
                                                     + _record_count(p.records))
                continue
            partitions.append(p.replace(records=records))
            where = (rule, name or "unknown")
            sealed[where] = sealed.get(where, 0) + count
        topics.append(topic.replace(partition_data=tuple(partitions)))
        changed = True
    if changed:
        result.request = req.replace(body=req.body.replace(topic_data=tuple(topics)))
    return result


def sealing_keks(req: Request, encryptions: Encryptions, id_names: IdNames,
                 keys_of: KeysOf) -> dict[Kek, str]:
    """The KEKs a Produce request's values would be sealed under, with a rule of each
    (so that their DEKs can be made before it is sealed)."""
    found: dict[Kek, str] = {}
    for _, name in client_topic_names(req.body, id_names):
        covering = _covering(encryptions, name)
        if covering is not None:
            kek = keys_of(covering[1]).sealing_for(name)
            if kek is not None:
                found.setdefault(kek, covering[0])
    return found


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
    how many records opened, how many did not (with why the first did not), and how
    many were held back for a KMS that could not be asked (their partitions answered
    UNKNOWN_SERVER_ERROR: the client fetches them again); ``kms_needed``: some were
    held back only because the KMS was not to be asked (not ``block``)."""

    response: Response
    opened: dict[tuple[str, str], int]
    failed: dict[tuple[str, str], tuple[int, str]]
    withheld: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    kms_needed: bool = False


def _held_back(partition: Any) -> Any:
    """A Fetch (ShareFetch) partition answered without its records, retriably (the
    Java consumer logs UNKNOWN_SERVER_ERROR and fetches again; a share group's records
    go back to the group when their acquisition lock runs out)."""
    changes: dict[str, Any] = {"error_code": UNKNOWN_SERVER_ERROR, "records": b""}
    if hasattr(partition, "acquired_records"):
        changes["acquired_records"] = ()
    return partition.replace(**changes)


def _record_count(records: Any) -> int:
    """How many records a records field holds, from its batch headers (one for records
    that do not read: a partition's, as one)."""
    try:
        return records_and_bytes(records)[0]
    except ProtocolError:
        return 1


def open_answer(resp: Response, encryptions: Encryptions, id_names: IdNames,
                cipher: RecordCipher, decompress: Decompress,
                to_client: Callable[[str], str | None] | None = None,
                repack: Repack | None = None, keys_of: KeysOf = local_keys,
                block: bool = True) -> OpenedAnswer:
    """A broker's Fetch or ShareFetch answer with the sealed values of the topics
    ``encryptions`` hold opened (a topic whose id is not known yet: opened with every
    KEK of theirs).  ``to_client``: a topic's name as the client knows it (a rule's
    rename or prefix), from the broker's; ``id_names`` gives the client's already.
    Not ``block``: EDEKs that only a KMS opens are not asked of it (``kms_needed``)."""
    finds = {id(encryption): keys_of(encryption).find for _, encryption in encryptions}

    def any_key(name: str) -> Kek | None:  # the first rule's KEK wins a name
        for find in finds.values():
            kek = find(name)
            if kek is not None:
                return kek
        return None

    limit = max(e.max_decompressed for _, e in encryptions)
    result = OpenedAnswer(resp, {}, {})
    opened, failed, withheld = result.opened, result.failed, result.withheld
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
        rule, find = ((covering[0], finds[id(covering[1])]) if covering is not None
                      else (encryptions[0][0], any_key))
        where = (rule, name or "unknown")
        partitions = []
        topic_changed = False
        for p in topic.partitions:
            try:
                found = open_records(p.records, find, cipher, decompress, limit, repack,
                                     block)
            except KmsUnavailable as exc:
                count, reason = withheld.get(where, (0, str(exc)))
                withheld[where] = (count + _record_count(p.records), reason)
                result.kms_needed = result.kms_needed or isinstance(exc, KmsNeeded)
                partitions.append(_held_back(p))
                topic_changed = True
                continue
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
        result.response = resp.replace(body=resp.body.replace(responses=tuple(topics)))
    return result


__all__ = [
    "HEADER",
    "ConfigError",
    "EncryptionKeys",
    "Encryptions",
    "Kek",
    "KeyRing",
    "KeysOf",
    "KmsNeeded",
    "KmsSpec",
    "KmsUnavailable",
    "LocalKek",
    "Opened",
    "OpenedAnswer",
    "RecordCipher",
    "RecordEncryption",
    "SealedRequest",
    "Undecryptable",
    "Unsealable",
    "load_key_ring",
    "local_keys",
    "open_answer",
    "open_records",
    "seal_records",
    "seal_request",
    "sealing_keks",
]
