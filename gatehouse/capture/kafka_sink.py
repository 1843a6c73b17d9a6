"""``capture.kafka``: the observation records also produced to a topic on the upstream cluster.

    capture:
      dir: /var/lib/gatehouse/capture        # the files stay: the record of last resort
      kafka:
        topic: gatehouse.observations        # the default
        create: {partitions: 6, replication: 3, config: {retention.ms: 604800000}}
                                             # true (default): broker defaults; false: never
        acks: all                            # or 1
        compression: gzip                    # or none
        batch_bytes: 524288                  # JSON bytes per Produce request at most
        linger_seconds: 0.05                 # wait this long for a batch to fill
        queue: 20000                         # records waiting for the cluster; more: dropped
        retries: 5                           # per batch, metadata refreshed between tries
        timeout: 10                          # seconds: connect, each request, acks
        key: connection                      # or client_id: what keeps records in order
        sasl: {mechanism: SCRAM-SHA-512, username: capture, password_file: capture.secret}
        # or {mechanism: OAUTHBEARER, token_endpoint_url, client_id, client_secret_file}

The sink connects straight to the brokers named in ``upstream`` (and then to the
partition leaders their Metadata names), never through the proxy: it does not observe
itself and cannot loop.  It uses ``tls.upstream`` when that is configured and SASL
credentials of its own (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) when given.

Why a thread and not a trio task: the proxy's side must cost a deque append and nothing
else.  Encoding JSON, gzip and the pure-Python CRC-32C are CPU work that would run
between the proxy's own steps on the trio thread and add to every request's latency;
a broker that stops answering must not hold anything the proxy needs.  So, like the
file writer, the sink owns a thread with blocking sockets (``socket`` and ``ssl``, one
request per broker in flight, pipelined across brokers), and the proxy only ever calls
``offer``.  Blocking I/O on a thread of its own also keeps the client small: no second
event loop, no callbacks.

Delivery: at least once within ``retries`` (a request that timed out may have been
written; it is sent again), per-partition order kept (one batch per partition in flight;
a retried batch goes before newer records).  Records of one key (connection, or client
id) go to one partition, chosen as Kafka's Java producer does (murmur2 of the key), so
they stay in order while the partition count does not change.  What cannot be produced
after the retries is counted (``write_errors``) and the outage is logged once, with a
summary at most every minute while it lasts, and once more when the cluster is back.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gatehouse
from gatehouse import codecs
from gatehouse.capture.schema import encode_record
from gatehouse.capture.writer import RecordInbox
from gatehouse.codecs import ProtocolError, Response, records
from gatehouse.codecs._error_codes import ERROR_NAMES
from gatehouse.codecs.sasl import BEARER_ACKNOWLEDGE, bearer_message
from gatehouse.codecs.scram import (
    SaslCredentials,
    SaslError,
    ScramClient,
    plain_token,
)
from gatehouse.configfile import Reader, line_of
from gatehouse.logs import log_event
from gatehouse.proxy.kerberos import KerberosCredentials, KerberosLogin, kerberos_identity
from gatehouse.proxy.oauth import OAuthClient, fetch_token, read_client_sasl

if TYPE_CHECKING:
    from gatehouse.proxy.config import Address, ProxyConfig, UpstreamTls

logger = logging.getLogger("gatehouse.capture")

KIB = 1024
DEFAULT_TOPIC = "gatehouse.observations"
CLIENT_ID = "gatehouse-capture"
KEYS = ("connection", "client_id")
COMPRESSIONS = ("gzip", "none")
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")

IDLE_WAIT = 0.05  # seconds the thread sleeps when the deque is empty
OUTAGE_LOG_EVERY = 60.0  # seconds between "still failing" log lines
METADATA_MAX_AGE = 300.0  # seconds: partition counts and leaders re-read at least this often
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 2.0  # seconds between tries of one batch, doubling
MAX_RESPONSE_BYTES = codecs.DEFAULT_MAX_FRAME_SIZE
CLOSED = "the broker closed the connection"

API_VERSIONS, METADATA, PRODUCE, CREATE_TOPICS = 18, 3, 0, 19
SASL_HANDSHAKE, SASL_AUTHENTICATE = 17, 36
# The versions this client builds bodies for: Produce v13 names topics by id (not us),
# CreateTopics v4 is the first that takes -1 for "the broker's default".
OUR_VERSIONS = {API_VERSIONS: (0, 3), METADATA: (1, 13), PRODUCE: (3, 12),
                CREATE_TOPICS: (4, 7), SASL_HANDSHAKE: (1, 1), SASL_AUTHENTICATE: (0, 2)}

NONE, UNKNOWN_TOPIC_OR_PARTITION, UNSUPPORTED_VERSION, TOPIC_ALREADY_EXISTS = 0, 3, 35, 36
# Produce errors that another try (after fresh metadata) can cure; the rest lose the batch
# at once (too large, corrupt, invalid: sending it again cannot help).  Authorization is
# retried: an operator may be adding the ACL right now.
RETRIABLE = frozenset({-1, 3, 5, 6, 7, 13, 19, 20, 29, 56, 74, 75, 89})


def error_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"error {code}")


# -- settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KafkaSinkSettings:
    topic: str = DEFAULT_TOPIC
    create: bool = True
    partitions: int = -1  # -1: the broker's num.partitions
    replication: int = -1  # -1: the broker's default.replication.factor
    topic_config: dict[str, str] = field(default_factory=dict)
    acks: int = -1  # all
    compression: str = "gzip"
    batch_bytes: int = 512 * KIB
    linger_seconds: float = 0.05
    queue: int = 20_000
    retries: int = 5
    timeout: float = 10.0
    key: str = "connection"
    sasl: SaslCredentials | OAuthClient | KerberosCredentials | None = None


def parse_kafka_sink(reader: Reader, base: Path) -> KafkaSinkSettings:
    """``reader``: the ``capture.kafka`` mapping; raises ConfigError with file:line."""
    what = "capture.kafka"
    topic = reader.take("topic", str, DEFAULT_TOPIC)
    if not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        raise reader.error("topic", f"{what}.topic: {topic!r} is not a legal Kafka topic name "
                           "(letters, digits, '.', '_', '-'; at most 249)")
    create, partitions, replication, topic_config = _parse_create(reader)

    acks_raw = reader.take("acks", (str, int), "all")
    if acks_raw not in ("all", -1, 1):
        hint = " (it would hide every failure)" if acks_raw == 0 else ""
        raise reader.error("acks", f"{what}.acks must be 'all' or 1, not {acks_raw!r}{hint}")
    acks = 1 if acks_raw == 1 else -1
    compression = _choice(reader, what, "compression", COMPRESSIONS, "gzip")

    def positive(key: str, default: float, integer: bool = True, zero: bool = False) -> Any:
        value = reader.take(key, (int,) if integer else (int, float), default)
        if value < 0 or (value == 0 and not zero):
            raise reader.error(key, f"{what}.{key} must be {'0 or more' if zero else 'positive'}, "
                               f"not {value}")
        return value

    batch_bytes = positive("batch_bytes", KafkaSinkSettings.batch_bytes)
    linger = float(positive("linger_seconds", KafkaSinkSettings.linger_seconds, False, True))
    queue = positive("queue", KafkaSinkSettings.queue)
    retries = positive("retries", KafkaSinkSettings.retries, zero=True)
    timeout = float(positive("timeout", KafkaSinkSettings.timeout, False))
    key = _choice(reader, what, "key", KEYS, "connection")
    sasl = read_client_sasl(reader.child("sasl"), base) if reader.has("sasl") else None
    reader.finish()
    return KafkaSinkSettings(topic=topic, create=create, partitions=partitions,
                             replication=replication, topic_config=topic_config, acks=acks,
                             compression=compression, batch_bytes=batch_bytes,
                             linger_seconds=linger, queue=queue, retries=retries,
                             timeout=timeout, key=key, sasl=sasl)


def _choice(reader: Reader, what: str, key: str, choices: Sequence[str], default: str) -> str:
    value: str = reader.take(key, str, default)
    if value not in choices:
        raise reader.error(key, f"{what}.{key} must be "
                           f"{' or '.join(repr(c) for c in choices)}, not {value!r}")
    return value


def _parse_create(reader: Reader) -> tuple[bool, int, int, dict[str, str]]:
    raw = reader.take("create", (bool, dict), True)
    if isinstance(raw, bool):
        return raw, -1, -1, {}
    create = reader.child("create")
    what = "capture.kafka.create"
    counts = []
    for key in ("partitions", "replication"):
        value = create.take(key, int, -1)
        if value < 1 and value != -1:
            raise create.error(key, f"{what}.{key} must be at least 1 (or -1: the "
                               f"broker's default), not {value}")
        counts.append(value)
    config_raw = create.take("config", dict, {})
    config: dict[str, str] = {}
    for name, value in config_raw.items():
        if isinstance(value, dict | list) or value is None:
            raise create.source.error(f"{what}.config.{name} must be a single value, "
                                      f"not {value!r}", line_of(config_raw, name))
        config[name] = str(value).lower() if isinstance(value, bool) else str(value)
    create.finish()
    return True, counts[0], counts[1], config


# -- partitioning: Kafka's murmur2, so a key lands where the Java producer would put it ----


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` (32-bit, seed 0x9747b28c), as a signed int."""
    m, mask = 0x5BD1E995, 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    whole = length - length % 4
    for (k,) in struct.iter_unpack("<I", data[:whole]):
        k = (k * m) & mask
        k ^= k >> 24
        k = (k * m) & mask
        h = ((h * m) & mask) ^ k
    tail = data[whole:]
    if tail:
        for i in reversed(range(len(tail))):
            h ^= tail[i] << (8 * i)
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


