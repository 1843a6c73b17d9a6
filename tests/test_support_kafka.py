"""The test clusters' broker configuration (tests/support/kafka.py) as the broker reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.kafka import KafkaCluster, KafkaNode


def properties(cluster: KafkaCluster, tmp_path: Path) -> dict[str, str]:
    node = KafkaNode(node_id=0, port=9092, controller_port=9093, sasl_port=None, dir=tmp_path)
    lines = cluster._server_properties(node).splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_a_relayed_listener_advertises_the_relays_port(tmp_path: Path) -> None:
    cluster = KafkaCluster(1, relayed_listeners={"RELAY0": (9200, 9300), "RELAY1": (9201, 9301)})
    props = properties(cluster, tmp_path)
    assert props["listeners"].split(",") == [
        "PLAINTEXT://127.0.0.1:9092", "RELAY0://127.0.0.1:9200", "RELAY1://127.0.0.1:9201",
        "CONTROLLER://127.0.0.1:9093"]
    assert props["advertised.listeners"].split(",") == [
        "PLAINTEXT://127.0.0.1:9092", "RELAY0://127.0.0.1:9300", "RELAY1://127.0.0.1:9301"]
    assert {"RELAY0:PLAINTEXT", "RELAY1:PLAINTEXT"} <= set(
        props["listener.security.protocol.map"].split(","))
    # The brokers still talk to each other on their own listener.
    assert props["inter.broker.listener.name"] == "PLAINTEXT"


def test_relayed_listeners_are_for_one_node() -> None:
    with pytest.raises(ValueError, match="one node only"):
        KafkaCluster(3, relayed_listeners={"RELAY0": (9200, 9300)})
