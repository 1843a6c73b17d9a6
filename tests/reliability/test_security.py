"""Security: no secret reaches the logs, the metrics (nor /connections) or the capture;
/metrics binds to localhost by default; upstream TLS verification is never turned off silently."""

from __future__ import annotations

import base64
import gzip
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
import trustme

from gatehouse import codecs
from gatehouse.proxy.config import Address, config_from_text
from tests.reliability.support import (
    FakeBrokerServer,
    GatehouseProcess,
    LogTap,
    ProxyRunner,
    api_versions_request,
    connect,
    fields,
    read_frame,
    scrape,
    wait_until,
)
from tests.support.clients import consume, produce, unique
from tests.support.fakebroker import frame_bytes, request, response_body
from tests.support.kafka import SCRAM_MECHANISM, SCRAM_PASSWORD, SCRAM_USER, KafkaCluster
from tests.support.ports import free_port

# --- a SCRAM-SHA-256 client (RFC 5802/7677) over a raw socket, so every secret is known ----


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Scram:
    """One SCRAM-SHA-256 conversation; afterwards ``secrets`` holds what must never leak."""

    def __init__(self, user: str, password: str) -> None:
        self.user, self.password = user, password
        self.nonce = _b64(os.urandom(18))
        self.secrets: dict[str, str] = {"password": password}

    def client_first(self) -> bytes:
        self.first_bare = f"n={self.user},r={self.nonce}"
        return f"n,,{self.first_bare}".encode()

    def client_final(self, server_first: bytes) -> bytes:
        text = server_first.decode()
        parts = dict(item.split("=", 1) for item in text.split(","))
        assert parts["r"].startswith(self.nonce)
        salted = hashlib.pbkdf2_hmac("sha256", self.password.encode(),
                                     base64.b64decode(parts["s"]), int(parts["i"]))
        client_key = _hmac(salted, b"Client Key")
        without_proof = f"c=biws,r={parts['r']}"
        self.auth_message = f"{self.first_bare},{text},{without_proof}".encode()
        signature = _hmac(hashlib.sha256(client_key).digest(), self.auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self.server_key = _hmac(salted, b"Server Key")
        self.secrets.update({
            "client proof": _b64(proof),
            "client key": _b64(client_key),
            "salted password (hex)": salted.hex(),
            "salted password (base64)": _b64(salted),
            "client-final message": f"{without_proof},p={_b64(proof)}",
        })
        return f"{without_proof},p={_b64(proof)}".encode()

    def check_server_final(self, server_final: bytes) -> None:
        expected = _b64(_hmac(self.server_key, self.auth_message))
        assert server_final.decode() == f"v={expected}"
        self.secrets["server signature"] = expected


def _call(sock: socket.socket, req: codecs.Request) -> Any:
    sock.sendall(frame_bytes(req.encode()))
    frame = read_frame(sock)
    assert frame is not None, "the proxy closed the connection"
    return codecs.decode_response(frame, req.api_key, req.api_version).body


def scram_session(port: int, handshake_version: int) -> dict[str, str]:
    """Authenticate as the SCRAM user through the proxy; then a Metadata request."""
    scram = Scram(SCRAM_USER, SCRAM_PASSWORD)
    with connect(port) as sock:
        hs = _call(sock, request(17, handshake_version, 1, mechanism=SCRAM_MECHANISM))
        assert hs.error_code == 0, hs
        if handshake_version == 0:  # raw tokens, no Kafka header (KIP-43)
            sock.sendall(frame_bytes(scram.client_first()))
            server_first = read_frame(sock)
            assert server_first is not None
            sock.sendall(frame_bytes(scram.client_final(server_first)))
            server_final = read_frame(sock)
            assert server_final is not None
        else:
            first = _call(sock, request(36, 2, 2, auth_bytes=scram.client_first()))
            assert first.error_code == 0, first
            final = _call(sock, request(36, 2, 3, auth_bytes=scram.client_final(first.auth_bytes)))
            assert final.error_code == 0, final
            server_final = final.auth_bytes
        scram.check_server_final(server_final)
        metadata = _call(sock, request(3, 12, 4, topics=None))
        assert metadata.brokers, "not authenticated"
    return scram.secrets


def _all_bytes(directory: Path) -> bytes:
    data = b""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            raw = path.read_bytes()
            data += gzip.decompress(raw) if path.suffix == ".gz" else raw
    return data


def _listening_hosts(pid: int, port: int) -> set[str]:
    """The addresses a process listens on for ``port`` (from /proc/<pid>/net/tcp)."""
    hosts = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host_hex, port_hex = local.split(":")
            if int(port_hex, 16) == port and state == "0A":  # LISTEN
                hosts.add(socket.inet_ntoa(struct.pack("<I", int(host_hex, 16)))
                          if len(host_hex) == 8 else host_hex)
    return hosts


@pytest.mark.parametrize("sasl", ["passed through", "at the proxy"])
def test_scram_secrets_never_reach_logs_metrics_or_capture(kafka_scram: KafkaCluster,
                                                           tmp_path: Path, sasl: str) -> None:
    """Passed through, the broker is the SCRAM server; at the proxy, the proxy is
    (sasl.downstream, the same user in its users file) and authenticates to the broker
    itself (sasl.upstream): its own exchange's password must not leak either."""
    port, metrics_port = free_port(), free_port()
    capture_dir = tmp_path / "capture"
    config = tmp_path / "gatehouse.yaml"
    at_the_proxy = ""
    if sasl == "at the proxy":
        (tmp_path / "admin.secret").write_text(SCRAM_PASSWORD)
        (tmp_path / "users.yaml").write_text(f"users:\n  {SCRAM_USER}: "
                                             "{password_file: admin.secret}\n")
        at_the_proxy = ("sasl:\n  downstream: {users_file: users.yaml}\n"
                        f"  upstream: {{mechanism: {SCRAM_MECHANISM}, username: {SCRAM_USER}, "
                        "password_file: admin.secret}\n")
    # metrics with a bare port: it must bind to localhost only
    config.write_text(
        f"listen: 127.0.0.1:{port}\nupstream: [{kafka_scram.sasl_bootstrap}]\n"
        f"brokers: {{start_port: 0}}\nmetrics: {{listen: {metrics_port}}}\n"
        f"capture: {{dir: {capture_dir}}}\nlog: {{level: DEBUG}}\n" + at_the_proxy)
    topic = unique("scram")
    kafka_scram.create_topic(topic)
    secrets: dict[str, str] = {}
    with GatehouseProcess(config, port, tmp_path / "gatehouse.log") as proc:
        wait_until(lambda: bool(_listening_hosts(proc.pid, metrics_port)), 10, "metrics")
        assert _listening_hosts(proc.pid, metrics_port) == {"127.0.0.1"}
        for version in (1, 0):
            for name, value in scram_session(port, version).items():
                secrets[f"{name} (SaslHandshake v{version})"] = value
        conf = {**kafka_scram.client_config(sasl=True), "bootstrap.servers": f"127.0.0.1:{port}"}
        sent = produce(conf, topic, count=10)
        assert sorted(consume(conf, topic, 10)) == sorted(sent)
        page = scrape(metrics_port)
        assert 'api="SaslAuthenticate"' in page  # the exchanges were seen and counted
        # /connections names the user of a live client's connections, and how it proved
        # who it is: nothing more.
        live = ck.Producer(conf)
        live.produce(topic, b"live")
        assert live.flush(30) == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/connections",
                                    timeout=10) as answer:
            listing = answer.read()
        del live
        proven = [c for c in json.loads(listing)["connections"]
                  if c["principal"] == SCRAM_USER]
        assert proven, listing
        assert {c["sasl_mechanism"] for c in proven} == {SCRAM_MECHANISM}
        assert proc.stop() == 0
    assert len(secrets) == 14
    log = proc.log_text()
    assert " DEBUG " in log
    if at_the_proxy:  # the proxy was the SCRAM server, and a SCRAM client to the broker
        assert "client authenticated" in log and "(sasl.upstream)" in log
    assert "SaslAuthenticate" in log or "SaslHandshake" in log or "connection closed" in log
    captured = _all_bytes(capture_dir)
    assert captured, "nothing was captured"
    assert b"SaslAuthenticate" in captured
    if at_the_proxy:  # its SASL answers are recorded as the proxy's, not as refusals
        assert any(f'"outcome":{gap}"by_proxy"'.encode() in captured for gap in ("", " "))
    # The user the broker accepted is recorded (a name, not a secret).
    assert any(f'"principal":{gap}"{SCRAM_USER}"'.encode() in captured for gap in ("", " "))
    places = {"log": log.encode(), "metrics": page.encode(), "capture": captured,
              "connections": listing}
    for where, text in places.items():
        for name, secret in secrets.items():
            assert secret.encode() not in text, f"{name} found in the {where}"
        assert SCRAM_PASSWORD.encode() not in text
        assert _b64(SCRAM_PASSWORD.encode()).encode() not in text


