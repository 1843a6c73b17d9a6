"""Java's admin client through a tenant prefix (``hide_others``) on a real Apache Kafka
broker: every call on the tenant's own topic (created, described by name and by id,
partitions added, configured, offsets listed, records deleted, producers, log dirs,
a preferred election, a reassignment, a group's offsets, deleted) lands on the broker
under the prefix and answers with the tenant's names, and nothing of another tenant's
is shown."""

from __future__ import annotations

from confluent_kafka.admin import AdminClient

from tests.support.clients import produce, unique
from tests.support.kafka import JAVA_SOURCES, KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = ("- name: tenant-a\n  match: {client_id: '^a-'}\n"
         "  topic_prefix: {broker: 'a.', hide_others: true, groups: true}\n")


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
