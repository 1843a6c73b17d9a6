"""The group census and the KIP-559 fallback counter, with real consumers on Kafka 4.4."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import confluent_kafka as ck

from tests.support.clients import produce, unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``condition`` (the proxy thread updates metrics after it answers the client)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def first_message(consumer: ck.Consumer, timeout: float = 60.0) -> Any:
    """Poll until a message arrives: the consumer has joined and been assigned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            return msg
    raise AssertionError("no message within the timeout")


def test_census_counts_classic_and_kip848_groups_while_members_live(
        kafka: KafkaCluster) -> None:
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("groups")
        kafka.create_topic(topic, partitions=2)
        conf = {"bootstrap.servers": proxy.bootstrap}
        produce(conf, topic, count=10)

        def groups(protocol_type: str, protocol: str) -> float:
            return proxy.sample("gatehouse_consumer_groups", protocol_type=protocol_type,
                                protocol=protocol)

        base = {**conf, "auto.offset.reset": "earliest", "log_level": 3}
        classic = [ck.Consumer({**base, "group.id": unique("classic"), "group.protocol":
                                "classic", "partition.assignment.strategy": "roundrobin",
                                "session.timeout.ms": 6000}) for _ in range(2)]
        modern = ck.Consumer({**base, "group.id": unique("kip848"),
                              "group.protocol": "consumer", "group.remote.assignor": "range"})
        try:
            for consumer in [*classic, modern]:
                consumer.subscribe([topic])
                first_message(consumer)
            # Two classic groups chose roundrobin; one KIP-848 group asked for range.
            assert wait_until(lambda: groups("consumer", "roundrobin") == 2)
            assert wait_until(lambda: groups("consumer", "range") == 1)
            classic[0].close()
            assert wait_until(lambda: groups("consumer", "roundrobin") == 1)
            modern.close()
            assert wait_until(lambda: groups("consumer", "range") == 0)
            assert groups("consumer", "roundrobin") == 1
        finally:
            for consumer in [*classic[1:]]:
                consumer.close()
        assert wait_until(lambda: groups("consumer", "roundrobin") == 0)
        # librdkafka's classic protocol uses JoinGroup v5 / SyncGroup v3 (before KIP-559).
        # Each group's one member is its leader: one JoinGroup response with member
        # metadata, one SyncGroup request with assignments and one SyncGroup response with
        # an assignment per group, each resolved from the JoinGroup on its connection.
        for api, direction in (("JoinGroup", "response"), ("SyncGroup", "request"),
                               ("SyncGroup", "response")):
            assert proxy.sample("gatehouse_group_protocol_fallbacks_total", api=api,
                                direction=direction, outcome="resolved") == 2, (api, direction)
        assert sum_samples(proxy, "gatehouse_group_protocol_fallbacks_total",
                           outcome="unresolved") == 0


def test_java_classic_consumer_needs_no_fallback(kafka: KafkaCluster) -> None:
    """Kafka 4.4's Java consumer joins with JoinGroup v7+ and SyncGroup v5+: its group
    payloads say their protocol type, so none is counted as a fallback."""
    with ProxyThread(kafka.bootstrap) as proxy:
        topic = unique("java-groups")
        kafka.create_topic(topic, partitions=1)
        produce({"bootstrap.servers": proxy.bootstrap}, topic, count=100)
        result = kafka.run_java_tool(
            "org.apache.kafka.tools.ConsumerPerformance", "--bootstrap-server",
            proxy.bootstrap, "--topic", topic, "--messages", "100", "--group",
            unique("g"), "--timeout", "60000", timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        joins = [s for family in proxy.metrics.registry.collect() for s in family.samples
                 if s.name == "gatehouse_requests_total" and s.labels["api"] == "JoinGroup"
                 and s.value]
        assert joins and min(int(s.labels["version"]) for s in joins) >= 7
        assert sum_samples(proxy, "gatehouse_group_protocol_fallbacks_total") == 0
        # The group left when the tool exited.
        assert wait_until(lambda: sum_samples(proxy, "gatehouse_consumer_groups") == 0)


def sum_samples(proxy: ProxyThread, name: str, **labels: str) -> float:
    total = 0.0
    for family in proxy.metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_rename_rule_decodes_pre_kip559_payloads_with_the_fallback(
        kafka: KafkaCluster) -> None:
    """Behind a rename, librdkafka's JoinGroup v5 / SyncGroup v3 payloads are decoded with
    the protocol type its JoinGroup declared (the rules count it; nothing undecodable)."""
    broker_name = unique("renamed.orders")
    rules = f"- name: orders-alias\n  rename_topics: {{orders: {broker_name}}}\n"
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        kafka.create_topic(broker_name, partitions=2)
        conf = {"bootstrap.servers": proxy.bootstrap}
        produce(conf, "orders", count=10)
        consumer = ck.Consumer({**conf, "group.id": unique("g"), "auto.offset.reset":
                                "earliest", "session.timeout.ms": 6000, "log_level": 3})
        try:
            consumer.subscribe(["orders"])
            assert first_message(consumer).topic() == "orders"
        finally:
            consumer.close()
        assert proxy.sample("gatehouse_rename_group_payloads_total", outcome="fallback") >= 2
        for outcome in ("undecodable", "unknown_protocol"):
            assert proxy.sample("gatehouse_rename_group_payloads_total", outcome=outcome) == 0
        assert proxy.sample("gatehouse_group_protocol_fallbacks_total", api="SyncGroup",
                            direction="response", outcome="resolved") == 1
