"""A certificate rotated under a running `gatehouse run`, as cert-manager rotates a
Kubernetes secret: the proxy notices the new files, new clients get the new certificate,
an open connection keeps working, and no restart is needed."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import trustme
from confluent_kafka.admin import AdminClient

from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port, wait_listening


def issue(tmp: Path, name: str) -> str:
    """A new CA and its certificate for the proxy, written over the proxy's files; the
    CA's file (for clients) is returned."""
    ca = trustme.CA()
    ca_file = tmp / f"{name}-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert = ca.issue_cert("localhost", "127.0.0.1")
    # The key first, then the certificate: a reload in between fails once, and the
    # certificate's change brings the next.
    cert.private_key_pem.write_to_path(str(tmp / "proxy.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "proxy.pem"))
    return str(ca_file)


def handshake_ok(port: int, ca_file: str) -> bool:
    context = ssl.create_default_context(cafile=ca_file)
    try:
        with (socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
              context.wrap_socket(raw, server_hostname="localhost")):
            return True
    except ssl.SSLCertVerificationError:
        return False


def wait_for_log(log: Path, text: str, proc: subprocess.Popen[bytes],
                 timeout: float = 30) -> None:
    """Until the proxy's log says ``text`` (its reload is the event awaited)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{log.read_text()[-2000:]}"
        time.sleep(0.1)


def test_a_rotated_certificate_is_served_without_a_restart(kafka: KafkaCluster,
                                                           tmp_path: Path) -> None:
    old_ca = issue(tmp_path, "old")
    port = free_port()
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      "brokers: {start_port: 0}\nlog: {level: INFO}\n"
                      f"tls: {{downstream: {{cert: {tmp_path}/proxy.pem, "
                      f"key: {tmp_path}/proxy.key}}}}\n")
    log = tmp_path / "gatehouse.log"
    proc = subprocess.Popen([sys.executable, "-m", "gatehouse.cli", "run", "--config",
                             str(config)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        wait_listening(port, proc)
        topic = unique("rotated")
        kafka.create_topic(topic)

        def conf(ca_file: str) -> dict[str, str]:
            return {"bootstrap.servers": f"127.0.0.1:{port}", "security.protocol": "SSL",
                    "ssl.ca.location": ca_file}

        before = produce(conf(old_ca), topic, count=10)
        opened = AdminClient(conf(old_ca))  # a connection open across the rotation
        assert topic in opened.list_topics(timeout=10).topics

        new_ca = issue(tmp_path, "new")
        wait_for_log(log, "TLS certificates reloaded", proc)
        assert handshake_ok(port, new_ca)
        assert not handshake_ok(port, old_ca)  # new handshakes: the new certificate only
        after = produce(conf(new_ca), topic, count=10)
        assert sorted(consume(conf(new_ca), topic, 20)) == sorted(before + after)
        assert topic in opened.list_topics(timeout=10).topics  # the open one carries on

        # A rotation that goes wrong keeps the certificate being served.
        (tmp_path / "proxy.pem").write_text("-----BEGIN CERTIFICATE-----\nhalf\n")
        wait_for_log(log, "TLS reload failed: keeping the old certificates", proc)
        assert handshake_ok(port, new_ca)
        produce(conf(new_ca), topic, count=5)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(20)
    assert watermarks(kafka.bootstrap, topic) == (0, 25)

