"""Clients through a tenant prefix (``hide_others``, groups too) on a real Apache Kafka
broker, beyond the consumers and producers of tests/integration/test_rules_groups.py:
Java's admin client, every call on the tenant's own topic (created, described by name
and by id, partitions added, configured, offsets listed, records deleted, producers, log
dirs, a preferred election, a reassignment, a group's offsets, deleted); kafka-python's
admin (its own encoding of the same APIs) around a live consumer group, whose member
subscriptions and assignments it decodes; librdkafka's admin; aiokafka's admin,
producer (transactional too) and consumer group; Kafka 3.9's Java producer and consumer
group. All of it lands on the broker under the prefix and answers with the tenant's
names; nothing of another tenant's is shown."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient

from scripts.fetch_kafka import PREVIOUS_KAFKA_VERSION, ensure_kafka
from tests.integration.test_rules_groups import committed, transactions
from tests.reliability.test_no_loss import consumed_records, start_tool
from tests.support.clients import produce, unique, watermarks
from tests.support.kafka import JAVA_SOURCES, KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = ("- name: tenant-a\n  match: {client_id: '^a-'}\n"
         "  topic_prefix: {broker: 'a.', hide_others: true, groups: true,"
         " transactional_ids: true}\n")


def test_a_tenants_admin_calls_reach_its_own_topic_and_show_no_other(
        kafka: KafkaCluster) -> None:
    theirs = unique("b.secret")
    kafka.create_topic(theirs)
    produce({"bootstrap.servers": kafka.bootstrap}, theirs, count=3)
    topic, group = unique("stock"), unique("auditors")
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        java = kafka.run_java_tool(
            str(JAVA_SOURCES / "TenantAdmin.java"), proxy.bootstrap, "a-admin", topic,
            theirs, group, str(kafka.nodes[0].node_id), timeout=180)
    assert java.returncode == 0, java.stderr[-3000:]
    said = dict(line.split(" ", 1) for line in java.stdout.splitlines())

    assert said["create"] == f"ok {topic}"
    shown = said["list"].removeprefix("ok ").split(",")
    assert topic in shown
    on_broker = set(broker.list_topics(timeout=10).topics)
    # Only the tenant's topics, by its names (its own since deleted).
    assert all("a." + name in on_broker for name in shown if name != topic), shown
    assert theirs not in shown and not any(n.startswith("a.") for n in shown)
    assert said["describe"] == f"ok {topic} 2"
    assert said["describe-by-id"] == f"ok {topic}"
    assert said["partitions"] == "ok 3"
    assert said["config"] == "ok 3600000"
    assert said["offsets"] == "ok 3"
    assert said["delete-records"] == "ok 1"
    assert said["producers"] == "ok 1"
    dirs = said["log-dirs"].removeprefix("ok ").split(",")
    assert topic in dirs and set(dirs) <= set(shown), dirs
    assert said["replica-log-dir"] == "ok found"
    assert said["elect"] == f"ok [{topic}-0] ElectionNotNeededException"
    assert said["reassign"] == "ok []"
    assert said["group-offsets"] == "ok 2"
    assert said["delete-group-offsets"] == "ok []"
    # Another tenant's topic is no topic here (it names a. + it, which does not exist).
    assert said["other"] == "UnknownTopicOrPartitionException"
    assert said["delete"] == f"ok {topic}"

    # It was all the tenant's topic on the broker, now deleted; the other's untouched.
    on_broker = set(broker.list_topics(timeout=10).topics)
    assert "a." + topic not in on_broker and topic not in on_broker
    assert theirs in on_broker


async def aiokafka_tenant(bootstrap: str, topic: str, group: str, tx: str
                          ) -> dict[str, Any]:
    """aiokafka as tenant a: its admin creates ``topic`` and describes it; a
    transactional producer writes 5 records (committed) and 2 (aborted); a consumer in
    ``group`` reads the committed ones (read_committed) and commits; what each saw."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    seen: dict[str, Any] = {}
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="a-aio-admin")
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1)])
        # The broker's metadata can trail the controller's answer to CreateTopics by a
        # moment (KRaft): list until the new topic shows (a broken rule never shows it).
        async with asyncio.timeout(30):
            while topic not in (listed := set(await admin.list_topics())):
                await asyncio.sleep(0.1)
        seen["listed"] = listed
        [described] = await admin.describe_topics([topic])
        seen["described"] = (described["topic"], described["error_code"],
                             len(described["partitions"]))
        [configs] = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic)])
        seen["configs"] = [(r[0], r[3]) for r in configs.resources]  # (error, name)

        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, client_id="a-aio-tx",
                                    transactional_id=tx)
        await producer.start()
        try:
            async with producer.transaction():
                for i in range(5):
                    await producer.send_and_wait(topic, f"kept-{i}".encode(), partition=0)
            await producer.begin_transaction()
            for i in range(2):
                await producer.send_and_wait(topic, f"dropped-{i}".encode(), partition=0)
            await producer.abort_transaction()
        finally:
            await producer.stop()

        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap,
                                    client_id="a-aio-reader", group_id=group,
                                    auto_offset_reset="earliest", enable_auto_commit=False,
                                    isolation_level="read_committed")
        await consumer.start()
        try:
            got: list[bytes] = []
            async with asyncio.timeout(60):
                while len(got) < 5:
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        got.extend(r.value for r in records)
            await consumer.commit()
            seen["read"] = got
            seen["committed"] = await consumer.committed(TopicPartition(topic, 0))
        finally:
            await consumer.stop()
        seen["groups"] = {g[0] for g in await admin.list_consumer_groups()}
        offsets = await admin.list_consumer_group_offsets(group)
        seen["group_offsets"] = {(tp.topic, tp.partition): o.offset for tp, o in offsets.items()}
    finally:
        await admin.close()
    return seen


