"""What metrics cost, measured where the proxy is the bottleneck: direct vs Gatehouse without
metrics vs Gatehouse with metrics (per-topic counters included) scraped every few seconds,
against a synthetic broker and a synthetic client, same run.

    python bench/replay.py [--rounds 5] [--megabytes 400] [--min-seconds 3] [--scrape-every 5]
                           [--workloads produce-1k consume-1k produce-100k consume-100k]
                           [--produce-version 12] [--fetch-version 17] [--no-pin]

bench/metrics.py answers the same question (issue #5: metrics cost <= 5% throughput) with a
real Kafka broker and Kafka's Java perf tools.  On a small shared machine those numbers swing
by +-15% between rounds (JIT, GC, the broker's disk, scheduling), so a 5% cost is lost in
the noise.  Here both ends are lightweight Python processes that only move pre-encoded
Kafka frames:

- the fake broker (``--serve-broker PORT``, a thread per connection) decodes request headers
  and answers from canned responses built with the codec, patching the correlation id:
  ApiVersions (every API the codec knows), Metadata (node 0 = itself, topic "bench" with a
  fixed topic id and 3 partitions), Produce (success for "bench" partitions 0-2, their base
  offsets patched in; it decodes Produce bodies for that) and Fetch (real uncompressed record
  batches v2, so the metered proxy counts real records from batch headers; the client id
  names the workload whose answer to give);
- the load client (``--client ADDR WORKLOAD``) sends ApiVersions and Metadata on one
  connection (the proxy learns topic id -> name from that Metadata answer), checks one
  fully decoded answer, then pipelines one pre-encoded request (5 in flight, like Kafka's
  max.in.flight) until the workload's megabytes of record values have moved and
  ``--min-seconds`` have passed, reading the answers into a preallocated buffer and
  checking their correlation ids and sizes.

Client, proxy and broker are separate processes, as in the real setup; with 2+ CPUs the
proxies get one to themselves (``--no-pin`` to share), so the proxy under test is the
bottleneck without fighting its own load for a core.  Each round runs the three targets in
a rotated order so drift hits them alike; the proxies' CPU time per MB is reported beside
the throughput, since where the proxy is the bottleneck throughput goes as 1 / (CPU per MB).
The metered proxy's records counter is read before and after each of its runs and must grow
by the records moved.  MB here is 10^6 bytes of record values.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import select
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.metrics import Scraper
from bench.proxy import cpu_seconds, start_gatehouse
from gatehouse import codecs
from gatehouse.codecs.plain import body_from_dict
from gatehouse.codecs.records import encode_batch, summarize
from gatehouse.embedded import free_port, wait_for_port

SCRIPT: Final = Path(__file__).resolve()
HOST: Final = "127.0.0.1"
PRODUCE, FETCH, METADATA, API_VERSIONS = 0, 1, 3, 18
API_VERSIONS_VERSION: Final = 4  # what Kafka 4.x Java clients send
METADATA_VERSION: Final = 12
TOPIC: Final = "bench"
TOPIC_ID: Final = uuid.UUID("5e1f0b5c-7a11-4c0d-9e5a-0000000000b5")
PARTITIONS: Final = 3
MAX_IN_FLIGHT: Final = 5  # Kafka's max.in.flight.requests.per.connection default
PARTITION_MAX_BYTES: Final = 1024 * 1024  # Kafka's max.partition.fetch.bytes default
TIMESTAMP_MS: Final = 1_700_000_000_000
CLIENT_ID_PREFIX: Final = "replay-"  # the client id names the workload: the broker's Fetch
# Produce answers carry these as base offsets; the broker finds and patches them.
OFFSET_SENTINEL: Final = 0x5E47_1E00_0000_0000
MB: Final = 1e6

_I32: Final = struct.Struct(">i")
_I64: Final = struct.Struct(">q")
_SIZE_AND_ID: Final = struct.Struct(">ii")  # a response's size prefix and correlation id


class ReplayError(RuntimeError):
    """Something the benchmark cannot go on with: a lost, mismatched or refused answer."""


@dataclass(frozen=True)
class Workload:
    """One request shape: Produce carries the records, or Fetch answers carry them."""

    name: str
    api_key: int  # PRODUCE or FETCH
    value_size: int
    records_per_batch: int
    batches_per_partition: int

    @property
    def records_per_request(self) -> int:
        return PARTITIONS * self.batches_per_partition * self.records_per_batch

    @property
    def payload_per_request(self) -> int:
        """Bytes of record values one request (Produce) or answer (Fetch) moves."""
        return self.records_per_request * self.value_size

    @property
    def direction(self) -> str:
        """The ``direction`` label of ``gatehouse_topic_records_total``."""
        return "produce" if self.api_key == PRODUCE else "fetch"

    def describe(self, version: int) -> str:
        kind = "Produce" if self.api_key == PRODUCE else "Fetch"
        batches = (f"{self.batches_per_partition} batches" if self.batches_per_partition > 1
                   else "1 batch")
        size = f"{self.value_size // 1024} KiB"
        carried = "acks=-1" if self.api_key == PRODUCE else "canned answer"
        return (f"{kind} v{version} ({carried}): {PARTITIONS} partitions x {batches} of "
                f"{self.records_per_batch} x {size} records, "
                f"{self.payload_per_request / 1024:.0f} KiB of values per request")


WORKLOADS: Final = {w.name: w for w in (
    Workload("produce-1k", PRODUCE, 1024, 16, 1),  # the Java producer's 16 KiB batches
    Workload("consume-1k", FETCH, 1024, 16, 63),  # 63 x 16,589 bytes: under 1 MiB
    Workload("produce-100k", PRODUCE, 100 * 1024, 1, 1),
    Workload("consume-100k", FETCH, 100 * 1024, 1, 10),
)}


# -- messages, built with the codec -------------------------------------------------------


def _fit(struct_spec: codecs.StructSpec, plain: Mapping[str, Any], version: int) -> dict[str, Any]:
    """``plain`` without the fields that ``version`` does not have, at every depth, so one
    description serves every version (topic names before topic ids, and so on)."""
    fields = {f.attr: f for f in struct_spec.fields}
    out: dict[str, Any] = {}
    for key, value in plain.items():
        spec = fields[key]
        if version not in spec.versions:
            continue
        if spec.struct is not None and value is not None:
            value = ([_fit(spec.struct, item, version) for item in value] if spec.is_array
                     else _fit(spec.struct, value, version))
        out[key] = value
    return out


def response_wire(api_key: int, version: int, plain: Mapping[str, Any]) -> bytes:
    """A response with its size prefix (correlation id 0; header v0 or v1 as the API says)."""
    spec = codecs.api(api_key).response
    body = body_from_dict(spec, _fit(spec.root, plain, version), version)
    frame = codecs.encode_response(codecs.Response.build(api_key, version, 0, body))
    return codecs.size_prefixed(frame)


def request_wire(api_key: int, version: int, client_id: str, plain: Mapping[str, Any],
                 correlation_id: int = 0) -> bytearray:
    """A request with its size prefix, in a buffer whose correlation id can be patched."""
    spec = codecs.api(api_key).request
    body = body_from_dict(spec, _fit(spec.root, plain, version), version)
    frame = codecs.encode_request(
        codecs.Request.build(api_key, version, correlation_id, client_id, body))
    return bytearray(codecs.size_prefixed(frame))


@cache
def record_batch(value_size: int, count: int) -> bytes:
    """One uncompressed batch v2 of ``count`` records (base offset 0); built once, since
    the CRC-32C is pure Python, then copied with other base offsets (outside the CRC)."""
    value = (bytes(range(256)) * (value_size // 256 + 1))[:value_size]
    return encode_batch([(TIMESTAMP_MS, None, value)] * count)


def record_set(workload: Workload) -> bytes:
    """A partition's records: the workload's batches at consecutive offsets."""
    batch = record_batch(workload.value_size, workload.records_per_batch)
    return b"".join(_I64.pack(n * workload.records_per_batch) + batch[8:]
                    for n in range(workload.batches_per_partition))


def _topic(**fields: Any) -> dict[str, Any]:
    """A topic entry named both ways; ``_fit`` keeps the one the version has."""
    return {"name": TOPIC, "topic_id": TOPIC_ID, **fields}


def api_versions_plain() -> dict[str, Any]:
    return {"error_code": 0, "throttle_time_ms": 0, "api_keys": [
        {"api_key": key, "min_version": spec.versions.lo, "max_version": spec.versions.hi}
        for key, spec in sorted(codecs.APIS.items())]}


def metadata_plain(host: str, port: int) -> dict[str, Any]:
    partitions = [{"error_code": 0, "partition_index": i, "leader_id": 0, "leader_epoch": 0,
                   "replica_nodes": [0], "isr_nodes": [0], "offline_replicas": []}
                  for i in range(PARTITIONS)]
    return {"throttle_time_ms": 0, "cluster_id": "replay", "controller_id": 0,
            "brokers": [{"node_id": 0, "host": host, "port": port, "rack": None}],
            "topics": [_topic(error_code=0, is_internal=False, partitions=partitions)]}


def produce_response_plain() -> dict[str, Any]:
    partitions = [{"index": i, "error_code": 0, "base_offset": OFFSET_SENTINEL + i,
                   "log_append_time_ms": -1, "log_start_offset": 0}
                  for i in range(PARTITIONS)]
    return {"throttle_time_ms": 0, "responses": [_topic(partition_responses=partitions)]}


def fetch_response_plain(workload: Workload) -> dict[str, Any]:
    records = record_set(workload)
    end = workload.batches_per_partition * workload.records_per_batch
    partitions = [{"partition_index": i, "error_code": 0, "high_watermark": end,
                   "last_stable_offset": end, "log_start_offset": 0,
                   "aborted_transactions": None, "preferred_read_replica": -1,
                   "records": records} for i in range(PARTITIONS)]
    responses = [{"topic": TOPIC, "topic_id": TOPIC_ID, "partitions": partitions}]
    return {"throttle_time_ms": 0, "error_code": 0, "session_id": 0, "responses": responses}


def produce_request_plain(workload: Workload) -> dict[str, Any]:
    batch = record_batch(workload.value_size, workload.records_per_batch)
    partitions = [{"index": i, "records": batch} for i in range(PARTITIONS)]
    return {"transactional_id": None, "acks": -1, "timeout_ms": 30_000,
            "topic_data": [_topic(partition_data=partitions)]}


def fetch_request_plain() -> dict[str, Any]:
    partitions = [{"partition": i, "current_leader_epoch": 0, "fetch_offset": 0,
                   "last_fetched_epoch": -1, "log_start_offset": -1,
                   "partition_max_bytes": PARTITION_MAX_BYTES} for i in range(PARTITIONS)]
    return {"replica_id": -1, "max_wait_ms": 500, "min_bytes": 1, "max_bytes": 52_428_800,
            "isolation_level": 0, "session_id": 0, "session_epoch": -1,
            "topics": [{"topic": TOPIC, "topic_id": TOPIC_ID, "partitions": partitions}],
            "forgotten_topics_data": [], "rack_id": ""}


# -- sockets ------------------------------------------------------------------------------


def recv_exactly(sock: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    """Fills ``view``.  False at a clean end of stream before its first byte when
    ``eof_ok``; a ``ConnectionError`` for any other end."""
    first = True
    while view:
        n = sock.recv_into(view)
        if not n:
            if first and eof_ok:
                return False
            raise ConnectionError("the peer closed the connection mid-frame"
                                  if not first else "the peer closed the connection")
        first = False
        view = view[n:]
    return True


def discard(sock: socket.socket, sink: memoryview, n: int) -> None:
    """Reads ``n`` bytes into ``sink`` (reused: only their count matters)."""
    while n:
        got = sock.recv_into(sink, min(n, len(sink)))
        if not got:
            raise ConnectionError(f"the peer closed the connection with {n} bytes to come")
        n -= got


def read_frame(sock: socket.socket, buffer: bytearray, eof_ok: bool = False,
               ) -> memoryview | None:
    """One frame (without its size prefix) in ``buffer``, or a new one if it is too small;
    None at a clean end of stream when ``eof_ok``."""
    head = bytearray(4)
    if not recv_exactly(sock, memoryview(head), eof_ok):
        return None
    (size,) = _I32.unpack(head)
    view = memoryview(buffer if size <= len(buffer) else bytearray(size))[:size]
    recv_exactly(sock, view)
    return view


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# -- the fake broker ----------------------------------------------------------------------


@dataclass(frozen=True)
class Canned:
    """A response with its size prefix, and where its Produce base offsets are."""

    wire: bytes
    offset_slots: tuple[int, ...] = ()


@cache
def canned_response(api_key: int, version: int, workload_name: str, host: str,
                    port: int) -> Canned:
    """The answer to every request of this API and version (Fetch: of this workload)."""
    if api_key == API_VERSIONS:
        return Canned(response_wire(api_key, version, api_versions_plain()))
    if api_key == METADATA:
        return Canned(response_wire(api_key, version, metadata_plain(host, port)))
    if api_key == PRODUCE:
        wire = response_wire(api_key, version, produce_response_plain())
        return Canned(wire, tuple(_find_once(wire, _I64.pack(OFFSET_SENTINEL + i))
                                  for i in range(PARTITIONS)))
    if api_key == FETCH:
        workload = WORKLOADS.get(workload_name)
        if workload is None or workload.api_key != FETCH:
            raise ReplayError(f"no canned Fetch answer for client {workload_name!r}")
        return Canned(response_wire(api_key, version, fetch_response_plain(workload)))
    spec = codecs.APIS.get(api_key)
    raise ReplayError(f"the fake broker does not answer {spec.name if spec else api_key} "
                      f"v{version}")


def _find_once(data: bytes, needle: bytes) -> int:
    if data.count(needle) != 1:
        raise ReplayError(f"sentinel {needle.hex()} is not unique in a canned response")
    return data.index(needle)


class BrokerConnection:
    """One connection's answers: its own copies of the canned responses, patched in place
    (correlation id, base offsets), since ``sendall`` is done with them on return."""

    def __init__(self, sock: socket.socket, port: int) -> None:
        self.sock, self.port = sock, port
        self.copies: dict[tuple[int, int, str], tuple[bytearray, Canned]] = {}
        self.next_offsets = [0] * PARTITIONS

    def serve(self) -> None:
        buffer = bytearray(1024 * 1024)
        while (frame := read_frame(self.sock, buffer, eof_ok=True)) is not None:
            self.sock.sendall(self.answer(frame))

    def answer(self, frame: memoryview) -> bytearray:
        req = codecs.decode_request(frame.toreadonly())  # read-only: decoded without a copy
        key, version, correlation_id, client_id = req.header[:4]
        workload = (client_id or "").removeprefix(CLIENT_ID_PREFIX) if key == FETCH else ""
        copy = self.copies.get((key, version, workload))
        if copy is None:
            canned = canned_response(key, version, workload, HOST, self.port)
            copy = self.copies[(key, version, workload)] = (bytearray(canned.wire), canned)
        wire, canned = copy
        _I32.pack_into(wire, 4, correlation_id)
        if key == PRODUCE:
            for slot, offset in zip(canned.offset_slots, self.acknowledge(req), strict=True):
                _I64.pack_into(wire, slot, offset)
        return wire

    def acknowledge(self, req: codecs.Request) -> list[int]:
        """The base offset of each partition's records (the canned answer names "bench"
        partitions 0..2: anything else is refused loudly)."""
        topics = req.body.topic_data
        if len(topics) != 1 or (topics[0].name or topics[0].topic_id) not in (TOPIC, TOPIC_ID):
            raise ReplayError(f"Produce for topics the fake broker does not have: {topics!r}")
        partitions = topics[0].partition_data
        if [p.index for p in partitions] != list(range(PARTITIONS)):
            raise ReplayError(f"Produce for partitions {[p.index for p in partitions]}")
        base = list(self.next_offsets)
        for p in partitions:
            self.next_offsets[p.index] += summarize(p.records).records
        return base


def serve_broker(port: int) -> None:
    """Accepts connections until killed; each is served by its own thread."""
    with socket.create_server((HOST, port), backlog=128) as listener:
        while True:
            sock, _ = listener.accept()
            threading.Thread(target=_serve_connection, args=(sock, port), daemon=True).start()


def _serve_connection(sock: socket.socket, port: int) -> None:
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            BrokerConnection(sock, port).serve()
        except (ConnectionError, codecs.ProtocolError, ReplayError) as exc:
            print(f"fake broker: closing a connection: {exc!r}", file=sys.stderr, flush=True)


# -- the load client ----------------------------------------------------------------------


def roundtrip(sock: socket.socket, wire: bytearray, api_key: int, version: int,
              correlation_id: int) -> codecs.Response:
    """One request and its fully decoded answer (the handshake and the probe)."""
    _I32.pack_into(wire, 8, correlation_id)
    sock.sendall(wire)
    frame = read_frame(sock, bytearray(0))
    assert frame is not None
    resp = codecs.decode_response(bytes(frame), api_key, version)
    if resp.correlation_id != correlation_id:
        raise ReplayError(f"answer to correlation id {resp.correlation_id}, expected "
                          f"{correlation_id}")
    resp.body  # noqa: B018 - decode it all now: a bad answer fails here
    return resp


def handshake(sock: socket.socket, client_id: str, versions: Mapping[int, int],
              topic_id: uuid.UUID | None = TOPIC_ID) -> None:
    """ApiVersions (the needed versions must be offered) and Metadata ("bench" with its
    topic id: through the proxy, this is how its metrics learn the id's name; a real
    broker's topic has an id of its own: ``topic_id=None``)."""
    api_versions = request_wire(API_VERSIONS, API_VERSIONS_VERSION, client_id, {
        "client_software_name": "gatehouse-bench-replay", "client_software_version": "1"})
    body = roundtrip(sock, api_versions, API_VERSIONS, API_VERSIONS_VERSION, 1).body
    offered = {e.api_key: (e.min_version, e.max_version) for e in body.api_keys}
    for key, version in versions.items():
        lo, hi = offered.get(key, (0, -1))
        if body.error_code or not lo <= version <= hi:
            raise ReplayError(f"{codecs.APIS[key].name} v{version} not offered "
                              f"(error {body.error_code}, range {lo}-{hi})")
    metadata = request_wire(METADATA, METADATA_VERSION, client_id, {
        "topics": [{"name": TOPIC, "topic_id": uuid.UUID(int=0)}],
        "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    topics = roundtrip(sock, metadata, METADATA, METADATA_VERSION, 2).body.topics
    if [(t.name, topic_id or t.topic_id, t.error_code, len(t.partitions)) for t in topics] != [
            (TOPIC, topic_id or topics[0].topic_id, 0, PARTITIONS)]:
        raise ReplayError(f"unexpected Metadata answer: {topics!r}")


def check_probe(resp: codecs.Response, workload: Workload) -> None:
    """The load's answer is what it should be: no errors, the records all there."""
    body = resp.body
    if workload.api_key == PRODUCE:
        codes = [p.error_code for t in body.responses for p in t.partition_responses]
        if codes != [0] * PARTITIONS:
            raise ReplayError(f"Produce answered error codes {codes}")
        return
    counts = [(p.error_code, summarize(p.records).records)
              for t in body.responses for p in t.partitions]
    expected = workload.records_per_request // PARTITIONS
    if body.error_code or counts != [(0, expected)] * PARTITIONS:
        raise ReplayError(f"Fetch answered error {body.error_code}, partitions "
                          f"(error, records) {counts}")


def pipeline(sock: socket.socket, wire: bytearray, minimum: int, seconds: float,
             first_id: int, answer_size: int) -> int:
    """Copies of the request (correlation ids from ``first_id``), at most MAX_IN_FLIGHT
    unanswered, until ``minimum`` were sent and ``seconds`` have passed; every answer must
    be the oldest one's and of the probe's size.  Returns how many were answered."""
    head = bytearray(_SIZE_AND_ID.size)
    head_view = memoryview(head)
    sink = memoryview(bytearray(1024 * 1024))
    in_flight: deque[int] = deque()
    until = time.perf_counter() + seconds
    next_id = first_id
    sent = received = 0
    while True:
        while len(in_flight) < MAX_IN_FLIGHT and (sent < minimum
                                                   or time.perf_counter() < until):
            _I32.pack_into(wire, 8, next_id)
            sock.sendall(wire)
            in_flight.append(next_id)
            next_id += 1
            sent += 1
        if not in_flight:
            return received
        recv_exactly(sock, head_view)
        size, correlation_id = _SIZE_AND_ID.unpack(head)
        expected = in_flight.popleft()
        if correlation_id != expected:
            raise ReplayError(f"answer to correlation id {correlation_id}, expected {expected}"
                              f" (after {received} answers): lost or out of order")
        if size != answer_size:
            raise ReplayError(f"answer of {size} bytes, expected {answer_size}")
        discard(sock, sink, size - 4)
        received += 1


def paced(sock: socket.socket, wire: bytearray, rate: float, seconds: float,
          first_id: int, answer_size: int) -> list[float]:
    """Copies of the request sent on a fixed schedule (``rate`` per second, at most
    MAX_IN_FLIGHT unanswered) for ``seconds``; the latency of each, send to answer, in
    seconds.  A send that falls behind the schedule goes at once (no catching up in bursts
    beyond the in-flight limit)."""
    head = bytearray(_SIZE_AND_ID.size)
    head_view = memoryview(head)
    sink = memoryview(bytearray(1024 * 1024))
    sent_at: deque[tuple[int, float]] = deque()
    latencies: list[float] = []
    interval = 1.0 / rate
    start = time.perf_counter()
    next_send = start
    until = start + seconds
    next_id = first_id
    while True:
        now = time.perf_counter()
        if now >= next_send and now < until and len(sent_at) < MAX_IN_FLIGHT:
            _I32.pack_into(wire, 8, next_id)
            sock.sendall(wire)
            sent_at.append((next_id, time.perf_counter()))
            next_id += 1
            next_send += interval
            continue
        if not sent_at:
            if now >= until:
                return latencies
            time.sleep(max(0.0, next_send - now))
            continue
        if now < until and len(sent_at) < MAX_IN_FLIGHT:
            # A send is possible: wait for an answer only until it is due.
            readable, _, _ = select.select([sock], [], [], max(0.0, next_send - now))
            if not readable:
                continue
        recv_exactly(sock, head_view)
        arrived = time.perf_counter()
        size, correlation_id = _SIZE_AND_ID.unpack(head)
        expected, sent = sent_at.popleft()
        if correlation_id != expected:
            raise ReplayError(f"answer to correlation id {correlation_id}, expected {expected}")
        if size != answer_size:
            raise ReplayError(f"answer of {size} bytes, expected {answer_size}")
        discard(sock, sink, size - 4)
        latencies.append(arrived - sent)


def run_paced_client(address: str, workload: Workload, rate: float, seconds: float,
                     produce_version: int, topic_id: uuid.UUID | None) -> dict[str, Any]:
    """``rate`` requests per second for ``seconds``: their latencies (ms percentiles)."""
    client_id = CLIENT_ID_PREFIX + workload.name
    wire = request_wire(workload.api_key, produce_version, client_id,
                        produce_request_plain(workload))
    with connect(address) as sock:
        handshake(sock, client_id, {workload.api_key: produce_version,
                                    METADATA: METADATA_VERSION}, topic_id)
        probe = roundtrip(sock, wire, workload.api_key, produce_version, 3)
        check_probe(probe, workload)
        lat = sorted(paced(sock, wire, rate, seconds, 4, len(probe.frame or b"")))

    def pct(q: float) -> float:
        return 1000 * lat[min(len(lat) - 1, int(q * len(lat)))]

    return {"workload": workload.name, "target": address, "requests": len(lat),
            "mb_per_s": len(lat) * workload.payload_per_request / MB / seconds,
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "p999_ms": pct(0.999)}


def run_client(address: str, workload: Workload, megabytes: float, min_seconds: float,
               produce_version: int, fetch_version: int,
               topic_id: uuid.UUID | None = TOPIC_ID,
               start_at: float | None = None) -> dict[str, Any]:
    """Moves ``megabytes`` of record values, for ``min_seconds`` at least; the result as a
    dict (printed as JSON).  With ``start_at`` (a ``time.time()``), the timed load begins
    then, after the handshake: clients started together load their targets together."""
    version = produce_version if workload.api_key == PRODUCE else fetch_version
    client_id = CLIENT_ID_PREFIX + workload.name
    plain = (produce_request_plain(workload) if workload.api_key == PRODUCE
             else fetch_request_plain())
    wire = request_wire(workload.api_key, version, client_id, plain)
    minimum = max(1, math.ceil(megabytes * MB / workload.payload_per_request))
    with connect(address) as sock:
        handshake(sock, client_id, {workload.api_key: version, METADATA: METADATA_VERSION},
                  topic_id)
        probe = roundtrip(sock, wire, workload.api_key, version, 3)  # also a warm-up
        check_probe(probe, workload)
        answer_size = len(probe.frame or b"")
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        started = time.perf_counter()
        count = pipeline(sock, wire, minimum, min_seconds, 4, answer_size)
        seconds = time.perf_counter() - started
    payload = count * workload.payload_per_request
    return {"workload": workload.name, "target": address, "requests": count,
            "records": (count + 1) * workload.records_per_request,  # the probe's included
            "payload_bytes": payload, "bytes_sent": count * len(wire),
            "bytes_received": count * (answer_size + 4), "seconds": seconds,
            "mb_per_s": payload / MB / seconds}


# -- orchestration ------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    address: str
    pid: int | None = None  # the proxy process (for its CPU time)
    metrics_url: str | None = None


@dataclass(frozen=True)
class Run:
    target: str
    round: int
    mb_per_s: float
    seconds: float
    cpu_ms_per_mb: float | None  # the proxy's
    busy: float | None  # the proxy's CPU seconds per timed second (its handshake included)
    records_sent: int
    records_counted: int | None  # by the metered proxy's gatehouse_topic_records_total
    scrapes: int | None  # of the metered proxy, done during the run


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process on ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task.name), cpus)


def start_broker() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--serve-broker", str(port)],
                            stdin=subprocess.DEVNULL)
    wait_for_port(HOST, port, 30, proc)
    return proc, f"{HOST}:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


