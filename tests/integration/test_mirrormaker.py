"""MirrorMaker 2 (dedicated mode) between two tenants of one real Apache Kafka broker,
each reached through its own proxy with its own prefix: the "west" tenant's topic is
replicated to the "east" tenant as ``west.<topic>``, with its records in order, its
topic config, its ACL (DescribeAcls on the source, CreateAcls on the target), and a
consumer group's committed offset translated (offset syncs on the source, checkpoints
on the target, the group's offset written on the target).  MM2's
Java clients see only the names their tenant's proxy gives them; on the broker all of
it lies under the two prefixes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import confluent_kafka as ck
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from scripts.fetch_kafka import ensure_kafka_connect
from tests.integration.test_connect import wait_until
from tests.integration.test_rules_groups import committed, read_and_commit
from tests.integration.test_rules_topic_policy import topic_config
from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import KafkaCluster, start_java_process, stop_process
from tests.support.proxythread import ProxyThread

RECORDS = 300
RETENTION_MS = "12345678"
ALICE_READS = ("User:alice", "READ", "ALLOW")


def tenant(prefix: str) -> str:
    return (f"- name: {prefix}\n"
            f"  topic_prefix: {{broker: '{prefix}.', hide_others: true, groups: true}}\n")


def settled(read: Callable[[], object], expected: object) -> Callable[[], bool]:
    """A wait condition: ``read()`` gives ``expected`` (not yet while the topic or group
    is unknown to the client)."""
    def check() -> bool:
        try:
            return read() == expected
        except ck.KafkaException:
            return False
    return check


def mm2_properties(west: str, east: str, topic: str) -> str:
    """west -> east only; every interval short, every internal topic of one replica, an
    offset sync for every record (so the group's offset translates exactly)."""
    return "\n".join([
        "clusters=west,east", f"west.bootstrap.servers={west}",
        f"east.bootstrap.servers={east}", "west->east.enabled=true",
        f"west->east.topics={topic}", "east->west.enabled=false",
        "replication.factor=1", "checkpoints.topic.replication.factor=1",
        "heartbeats.topic.replication.factor=1", "offset-syncs.topic.replication.factor=1",
        "offset.storage.replication.factor=1", "status.storage.replication.factor=1",
        "config.storage.replication.factor=1", "offset.lag.max=0",
        "emit.checkpoints.interval.seconds=1", "sync.group.offsets.enabled=true",
        "sync.group.offsets.interval.seconds=1", "emit.heartbeats.interval.seconds=1",
        "refresh.groups.interval.seconds=5", "refresh.topics.interval.seconds=5",
        "sync.topic.acls.interval.seconds=1", ""])


def reader_acls(admin: AdminClient, topic: str) -> set[tuple[str, str, str]]:
    """The topic's ACL bindings named for it literally: (principal, operation, permission)."""
    found = admin.describe_acls(AclBindingFilter(
        ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, None, None, AclOperation.ANY,
        AclPermissionType.ANY)).result(30)
    return {(b.principal, b.operation.name, b.permission_type.name) for b in found
            if b.name == topic}


def test_mirrormaker_2_between_two_tenants(kafka_acls: KafkaCluster, tmp_path: Path) -> None:
    kafka = kafka_acls
    libs = ensure_kafka_connect()
    topic, group = unique("orders"), unique("readers")
    with (ProxyThread(kafka.bootstrap, rules_yaml=tenant("west")) as west,
          ProxyThread(kafka.bootstrap, rules_yaml=tenant("east")) as east):
        source = {"bootstrap.servers": west.bootstrap}
        source_admin = AdminClient(source)
        source_admin.create_topics([ck.admin.NewTopic(
            topic, 1, 1, config={"retention.ms": RETENTION_MS})])[topic].result(30)
        [created] = source_admin.create_acls([AclBinding(
            ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, "User:alice", "*",
            AclOperation.READ, AclPermissionType.ALLOW)]).values()
        created.result(30)
        sent = produce(source, topic, count=RECORDS, tag="order")
        assert read_and_commit(source, topic, group, RECORDS) == sent  # the group to translate

        config = tmp_path / "mm2.properties"
        config.write_text(mm2_properties(west.bootstrap, east.bootstrap, topic))
        log = tmp_path / "mm2.log"
        process = start_java_process(libs, "org.apache.kafka.connect.mirror.MirrorMaker",
                                     str(config), log=log)
        replica = f"west.{topic}"
        target = {"bootstrap.servers": east.bootstrap}
        target_admin = AdminClient(target)
        try:
            wait_until(settled(lambda: watermarks(east.bootstrap, replica), (0, RECORDS)), 180,
                       "every record in the east tenant's replica", log)
            wait_until(settled(lambda: committed(target_admin, group, replica), RECORDS), 120,
                       "the group's offset translated to the east tenant", log)
            wait_until(settled(lambda: reader_acls(target_admin, replica), {ALICE_READS}), 60,
                       "the topic's ACL copied to the east tenant's replica", log)
            east_topics = set(target_admin.list_topics(timeout=10).topics)
            west_topics = set(source_admin.list_topics(timeout=10).topics)
        finally:
            stop_process(process, 30, kill=True)
        # What the tenants see: their own names, MM2's names for what it made.
        assert consume(target, replica, RECORDS) == sent  # in order: one partition
        assert topic_config(target_admin, replica, "retention.ms") == RETENTION_MS
        assert {replica, "heartbeats", "west.checkpoints.internal",
                "mm2-configs.west.internal", "mm2-offsets.west.internal",
                "mm2-status.west.internal"} <= east_topics, east_topics
        assert {topic, "mm2-offset-syncs.east.internal"} <= west_topics, west_topics
        assert not any(t.startswith(("east.", "west.east.")) for t in east_topics | west_topics)

    # On the broker: the source under west., everything MM2 wrote for east under east.
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    on_broker = set(broker.list_topics(timeout=10).topics)
    assert {f"west.{topic}", "west.mm2-offset-syncs.east.internal", f"east.west.{topic}",
            "east.heartbeats", "east.west.checkpoints.internal"} <= on_broker, on_broker
    # (the replica's name in east, west.<topic>, is the source's on the broker)
    assert not {topic, "heartbeats", "mm2-offset-syncs.east.internal",
                "west.checkpoints.internal"} & on_broker
    assert watermarks(kafka.bootstrap, f"east.west.{topic}") == (0, RECORDS)
    assert topic_config(broker, f"east.west.{topic}", "retention.ms") == RETENTION_MS
    assert committed(broker, f"east.{group}", f"east.west.{topic}") == RECORDS
    assert committed(broker, f"west.{group}", f"west.{topic}") == RECORDS
    assert reader_acls(broker, f"east.west.{topic}") == {ALICE_READS}
    assert reader_acls(broker, f"west.{topic}") == {ALICE_READS}
