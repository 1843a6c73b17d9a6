"""Per-topic counters when clients name topics by id (Produce v13, Fetch v13+).

Kafka 4.4's own clients produce with Produce v13 and fetch with Fetch v17+, librdkafka
fetches with Fetch v13+: none of those frames carry a topic name.  The proxy names them
from the Metadata responses it has carried, so the counters are exact per topic name.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tests.support.clients import consume, unique
from tests.support.kafka import PERF, KafkaCluster
from tests.support.proxythread import ProxyThread


def versions_seen(registry: CollectorRegistry, api: str, software_prefix: str) -> set[int]:
    """The versions of ``api`` requests from clients whose KIP-511 name starts so."""
    found = set()
    for family in registry.collect():
        for s in family.samples:
            if (s.name == "gatehouse_requests_total" and s.labels["api"] == api
                    and s.labels["client_software"].startswith(software_prefix) and s.value):
                found.add(int(s.labels["version"]))
    return found


def test_topic_ids_resolved_to_names_for_java_and_librdkafka(kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("ids")
        kafka.create_topic(topic, partitions=2)
        produced = kafka.run_java_tool(
            PERF, "--topic", topic, "--num-records", "1000", "--record-size", "100",
            "--throughput", "-1", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "acks=all", timeout=120)
        assert produced.returncode == 0, produced.stderr[-2000:]
        registry = proxy.metrics.registry
        # The Java producer named the topic by id only.
        assert max(versions_seen(registry, "Produce", "apache-kafka-java")) >= 13
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="produce") == 1000

        conf = {"bootstrap.servers": proxy.bootstrap}
        assert len(consume(conf, topic, 1000)) == 1000
        assert min(versions_seen(registry, "Fetch", "confluent-kafka-python")) >= 13
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="fetch") == 1000

        kafka.consume_with_java(proxy.bootstrap, topic, 1000)
        assert min(versions_seen(registry, "Fetch", "apache-kafka-java")) >= 13
        assert proxy.sample("gatehouse_topic_records_total", topic=topic,
                            direction="fetch") == 2000
        # Nothing went unnamed, and bytes were counted for both directions.
        for direction in ("produce", "fetch"):
            assert proxy.sample("gatehouse_topic_records_total", topic="unknown",
                                direction=direction) == 0
            assert proxy.sample("gatehouse_topic_bytes_total", topic=topic,
                                direction=direction) > 100 * 1000