def test_aiokafka_as_a_tenant_writes_reads_and_administers_its_own(
        kafka: KafkaCluster) -> None:
    theirs = unique("b.ledger")
    kafka.create_topic(theirs)
    topic, group, tx = unique("events"), unique("aio-readers"), unique("aio-tx")
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        seen = asyncio.run(aiokafka_tenant(proxy.bootstrap, topic, group, tx))

    assert topic in seen["listed"] and theirs not in seen["listed"]
    assert not any(n.startswith(("a.", "b.")) for n in seen["listed"]), seen["listed"]
    assert seen["described"] == (topic, 0, 2)
    assert seen["configs"] == [(0, topic)]
    assert seen["read"] == [f"kept-{i}".encode() for i in range(5)]
    # Past the 5 records and their commit marker, the aborted 2 and their marker.
    assert seen["committed"] == 9
    assert group in seen["groups"]
    assert not any(g.startswith("a.") for g in seen["groups"]), seen["groups"]
    assert seen["group_offsets"] == {(topic, 0): 9, (topic, 1): 0}

    # On the broker: the tenant's topic, group and transaction, under the prefix.
    assert "a." + topic in broker.list_topics(timeout=10).topics
    assert "a." + group in {g.group_id for g in broker.list_consumer_groups().result().valid}
    [described] = broker.describe_consumer_groups(["a." + group]).values()
    assert described.result().group_id == "a." + group
    assert transactions(kafka.bootstrap, "ops", "a." + tx)["a." + tx] == (0, "CompleteAbort")


