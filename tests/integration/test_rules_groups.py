"""Group ids under a tenant prefix with ``groups: true``, on a real Apache Kafka broker:
the tenant's consumer groups (librdkafka and the Java consumer, classic and KIP-848, the
admin calls), share groups (KIP-932) and Kafka Streams applications (KIP-1071, their
internal topics too) live on the broker under the prefix, the tenant sees them without
it, and never sees or touches another tenant's groups."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import confluent_kafka as ck
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from scripts.fetch_kafka import ensure_kafka_streams
from tests.integration.test_metrics_groups import JavaMember
from tests.integration.test_metrics_topics import versions_seen
from tests.integration.test_rules_topic_ids import call
from tests.support.clients import produce, unique
from tests.support.kafka import PERF, KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = ("- name: tenant-a\n  match: {client_id: '^a-'}\n"
         "  topic_prefix: {broker: 'a.', hide_others: true, groups: true}\n")


def read_and_commit(conf: dict[str, str], topic: str, group: str, count: int) -> list[bytes]:
    """``count`` records read by librdkafka in ``group``, then committed (synchronously)."""
    consumer = ck.Consumer({**conf, "group.id": group, "auto.offset.reset": "earliest",
                            "enable.auto.commit": False, "log_level": 0})
    got: list[bytes] = []
    try:
        consumer.subscribe([topic])
        for _ in range(120):
            if len(got) >= count:
                break
            for message in consumer.consume(count - len(got), timeout=0.5):
                if message.error() is None:
                    got.append(message.value())
        consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return got


def groups_listed(admin: AdminClient) -> set[str]:
    return {g.group_id for g in admin.list_consumer_groups(request_timeout=10).result().valid}


def committed(admin: AdminClient, group: str, topic: str) -> int:
    [future] = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, [TopicPartition(topic, 0)])]).values()
    [partition] = future.result().topic_partitions
    assert partition.error is None and partition.topic == topic
    return int(partition.offset)


def test_a_tenants_groups_live_under_its_prefix_and_others_are_out_of_reach(
        kafka: KafkaCluster, tmp_path: Path) -> None:
    topic = unique("a.orders")
    name = topic.removeprefix("a.")
    kafka.create_topic(topic)
    direct = {"bootstrap.servers": kafka.bootstrap}
    sent = produce(direct, topic, count=100, tag="first")
    theirs = unique("b.billing")
    assert len(read_and_commit(direct, topic, theirs, 100)) == 100  # another tenant's group
    broker = AdminClient(direct)
    mine, java, kip848, kp = (unique(g) for g in ("readers", "java", "kip848", "kp"))

    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "a-app"}
        assert sorted(read_and_commit(conf, name, mine, 100)) == sorted(sent)
        # On the broker the group and its offsets are the tenant's, under the prefix.
        assert "a." + mine in groups_listed(broker) and mine not in groups_listed(broker)
        assert committed(broker, "a." + mine, topic) == 100

        admin = AdminClient({**conf, "client.id": "a-admin"})
        listed = groups_listed(admin)
        assert mine in listed
        assert not any(g.startswith(("a.", "b.")) for g in listed)  # nothing foreign shown
        assert committed(admin, mine, name) == 100
        [described] = admin.describe_consumer_groups([mine]).values()
        assert described.result().group_id == mine

        # The group goes on from its commit: only the new records.
        later = produce(direct, topic, count=10, tag="later")
        assert sorted(read_and_commit(conf, name, mine, 10)) == sorted(later)
        # librdkafka on KIP-848's protocol (ConsumerGroupHeartbeat), from the start.
        kip848_rd = unique("kip848-rd")
        assert sorted(read_and_commit({**conf, "group.protocol": "consumer"}, name,
                                      kip848_rd, 110)) == sorted(sent + later)
        assert committed(broker, "a." + kip848_rd, topic) == 110
        assert versions_seen(proxy.metrics.registry, "ConsumerGroupHeartbeat",
                             "confluent-kafka-python")

        # The Java consumer, classic group protocol and KIP-848's.
        for group, protocol in ((java, "classic"), (kip848, "consumer")):
            kafka.consume_with_java(proxy.bootstrap, name, 110, "--group", group,
                                    "--command-property", "client.id=a-java",
                                    "--command-property", f"group.protocol={protocol}")
        # kafka-python, the classic group APIs.
        from kafka import KafkaConsumer

        old = KafkaConsumer(name, bootstrap_servers=proxy.bootstrap, client_id="a-kp",
                            group_id=kp, auto_offset_reset="earliest",
                            enable_auto_commit=False, consumer_timeout_ms=15000)
        got = [m.value for m, _ in zip(old, range(110), strict=False)]
        old.commit()
        old.close()
        assert sorted(got) == sorted(sent + later)
        assert committed(broker, "a." + kp, topic) == 110

        registry = proxy.metrics.registry
        # librdkafka looks a group up by one key (before v4), the others batch them.
        assert max(versions_seen(registry, "FindCoordinator", "confluent-kafka-python")) < 4
        assert versions_seen(registry, "ConsumerGroupHeartbeat", "apache-kafka-java")
        assert max(versions_seen(registry, "FindCoordinator", "apache-kafka-java")) >= 4
        on_broker = groups_listed(broker)
        assert {"a." + java, "a." + kip848} <= on_broker
        assert {java, kip848} <= groups_listed(admin)
        # Kafka's own tool (kafka-consumer-groups.sh --describe) as the tenant.
        (tmp_path / "tool.properties").write_text("client.id=a-tool\n")
        for group in (java, kip848):
            tool = kafka.run_java_tool(
                "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
                "--bootstrap-server", proxy.bootstrap, "--describe", "--group", group,
                "--command-config", str(tmp_path / "tool.properties"), timeout=120)
            assert tool.returncode == 0, tool.stderr[-2000:]
            rows = [line.split() for line in tool.stdout.splitlines()
                    if line.startswith(group)]
            assert [(row[1], row[2], row[3]) for row in rows] == [(name, "0", "110")], (
                tool.stdout)

        # Naming the other tenant's group reaches a group of the tenant's own.
        assert committed(admin, theirs, name) < 0  # nothing committed there
        [deleted] = admin.delete_consumer_groups([mine], request_timeout=10).values()
        deleted.result()
        assert "a." + mine not in groups_listed(broker)

    # The other tenant's group was never touched.
    assert theirs in groups_listed(broker)
    assert committed(broker, theirs, topic) == 100


TRANSACTIONS = ("- name: tenant-a\n  match: {client_id: '^a-'}\n"
                "  topic_prefix: {broker: 'a.', hide_others: true, groups: true,"
                " transactional_ids: true}\n")


def transactions(address: str, client_id: str, *ids: str) -> dict[str, tuple[int, str]]:
    """DescribeTransactions (or ListTransactions with no ids): id -> (error, state)."""
    if ids:
        body = call(address, 65, 0, {"transactional_ids": list(ids)}, client_id)
    else:
        body = call(address, 66, 1, {"state_filters": [], "producer_id_filters": []},
                    client_id)
    return {t.transactional_id: (getattr(t, "error_code", 0), t.transaction_state)
            for t in body.transaction_states}


def test_a_tenants_transactions_live_under_its_prefix(kafka: KafkaCluster) -> None:
    """Consume-transform-produce through the proxy: librdkafka reads a topic in a group
    and writes another in a transaction that carries the group's offsets; the Java
    producer (Produce v13, by topic id) writes in a transaction of its own. The broker
    holds both transactions and the group under the prefix; the tenant sees its own
    names, and not another tenant's transaction."""
    source, sink = unique("a.in"), unique("a.out")
    for topic in (source, sink):
        kafka.create_topic(topic)
    direct = {"bootstrap.servers": kafka.bootstrap}
    sent = produce(direct, source, count=50, tag="in")
    theirs = unique("b-tx")
    other = ck.Producer({**direct, "transactional.id": theirs, "log_level": 0})
    other.init_transactions(30)
    group, tx, tx_java = unique("etl"), unique("tx"), unique("tx-java")

    with ProxyThread(kafka.bootstrap, rules_yaml=TRANSACTIONS) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "client.id": "a-etl", "log_level": 0}
        consumer = ck.Consumer({**conf, "group.id": group, "auto.offset.reset": "earliest",
                                "enable.auto.commit": False})
        producer = ck.Producer({**conf, "transactional.id": tx})
        producer.init_transactions(30)
        consumer.subscribe([source.removeprefix("a.")])
        got: list[Any] = []
        for _ in range(120):
            if len(got) >= 50:
                break
            got += [m for m in consumer.consume(50 - len(got), timeout=0.5)
                    if m.error() is None]
        producer.begin_transaction()
        for message in got:
            producer.produce(sink.removeprefix("a."), value=message.value().upper())
        producer.send_offsets_to_transaction(consumer.position(consumer.assignment()),
                                             consumer.consumer_group_metadata(), 30)
        producer.commit_transaction(30)
        consumer.close()

        result = kafka.run_java_tool(
            PERF, "--topic", sink.removeprefix("a."), "--num-records", "100",
            "--record-size", "10", "--throughput", "-1", "--transactional-id", tx_java,
            "--transaction-duration-ms", "200", "--producer-props",
            f"bootstrap.servers={proxy.bootstrap}", "client.id=a-java", timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        registry = proxy.metrics.registry
        assert max(versions_seen(registry, "Produce", "apache-kafka-java")) >= 13

        seen = transactions(proxy.bootstrap, "a-admin")
        assert {tx, tx_java} <= seen.keys() and theirs not in seen  # its own, by its names
        assert transactions(proxy.bootstrap, "a-admin", tx)[tx] == (0, "CompleteCommit")
        # KIP-1152: a pattern over its own names (the broker's hold the prefix).
        matched = call(proxy.bootstrap, 66, 2, {
            "state_filters": [], "producer_id_filters": [],
            "transactional_id_pattern": re.escape(tx_java).replace("\\-", "-")},
            "a-admin")
        assert [t.transactional_id for t in matched.transaction_states] == [tx_java]

    on_broker = transactions(kafka.bootstrap, "ops", "a." + tx, "a." + tx_java, tx)
    assert on_broker["a." + tx] == (0, "CompleteCommit")
    assert on_broker["a." + tx_java][0] == 0
    assert on_broker[tx][0] != 0  # nothing by the client's own name
    assert committed(AdminClient(direct), "a." + group, source) == 50
    reader = ck.Consumer({**direct, "group.id": unique("check"), "log_level": 0,
                          "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    reader.subscribe([sink])
    values: list[bytes] = []
    for _ in range(120):
        if len(values) >= 150:
            break
        values += [m.value() for m in reader.consume(150 - len(values), timeout=0.5)
                   if m.error() is None]
    reader.close()
    assert sorted(v for v in values if b"-" in v) == sorted(v.upper() for v in sent)
    assert len(values) == 150



# Every client is the tenant's (the Java members set no client id to match on).
EVERYONE = "- name: tenant-a\n  topic_prefix: {broker: 'a.', hide_others: true, groups: true}\n"


def group_types(address: str, client_id: str = "ops") -> dict[str, str]:
    """ListGroups v5 (every type): group id -> its type (classic, consumer, share, streams)."""
    body = call(address, 16, 5, {"states_filter": [], "types_filter": []}, client_id)
    assert body.error_code == 0
    return {g.group_id: g.group_type for g in body.groups}


def group_config(address: str, group: str, key: str) -> str | None:
    """A group's config value (DescribeConfigs of a GROUP resource, KIP-848), as set."""
    body = call(address, 32, 4, {"resources": [
        {"resource_type": 32, "resource_name": group, "configuration_keys": [key]}],
        "include_synonyms": False, "include_documentation": False}, "a-admin")
    [resource] = body.results
    assert resource.error_code == 0 and resource.resource_name == group, resource
    return next((c.value for c in resource.configs if c.name == key), None)


def test_a_tenants_share_group_lives_under_its_prefix(kafka: KafkaCluster,
                                                      tmp_path: Path) -> None:
    """A Java share consumer (KIP-932) through the proxy: the group config it sets, its
    heartbeats, ShareFetch and acknowledgements all reach the tenant's group and topic
    under the prefix; the tenant describes its group by its own names."""
    topic = unique("a.jobs")
    name = topic.removeprefix("a.")
    kafka.create_topic(topic)
    values = produce({"bootstrap.servers": kafka.bootstrap}, topic, count=5)
    group = unique("workers")
    with ProxyThread(kafka.bootstrap, rules_yaml=EVERYONE) as proxy:
        args = [proxy.bootstrap, name, group]
        with JavaMember("ShareMember.java", kafka.libs, args, tmp_path / "share.log") as member:
            got = [member.wait_for("record ") for _ in values]
            assert sorted(got) == sorted(f"record {v.decode()}" for v in values)

            on_broker = group_types(kafka.bootstrap)
            assert on_broker.get("a." + group) == "share" and group not in on_broker
            # The member's group config (share.auto.offset.reset) is the tenant's group's.
            assert group_config(kafka.bootstrap, "a." + group, "share.auto.offset.reset") \
                == "earliest"
            shown = group_types(proxy.bootstrap, "a-admin")
            assert shown.get(group) == "share"
            assert not any(g.startswith("a.") for g in shown)
            assert group_config(proxy.bootstrap, group, "share.auto.offset.reset") == "earliest"

            described = call(proxy.bootstrap, 77, 1, {
                "group_ids": [group], "include_authorized_operations": False}, "a-admin")
            [shared] = described.groups
            assert shared.error_code == 0 and shared.group_id == group
            [one] = shared.members
            assert list(one.subscribed_topic_names) == [name]
            assert [t.topic_name for t in one.assignment.topic_partitions] == [name]
            # The group's offsets, of every topic it has (the broker's names unprefixed).
            offsets = call(proxy.bootstrap, 90, 1, {"groups": [
                {"group_id": group, "topics": None}]}, "a-admin")
            [of_group] = offsets.groups
            assert of_group.error_code == 0 and of_group.group_id == group
            assert [(t.topic_name, [q.partition_index for q in t.partitions])
                    for t in of_group.topics] == [(name, [0])]
            # Kafka's own tool (kafka-share-groups.sh --describe) sees the same.
            tool = kafka.run_java_tool(
                "org.apache.kafka.tools.consumer.group.ShareGroupCommand", "--bootstrap-server",
                proxy.bootstrap, "--describe", "--group", group, timeout=120)
            assert tool.returncode == 0, tool.stderr[-2000:]
            rows = [line.split() for line in tool.stdout.splitlines() if line.startswith(group)]
            assert [(row[0], row[1], row[2]) for row in rows] == [(group, name, "0")], tool.stdout
            member.leave()

        # Explicit acknowledgements (ShareAcknowledge): each record released once, so
        # delivered again, then accepted.
        again = unique("workers")
        args = [proxy.bootstrap, name, again, "release-first"]
        with JavaMember("ShareMember.java", kafka.libs, args, tmp_path / "again.log") as member:
            got = sorted(member.wait_for("record ") for _ in range(2 * len(values)))
            assert got == sorted(f"record {v.decode()} {n}" for v in values for n in (1, 2))
            member.leave()
        assert versions_seen(proxy.metrics.registry, "ShareAcknowledge", "apache-kafka-java")


def test_a_tenants_streams_app_and_its_internal_topics_live_under_its_prefix(
        kafka: KafkaCluster, tmp_path: Path) -> None:
    """A Kafka Streams application on the streams rebalance protocol (KIP-1071) with a
    repartition topic and a store's changelog, which the broker creates from the topology
    the member sends: through the proxy they are the tenant's (under the prefix), the
    application counts what it reads, and its group is the tenant's."""
    streams_libs = ensure_kafka_streams()
    topic = unique("a.words")
    name = topic.removeprefix("a.")
    kafka.create_topic(topic)
    words = [b"fig", b"kiwi", b"fig", b"plum", b"fig", b"kiwi"]
    producer = ck.Producer({"bootstrap.servers": kafka.bootstrap, "log_level": 0})
    for word in words:
        producer.produce(topic, word)
    assert producer.flush(30) == 0
    app = unique("counter")
    broker = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with ProxyThread(kafka.bootstrap, rules_yaml=EVERYONE) as proxy:
        args = [proxy.bootstrap, name, app, str(tmp_path / "state"), "count"]
        with JavaMember("StreamsMember.java", streams_libs, args,
                        tmp_path / "streams.log") as member:
            member.wait_for("state RUNNING")
            counts: dict[str, int] = {}
            while counts != {"fig": 3, "kiwi": 2, "plum": 1}:
                word, n = member.wait_for("count ").removeprefix("count ").split("=")
                counts[word] = int(n)
                assert counts[word] <= words.count(word.encode()), counts

            internal = {t for t in broker.list_topics(timeout=10).topics if app in t}
            # A repartition topic and a changelog, both the tenant's.
            assert any(t.endswith("-repartition") for t in internal), internal
            assert any(t.endswith("-changelog") for t in internal), internal
            assert all(t.startswith(f"a.{app}-") for t in internal), internal
            assert group_types(kafka.bootstrap).get("a." + app) == "streams"
            assert group_types(proxy.bootstrap, "a-admin").get(app) == "streams"
            # Its topology described (StreamsGroupDescribe) by the tenant's names.
            described = call(proxy.bootstrap, 89, 0, {
                "group_ids": [app], "include_authorized_operations": False}, "a-admin")
            [streams] = described.groups
            assert streams.error_code == 0 and streams.group_id == app
            named = {kind: sorted(n for s in streams.topology.subtopologies
                                  for n in names(s))
                     for kind, names in (
                         ("source", lambda s: s.source_topics),
                         ("sink", lambda s: s.repartition_sink_topics),
                         ("changelog", lambda s: [t.name for t in s.state_changelog_topics]),
                         ("repartition", lambda s: [t.name
                                                    for t in s.repartition_source_topics]))}
            shown = {t.removeprefix("a.") for t in internal}
            assert named["source"] == [name]
            assert named["sink"] == named["repartition"] and named["sink"]
            assert set(named["sink"]) | set(named["changelog"]) == shown, (named, shown)
            # Kafka's own tool (kafka-streams-groups.sh --describe) sees the same.
            tool = kafka.run_java_tool(
                "org.apache.kafka.tools.streams.StreamsGroupCommand", "--bootstrap-server",
                proxy.bootstrap, "--describe", "--group", app, timeout=120)
            assert tool.returncode == 0, tool.stderr[-2000:]
            rows = [line.split() for line in tool.stdout.splitlines() if line.startswith(app)]
            assert {row[1] for row in rows} == {name, *named["repartition"]}, tool.stdout
            member.leave()