def start_load(address: str, workload: Workload, args: argparse.Namespace,
               megabytes: float | None = None, start_at: float | None = None,
               ) -> subprocess.Popen[str]:
    """One client process against ``address`` (``finish_load`` gives its result)."""
    command = [sys.executable, str(SCRIPT), "--client", address, workload.name,
               "--megabytes", str(args.megabytes if megabytes is None else megabytes),
               "--min-seconds", str(args.min_seconds),
               "--produce-version", str(args.produce_version),
               "--fetch-version", str(args.fetch_version)]
    if start_at is not None:
        command += ["--start-at", repr(start_at)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)


def finish_load(proc: subprocess.Popen[str], workload: Workload, address: str
                ) -> dict[str, Any]:
    """The JSON result of a client process started by ``start_load``."""
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise ReplayError(f"client {workload.name} -> {address} did not finish") from None
    if proc.returncode != 0:
        raise ReplayError(f"client {workload.name} -> {address} failed:\n{stderr}")
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def load(address: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """One client process against ``address``; its JSON result."""
    return finish_load(start_load(address, workload, args), workload, address)


_SAMPLE: Final = re.compile(r"^gatehouse_topic_records_total\{([^}]*)\} (\S+)$", re.MULTILINE)
_LABEL: Final = re.compile(r'(\w+)="([^"]*)"')


def topic_records(url: str, direction: str) -> int:
    """``gatehouse_topic_records_total{topic="bench", direction=...}`` now."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    for labels, value in _SAMPLE.findall(text):
        found = dict(_LABEL.findall(labels))
        if found.get("topic") == TOPIC and found.get("direction") == direction:
            return int(float(value))
    return 0


def run_once(target: Target, workload: Workload, round_: int, args: argparse.Namespace,
             scraper: Scraper) -> Run:
    """One load run against one target, with the proxy's CPU time and, when metered, the
    scrapes done meanwhile and the records counter before and after."""
    url = target.metrics_url
    before = topic_records(url, workload.direction) if url else 0
    scrapes_before = len(scraper.durations)
    cpu_before = cpu_seconds(target.pid) if target.pid else 0.0
    result = load(target.address, workload, args)
    cpu = cpu_seconds(target.pid) - cpu_before if target.pid else None
    scrapes = len(scraper.durations) - scrapes_before if url else None
    megabytes = result["payload_bytes"] / MB
    return Run(target.name, round_, result["mb_per_s"], result["seconds"],
               None if cpu is None else 1000 * cpu / megabytes,
               None if cpu is None else cpu / result["seconds"], result["records"],
               topic_records(url, workload.direction) - before if url else None, scrapes)


def rotated(targets: Sequence[Target], round_: int) -> list[Target]:
    start = round_ % len(targets)
    return [*targets[start:], *targets[:start]]


def run_workload(targets: Sequence[Target], workload: Workload, args: argparse.Namespace,
                 scraper: Scraper) -> list[Run]:
    runs = []
    for round_ in range(args.rounds):
        for target in rotated(targets, round_):
            run = run_once(target, workload, round_, args, scraper)
            cpu = ("" if run.cpu_ms_per_mb is None else
                   f", proxy CPU {run.cpu_ms_per_mb:.2f} ms/MB, busy {run.busy:.0%}")
            counted = ("" if run.records_counted is None
                       else f", records counted {run.records_counted}/{run.records_sent}, "
                            f"{run.scrapes} scrapes")
            print(f"  round {round_ + 1} {workload.name:<13} {target.name:<8} "
                  f"{run.mb_per_s:8.1f} MB/s in {run.seconds:.1f} s{cpu}{counted}", flush=True)
            runs.append(run)
    return runs


# Time for both clients of a side-by-side round to start and shake hands before the load.
SIDE_BY_SIDE_LEAD: Final = 2.0


def run_side_by_side(pair: Sequence[Target], workload: Workload, args: argparse.Namespace
                     ) -> list[Run]:
    """Both proxies of ``pair`` loaded at once, each by its own client, for
    ``--min-seconds`` from one start time: they share the proxies' CPU, so each moves
    what its CPU per MB allows under the very same conditions (the machine's drift, which
    swings sequential runs by +-25% here, hits both alike at every moment)."""
    runs = []
    for round_ in range(args.rounds):
        order = rotated(pair, round_)  # which client starts first alternates
        cpu_before = {t.name: cpu_seconds(t.pid) for t in order if t.pid}
        start_at = time.time() + SIDE_BY_SIDE_LEAD
        procs = [(t, start_load(t.address, workload, args, 0.001, start_at)) for t in order]
        results = {t.name: finish_load(proc, workload, t.address) for t, proc in procs}
        line = []
        for target in pair:
            result = results[target.name]
            megabytes = result["payload_bytes"] / MB
            cpu = cpu_seconds(target.pid) - cpu_before[target.name] if target.pid else None
            run = Run(target.name, round_, result["mb_per_s"], result["seconds"],
                      None if cpu is None else 1000 * cpu / megabytes,
                      None if cpu is None else cpu / result["seconds"], result["records"],
                      None, None)
            runs.append(run)
            line.append(f"{target.name} {run.mb_per_s:7.1f} MB/s in {run.seconds:.1f} s"
                        + ("" if run.cpu_ms_per_mb is None else
                           f" ({run.cpu_ms_per_mb:.2f} CPU ms/MB, busy {run.busy:.0%})"))
        print(f"  round {round_ + 1} {workload.name:<13} side by side: " + "; ".join(line),
              flush=True)
    return runs


def report_side_by_side(workload: Workload, runs: Sequence[Run]) -> float:
    """The side-by-side table of a workload; returns the median metered/plain MB/s."""
    names = ("plain", "metered")
    mbs = {n: [r.mb_per_s for r in runs if r.target == n] for n in names}
    busy = [sum(r.busy or 0.0 for r in runs if r.round == n)
            for n in sorted({r.round for r in runs})]
    ratios = {
        "metered/plain MB/s": paired(runs, "metered", "plain", lambda r: r.mb_per_s),
        "metered/plain proxy CPU per MB": paired(runs, "metered", "plain",
                                                 lambda r: r.cpu_ms_per_mb),
    }
    print(f"\n### {workload.name}, side by side (both proxies loaded at once, sharing "
          f"their CPU)\n")
    table(["", "plain", "metered"], [
        ["MB/s, median", *(f"{statistics.median(mbs[n]):.1f}" for n in names)],
        ["MB/s, min-max", *(spread(mbs[n], ".1f") for n in names)],
    ])
    print()
    table(["paired per round", "median", "min-max"],
          [[k, f"{statistics.median(v):.3f}", spread(v)] for k, v in ratios.items()])
    print(f"\nthe two proxies' CPU busy together, median {statistics.median(busy):.0%} "
          f"(near 100%: the shared CPU was the bottleneck, as the measure needs)")
    return statistics.median(ratios["metered/plain MB/s"])


# -- report -------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A markdown table, columns padded for the terminal."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")


def spread(values: Sequence[float], fmt: str = ".3f") -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def paired(runs: Sequence[Run], numerator: str, denominator: str,
           value: Callable[[Run], float | None]) -> list[float]:
    """Per round: value(numerator's run) / value(denominator's run)."""
    by_key = {(r.target, r.round): value(r) for r in runs}
    rounds = sorted({r.round for r in runs})
    return [by_key[(numerator, n)] / by_key[(denominator, n)]  # type: ignore[operator]
            for n in rounds]


def report_workload(workload: Workload, version: int, runs: Sequence[Run]) -> float:
    """The workload's tables; returns the paired median metered/plain throughput."""
    names = ("direct", "plain", "metered")
    mbs = {n: [r.mb_per_s for r in runs if r.target == n] for n in names}
    cpu = {n: [r.cpu_ms_per_mb for r in runs if r.target == n and r.cpu_ms_per_mb is not None]
           for n in names}
    busy = {n: [r.busy for r in runs if r.target == n and r.busy is not None] for n in names}
    print(f"\n### {workload.name}: {workload.describe(version)}\n")
    table(["", *names], [
        ["MB/s, median", *(f"{statistics.median(mbs[n]):.1f}" for n in names)],
        ["MB/s, min-max", *(spread(mbs[n], ".1f") for n in names)],
        ["proxy CPU ms/MB, median",
         *(f"{statistics.median(cpu[n]):.2f}" if cpu[n] else "-" for n in names)],
        ["proxy CPU busy, median",
         *(f"{statistics.median(busy[n]):.0%}" if busy[n] else "-" for n in names)],
    ])
    ratios = {
        "metered/plain MB/s": paired(runs, "metered", "plain", lambda r: r.mb_per_s),
        "plain/direct MB/s": paired(runs, "plain", "direct", lambda r: r.mb_per_s),
        "metered/plain proxy CPU per MB": paired(runs, "metered", "plain",
                                                 lambda r: r.cpu_ms_per_mb),
    }
    print()
    table(["paired per round", "median", "min-max"],
          [[k, f"{statistics.median(v):.3f}", spread(v)] for k, v in ratios.items()])
    metered = [r for r in runs if r.target == "metered"]
    sent = sum(r.records_sent for r in metered)
    counted = sum(r.records_counted or 0 for r in metered)
    print(f"\nrecords counted by the metered proxy (gatehouse_topic_records_total"
          f"{{topic=\"{TOPIC}\",direction=\"{workload.direction}\"}}, increase over its runs): "
          f"{counted} of {sent} sent{'' if counted == sent else '  <-- MISMATCH'}")
    return statistics.median(ratios["metered/plain MB/s"])


def goal_line(name: str, ratio: float) -> str:
    return (f"{name}: metrics cost <= 5%: paired median metered/plain >= 0.95: "
            f"{ratio:.3f} -> {'met' if ratio >= 0.95 else 'NOT met'}")


def environment() -> list[str]:
    model = cpus = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        found = dict(re.findall(r"^([^:\n]+):\s*(.*)$", text, re.MULTILINE))
        model, cpus = found.get("Model name", model), found.get("CPU(s)", cpus)
    root = SCRIPT.parents[1]
    commit = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "?"
        if subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                          capture_output=True, text=True, timeout=10).stdout.strip():
            commit += " + uncommitted changes"
    load1, load5, _ = os.getloadavg()
    return [f"machine: {model}, {cpus} CPUs ({platform.machine()}, {platform.system()} "
            f"{platform.release()}); load average {load1:.2f} (1 min), {load5:.2f} (5 min)",
            f"python: {platform.python_implementation()} {platform.python_version()}",
            f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
            f"gatehouse: {commit}"]