# -- SASL -----------------------------------------------------------------------------------


# -- one broker connection (blocking, on the sink's thread) ---------------------------------


class BrokerUnavailable(Exception):
    """Connecting, a request or its answer failed: the connection is gone."""


class TopicUnavailable(Exception):
    """The cluster answered, but the topic cannot take records now (no leader yet, missing,
    not allowed, ...)."""


class BrokerConnection:
    """Requests and answers with one broker, one at a time or pipelined (``send``/``receive``)."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self.versions: dict[int, int] = {}  # api key -> the version we use
        self._correlation = 0

    @classmethod
    def open(cls, host: str, port: int, *, timeout: float, ssl_context: ssl.SSLContext | None,
             server_hostname: str | None,
             sasl: SaslCredentials | OAuthClient | KerberosCredentials | None
             ) -> BrokerConnection:
        address = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise BrokerUnavailable(f"{address}: {_describe(exc)}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(sock, server_hostname=server_hostname or host)
            conn = cls(sock, address)
            conn._negotiate()
            if sasl is not None:
                conn._authenticate(sasl, host)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                sock.close()
            if isinstance(exc, OSError):
                raise BrokerUnavailable(f"{address}: {_describe(exc)}") from None
            raise
        return conn

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def version(self, api_key: int) -> int:
        version = self.versions.get(api_key)
        if version is None:
            name = codecs.api(api_key).name
            raise BrokerUnavailable(f"{self.address}: no {name} version both sides support")
        return version

    def send(self, api_key: int, body: dict[str, Any], version: int | None = None) -> tuple[int, int]:
        """Send a request; ``(correlation id, version)`` for ``receive``."""
        version = self.version(api_key) if version is None else version
        self._correlation = (self._correlation + 1) & 0x7FFFFFFF
        req = codecs.request_from_dict({
            "header": {"api_key": api_key, "api_version": version,
                       "correlation_id": self._correlation, "client_id": CLIENT_ID},
            "body": body,
        })
        try:
            self.sock.sendall(codecs.size_prefixed(req.encode()))
        except OSError as exc:
            raise BrokerUnavailable(f"{self.address}: {_describe(exc)}") from None
        return self._correlation, version

    def receive(self, api_key: int, sent: tuple[int, int]) -> Any:
        """The body of the answer to ``sent``."""
        correlation_id, version = sent
        try:
            (size,) = struct.unpack(">i", self._read(4))
            if not 4 <= size <= MAX_RESPONSE_BYTES:
                raise BrokerUnavailable(f"{self.address}: a response frame of {size} bytes")
            frame = self._read(size)
        except OSError as exc:
            raise BrokerUnavailable(f"{self.address}: {_describe(exc)}") from None
        try:
            resp: Response = codecs.decode_response(frame, api_key, version)
            if resp.correlation_id != correlation_id:
                raise BrokerUnavailable(f"{self.address}: answer to request {correlation_id} "
                                        f"has correlation id {resp.correlation_id}")
            return resp.body
        except ProtocolError as exc:
            raise BrokerUnavailable(f"{self.address}: a response we cannot read: {exc}") from None

    def call(self, api_key: int, body: dict[str, Any], version: int | None = None) -> Any:
        return self.receive(api_key, self.send(api_key, body, version))

    def _read(self, n: int) -> bytes:
        view = memoryview(bytearray(n))
        got = 0
        while got < n:
            count = self.sock.recv_into(view[got:])
            if not count:
                raise BrokerUnavailable(f"{self.address}: {CLOSED}")
            got += count
        return bytes(view)

    def _negotiate(self) -> None:
        ours = OUR_VERSIONS[API_VERSIONS][1]
        software = {"client_software_name": CLIENT_ID,
                    "client_software_version": gatehouse.__version__}
        body = self.call(API_VERSIONS, software, ours)
        if body.error_code == UNSUPPORTED_VERSION:  # answered in v0, with its own range
            theirs = {k.api_key: k.max_version for k in body.api_keys}.get(API_VERSIONS, 0)
            if theirs < ours:
                body = self.call(API_VERSIONS, software if theirs >= 3 else {}, theirs)
        if body.error_code:
            raise BrokerUnavailable(f"{self.address}: ApiVersions: {error_name(body.error_code)}")
        for key in body.api_keys:
            low, high = OUR_VERSIONS.get(key.api_key, (0, -1))
            low, high = max(low, key.min_version), min(high, key.max_version)
            if low <= high and key.api_key in codecs.APIS:
                self.versions[key.api_key] = high

    def _authenticate(self, sasl: SaslCredentials | OAuthClient | KerberosCredentials,
                      host: str) -> None:
        body = self.call(SASL_HANDSHAKE, {"mechanism": sasl.mechanism})
        if body.error_code:
            offered = ", ".join(body.mechanisms) or "none"
            raise SaslError(f"{self.address}: SASL {sasl.mechanism}: "
                            f"{error_name(body.error_code)} (the broker offers {offered})")
        if isinstance(sasl, KerberosCredentials):
            login = KerberosLogin(kerberos_identity(sasl), host)
            try:
                answer: bytes | None = login.first()
                while answer is not None:
                    answer = login.step(self._sasl_step(answer))
            except SaslError as exc:
                raise SaslError(f"{self.address}: SASL GSSAPI: {exc}") from None
            finally:
                login.close()
            return
        if isinstance(sasl, OAuthClient):
            try:
                token, _ = fetch_token(sasl)
            except SaslError as exc:
                raise SaslError(f"{self.address}: SASL OAUTHBEARER: {exc}") from None
            if self._sasl_step(bearer_message(token)):  # RFC 7628's error challenge
                self._sasl_step(BEARER_ACKNOWLEDGE)  # the broker's refusal raises here
                raise SaslError(f"{self.address}: SASL authentication failed: the broker "
                                "refused the token")
            return
        if sasl.mechanism == "PLAIN":
            self._sasl_step(plain_token(sasl.username, sasl.password))
            return
        scram = ScramClient(sasl.mechanism, sasl.username, sasl.password)
        server_first = self._sasl_step(scram.first_message())
        scram.check_final(self._sasl_step(scram.final_message(server_first)))

    def _sasl_step(self, token: bytes) -> bytes:
        body = self.call(SASL_AUTHENTICATE, {"auth_bytes": token})
        if body.error_code:
            message = body.error_message or error_name(body.error_code)
            raise SaslError(f"{self.address}: SASL authentication failed: {message}")
        return bytes(body.auth_bytes)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


# -- the sink -------------------------------------------------------------------------------


@dataclass
class _TopicLayout:
    partitions: int
    leaders: dict[int, int]  # partition -> leader node id (-1: none right now)
    fetched_at: float


@dataclass
class _PartitionBatch:
    partition: int
    count: int
    value_bytes: int
    batch: bytes


class KafkaSink(RecordInbox):
    """Records in (``offer``, never blocks), a topic out (on the ``gatehouse-capture-kafka``
    thread).  ``statistics()`` counts like the file writer's: ``written`` (acknowledged
    by the cluster), ``dropped`` (the queue was full), ``write_errors`` (lost after the
    retries or refused by the broker)."""

    def __init__(self, settings: KafkaSinkSettings, bootstrap: Sequence[Address], *,
                 tls: UpstreamTls | None = None, connect_timeout: float | None = None) -> None:
        if not bootstrap:
            raise ValueError("the Kafka sink needs at least one bootstrap address")
        self.settings = settings
        self.bootstrap = [(a.host, a.port) for a in bootstrap]
        self._ssl_context: ssl.SSLContext | None = None
        self._server_hostname: str | None = None
        if tls is not None:
            from gatehouse.proxy.tls import upstream_ssl_context

            self._ssl_context = upstream_ssl_context(tls)
            self._server_hostname = tls.server_hostname
        if settings.sasl is not None and settings.sasl.mechanism in ("PLAIN", "OAUTHBEARER") \
                and tls is None:
            log_event(logger, logging.WARNING, f"capture kafka: SASL {settings.sasl.mechanism} "
                      "without tls.upstream sends the "
                      f"{'password' if settings.sasl.mechanism == 'PLAIN' else 'token'} "
                      "in clear text")
        self._connect_timeout = connect_timeout or settings.timeout
        self._open_inbox(settings.queue, max(1, min(1000, settings.queue // 4)),
                         "capture kafka: queue full, records dropped")
        self._conns: dict[int, BrokerConnection] = {}  # node id -> connection
        self._brokers: dict[int, tuple[str, int]] = {}  # node id -> advertised address
        self._layout: _TopicLayout | None = None
        self._stale = True
        self._down_since: float | None = None  # an outage: when the first failure was
        self._lost_at_outage = 0
        self._outage_log_at = 0.0
        self._thread = threading.Thread(target=self._run, name="gatehouse-capture-kafka",
                                        daemon=True)
        self._thread.start()

    @property
    def up(self) -> bool:
        """False while the sink fails to produce (an outage that has not ended)."""
        return self._down_since is None

    def stop(self) -> None:
        """Take no more records; the thread produces what is queued (one try each) and ends."""
        self._stopping = True
        self._wake.set()

    def close(self, timeout: float | None = 30.0) -> bool:
        """Produce what is queued and stop; False if that did not finish in time."""
        self.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log_event(logger, logging.ERROR, "capture kafka: the cluster did not take the last "
                      "records in time", queued=len(self._queue), timeout_seconds=timeout)
            return False
        return True

    def metric_families(self) -> Iterator[Any]:
        """The sink's counters, for the capture's Prometheus collector."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.statistics()
        family = CounterMetricFamily("gatehouse_capture_kafka_records", "Capture records by "
                                     "what became of them in the Kafka sink",
                                     labels=["outcome"])
        family.add_metric(["written"], stats.written)
        family.add_metric(["dropped"], stats.dropped)
        family.add_metric(["write_error"], stats.write_errors)
        yield family
        yield CounterMetricFamily("gatehouse_capture_kafka_bytes_written", "JSON bytes of "
                                  "capture records acknowledged by the cluster (before "
                                  "compression)", value=stats.bytes_written)
        yield GaugeMetricFamily("gatehouse_capture_kafka_queue_depth", "Capture records "
                                "waiting for the cluster", value=stats.queue_depth)
        yield GaugeMetricFamily("gatehouse_capture_kafka_up", "1 unless the Kafka sink is "
                                "failing to produce", value=1.0 if self.up else 0.0)

    # -- the sink's thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                batch = self._take()
                if batch is None:
                    break
                self._deliver(batch)
        except Exception:  # a bug here must not pass silently: it ends the sink
            logger.exception("capture kafka: the sink stopped on an unexpected error")
            self._stopping = True
            self._stats.write_errors += len(self._queue)
            self._queue.clear()
        finally:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()

    def _take(self) -> list[tuple[int, bytes, bytes]] | None:
        """The next records to produce as ``(timestamp ms, key, JSON)``; None: stopped."""
        queue = self._queue
        while not queue:
            if self._stopping:
                return None
            self._wake.wait(IDLE_WAIT)
            self._wake.clear()
        if not self._stopping and len(queue) < self._wake_at and self.settings.linger_seconds:
            self._wake.wait(self.settings.linger_seconds)  # let the batch fill a little
            self._wake.clear()
        limit, by_client = self.settings.batch_bytes, self.settings.key
        out: list[tuple[int, bytes, bytes]] = []
        size = 0
        while queue and size < limit:
            record = queue.popleft()
            value = encode_record(record)
            size += len(value)
            if by_client == "client_id":
                key = str(record.get("client_id") or "").encode()
            else:
                key = f"{record.get('proxy')}/{record.get('run')}/{record.get('conn')}".encode()
            when = record.get("time")
            stamp = int(when * 1000) if isinstance(when, int | float) else int(time.time() * 1000)
            out.append((stamp, key, value))
        return out

    def _deliver(self, entries: list[tuple[int, bytes, bytes]]) -> None:
        """Produce ``entries``: tries, metadata refreshed between them; then counted."""
        settings = self.settings
        pending: dict[int, _PartitionBatch] | None = None
        attempt = 0
        while True:
            try:
                layout = self._topic_layout()
                if pending is None:
                    pending = self._partition(entries, layout.partitions)
                pending, problem, unreachable = self._produce_once(layout, pending)
            except BrokerUnavailable as exc:
                problem, unreachable = str(exc), True
                self._stale = True
            except (TopicUnavailable, SaslError) as exc:
                problem, unreachable = str(exc), False
                self._stale = True
            if pending is not None and not pending:
                self._recovered()
                return
            attempt += 1
            # Shutting down, a cluster that does not answer gets no more tries; one that
            # answers (a leader being elected) gets its retries.
            if attempt > settings.retries or (self._stopping and unreachable):
                lost = len(entries) if pending is None else sum(p.count for p in pending.values())
                self._stats.write_errors += lost
                self._failed(problem, lost)
                if self._stopping:  # the rest would fail the same way: don't make exit wait
                    self._abandon_queue()
                return
            if unreachable:  # an outage is logged at once; a leader moving, only if it lasts
                self._failed(problem, 0)
            log_event(logger, logging.DEBUG, "capture kafka: retrying", problem=problem,
                      attempt=attempt)
            time.sleep(min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (attempt - 1)))

    def _abandon_queue(self) -> None:
        """Shutting down with the cluster failing: what is queued would only wait in vain."""
        left = len(self._queue)
        self._queue.clear()
        if left:
            self._stats.write_errors += left
            log_event(logger, logging.WARNING, "capture kafka: records not produced at "
                      "shutdown (the files have them)", records=left)

    def _partition(self, entries: list[tuple[int, bytes, bytes]], partitions: int
                   ) -> dict[int, _PartitionBatch]:
        grouped: dict[int, list[tuple[int, bytes | None, bytes | None]]] = {}
        for stamp, key, value in entries:
            grouped.setdefault(partition_for(key, partitions), []).append((stamp, key, value))
        return {p: _PartitionBatch(p, len(items), sum(len(v or b"") for _, _, v in items),
                                   records.encode_batch(items,
                                                        compression=self.settings.compression))
                for p, items in grouped.items()}

    def _produce_once(self, layout: _TopicLayout, pending: dict[int, _PartitionBatch]
                      ) -> tuple[dict[int, _PartitionBatch], str, bool]:
        """One try: a Produce to each leader (pipelined); what is left to retry, why, and
        whether a broker could not be reached (rather than answering with an error)."""
        settings = self.settings
        left: dict[int, _PartitionBatch] = {}
        problems: list[str] = []
        unreachable = False
        by_leader: dict[int, list[_PartitionBatch]] = {}
        for batch in pending.values():
            leader = layout.leaders.get(batch.partition, -1)
            if leader < 0:
                left[batch.partition] = batch
                problems.append(f"partition {batch.partition} has no leader")
                continue
            by_leader.setdefault(leader, []).append(batch)
        in_flight = []
        for leader, batches in by_leader.items():
            body = {"transactional_id": None, "acks": settings.acks,
                    "timeout_ms": int(settings.timeout * 1000),
                    "topic_data": [{"name": settings.topic, "partition_data": [
                        {"index": b.partition, "records": b.batch} for b in batches]}]}
            try:
                conn = self._connection(leader)
                in_flight.append((leader, conn, conn.send(PRODUCE, body), batches))
            except BrokerUnavailable as exc:
                self._drop_connection(leader)
                problems.append(str(exc))
                unreachable = True
                left.update((b.partition, b) for b in batches)
        for leader, conn, sent, batches in in_flight:
            try:
                answer = conn.receive(PRODUCE, sent)
            except BrokerUnavailable as exc:
                self._drop_connection(leader)
                problems.append(str(exc))
                unreachable = True
                left.update((b.partition, b) for b in batches)
                continue
            codes = {p.index: p.error_code for t in answer.responses
                     for p in t.partition_responses}
            for batch in batches:
                code = codes.get(batch.partition, -1)
                if code == NONE:
                    self._stats.written += batch.count
                    self._stats.bytes_written += batch.value_bytes
                elif code in RETRIABLE:
                    left[batch.partition] = batch
                    problems.append(f"partition {batch.partition}: {error_name(code)}")
                else:
                    self._stats.write_errors += batch.count
                    log_event(logger, logging.ERROR, "capture kafka: the broker refused records",
                              topic=settings.topic, partition=batch.partition,
                              error=error_name(code), records=batch.count,
                              batch_bytes=len(batch.batch))
        if left:
            self._stale = True
        return left, "; ".join(dict.fromkeys(problems)), unreachable

    # -- metadata and connections --------------------------------------------------------

    def _topic_layout(self) -> _TopicLayout:
        layout = self._layout
        now = time.monotonic()
        if layout is not None and not self._stale and now - layout.fetched_at < METADATA_MAX_AGE:
            return layout
        node, conn = self._any_connection()
        topic = self._metadata(node, conn)
        if topic is not None and topic.error_code == UNKNOWN_TOPIC_OR_PARTITION:
            if not self.settings.create:
                raise TopicUnavailable(f"topic {self.settings.topic!r} does not exist "
                                        "(capture.kafka.create is false)")
            self._create_topic(node, conn)
            topic = self._metadata(node, conn)
        if topic is None or topic.error_code:
            code = UNKNOWN_TOPIC_OR_PARTITION if topic is None else topic.error_code
            raise TopicUnavailable(f"topic {self.settings.topic!r}: {error_name(code)}")
        if not topic.partitions:
            raise TopicUnavailable(f"topic {self.settings.topic!r} has no partitions yet")
        leaders = {p.partition_index: p.leader_id if p.error_code == NONE else -1
                   for p in topic.partitions}
        self._layout = _TopicLayout(len(leaders), leaders, now)
        self._stale = False
        return self._layout

    def _metadata(self, node: int, conn: BrokerConnection) -> Any:
        body: dict[str, Any] = {"topics": [{"name": self.settings.topic}]}
        if conn.version(METADATA) >= 4:
            body["allow_auto_topic_creation"] = False
        try:
            answer = conn.call(METADATA, body)
        except BrokerUnavailable as exc:
            self._drop_connection(node)
            if self.settings.sasl is None and str(exc).endswith(CLOSED):
                raise BrokerUnavailable(f"{exc} (a SASL listener closes connections that do "
                                        "not authenticate: see capture.kafka.sasl)") from None
            raise
        if getattr(answer, "error_code", NONE):
            raise TopicUnavailable(f"{conn.address}: Metadata: {error_name(answer.error_code)}")
        for broker in answer.brokers:
            self._brokers[broker.node_id] = (broker.host, broker.port)
        return next((t for t in answer.topics if t.name == self.settings.topic), None)

    def _create_topic(self, node: int, conn: BrokerConnection) -> None:
        settings = self.settings
        body = {"topics": [{"name": settings.topic, "num_partitions": settings.partitions,
                            "replication_factor": settings.replication, "assignments": [],
                            "configs": [{"name": k, "value": v}
                                        for k, v in settings.topic_config.items()]}],
                "timeout_ms": int(settings.timeout * 1000), "validate_only": False}
        try:
            answer = conn.call(CREATE_TOPICS, body)
        except BrokerUnavailable:
            self._drop_connection(node)
            raise
        for result in answer.topics:
            if result.error_code not in (NONE, TOPIC_ALREADY_EXISTS):
                raise TopicUnavailable(
                    f"creating topic {settings.topic!r}: {error_name(result.error_code)}"
                    + (f": {result.error_message}" if result.error_message else ""))
            if result.error_code == NONE:
                log_event(logger, logging.INFO, "capture kafka: topic created",
                          topic=settings.topic, partitions=result.num_partitions,
                          replication=result.replication_factor)

    def _any_connection(self) -> tuple[int, BrokerConnection]:
        """An open connection, else the first known broker or bootstrap address that answers."""
        for node, conn in self._conns.items():
            return node, conn
        candidates = [(node, address) for node, address in self._brokers.items()]
        candidates += [(-1 - i, address) for i, address in enumerate(self.bootstrap)]
        problems = []
        for node, (host, port) in candidates:
            try:
                conn = self._open(host, port)
            except BrokerUnavailable as exc:
                problems.append(str(exc))
                continue
            self._conns[node] = conn
            return node, conn
        raise BrokerUnavailable("no broker reachable: " + "; ".join(dict.fromkeys(problems)))

    def _connection(self, node: int) -> BrokerConnection:
        conn = self._conns.get(node)
        if conn is None:
            address = self._brokers.get(node)
            if address is None:
                raise BrokerUnavailable(f"broker {node} is not in the cluster's metadata")
            conn = self._conns[node] = self._open(*address)
        return conn

    def _open(self, host: str, port: int) -> BrokerConnection:
        return BrokerConnection.open(host, port, timeout=self._connect_timeout,
                                     ssl_context=self._ssl_context,
                                     server_hostname=self._server_hostname,
                                     sasl=self.settings.sasl)

    def _drop_connection(self, node: int) -> None:
        conn = self._conns.pop(node, None)
        if conn is not None:
            conn.close()

    # -- outages: logged once, summarised while they last, and when they end ----------

    def _lost(self) -> int:
        return self._stats.write_errors + self._stats.dropped

    def _failed(self, problem: str, lost: int) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            self._lost_at_outage = self._lost() - lost
            self._outage_log_at = now + OUTAGE_LOG_EVERY
            log_event(logger, logging.WARNING, "capture kafka: cannot produce to the cluster; "
                      f"records still failing after {self.settings.retries} retries are lost "
                      "(counted; the files keep them)", topic=self.settings.topic,
                      problem=problem, records_lost=lost)
        elif now >= self._outage_log_at:
            self._outage_log_at = now + OUTAGE_LOG_EVERY
            log_event(logger, logging.WARNING, "capture kafka: still cannot produce",
                      topic=self.settings.topic, problem=problem,
                      down_seconds=round(now - self._down_since, 1),
                      records_lost=self._lost() - self._lost_at_outage)

    def _recovered(self) -> None:
        if self._down_since is None:
            return
        down = time.monotonic() - self._down_since
        self._down_since = None
        log_event(logger, logging.WARNING, "capture kafka: producing again",
                  topic=self.settings.topic, down_seconds=round(down, 1),
                  records_lost=self._lost() - self._lost_at_outage)


def sink_for(config: ProxyConfig) -> KafkaSink | None:
    """The Kafka sink a proxy config asks for (``capture.kafka``), started; else None."""
    capture = config.capture
    settings = getattr(capture, "kafka", None)
    if settings is None:
        return None
    return KafkaSink(settings, config.upstream, tls=config.tls_upstream,
                     connect_timeout=config.limits.connect_timeout)


__all__ = [
    "BrokerConnection",
    "KafkaSink",
    "KafkaSinkSettings",
    "SaslCredentials",
    "ScramClient",
    "murmur2",
    "parse_kafka_sink",
    "partition_for",
    "sink_for",
]
