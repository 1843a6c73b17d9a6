"""Gatehouse behind a TCP load balancer that sends the PROXY protocol header, on a real
Apache Kafka broker with librdkafka: the proxy serves each connection as the client the
header names (rules' ``source``, connection logs, the per-address limit), serves other
peers as they are, and closes a balancer connection without a good header, saying why.

The balancer is the test's own relay: it listens on 127.0.0.2 (the address the proxy
advertises), connects to the proxy from 127.0.0.3 and puts a header naming
198.51.100.7 (with the client's real port) in front of each connection."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from gatehouse import codecs
from gatehouse.proxy.proxyprotocol import V2_SIGNATURE
from tests.support.clients import consume, produce, unique
from tests.support.fakebroker import frame_bytes, request
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port
from tests.support.proxythread import ProxyThread

CLIENT_HOST = "198.51.100.7"  # who the balancer says each client is
BALANCER, FRONT = "127.0.0.3", "127.0.0.2"


def header(source_port: int) -> bytes:
    addresses = (ipaddress.IPv4Address(CLIENT_HOST).packed
                 + ipaddress.IPv4Address(FRONT).packed + struct.pack(">HH", source_port, 9))
    return V2_SIGNATURE + struct.pack(">BBH", 0x21, 0x11, len(addresses)) + addresses


def pump(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def balancer(ports: list[int]) -> Iterator[None]:
    """For each port: FRONT:port -> 127.0.0.1:port from BALANCER, with a header."""
    stop = threading.Event()
    listeners = []
    for port in ports:
        listener = socket.create_server((FRONT, port))
        listener.settimeout(0.2)
        listeners.append((listener, port))

    def serve(listener: socket.socket, port: int) -> None:
        while not stop.is_set():
            try:
                client, (_, client_port) = listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", port),
                                                source_address=(BALANCER, 0))
            upstream.sendall(header(client_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threads = [threading.Thread(target=serve, args=pair, daemon=True) for pair in listeners]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        for listener, _ in listeners:
            listener.close()


def api_versions_answer(sock: socket.socket) -> bytes:
    """An ApiVersions request on ``sock``; the answer's bytes (b"" if closed: reset, when
    the proxy closed with the request's bytes unread)."""
    sock.sendall(frame_bytes(request(18, 3, 1, client_software_name="raw",
                                     client_software_version="1").encode()))
    answer = b""
    try:
        while len(answer) < 4 or len(answer) < 4 + struct.unpack_from(">i", answer)[0]:
            if not (data := sock.recv(65536)):
                break
            answer += data
    except ConnectionResetError:
        pass
    return answer


def test_clients_behind_a_balancer_are_served_as_who_they_are(
        kafka: KafkaCluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    [node] = [n.node_id for n in kafka.nodes]
    port, broker_port = free_port(), free_port()
    config = (f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
              f"advertise_host: {FRONT}\n"
              f"brokers: {{start_port: null, ports: {{{node}: {broker_port}}}}}\n"
              f"proxy_protocol: {{from: [{BALANCER}/32]}}\n"
              "limits: {max_connections_per_ip: 50}\n")
    # Clients from the balancer's network may not delete topics.
    rules = ("- name: no-deletes-from-outside\n"
             f"  match: {{source: {CLIENT_HOST}/32}}\n  deny_apis: [DeleteTopics]\n")
    topic = unique("behind-lb")
    kafka.create_topic(topic)
    with ProxyThread(config_text=config, rules_yaml=rules) as proxy, balancer([port, broker_port]):
        conf = {"bootstrap.servers": f"{FRONT}:{port}"}
        sent = produce(conf, topic, count=20)
        assert sorted(consume(conf, topic, 20)) == sorted(sent)
        # The rule matched the client the header named, not the balancer.
        admin = AdminClient({**conf, "log_level": 0})
        [future] = admin.delete_topics([topic], operation_timeout=10).values()
        with pytest.raises(ck.KafkaException) as refused:
            future.result(30)
        assert refused.value.args[0].code() == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED
        assert topic in admin.list_topics(timeout=30).topics

        # A peer that is not a balancer is served as it is: no header read.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as direct:
            answer = api_versions_answer(direct)
        assert struct.unpack_from(">i", answer, 4)[0] == 1  # the correlation id
        # A balancer connection without a header: closed, and the log says why.
        with socket.create_connection(("127.0.0.1", port), timeout=10,
                                      source_address=(BALANCER, 0)) as bare:
            assert api_versions_answer(bare) == b""
        # The balancer's TCP health checks (connect, then close or reset): an INFO line
        # each, no warning.
        socket.create_connection(("127.0.0.1", port), timeout=10,
                                 source_address=(BALANCER, 0)).close()
        reset = socket.create_connection(("127.0.0.1", port), timeout=10,
                                         source_address=(BALANCER, 0))
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.close()  # an RST, not a FIN

        def logged() -> tuple[list[str], list[str]]:
            closed = [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
                      if r.getMessage() == "connection closed"]
            bad = [r.gatehouse_fields["error"] for r in caplog.records  # type: ignore[attr-defined]
                   if r.getMessage() == "connection closed: bad PROXY protocol header"]
            return [f["client"] for f in closed], bad

        def checks() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage()
                    == "connection closed before a PROXY protocol header (a port check?)"]

        deadline = time.monotonic() + 10
        while not (logged()[1] and len(checks()) >= 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        clients, bad = logged()
        assert len(bad) == 1 and "no PROXY protocol header: the connection began" in bad[0]
        assert [r.levelno for r in checks()] == [logging.INFO] * 2
        assert any(c.startswith(f"{CLIENT_HOST}:") for c in clients), clients
        assert not any(c.startswith(f"{BALANCER}:") for c in clients), clients
        assert proxy.sample("gatehouse_rule_decisions_total", rule="no-deletes-from-outside",
                            action="refuse") == 1
        assert codecs.decode_response(answer[4:], 18, 3).body.error_code == 0