def test_kafka_python_as_a_tenant_administers_its_own(kafka: KafkaCluster) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic

    theirs = unique("b.ledger")
    kafka.create_topic(theirs)
    topic, group = unique("kp"), unique("kp-readers")
    first = TopicPartition(topic, 0)
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        admin = KafkaAdminClient(bootstrap_servers=proxy.bootstrap, client_id="a-kp-admin")
        try:
            created = admin.create_topics([NewTopic(topic, 2, 1)])
            assert [(t["name"], t["error_code"]) for t in created["topics"]] == [(topic, 0)]
            producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, client_id="a-kp",
                                     acks="all")
            for i in range(3):
                producer.send(topic, f"v{i}".encode(), partition=0)
            producer.flush(30)
            producer.close()
            consumer = KafkaConsumer(topic, bootstrap_servers=proxy.bootstrap,
                                     client_id="a-kp", group_id=group,
                                     auto_offset_reset="earliest", enable_auto_commit=False,
                                     consumer_timeout_ms=15000)
            assert [m.value for m, _ in zip(consumer, range(3), strict=False)] == [
                b"v0", b"v1", b"v2"]
            consumer.commit()
            # The live member's subscription and assignment (consumer-protocol bytes).
            [member] = admin.describe_groups([group])[group]["members"]
            assert member["member_metadata"]["topics"] == [topic]
            assert member["member_assignment"]["assigned_partitions"] == [
                {"topic": topic, "partitions": [0, 1]}]
            consumer.close()

            # Its own topics (the broker's under the prefix), none of the other's.
            shown = set(admin.list_topics())
            on_broker = set(broker.list_topics(timeout=10).topics)
            assert topic in shown and {"a." + n for n in shown} <= on_broker, shown
            [listed] = [g for g in admin.list_groups() if g["group_id"] == group]
            assert not any(g["group_id"].startswith("a.") for g in admin.list_groups())
            assert listed["group_type"] == "classic"
            assert set(admin.list_config_resources()["topic"]) == shown
            assert admin.describe_topics([theirs])[0]["error_code"] == 3  # no such topic
            [dirs] = admin.describe_log_dirs()
            in_dirs = {t["name"] for d in dirs["log_dirs"] for t in d["topics"]}
            assert topic in in_dirs and in_dirs <= shown, in_dirs - shown
            assert admin.delete_records({first: 1})[first]["low_watermark"] == 1
            offsets = admin.list_group_offsets(group)[group]
            assert {tp: o.offset for tp, o in offsets.items()} == {
                first: 3, TopicPartition(topic, 1): 0}
            assert admin.delete_groups([group]) == {group: "OK"}
            deleted = admin.delete_topics([topic])
            assert [(t["name"], t["error_code"]) for t in deleted["topics"]] == [(topic, 0)]
        finally:
            admin.close()
    assert theirs in broker.list_topics(timeout=10).topics
    assert "a." + group not in {g.group_id for g in broker.list_consumer_groups().result().valid}


