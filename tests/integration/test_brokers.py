"""The real-broker fixtures work: messages go through Apache Kafka (1 node, 3 nodes, SCRAM)
and Tansu with librdkafka (confluent-kafka), and a cluster node can be stopped and started."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient

from scripts.fetch_kafka import ensure_kafka, kafka_clients_jar
from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import SCRAM_MECHANISM, SCRAM_USER, KafkaCluster, process_state
from tests.support.tansu import TansuBroker


def round_trip(conf: dict[str, Any], topic: str) -> None:
    sent = produce(conf, topic)
    assert sorted(consume(conf, topic, len(sent))) == sorted(sent)


def test_kafka_libs_are_cached(kafka_libs: Path) -> None:
    assert ensure_kafka() == kafka_libs
    assert (kafka_libs.parent / ".complete").is_file()
    jar = kafka_clients_jar()
    assert jar.parent == kafka_libs and jar.name.startswith("kafka-clients-")


def test_single_node_round_trip(kafka: KafkaCluster) -> None:
    topic = unique("single")
    kafka.create_topic(topic, partitions=1, replication=1)
    round_trip({"bootstrap.servers": kafka.bootstrap}, topic)


def test_java_tool_producer_performance(kafka: KafkaCluster) -> None:
    topic = unique("perf")
    kafka.create_topic(topic)
    result = kafka.run_java_tool(
        "org.apache.kafka.tools.ProducerPerformance",
        "--topic", topic, "--num-records", "500", "--record-size", "100",
        "--throughput", "-1", "--producer-props", f"bootstrap.servers={kafka.bootstrap}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "500 records sent" in result.stdout
    assert watermarks(kafka.bootstrap, topic) == (0, 500)


def test_deleted_topics_leave_the_broker_and_its_disk(kafka: KafkaCluster) -> None:
    # What keeps a long benchmark's disk bounded: the topic and, a second later, its files.
    topic = unique("deleted")
    kafka.create_topic(topic, partitions=2)
    produce({"bootstrap.servers": kafka.bootstrap}, topic, count=200)
    data = Path(kafka.nodes[0].data_dir)

    def files() -> list[Path]:
        return [p for p in data.iterdir() if p.name.startswith(f"{topic}-")]

    assert sorted(p.name for p in files()) == [f"{topic}-0", f"{topic}-1"]
    kafka.delete_topics([topic, unique("never-created")])
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    assert topic not in admin.list_topics(timeout=10).topics
    deadline = time.monotonic() + 30
    while files() and time.monotonic() < deadline:  # no event to await: a file's removal
        time.sleep(0.1)
    assert files() == []
    kafka.delete_topics([topic])  # gone already: no error


def test_cluster_spreads_partitions(kafka_cluster: KafkaCluster) -> None:
    topic = unique("spread")
    kafka_cluster.create_topic(topic, partitions=3, replication=3)
    metadata = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap}).list_topics(
        topic=topic, timeout=10)
    assert set(metadata.brokers) == {0, 1, 2}
    partitions = metadata.topics[topic].partitions
    assert len(partitions) == 3
    for p in partitions.values():
        assert sorted(p.replicas) == [0, 1, 2]
        assert sorted(p.isrs) == [0, 1, 2]
    assert {p.leader for p in partitions.values()} == {0, 1, 2}
    round_trip({"bootstrap.servers": kafka_cluster.bootstrap}, topic)


def wait_full_isr(cluster: KafkaCluster, topic: str, timeout: float = 30.0) -> None:
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap, "log_level": 0})
    want = sorted(node.node_id for node in cluster.nodes)
    deadline = time.monotonic() + timeout
    while True:
        partitions = admin.list_topics(topic=topic, timeout=10).topics[topic].partitions
        if all(sorted(p.isrs) == want for p in partitions.values()):
            return
        assert time.monotonic() < deadline, {k: p.isrs for k, p in partitions.items()}
        time.sleep(0.2)


def test_cluster_survives_node_restart(kafka_cluster: KafkaCluster) -> None:
    topic = unique("restart")
    kafka_cluster.create_topic(topic, partitions=3, replication=3)
    conf = {"bootstrap.servers": kafka_cluster.bootstrap}
    before = produce(conf, topic, tag="before")
    kafka_cluster.stop_node(1)
    try:
        assert not kafka_cluster.nodes[1].running
        during = produce(conf, topic, tag="during")
    finally:
        kafka_cluster.start_node(1)
    assert kafka_cluster.nodes[1].running
    wait_full_isr(kafka_cluster, topic)
    after = produce(conf, topic, tag="after")
    sent = before + during + after
    assert sorted(consume(conf, topic, len(sent))) == sorted(sent)


def test_cluster_pause_and_resume(kafka_cluster: KafkaCluster) -> None:
    node = kafka_cluster.nodes[2]
    assert node.process is not None
    kafka_cluster.pause_node(2)
    try:
        assert process_state(node.process.pid) == "T"
    finally:
        kafka_cluster.resume_node(2)
    assert process_state(node.process.pid) != "T"


def test_scram_round_trip(kafka_scram: KafkaCluster) -> None:
    conf = kafka_scram.client_config(sasl=True)
    assert conf["sasl.mechanism"] == SCRAM_MECHANISM and conf["sasl.username"] == SCRAM_USER
    topic = unique("scram")
    round_trip(conf, topic)  # auto-created through the SASL listener


def test_scram_rejects_wrong_password(kafka_scram: KafkaCluster) -> None:
    errors: list[Any] = []
    producer = ck.Producer(kafka_scram.client_config(
        sasl=True, **{"sasl.password": "wrong", "error_cb": errors.append, "log_level": 0}))
    deadline = time.monotonic() + 15
    while not errors and time.monotonic() < deadline:
        producer.poll(0.2)  # serves error_cb
    assert [e.code() for e in errors][:1] == [ck.KafkaError._AUTHENTICATION], errors
    assert "invalid credentials" in errors[0].str()


def test_tansu_round_trip(tansu: TansuBroker) -> None:
    round_trip({"bootstrap.servers": tansu.bootstrap}, unique("tansu"))