def test_metrics_listen_defaults_to_localhost() -> None:
    base = "listen: 127.0.0.1:9192\nupstream: [127.0.0.1:9092]\n"
    for block, expected in [
        ("metrics: {}", Address("127.0.0.1", 9464)),
        ("metrics: {listen: 9500}", Address("127.0.0.1", 9500)),
        ("metrics: {listen: ':9501'}", Address("127.0.0.1", 9501)),
        ("metrics: {listen: '0.0.0.0:9502'}", Address("0.0.0.0", 9502)),  # only if asked
    ]:
        assert config_from_text(base + block + "\n").metrics_listen == expected, block


# --- upstream TLS: verification on unless explicitly off, and then loudly -------------------------


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeBrokerServer]:
    """A TLS broker whose certificate no default trust store accepts."""
    import ssl

    untrusted = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    untrusted.issue_cert("127.0.0.1", "localhost").configure_cert(ctx)

    def answer(req: codecs.Request) -> Any:
        return response_body(18, req.api_version, api_keys=[
            {"api_key": 18, "min_version": 0, "max_version": 4}])

    with FakeBrokerServer(answer, ssl_context=ctx) as broker:
        yield broker


def _warnings_about_verification(tap: LogTap) -> list[logging.LogRecord]:
    return [r for r in tap.snapshot() if r.levelno == logging.WARNING
            and "verification is DISABLED" in r.getMessage()]


def test_upstream_verification_cannot_be_silently_disabled(
        tls_broker: FakeBrokerServer) -> None:
    base = f"listen: 127.0.0.1:0\nupstream: [{tls_broker.address}]\nbrokers: {{start_port: 0}}\n"
    # On by default: an untrusted broker certificate fails the connection.
    with LogTap() as tap, ProxyRunner(base + "tls: {upstream: {}}\n") as proxy, \
            connect(proxy.port) as sock:
        sock.sendall(api_versions_request(1))
        assert read_frame(sock) is None
        wait_until(lambda: any("CERTIFICATE_VERIFY_FAILED" in str(fields(r).get("reason"))
                               for r in tap.snapshot()), 10, "the verify failure")
        assert _warnings_about_verification(tap) == []
    # Off only when the config says so, with a warning on every start.
    for start in range(2):
        with LogTap() as tap, ProxyRunner(base + "tls: {upstream: {verify: false}}\n") as proxy:
            with connect(proxy.port) as sock:
                sock.sendall(api_versions_request(2))
                frame = read_frame(sock)
                assert frame is not None
                assert codecs.decode_response(frame, 18, 3).body.error_code == 0
            assert len(_warnings_about_verification(tap)) == 1, f"start {start}"
