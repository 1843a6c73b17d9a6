"""A Kafka 3.x broker (the last 3.9 release, KRaft) behind the proxy, with clients that
use the versions Kafka 4.0 removed (KIP-896) and 3.x brokers still serve: kafka-python
pinned to Kafka 0.8.2 (Produce v0, Fetch v0, OffsetCommit v1: no group coordination), to
0.9 (Produce v1 with magic 0 message sets, Fetch v1, ListOffsets v0, Metadata v0) and to
0.10.1 (Produce v2 with magic 1, Fetch v3), and librdkafka on Kafka
0.9's protocol, through a tenant prefix
that renames every topic and group, counted by the metrics and the observation log; and a rule that keeps such
clients out, answered with UNSUPPORTED_VERSION in the version they sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from gatehouse.capture.observer import CaptureObserver
from gatehouse.capture.settings import CaptureSettings
from scripts.fetch_kafka import PREVIOUS_KAFKA_VERSION, ensure_kafka
from tests.integration.test_rules_groups import committed
from tests.support.clients import (
    consume,
    kafka_python_produce,
    kafka_python_read,
    kafka_python_send_one,
    produce,
    unique,
    watermarks,
)
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread
from tests.test_capture import read_records

RULES = "- name: tenant\n  topic_prefix: {broker: 'old.', hide_others: true, groups: true}\n"
NO_ANCIENT_PRODUCERS = "- name: no-ancient-producers\n  min_api_version: {Produce: 3}\n"
RECORDS = 30
PRODUCE_VERSION_OF = {(0, 8, 2): 0, (0, 9): 1, (0, 10, 1): 2}  # kafka-python's, pinned


@pytest.fixture(scope="module")
def kafka3(kafka_libs: Path) -> Iterator[KafkaCluster]:
    with KafkaCluster(1, libs=ensure_kafka(PREVIOUS_KAFKA_VERSION)) as cluster:
        yield cluster


@pytest.mark.parametrize("api_version", [(0, 8, 2), (0, 9), (0, 10, 1)],
                         ids=["kafka-0.8.2", "kafka-0.9", "kafka-0.10.1"])
def test_clients_of_removed_versions_through_a_tenant_prefix(
        kafka3: KafkaCluster, api_version: tuple[int, ...], tmp_path: Path) -> None:
    topic, group = unique("legacy"), unique("legacy-readers")
    kafka3.create_topic("old." + topic)
    sent = [f"record-{i}".encode() for i in range(RECORDS)]
    capture = CaptureObserver(CaptureSettings(dir=tmp_path / "captures", instance="k3"))
    with ProxyThread(kafka3.bootstrap, rules_yaml=RULES, observers=[capture]) as proxy:
        args = {"bootstrap_servers": proxy.bootstrap, "api_version": api_version}
        kafka_python_produce(args, sent, topic)
        assert kafka_python_read(args, topic, RECORDS, 20_000, group=group, commit=True) == sent
        produced = proxy.summed("gatehouse_topic_records_total", topic=topic,
                                direction="produce")
        fetched = proxy.summed("gatehouse_topic_records_total", topic=topic, direction="fetch")
    assert capture.close(10)
    # On the broker: the tenant's topic and group, under the prefix.
    assert watermarks(kafka3.bootstrap, "old." + topic) == (0, RECORDS)
    broker = AdminClient({"bootstrap.servers": kafka3.bootstrap})
    assert committed(broker, "old." + group, "old." + topic) == RECORDS
    # Counted by the metrics and logged, by the tenant's name, in the versions it used.
    assert (produced, fetched) == (RECORDS, RECORDS)
    logged = read_records(tmp_path / "captures")
    moved = {api: sum(t["records"] for r in logged if r["api"] == api for t in r["topics"]
                      if t["name"] == topic) for api in ("Produce", "Fetch")}
    assert moved == {"Produce": RECORDS, "Fetch": RECORDS}
    assert {r["api_version"] for r in logged if r["api"] == "Produce"} == {
        PRODUCE_VERSION_OF[api_version]}


def test_a_rule_keeps_clients_of_removed_versions_out(kafka3: KafkaCluster) -> None:
    topic = unique("guarded")
    kafka3.create_topic(topic)
    with ProxyThread(kafka3.bootstrap, rules_yaml=NO_ANCIENT_PRODUCERS) as proxy:
        refused = kafka_python_send_one(proxy.bootstrap, (0, 10, 1), topic)
        assert type(refused).__name__ == "UnsupportedVersionError", refused
        produce({"bootstrap.servers": proxy.bootstrap}, topic, count=5)  # librdkafka: v9+
        assert proxy.sample("gatehouse_rule_decisions_total", rule="no-ancient-producers",
                            action="refuse") >= 1
    assert watermarks(kafka3.bootstrap, topic) == (0, 5)


def test_librdkafka_on_kafka_0_9s_protocol_through_a_tenant_prefix(kafka3: KafkaCluster
                                                                    ) -> None:
    """librdkafka told the broker is Kafka 0.9 (no ApiVersions): Produce v1, Fetch v1,
    ListOffsets v0, Metadata v0 and the v0 group APIs, all through the prefix."""
    topic = unique("fallback")
    kafka3.create_topic("old." + topic)
    with ProxyThread(kafka3.bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "old-rdkafka",
                "api.version.request": False, "broker.version.fallback": "0.9.0"}
        sent = produce(conf, topic, count=RECORDS)
        assert sorted(consume(conf, topic, RECORDS)) == sorted(sent)
        used = {(s.labels["api"], s.labels["version"])
                for family in proxy.metrics.registry.collect() for s in family.samples
                if s.name == "gatehouse_requests_total"}
    assert {("Produce", "1"), ("Fetch", "1"), ("ListOffsets", "0"), ("Metadata", "0"),
            ("JoinGroup", "0")} <= used, used
    assert watermarks(kafka3.bootstrap, "old." + topic) == (0, RECORDS)
