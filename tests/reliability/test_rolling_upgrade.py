"""A rolling upgrade behind the proxy: a 3-node KRaft cluster of Kafka 3.9 (the last 3.x
release) restarted node by node on Kafka 4.4 while Kafka's VerifiableProducer (idempotent,
acks=all) and VerifiableConsumer run through a tenant's proxy, then the cluster's features
finalized at 4.4's level through that proxy (kafka-features upgrade: UpdateFeatures).

Every acked record is in the log once, at the offset its producer was told, under the
tenant's prefix, and the group that lived through the upgrade got each of them; each
broker's ApiVersions answer read through the proxy is the broker's own at every step
(3.9's, then 4.4's: nothing kept from before a restart), so the producer moved from 3.9's
Produce version to 4.4's (topic ids, KIP-516, which the prefix maps) as the brokers did;
and a KIP-848 consumer, which needs the newly finalized group.version, reads through the
prefix afterwards.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from scripts.fetch_kafka import PREVIOUS_KAFKA_VERSION, ensure_kafka
from tests.integration.test_rules_groups import group_types, read_and_commit
from tests.reliability.support import wait_until
from tests.reliability.test_no_loss import (
    CONSUMER_CONFIG,
    PRODUCER_CONFIG,
    consumed_records,
    start_tool,
)
from tests.support.clients import unique, watermarks
from tests.support.kafka import KafkaCluster, run_java_tool, stop_process
from tests.support.proxythread import ProxyThread

PREFIX = "up."
RULES = (f"- name: tenant\n  topic_prefix: {{broker: '{PREFIX}', hide_others: true,"
         " groups: true}\n")
TOOLS = "org.apache.kafka.tools."
PARTITIONS = 3
# kafka-broker-api-versions: a broker's line, then one line per API.
BROKER_LINE = re.compile(r"^\S+:\d+ \(id: (\d+)", re.M)
API_LINE = re.compile(r"^\t(\w+)\(\d+\): (\d+) to (\d+)", re.M)
# kafka-features version-mapping's first line: the release's metadata.version.
RELEASE = re.compile(r"^metadata\.version=\d+ \(([\w.-]+)\)", re.M)


def api_versions(libs: Path, bootstrap: str) -> dict[int, dict[str, tuple[int, int]]]:
    """kafka-broker-api-versions at ``bootstrap``: each broker's API version ranges, by
    node id."""
    out = run_java_tool(libs, TOOLS + "BrokerApiVersionsCommand", "--bootstrap-server",
                        bootstrap, check=True).stdout
    lines = list(BROKER_LINE.finditer(out))
    return {int(line.group(1)): {name: (int(low), int(high)) for name, low, high in
                                 API_LINE.findall(out, line.end(), following.start()
                                                  if following else len(out))}
            for line, following in zip(lines, [*lines[1:], None], strict=True)}


def versions_as_the_brokers_answer(libs: Path, cluster: KafkaCluster,
                                   proxies: tuple[ProxyThread, ...]
                                   ) -> dict[int, dict[str, tuple[int, int]]]:
    """Each broker's API versions as it answers them, checked to be what each proxy
    passes on for it."""
    direct = api_versions(libs, cluster.bootstrap)
    for proxy in proxies:
        assert api_versions(libs, proxy.bootstrap) == direct, proxy.bootstrap
    return direct


def features(libs: Path, bootstrap: str, *args: str) -> str:
    return run_java_tool(libs, TOOLS + "FeatureCommand", "--bootstrap-server", bootstrap,
                         *args, check=True).stdout


def in_sync(cluster: KafkaCluster, topic: str) -> bool:
    """Every partition of ``topic`` has all its replicas in sync (the brokers say; a node
    just restarted may fail the question, which then says not yet)."""
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap, "log_level": 0})
    try:
        described = admin.describe_topics(ck.TopicCollection([topic]))[topic].result(
            timeout=10)
    except ck.KafkaException:
        return False
    return all(len(p.isr) == len(p.replicas) for p in described.partitions)


@pytest.mark.timeout(900)
def test_rolling_upgrade_from_kafka_3_to_4_behind_a_tenants_proxy(kafka_libs: Path,
                                                                 tmp_path: Path) -> None:
    new_libs, old_libs = kafka_libs, ensure_kafka(PREVIOUS_KAFKA_VERSION)
    topic, kip848_group = unique("upgrade"), unique("kip848")
    [release] = RELEASE.findall(features(new_libs, "127.0.0.1:1", "version-mapping"))
    with KafkaCluster(3, libs=old_libs) as cluster, \
            ProxyThread(cluster.bootstrap, rules_yaml=RULES) as proxy, \
            ProxyThread(cluster.bootstrap) as edge:  # no rules: the operators' view
        proxies = (proxy, edge)
        cluster.create_topic(PREFIX + topic, partitions=PARTITIONS, replication=3,
                             config={"min.insync.replicas": "2"})
        old_versions = versions_as_the_brokers_answer(new_libs, cluster, proxies)
        producer = start_tool(
            "producer", TOOLS + "VerifiableProducer",
            ["--topic", topic, "--bootstrap-server", proxy.bootstrap, "--max-messages", "-1",
             "--throughput", "300", "--acks", "-1"], PRODUCER_CONFIG, tmp_path, new_libs)
        consumer = start_tool(
            "consumer", TOOLS + "VerifiableConsumer",
            ["--topic", topic, "--bootstrap-server", proxy.bootstrap, "--group-id",
             unique("during"), "--verbose", "--reset-policy", "earliest",
             "--session-timeout", "20000"], CONSUMER_CONFIG, tmp_path, new_libs)
        acks = lambda: len(producer.named("producer_send_success"))  # noqa: E731

        def more_acks(what: str, n: int = 100) -> None:
            done = acks()
            wait_until(lambda: acks() > done + n, 120, what, interval=0.2)

        try:
            more_acks("the producer's first acks")
            took = []
            for i in range(len(cluster.nodes)):
                start = time.monotonic()
                cluster.stop_node(i)
                cluster.start_node(i, libs=new_libs)
                wait_until(lambda: in_sync(cluster, PREFIX + topic), 120,
                           f"node {i}'s replicas back in sync", interval=0.5)
                more_acks(f"acks after node {i}'s upgrade")
                took.append(time.monotonic() - start)
            new_versions = versions_as_the_brokers_answer(new_libs, cluster, proxies)

            upgraded = features(new_libs, proxy.bootstrap, "upgrade", "--release-version",
                                release)
            assert "metadata.version was upgraded to" in upgraded, upgraded
            assert "group.version was upgraded to 1." in upgraded, upgraded
            described = features(new_libs, proxy.bootstrap, "describe")
            assert re.search(rf"Feature: metadata\.version .*FinalizedVersionLevel: "
                             rf"{re.escape(release)}\s", described), described
            versions_as_the_brokers_answer(new_libs, cluster, proxies)
            more_acks("acks after the features' upgrade", 300)
        finally:
            stop_process(producer.process, 60)  # type: ignore[arg-type]
        assert producer.named("tool_data")[-1]["acked"] == acks()
        assert producer.named("producer_send_error") == []
        acked = {e["value"]: (e["partition"], e["offset"])
                 for e in producer.named("producer_send_success")}
        try:
            wait_until(lambda: {r[2] for r in consumed_records(consumer)} >= acked.keys(),
                       120, "the consumer that lived through the upgrade to catch up",
                       interval=0.5)
        finally:
            stop_process(consumer.process, 30)  # type: ignore[arg-type]
        after = start_tool(
            "consumer-after", TOOLS + "VerifiableConsumer",
            ["--topic", topic, "--bootstrap-server", proxy.bootstrap, "--group-id",
             unique("after"), "--verbose", "--reset-policy", "earliest", "--max-messages",
             str(len(acked))], CONSUMER_CONFIG, tmp_path, new_libs)
        assert after.process.wait(180) == 0
        log = consumed_records(after)

        # The producer followed the brokers' Produce versions: 3.9's newest, then 4.4's.
        old_produce, new_produce = (versions[0]["Produce"][1]
                                    for versions in (old_versions, new_versions))
        assert old_produce < new_produce
        assert {str(old_produce), str(new_produce)} <= {
            version for version, n in proxy.summed_by("gatehouse_requests_total", "version",
                                                      api="Produce").items() if n}
        # A consumer of the KIP-848 protocol, which the finalized group.version enabled.
        read = read_and_commit({"bootstrap.servers": proxy.bootstrap,
                                "group.protocol": "consumer"}, topic, kip848_group, 50)
        assert len(read) == 50
        # Listed by its coordinator (each broker lists its own groups).
        assert {group_types(node.bootstrap).get(PREFIX + kip848_group)
                for node in cluster.nodes} == {"consumer", None}
        on_broker = sum(watermarks(cluster.bootstrap, PREFIX + topic, p)[1]
                        for p in range(PARTITIONS))

    # Exactly once in the log, where the producer was told, all of it under the prefix.
    assert on_broker == len(acked)
    values = [value for _, _, value in log]
    assert len(values) == len(set(values)) == len(acked)
    assert {value: (p, o) for p, o, value in log} == acked
    # The group that lived through the upgrade: every acked record, each at its offset.
    seen = {(p, o): value for p, o, value in consumed_records(consumer)}
    assert set(seen.values()) >= acked.keys()
    assert all(acked[value] == (p, o) for (p, o), value in seen.items() if value in acked)
    print(f"\n{len(acked)} acked through the upgrade (nodes upgraded in "
          f"{', '.join(f'{t:.1f}' for t in took)} s); Produce v{old_produce} then "
          f"v{new_produce}; the group during it read {len(seen)} offsets")
