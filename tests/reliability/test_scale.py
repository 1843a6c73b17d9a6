"""Scale: many concurrent connections (RSS measured) and many short-lived ones (no fd leak),
against `gatehouse run` as deployed, its memory and descriptors read from /proc."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gatehouse import codecs
from tests.reliability.support import (
    GatehouseProcess,
    api_versions_request,
    connect,
    fd_count,
    read_frame,
    rss_bytes,
    scaled,
    wait_until,
)
from tests.support.clients import consume, produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port

MiB = 2**20


@pytest.fixture(scope="module")
def gatehouse(kafka: KafkaCluster, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[GatehouseProcess]:
    d = tmp_path_factory.mktemp("scale")
    port = free_port()
    config = d / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      "brokers: {start_port: 0}\nlog: {level: WARNING}\n")
    with GatehouseProcess(config, port, d / "gatehouse.log") as proc:
        yield proc
        proc.check_alive()
        assert proc.stop() == 0


def _roundtrip(sock: socket.socket, correlation_id: int) -> None:
    sock.sendall(api_versions_request(correlation_id))
    frame = read_frame(sock)
    assert frame is not None
    resp = codecs.decode_response(frame, 18, 3)
    assert resp.header.correlation_id == correlation_id and resp.body.error_code == 0


def _settled_fds(pid: int) -> int:
    """The fd count once it stops moving (connections close asynchronously)."""
    last = fd_count(pid)
    while True:
        time.sleep(0.3)
        now = fd_count(pid)
        if now == last:
            return now
        last = now


def test_a_thousand_concurrent_connections(gatehouse: GatehouseProcess,
                                           kafka: KafkaCluster) -> None:
    total, active = 1000, 300
    baseline_rss = rss_bytes(gatehouse.pid)
    baseline_fds = _settled_fds(gatehouse.pid)
    socks: list[socket.socket] = []
    try:
        for _ in range(total):
            socks.append(connect(gatehouse.port, timeout=30))
        # each client connection is paired with one to the broker
        wait_until(lambda: fd_count(gatehouse.pid) >= baseline_fds + 2 * total, 60,
                   "the proxy to hold every connection and its upstream")
        busy = socks[:active]
        for round_ in range(5):
            for i, sock in enumerate(busy):
                sock.sendall(api_versions_request(round_ * active + i))
            for i, sock in enumerate(busy):
                frame = read_frame(sock)
                assert frame is not None
                assert codecs.decode_response(frame, 18, 3).header.correlation_id == \
                    round_ * active + i
        # real traffic through the same proxy while the thousand are held
        topic = unique("scale")
        kafka.create_topic(topic)
        conf = {"bootstrap.servers": f"127.0.0.1:{gatehouse.port}"}
        sent = produce(conf, topic, count=100)
        assert sorted(consume(conf, topic, 100)) == sorted(sent)
        held_rss = rss_bytes(gatehouse.pid)
        # idle ones are still served
        for i, sock in enumerate(socks[active::50]):
            _roundtrip(sock, 10_000 + i)
    finally:
        for sock in socks:
            sock.close()
    per_connection = (held_rss - baseline_rss) / total
    print(f"\nproxy RSS {baseline_rss / MiB:.1f} MiB idle, {held_rss / MiB:.1f} MiB with "
          f"{total} connections ({per_connection / 1024:.1f} KiB each)")
    assert held_rss < 400 * MiB
    assert per_connection < 200 * 1024
    wait_until(lambda: fd_count(gatehouse.pid) <= baseline_fds, 30,
               "the proxy's descriptors to return to the baseline")
    gatehouse.check_alive()


def test_short_lived_connections_leak_no_fds(gatehouse: GatehouseProcess) -> None:
    count = scaled(2000, 10_000)
    workers = 4
    warm = connect(gatehouse.port)
    _roundtrip(warm, 1)
    warm.close()
    baseline_fds = _settled_fds(gatehouse.pid)
    baseline_rss = rss_bytes(gatehouse.pid)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(n):
                with connect(gatehouse.port) as sock:
                    _roundtrip(sock, i)
        except BaseException as exc:
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(count // workers,)) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    elapsed = time.monotonic() - started
    assert errors == []
    # Abrupt ends too: connections reset mid-request.
    for i in range(scaled(200, 1000)):
        sock = connect(gatehouse.port)
        sock.sendall(api_versions_request(i)[:7])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
    wait_until(lambda: fd_count(gatehouse.pid) <= baseline_fds, 30,
               f"fds back to {baseline_fds} (now {fd_count(gatehouse.pid)})")
    grown = rss_bytes(gatehouse.pid) - baseline_rss
    print(f"\n{count} connections in {elapsed:.1f}s ({count / elapsed * 60:.0f}/min); "
          f"RSS grew {grown / MiB:.1f} MiB")
    assert grown < 32 * MiB
    gatehouse.check_alive()


def test_log_has_no_errors(gatehouse: GatehouseProcess) -> None:
    text = gatehouse.log_text()
    assert " ERROR " not in text and "Traceback" not in text, text[-3000:]
