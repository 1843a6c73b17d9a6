"""Several `gatehouse run` processes on the same ports (``reuse_port``), on a real
Apache Kafka broker: the kernel spreads client connections over them (one event loop,
one core each), clients see one proxy, and one process can stop while the other keeps
serving (a restart or an upgrade with no gap)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.integration.test_workers import ready, wait_for
from tests.support.clients import consume, produce, round_trip
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port, held_connections, wait_listening


def opened(metrics_port: int) -> float:
    """Client connections a process has served (its gatehouse_connections_total)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    found = re.search(r'^gatehouse_connections_total\{outcome="opened",side="client"\} '
                      r"([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def start(config: Path, metrics_port: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gatehouse.cli", "run", "--config", str(config),
         "--metrics-listen", f"127.0.0.1:{metrics_port}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def test_two_processes_share_the_ports_and_the_clients(kafka: KafkaCluster,
                                                        tmp_path: Path) -> None:
    port, broker_port = free_port(), free_port()
    [node] = [n.node_id for n in kafka.nodes]
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      f"brokers: {{start_port: null, ports: {{{node}: {broker_port}}}}}\n"
                      "reuse_port: true\n")
    metrics = [free_port(), free_port()]
    procs = [start(config, m, tmp_path / f"p{i}.log") for i, m in enumerate(metrics)]
    try:
        for i, (proc, metrics_port) in enumerate(zip(procs, metrics, strict=True)):
            wait_listening(metrics_port, proc)
            # Its proxy port bound too (its metrics endpoint may come up first): else the
            # kernel has only the other process's socket to give connections to.
            wait_for(lambda m=metrics_port: ready(m), "/readyz", proc, tmp_path / f"p{i}.log")
        # Connections spread over both processes (the kernel hashes each connection).
        with held_connections(port, 24):
            deadline = time.monotonic() + 30
            while sum(opened(m) for m in metrics) < 24 and time.monotonic() < deadline:
                time.sleep(0.1)
            counts = [opened(m) for m in metrics]
            assert sum(counts) == 24 and min(counts) > 0, counts

        topic, conf, sent = round_trip(kafka, f"127.0.0.1:{port}", "shared", 50)

        # One process stops (drains and exits 0); the other serves every new client.
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(30) == 0
        before = opened(metrics[1])
        more = produce(conf, topic, count=50, tag="after")
        assert sorted(consume(conf, topic, 100)) == sorted(sent + more)
        assert opened(metrics[1]) > before
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)


def test_without_reuse_port_a_second_process_says_the_port_is_taken(
        kafka: KafkaCluster, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      f"brokers: {{start_port: {free_port()}}}\n")
    first = start(config, free_port(), tmp_path / "first.log")
    try:
        wait_listening(port, first)
        log = tmp_path / "second.log"
        second = start(config, free_port(), log)
        assert second.wait(30) == 1
        assert (f'proxy failed error="cannot listen on 127.0.0.1:{port}: Address already '
                'in use"') in log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        first.terminate()
        first.wait(30)