def test_librdkafkas_admin_as_a_tenant_reaches_its_own_topic_only(kafka: KafkaCluster) -> None:
    """librdkafka's admin calls on the tenant's topic (DescribeTopicPartitions, ListOffsets, DeleteRecords, ElectLeaders, CreatePartitions, the configs both
    ways, a group's offsets altered and listed), each answered with the tenant's names."""
    from confluent_kafka import (
        ConsumerGroupTopicPartitions,
        ElectionType,
        TopicCollection,
        TopicPartition,
    )
    from confluent_kafka.admin import (
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        NewPartitions,
        NewTopic,
        OffsetSpec,
    )

    theirs = unique("b.ledger")
    kafka.create_topic(theirs)
    topic, group = unique("rd"), unique("rd-auditors")
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "a-rd"}
        admin = AdminClient(conf)
        [created] = admin.create_topics([NewTopic(topic, 2, 1)]).values()
        created.result(30)
        assert produce(conf, topic, count=4)

        [described] = admin.describe_topics(TopicCollection([topic])).values()
        by_name = described.result(30)
        assert (by_name.name, len(by_name.partitions)) == (topic, 2)
        [other] = admin.describe_topics(TopicCollection([theirs])).values()
        try:
            other.result(30)
            raise AssertionError("another tenant's topic was described")
        except ck.KafkaException as exc:
            assert exc.args[0].code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART

        partitions = [TopicPartition(topic, p) for p in (0, 1)]
        ends = {tp.partition: f.result(30).offset for tp, f in admin.list_offsets(
            {tp: OffsetSpec.latest() for tp in partitions}).items()}
        assert sum(ends.values()) == 4
        [first] = [p for p, end in ends.items() if end > 0][:1]
        deleted = admin.delete_records([TopicPartition(topic, first, 1)])
        [(done, future)] = deleted.items()
        assert (done.topic, future.result(30).low_watermark) == (topic, 1)

        elected = admin.elect_leaders(ElectionType.PREFERRED,
                                      [TopicPartition(topic, 0)]).result(30)
        [(where, error)] = elected.items()
        assert where.topic == topic
        assert error is not None and error.code() == ck.KafkaError.ELECTION_NOT_NEEDED

        [grown] = admin.create_partitions([NewPartitions(topic, 3)]).values()
        grown.result(30)
        resource = ConfigResource("topic", topic, incremental_configs=[ConfigEntry(
            "retention.ms", "3600000", incremental_operation=AlterConfigOpType.SET)])
        [(_, altered)] = admin.incremental_alter_configs([resource]).items()
        altered.result(30)
        [(named, configs)] = admin.describe_configs([ConfigResource("topic", topic)]).items()
        assert named.name == topic
        assert configs.result(30)["retention.ms"].value == "3600000"

        [moved] = admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(
            group, [TopicPartition(topic, 0, 1)])]).values()
        assert [(tp.topic, tp.offset) for tp in moved.result(30).topic_partitions] == [
            (topic, 1)]
        [listed] = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group)]).values()
        assert [(tp.topic, tp.partition, tp.offset)
                for tp in listed.result(30).topic_partitions] == [(topic, 0, 1)]
        cluster = admin.describe_cluster().result(30)
        assert {n.port for n in cluster.nodes} <= proxy.broker_ports

    # On the broker: all of it the tenant's topic and group, under the prefix.
    on_broker = broker.list_topics("a." + topic, timeout=10).topics["a." + topic]
    assert len(on_broker.partitions) == 3
    [(_, configs)] = broker.describe_configs([ConfigResource("topic", "a." + topic)]).items()
    assert configs.result(30)["retention.ms"].value == "3600000"
    [offsets] = broker.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions("a." + group)]).values()
    assert [(tp.topic, tp.offset) for tp in offsets.result(30).topic_partitions] == [
        ("a." + topic, 1)]


def test_kafka_3_java_clients_as_a_tenant(kafka: KafkaCluster, tmp_path: Path) -> None:
    """Kafka 3.9's Java clients (the last 3.x, as many applications still ship: Produce v11
    by topic name, the classic group protocol) on the 4.4 broker through the prefix: an
    idempotent producer's records read back in order by a group that commits, all of it
    under the prefix on the broker."""
    libs = ensure_kafka(PREVIOUS_KAFKA_VERSION)
    topic, group, records = unique("legacy-java"), unique("legacy-readers"), 200
    kafka.create_topic("a." + topic)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        producer = start_tool(
            "producer", "org.apache.kafka.tools.VerifiableProducer",
            ["--topic", topic, "--bootstrap-server", proxy.bootstrap, "--max-messages",
             str(records), "--acks", "-1"],
            {"client.id": "a-producer", "enable.idempotence": "true", "retries": "2147483647"},
            tmp_path, libs, "--producer.config")
        assert producer.process.wait(120) == 0
        consumer = start_tool(
            "consumer", "org.apache.kafka.tools.VerifiableConsumer",
            ["--topic", topic, "--bootstrap-server", proxy.bootstrap, "--group-id", group,
             "--max-messages", str(records), "--reset-policy", "earliest", "--verbose"],
            {"client.id": "a-consumer"}, tmp_path, libs, "--consumer.config")
        assert consumer.process.wait(120) == 0
        assert proxy.summed("gatehouse_requests_total", api="Produce", version="11") > 0
    assert producer.named("tool_data")[-1]["acked"] == records
    acked = [e["value"] for e in producer.named("producer_send_success")]
    assert [value for _, _, value in consumed_records(consumer)] == acked
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    assert watermarks(kafka.bootstrap, "a." + topic) == (0, records)
    assert committed(broker, "a." + group, "a." + topic) == records
