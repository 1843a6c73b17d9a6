"""/connections and `gatehouse connections` on a real Apache Kafka broker: real clients
(librdkafka, kafka-python) through `gatehouse run`, each listed with the client id,
software and traffic the proxy saw, gone once it closes; served to loopback clients
only by default."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
from kafka import KafkaConsumer

from tests.reliability.support import GatehouseProcess, wait_until
from tests.support.clients import produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port, port_is_listening
from tests.test_proxy_connections import get, non_loopback_address

GATEHOUSE = [sys.executable, "-m", "gatehouse.cli"]


@pytest.fixture
def gatehouse(kafka: KafkaCluster, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """`gatehouse run` with its metrics endpoint on every address: (bootstrap, metrics
    port)."""
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      f"brokers: {{start_port: 0}}\nmetrics: {{listen: 0.0.0.0:{metrics_port}}}\n"
                      "log: {level: WARNING}\n")
    with GatehouseProcess(config, port, tmp_path / "gatehouse.log") as proc:
        wait_until(lambda: port_is_listening(metrics_port), 10, "the metrics endpoint")
        yield f"127.0.0.1:{port}", metrics_port
        assert proc.stop() == 0, proc.log_text()


def listed(metrics_port: int) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/connections",
                                timeout=10) as answer:
        assert answer.headers["Content-Type"] == "application/json"
        doc = json.loads(answer.read())
    assert doc["count"] == len(doc["connections"])
    return list(doc["connections"])


def of(connections: list[dict[str, Any]], client_id: str) -> list[dict[str, Any]]:
    return [c for c in connections if c["client_id"] == client_id]


def test_real_clients_listed_as_the_proxy_saw_them(kafka: KafkaCluster,
                                                   gatehouse: tuple[str, int]) -> None:
    bootstrap, metrics_port = gatehouse
    topic = unique("conns")
    kafka.create_topic(topic, partitions=2)
    writer = ck.Producer({"bootstrap.servers": bootstrap, "client.id": "orders-writer",
                          "linger.ms": 5})
    values = [b"v" * 1000] * 500
    for value in values:
        writer.produce(topic, value)
    assert writer.flush(30) == 0
    reader = KafkaConsumer(topic, bootstrap_servers=bootstrap, client_id="orders-reader",
                           group_id=unique("g"), auto_offset_reset="earliest",
                           consumer_timeout_ms=15_000)
    try:
        got = [m.value for m, _ in zip(reader, range(500), strict=False)]
        assert got == values
        everything = listed(metrics_port)
        writers, readers = of(everything, "orders-writer"), of(everything, "orders-reader")
        assert writers and readers, everything
        for conn in writers:
            assert conn["software_name"] == "confluent-kafka-python"
            assert conn["software_version"].startswith(ck.version()[0])
        for conn in readers:
            assert conn["software_name"] == "kafka-python"
        for conn in writers + readers:
            assert conn["state"] == "open" and conn["upstream"] is not None
            assert conn["client"].startswith("127.0.0.1:")
        # The broker's connection carried the records: at least their bytes each way.
        assert sum(c["bytes_from_client"] for c in writers) > 500 * 1000
        assert sum(c["bytes_to_client"] for c in readers) > 500 * 1000
        assert any(c["listener"].startswith("broker-") for c in writers)
        # What each did: the records of the topic produced and fetched, exactly, on the
        # brokers' connections (read from the batch headers by the metrics).
        assert sum(c["produced"].get(topic, {}).get("records", 0) for c in writers) == 500
        assert sum(c["fetched"].get(topic, {}).get("records", 0) for c in readers) >= 500
        assert all(not c["fetched"] for c in writers) and all(not c["produced"] for c in readers)
        assert sum(c["requests_by_api"].get("Produce", 0) for c in writers) >= 1
        assert sum(c["requests_by_api"].get("Fetch", 0) for c in readers) >= 1
        assert all(sum(c["requests_by_api"].values()) == c["requests"]
                   for c in writers + readers)

        # The command: one row per connection, found by what the clients call themselves.
        table = subprocess.run(
            [*GATEHOUSE, "connections", "--metrics",
             f"http://127.0.0.1:{metrics_port}/metrics", "--match", "orders-", "--sort",
             "bytes"], capture_output=True, text=True, timeout=60,
            env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"}, check=True).stdout
        rows = [line for line in table.splitlines() if "orders-" in line]
        assert len(rows) == len(writers) + len(readers), table
        assert any("kafka-python" in row for row in rows)
        only = json.loads(subprocess.run(
            [*GATEHOUSE, "connections", "--metrics", f"127.0.0.1:{metrics_port}", "--match",
             "orders-reader", "--json"], capture_output=True, text=True, timeout=60,
            check=True).stdout)
        assert {c["client_id"] for c in only["connections"]} == {"orders-reader"}
        assert only["shown"] == len(readers)
        # Found by the topic it moves, too.
        by_topic = json.loads(subprocess.run(
            [*GATEHOUSE, "connections", "--metrics", f"127.0.0.1:{metrics_port}", "--match",
             topic, "--json"], capture_output=True, text=True, timeout=60,
            check=True).stdout)
        assert {c["client_id"] for c in by_topic["connections"]} == {"orders-writer",
                                                                     "orders-reader"}

        # Someone elsewhere on the network is not told who is connected.
        elsewhere = non_loopback_address()
        status, body = get(f"http://{elsewhere}:{metrics_port}/connections", elsewhere)
        assert status == 403 and b"orders" not in body
        assert get(f"http://{elsewhere}:{metrics_port}/metrics", elsewhere)[0] == 200
    finally:
        reader.close()
    # Closed: its connections leave the list; the producer's stay while it lives.
    wait_until(lambda: not of(listed(metrics_port), "orders-reader"), 30, "the reader to go")
    assert of(listed(metrics_port), "orders-writer")
    del writer
    wait_until(lambda: not of(listed(metrics_port), "orders-writer"), 30, "the writer to go")
    assert produce({"bootstrap.servers": bootstrap}, topic, count=1)  # still serving
