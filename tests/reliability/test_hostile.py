"""Hostile input against a running proxy in front of a real broker.

Every case: the proxy stays up, a well-behaved librdkafka producer and consumer keep
moving messages through it while the attack is under way, and the attacking connection
is logged exactly once (its close line) with the client's address.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.proxy.policy import RulesPolicy
from tests.reliability.support import (
    FakeBrokerServer,
    LogTap,
    ProxyRunner,
    Traffic,
    api_versions_request,
    connect,
    fields,
    local_address,
    read_frame,
    rss_bytes,
    scaled,
    wait_closed,
    wait_until,
)
from tests.support.clients import produce, unique
from tests.support.fakebroker import frame_bytes, request
from tests.support.kafka import KafkaCluster, tls_files_for_loopback
from tests.test_rules import rules

IDLE_TIMEOUT = 3.0
HANDSHAKE_TIMEOUT = 2.0
LIMITS = f"limits: {{idle_timeout: {IDLE_TIMEOUT}, connect_timeout: {HANDSHAKE_TIMEOUT}}}\n"


@dataclass
class Setup:
    proxy: ProxyRunner
    tap: LogTap
    traffic: Traffic
    kafka: KafkaCluster


@pytest.fixture(scope="module")
def hostile(kafka: KafkaCluster) -> Iterator[Setup]:
    topic = unique("hostile-traffic")
    kafka.create_topic(topic)
    config = (f"listen: 127.0.0.1:0\nupstream: [{kafka.bootstrap}]\nbrokers: {{start_port: 0}}\n"
              + LIMITS)
    with LogTap() as tap, ProxyRunner(config) as proxy, Traffic(proxy.bootstrap, topic) as traffic:
        yield Setup(proxy, tap, traffic, kafka)
        assert proxy.alive(), "the proxy crashed"
    assert traffic.errors == []


def assert_logged_once(setup: Setup, client: str, reason_has: str = "") -> str:
    return logged_once(setup.tap, setup.proxy, client, reason_has)


def logged_once(tap: LogTap, proxy: ProxyRunner, client: str, reason_has: str = "") -> str:
    """The attacker's connection is logged exactly once (at INFO or above): its close line."""
    wait_until(lambda: any(r.getMessage() == "connection closed"
                           for r in tap.about_latest(client)),
               10, f"the close line of {client}")
    lines = tap.about_latest(client)
    assert len(lines) == 1, [(r.getMessage(), fields(r)) for r in lines]
    reason = str(fields(lines[0])["reason"])
    assert reason_has in reason, reason
    assert proxy.alive()
    return reason


def test_random_bytes(hostile: Setup) -> None:
    for seed in range(scaled(12, 200)):
        rng = random.Random(seed)
        junk = rng.randbytes(rng.choice([1, 3, 4, 17, 512, 65536]))
        with connect(hostile.proxy.port) as sock:
            client = local_address(sock)
            sock.sendall(junk)
            # a size prefix inside the limit waits for the rest: the idle timeout ends it
            wait_closed(sock, IDLE_TIMEOUT + 5)
        assert_logged_once(hostile, client)
        if seed % 4 == 0:
            hostile.traffic.wait_progress(5)
    hostile.traffic.wait_progress()


def test_lying_lengths(hostile: Setup) -> None:
    frame = request(18, 3, 1, client_software_name="liar", client_software_version="1").encode()
    body = bytes(frame)
    # Shorter than the truth: the ApiVersions body is cut off and cannot be decoded.
    with connect(hostile.proxy.port) as sock:
        client = local_address(sock)
        sock.sendall(struct.pack(">i", len(body) - 5) + body)
        wait_closed(sock, 5)
    assert "malformed request" in assert_logged_once(hostile, client)
    # Longer than the truth, then silence: the proxy waits for bytes that never come,
    # and the idle timeout closes it; meanwhile everyone else carries on.
    with connect(hostile.proxy.port) as sock:
        client = local_address(sock)
        sock.sendall(struct.pack(">i", len(body) + 1000) + body)
        hostile.traffic.wait_progress()
        waited = wait_closed(sock, IDLE_TIMEOUT * 3)
    assert waited < IDLE_TIMEOUT * 2
    assert_logged_once(hostile, client, "idle timeout")