def pinning(wanted: bool) -> tuple[set[int], str]:
    """With 2+ CPUs: the proxies get the last one to themselves, and this process (so the
    broker and the clients it starts) the others; the proxy under test is then the
    bottleneck without fighting its own load for a core."""
    cpus = sorted(os.sched_getaffinity(0))
    if not wanted or len(cpus) < 2:
        return set(), "not pinned"
    os.sched_setaffinity(0, set(cpus[:-1]))
    return {cpus[-1]}, (f"proxies pinned to CPU {cpus[-1]}, client and broker to CPU "
                        f"{','.join(map(str, cpus[:-1]))}")


def benchmark(args: argparse.Namespace) -> None:
    print("# bench/replay.py: metrics cost, synthetic client and broker (proxy-bound)\n")
    for line in environment():
        print(f"- {line}")
    proxy_cpus, pinned = pinning(args.pin)
    print(f"- {pinned}")
    print(f"- rounds {args.rounds}; a run moves {args.megabytes:g} MB of record values and "
          f"lasts {args.min_seconds:g} s, at least; the metered proxy scraped every "
          f"{args.scrape_every:g} s; {MAX_IN_FLIGHT} requests in flight; Metadata "
          f"v{METADATA_VERSION}\n", flush=True)
    goals = []
    metered_scrapes = 0
    with contextlib.ExitStack() as stack:
        broker, broker_addr = start_broker()  # started after the pinning: inherits it
        stack.callback(stop, broker)
        plain, plain_addr = start_gatehouse(broker_addr)
        stack.callback(stop, plain)
        metrics_port = free_port()
        metered, metered_addr = start_gatehouse(
            broker_addr, f"metrics: {{listen: {HOST}:{metrics_port}}}\n")
        stack.callback(stop, metered)
        metrics_url = f"http://{HOST}:{metrics_port}/metrics"
        # Scraped all along, as Prometheus would: each run gets the scrapes of its duration.
        scraper = Scraper(metrics_url, args.scrape_every)
        scraper.start()
        stack.callback(scraper.join, 60)
        stack.callback(scraper.stop.set)
        if proxy_cpus:
            for proc in (plain, metered):
                pin(proc.pid, proxy_cpus)
        targets = [Target("direct", broker_addr),
                   Target("plain", plain_addr, plain.pid),
                   Target("metered", metered_addr, metered.pid, metrics_url)]
        for name in args.workloads:
            workload = WORKLOADS[name]
            version = args.produce_version if workload.api_key == PRODUCE else args.fetch_version
            runs = run_workload(targets, workload, args, scraper)
            goals.append(goal_line(name, report_workload(workload, version, runs)))
            print(flush=True)
            metered_scrapes += sum(r.scrapes or 0 for r in runs)
            if args.side_by_side:
                pair = targets[1:]  # plain, metered
                together = run_side_by_side(pair, workload, args)
                goals.append(goal_line(f"{name} (side by side)",
                                       report_side_by_side(workload, together)))
                print(flush=True)
    if scraper.durations:
        print(f"scrapes of the metered proxy: {len(scraper.durations)}, {metered_scrapes} of "
              f"them during its runs; median {1000 * statistics.median(scraper.durations):.1f}"
              f" ms, max {1000 * max(scraper.durations):.1f} ms, last page "
              f"{scraper.size / 1024:.0f} KiB")
    else:
        print("scrapes: none (the benchmark was shorter than --scrape-every)")
    load1, _, _ = os.getloadavg()
    print(f"load average at the end: {load1:.2f} (1 min)\n")
    for line in goals:
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=400.0,
                        help="MB (10^6 bytes) of record values per run, at least")
    parser.add_argument("--min-seconds", type=float, default=3.0,
                        help="a run goes on until it has lasted this long too")
    parser.add_argument("--scrape-every", type=float, default=5.0,
                        help="seconds between scrapes of the metered proxy's /metrics")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=["produce-1k", "consume-1k", "produce-100k", "consume-100k"])
    parser.add_argument("--produce-version", type=int, default=12, choices=range(3, 14),
                        help="12 as Kafka 4.0 clients; 13 names topics by id")
    parser.add_argument("--fetch-version", type=int, default=17, choices=range(4, 19),
                        help="17 as Kafka 4.0 clients; topic ids from 13")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="a CPU of its own for the proxies (default: on with 2+ CPUs)")
    parser.add_argument("--side-by-side", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="also load the plain and the metered proxy at once, sharing "
                             "their CPU, --rounds times per workload")
    parser.add_argument("--serve-broker", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=2, metavar=("ADDR", "WORKLOAD"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_broker is not None:
        serve_broker(args.serve_broker)
    elif args.client:
        address, name = args.client
        print(json.dumps(run_client(address, WORKLOADS[name], args.megabytes,
                                    args.min_seconds, args.produce_version,
                                    args.fetch_version, start_at=args.start_at)))
    else:
        benchmark(args)


if __name__ == "__main__":
    main()
