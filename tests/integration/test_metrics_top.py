"""`gatehouse top` against a real proxy's /metrics, with real clients behind it."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient, ConfigResource
from rich.console import Console

from gatehouse.cli.top import run_top
from tests.support.clients import consume, produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.ports import free_port, wait_listening

GATEHOUSE = [sys.executable, "-m", "gatehouse.cli"]


@pytest.fixture
def gatehouse(kafka: KafkaCluster, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`gatehouse run` with metrics (the clients' own too) and a refusing rule:
    (bootstrap, metrics URL)."""
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "gatehouse.yaml"
    config.write_text(f"listen: 127.0.0.1:{port}\nupstream: [{kafka.bootstrap}]\n"
                      f"brokers: {{start_port: 0}}\nmetrics: {{listen: 127.0.0.1:{metrics_port}, "
                      "client_telemetry: {push_interval: 30}}\n"
                      "rules:\n  - name: no-describe-configs\n    deny_apis: [DescribeConfigs]\n"
                      "log: {level: WARNING}\n")
    proc = subprocess.Popen([*GATEHOUSE, "run", "--config", str(config)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        wait_listening(metrics_port, proc)
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        proc.terminate()
        proc.wait(30)


def row(text: str, *first: str) -> list[str]:
    """The cells of the table row that starts with the cells ``first`` (rich draws │
    between cells)."""
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│|┃]", line)]
        cells = [c for c in cells if c]
        if tuple(cells[:len(first)]) == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{text}")


def test_top_once_shows_traffic_census_topics_and_refusals(
        kafka: KafkaCluster, gatehouse: tuple[str, str]) -> None:
    bootstrap, url = gatehouse
    topic = unique("top")
    kafka.create_topic(topic, partitions=2)
    conf = {"bootstrap.servers": bootstrap}
    produce(conf, topic, count=1000)
    assert len(consume(conf, topic, 1000)) == 1000
    admin = AdminClient({**conf, "client.id": "top-admin"})
    resource = ConfigResource("topic", topic)
    with pytest.raises(ck.KafkaException):
        admin.describe_configs([resource], request_timeout=10)[resource].result(10)

    # Between the two scrapes, 500 records go to another topic: rates come from them.
    other = unique("top-live")
    kafka.create_topic(other, partitions=1)

    def during_interval(seconds: float) -> None:
        produce(conf, other, count=500)

    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False, color_system=None)
    assert run_top(url, once=True, console=console, wait=during_interval) == 0
    text = out.getvalue()

    assert "ready" in text and "NOT READY" not in text
    # topic | produced rec/s | fetched rec/s | produced | fetched | bytes in/s | bytes out/s
    done = row(text, topic)
    assert done[1:5] == ["0", "0", "1,000", "1,000"]
    live = row(text, other)
    assert float(live[1].replace(",", "")) > 0 and live[3] == "500"
    assert float(row(text, "Produce")[1].replace(",", "")) > 0  # req/s over the interval
    assert row(text, "Fetch")
    # The admin client is still connected: one live librdkafka connection at least.
    assert int(row(text, "confluent-kafka-python")[2]) >= 1
    assert row(text, "no-describe-configs", "refuse")[3] == "1"
    assert row(text, "DescribeConfigs", "CLUSTER_AUTHORIZATION_FAILED")[3] == "1"
    assert row(text, "client")  # the connections table
    # /connections beside /metrics: the admin client's connections, one by one.
    busiest = text.split("Busiest connections", 1)[1]
    admins = [[c.strip() for c in re.split(r"[│|┃]", line) if c.strip()]
              for line in busiest.splitlines() if "top-admin" in line]
    assert admins and all(cells[0].isdigit() and cells[3].startswith("confluent-kafka")
                          for cells in admins), busiest
    # What the producers measured themselves and pushed as they closed (KIP-714).
    measured = row(text, "rdkafka", "confluent-kafka-python")
    assert float(measured[2]) >= 0  # the producer's record queue time, in ms


def test_top_command_once_and_unreachable(gatehouse: tuple[str, str]) -> None:
    bootstrap, url = gatehouse
    topic = unique("top-cli")
    produce({"bootstrap.servers": bootstrap}, topic, count=10)
    result = subprocess.run([*GATEHOUSE, "top", "--metrics", url, "--once", "--interval",
                             "0.2"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert row(result.stdout, topic)[3] == "10"
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    result = subprocess.run([*GATEHOUSE, "top", "--metrics", dead, "--once"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "error:" in result.stdout