@pytest.mark.parametrize("prefix", [0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 104857601])
def test_huge_and_negative_length_prefixes(hostile: Setup, prefix: int) -> None:
    with connect(hostile.proxy.port) as sock:
        client = local_address(sock)
        sock.sendall(struct.pack(">I", prefix) + b"\x00" * 64)
        assert wait_closed(sock, 5) < 2  # at once: nothing is buffered for it
    assert "frame size" in assert_logged_once(hostile, client, "malformed request")


def test_truncated_frame_then_eof(hostile: Setup) -> None:
    wire = api_versions_request(1)
    with connect(hostile.proxy.port) as sock:
        client = local_address(sock)
        sock.sendall(wire[: len(wire) // 2])
        sock.shutdown(socket.SHUT_WR)
        wait_closed(sock, 5)
    assert "middle of a frame" in assert_logged_once(hostile, client, "malformed request")


def test_unknown_api_key_reaches_the_broker_which_closes(hostile: Setup) -> None:
    # Header v1 layout; key 999 is in no table: forwarded, and Kafka drops the connection.
    frame = struct.pack(">hhih", 999, 0, 7, 3) + b"raw" + b"\x00" * 8
    with connect(hostile.proxy.port) as sock:
        client = local_address(sock)
        sock.sendall(frame_bytes(frame))
        assert read_frame(sock) is None
    assert_logged_once(hostile, client, "closed the connection")
    hostile.traffic.wait_progress()


def test_api_versions_from_the_future_gets_kafkas_v0_answer(hostile: Setup) -> None:
    # KIP-35: a broker answers an ApiVersions version it does not know with a v0 body,
    # UNSUPPORTED_VERSION and its ranges; the proxy must carry that through intact.
    future = struct.pack(">hhih", 18, 127, 42, 3) + b"raw" + b"\x00" * 3
    with connect(hostile.proxy.port) as sock:
        sock.sendall(frame_bytes(future))
        answer = read_frame(sock)
        assert answer is not None
        resp = codecs.decode_response(answer, 18, 0)
        assert resp.header.correlation_id == 42
        assert resp.body.error_code == 35
        assert any(k.api_key == 18 for k in resp.body.api_keys)
        # and the connection stays usable
        sock.sendall(api_versions_request(43))
        again = read_frame(sock)
        assert again is not None
        assert codecs.decode_response(again, 18, 3).body.error_code == 0


def echo_answer(req: codecs.Request) -> Any:
    """A fake broker's answer naming the request's first four bytes."""
    # a future version of a flexible API still has header v1 (an empty tag section)
    tags = b"\x00" if req.api_key in codecs.APIS else b""
    return (struct.pack(">i", req.correlation_id) + tags + b"answer-to-"
            + bytes(req.frame or b"")[:4])


# request header v2 (an empty tag section), then a body no table describes
METADATA_V99 = struct.pack(">hhih", 3, 99, 6, 1) + b"y\x00" + b"\x00\x01\x02\xff" * 9


def test_unknown_key_and_future_version_forwarded_untouched() -> None:
    """Byte for byte, both ways, through a broker that records what it got."""
    frames = {
        "unknown key": struct.pack(">hhih", 999, 0, 5, 1) + b"x" + bytes(range(40)),
        # Produce keeps its v9+ start (null TransactionalId, acks=-1): it awaits an answer
        "Metadata v99": METADATA_V99,
        "Produce v99": struct.pack(">hhih", 0, 99, 7, 1) + b"z\x00\x00\xff\xff" + b"\xff" * 33,
    }
    answer = echo_answer

    with FakeBrokerServer(answer) as broker, \
            ProxyRunner(f"listen: 127.0.0.1:0\nupstream: [{broker.address}]\n"
                        f"brokers: {{start_port: 0}}\n") as proxy, \
            connect(proxy.port) as sock:
        for frame in frames.values():
            sock.sendall(frame_bytes(frame))
            got = read_frame(sock)
            tags = b"\x00" if frame[:2] != struct.pack(">h", 999) else b""
            assert got == frame[4:8] + tags + b"answer-to-" + frame[:4]
        assert [f for f in broker.received if f in frames.values()] == list(frames.values())


def test_a_future_version_a_rule_must_read_closes_its_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    """Under a tenant's prefix, a request newer than the tables (ApiVersions' answer
    never offered it) would slip past the mapping, to a broker that may read it: its
    connection closes, the broker never sees it, the log says why.  A client no such
    rule matches still passes it untouched; so does one the rule only observes."""
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    policy = RulesPolicy(rules(
        "- name: tenant-a\n  match: {client_id: '^y$'}\n"
        "  topic_prefix: {broker: 'tenant-a.', hide_others: true}\n"
        "- name: watching\n  mode: observe\n  match: {client_id: '^w$'}\n"
        "  topic_prefix: {broker: 'w.', hide_others: true}\n"))
    other, watched = (METADATA_V99.replace(b"y\x00", name + b"\x00", 1) for name in (b"z", b"w"))
    with FakeBrokerServer(echo_answer) as broker, \
            ProxyRunner(f"listen: 127.0.0.1:0\nupstream: [{broker.address}]\n"
                        f"brokers: {{start_port: 0}}\n", policy=policy) as proxy:
        with connect(proxy.port) as sock:
            sock.sendall(frame_bytes(METADATA_V99))
            assert read_frame(sock) is None  # closed
        for frame in (other, watched):
            with connect(proxy.port) as sock:
                sock.sendall(frame_bytes(frame))
                assert read_frame(sock) == frame[4:8] + b"\x00answer-to-" + frame[:4]
        assert METADATA_V99 not in broker.received
        assert other in broker.received and watched in broker.received
    closed = [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
              if r.getMessage() == "connection closed"]
    assert any(f.get("reason") == (
        f"Metadata v99 is newer than the proxy's tables (Kafka {codecs.KAFKA_RELEASE}) and "
        "the rules map or filter the names in it: it cannot go on unread (the client was "
        "offered only the APIs and versions the proxy reads, in ApiVersions)")
        for f in closed), closed


def test_one_byte_writes(hostile: Setup) -> None:
    wire = api_versions_request(1) + frame_bytes(request(3, 12, 2, topics=None).encode())
    with connect(hostile.proxy.port) as sock:
        for i in range(len(wire)):
            sock.send(wire[i:i + 1])
            if i % 16 == 0:
                time.sleep(0.001)  # let the bytes leave as separate segments
        first, second = read_frame(sock), read_frame(sock)
    assert first is not None and second is not None
    versions = codecs.decode_response(first, 18, 3)
    assert versions.header.correlation_id == 1 and versions.body.error_code == 0
    metadata = codecs.decode_response(second, 3, 12)
    assert metadata.header.correlation_id == 2
    ports = {b.port for b in metadata.body.brokers}
    assert ports and ports <= {b.port for b in hostile.proxy.proxy.brokers.values()}


def test_ten_thousand_pipelined_fetches_without_reading(hostile: Setup) -> None:
    """Each answer is ~1 MiB: 10 GiB if the proxy buffered them; it must stop reading."""
    topic = unique("pipelined")
    hostile.kafka.create_topic(topic)
    produce({"bootstrap.servers": hostile.kafka.bootstrap, "batch.size": 1 << 20}, topic,
            count=1100, tag="x" * 1000)
    fetch = frame_bytes(request(
        1, 12, 0, replica_id=-1, max_wait_ms=0, min_bytes=1, max_bytes=1 << 20,
        isolation_level=0, topics=[{"topic": topic, "partitions": [
            {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 20}]}]).encode())
    requests = 10_000
    baseline = rss_bytes()
    peak = baseline
    sent = 0
    sock = connect(hostile.proxy.port)
    client = local_address(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    done = threading.Event()

    def flood() -> None:
        nonlocal sent
        sock.settimeout(8)
        try:
            for i in range(requests):
                # correlation ids in place: bytes 8..12 of the wire frame
                sock.sendall(fetch[:8] + struct.pack(">i", i) + fetch[12:])
                sent += 1
        except (TimeoutError, OSError):
            pass  # the proxy stopped reading us: backpressure
        done.set()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            peak = max(peak, rss_bytes())
            time.sleep(0.1)
        hostile.traffic.wait_progress()
        assert done.wait(30)
        peak = max(peak, rss_bytes())
    finally:
        sock.close()
        flooder.join(30)
    grown = peak - baseline
    assert grown < 96 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
    assert sent > 0
    assert_logged_once(hostile, client)
    hostile.traffic.wait_progress()


def test_slowloris(hostile: Setup) -> None:
    """Silent connections and connections that trickle one byte at a time both end by the
    idle timeout: bytes that never complete a request are not activity."""
    silent = [connect(hostile.proxy.port) for _ in range(10)]
    tricklers = [connect(hostile.proxy.port) for _ in range(10)]
    clients = [local_address(s) for s in silent + tricklers]
    wire = api_versions_request(1)
    started = time.monotonic()
    closed: dict[int, float] = {}
    try:
        for s in silent + tricklers:
            s.setblocking(False)
        offset = 0
        while len(closed) < len(tricklers) + len(silent) and time.monotonic() - started < 20:
            for i, s in enumerate(tricklers):
                if i in closed:
                    continue
                try:
                    s.send(wire[offset % (len(wire) - 1): offset % (len(wire) - 1) + 1])
                except OSError:
                    closed[i] = time.monotonic() - started
            for j, s in enumerate(silent, start=len(tricklers)):
                if j in closed:
                    continue
                try:
                    if s.recv(1) == b"":
                        closed[j] = time.monotonic() - started
                except BlockingIOError:
                    pass
                except OSError:
                    closed[j] = time.monotonic() - started
            offset += 1
            time.sleep(IDLE_TIMEOUT / 6)
            if offset == 3:
                hostile.traffic.wait_progress(5)
    finally:
        for s in silent + tricklers:
            s.close()
    assert len(closed) == len(silent) + len(tricklers), "slowloris connections outlived the timeout"
    assert max(closed.values()) < IDLE_TIMEOUT * 3
    for client in clients:
        assert_logged_once(hostile, client, "idle timeout")


@pytest.fixture(scope="module")
def tls_proxy(kafka: KafkaCluster, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[ProxyRunner, LogTap, Path]]:
    files = tls_files_for_loopback(tmp_path_factory.mktemp("tls"))
    config = (f"listen: 127.0.0.1:0\nupstream: [{kafka.bootstrap}]\nbrokers: {{start_port: 0}}\n"
              f"tls: {{downstream: {{cert: {files['cert']}, key: {files['key']}}}}}\n"
              + LIMITS)
    with LogTap() as tap, ProxyRunner(config) as proxy:
        yield proxy, tap, files["ca"]
        assert proxy.alive()


def test_tls_handshakes_that_never_finish(tls_proxy: tuple[ProxyRunner, LogTap, Path],
                                          kafka: KafkaCluster) -> None:
    proxy, tap, ca = tls_proxy
    topic = unique("tls-traffic")
    kafka.create_topic(topic)
    hello = _client_hello_prefix()
    stuck = [connect(proxy.port) for _ in range(5)]
    half = [connect(proxy.port) for _ in range(5)]
    for s in half:
        s.sendall(hello)  # a ClientHello cut short: the handshake can never complete
    started = time.monotonic()
    # A well-behaved TLS client meanwhile.
    conf = {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SSL",
            "ssl.ca.location": str(ca)}
    sent = produce(conf, topic, count=20)
    assert len(sent) == 20
    for s in stuck + half:
        waited = wait_closed(s, HANDSHAKE_TIMEOUT * 5)
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT * 3, waited
    for s in stuck + half:
        logged_once(tap, proxy, local_address(s), "TLS handshake failed")
        s.close()


def test_a_port_check_on_the_tls_listener_is_no_failed_handshake(
        tls_proxy: tuple[ProxyRunner, LogTap, Path]) -> None:
    """A load balancer's or Kubernetes' TCP check connects and closes (or resets)
    without a byte: one INFO line each, where every few seconds of warnings would bury
    the real ones; a ClientHello cut short by a close still warns."""
    proxy, tap, _ = tls_proxy
    closed, reset, cut = (connect(proxy.port) for _ in range(3))
    clients = {name: local_address(s) for name, s in
               (("closed", closed), ("reset", reset), ("cut", cut))}
    closed.close()
    # At once: reset while it may still wait in the listen queue, it is still named.
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset.close()  # an RST, not a FIN
    cut.sendall(_client_hello_prefix())
    cut.close()
    for name in ("closed", "reset"):
        logged_once(tap, proxy, clients[name], "closed before a TLS handshake began")
        assert [r.levelno for r in tap.about_latest(clients[name])] == [logging.INFO]
    logged_once(tap, proxy, clients["cut"], "TLS handshake failed")
    assert [r.levelno for r in tap.about_latest(clients["cut"])] == [logging.WARNING]


def _client_hello_prefix() -> bytes:
    """The first bytes of a real TLS ClientHello (from an in-memory handshake)."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        conn.do_handshake()
    data = outgoing.read()
    return data[: len(data) // 2]


def test_attacks_are_not_logged_above_warning(hostile: Setup) -> None:
    """Hostile input is the client's problem: nothing at ERROR (that is for the operator)."""
    errors = [r for r in hostile.tap.snapshot() if r.levelno >= logging.ERROR]
    assert errors == [], [(r.getMessage(), fields(r)) for r in errors]
