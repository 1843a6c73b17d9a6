"""Kafka's own command-line tools (kafka-configs, kafka-acls, kafka-get-offsets,
kafka-delete-records, kafka-leader-election, kafka-log-dirs, kafka-reassign-partitions,
kafka-transactions, kafka-features, kafka-metadata-quorum) run by a tenant through the
proxy, on a broker that keeps ACLs: each does its work under the tenant's prefix on the
broker and prints only the tenant's names; another tenant's topic, ACL and transaction
stay out of every listing.  And an operator's tools through the proxy at the edge of a
3-broker cluster."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import confluent_kafka as ck
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    NewTopic,
    ResourcePatternType,
    ResourceType,
)

from tests.integration.test_rules_groups import group_config, read_and_commit
from tests.integration.test_rules_topic_policy import topic_config
from tests.support.clients import produce, unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

TOOLS = "org.apache.kafka.tools."


def acls_on_broker(admin: AdminClient, prefix: str) -> set[tuple[str, str, str, str]]:
    """The broker's ACL bindings on names under ``prefix``: (resource type, name,
    pattern type, operation)."""
    found = admin.describe_acls(AclBindingFilter(
        ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY,
        AclPermissionType.ANY)).result(30)
    return {(b.restype.name, b.name, b.resource_pattern_type.name, b.operation.name)
            for b in found if b.name.startswith(prefix)}


def run_tool(kafka: KafkaCluster, bootstrap: str, name: str, *args: str,
             command: tuple[str, ...] = (), ok: bool = True) -> str:
    """Kafka's tool ``name`` (``command`` before its options) at ``bootstrap``: its
    output when it succeeds, as ``ok`` says it must; its error output when it fails."""
    run = kafka.run_java_tool(TOOLS + name, *command, "--bootstrap-server", bootstrap, *args,
                              timeout=120)
    assert (run.returncode == 0) == ok, (name, args, run.stdout, run.stderr[-3000:])
    return run.stdout if ok else run.stderr


def committed_transaction(conf: dict[str, str], transactional_id: str, topic: str) -> None:
    producer = ck.Producer({**conf, "transactional.id": transactional_id, "log_level": 0})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"in a transaction", partition=0)
    producer.commit_transaction(30)


def test_kafkas_tools_as_a_tenant(kafka_acls: KafkaCluster, tmp_path: Path) -> None:
    kafka = kafka_acls
    prefix = unique("t") + "."
    rules = (f"- name: tenant\n  topic_prefix: {{broker: '{prefix}', hide_others: true,"
             " groups: true, transactional_ids: true}\n")
    topic, group, txn = unique("tools"), unique("readers"), unique("txn")
    direct = {"bootstrap.servers": kafka.bootstrap}
    broker = AdminClient(direct)
    # Another tenant's topic, ACL and transaction, on the broker.
    theirs = unique("u") + ".secret"
    kafka.create_topic(theirs)
    [made] = broker.create_acls([AclBinding(
        ResourceType.TOPIC, theirs, ResourcePatternType.LITERAL, "User:eve", "*",
        AclOperation.READ, AclPermissionType.ALLOW)]).values()
    made.result(30)
    committed_transaction(direct, unique("u") + ".txn", theirs)

    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap}
        admin = AdminClient(conf)
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
        produce(conf, topic, count=100)
        read_and_commit(conf, topic, group, 100)
        committed_transaction(conf, txn, topic)
        ends = {p: watermarks(proxy.bootstrap, topic, p)[1] for p in (0, 1)}
        assert sum(ends.values()) == 102  # 100, one record and its commit marker

        def tool(name: str, *args: str, ok: bool = True) -> str:
            out = run_tool(kafka, proxy.bootstrap, name, *args, ok=ok)
            if ok:
                # Only the tenant's names: none of the broker's (its prefix, the other's).
                assert prefix not in out and theirs not in out, out
            return out

        # kafka-configs: a topic's and a group's (KIP-848) dynamic configs.
        tool("ConfigCommand", "--entity-type", "topics", "--entity-name", topic, "--alter",
             "--add-config", "retention.ms=5000000")
        assert "retention.ms=5000000" in tool("ConfigCommand", "--entity-type", "topics",
                                              "--entity-name", topic, "--describe")
        tool("ConfigCommand", "--entity-type", "groups", "--entity-name", group, "--alter",
             "--add-config", "consumer.session.timeout.ms=50000")
        shown = tool("ConfigCommand", "--entity-type", "groups", "--describe")
        assert f"Dynamic configs for group {group} are:" in shown, shown

        # kafka-acls: a consumer's, a producer's (transactional, idempotent) and a
        # prefixed ACL, then every ACL the tenant may see.
        tool("AclCommand", "--add", "--allow-principal", "User:bob", "--consumer", "--topic",
             topic, "--group", group)
        tool("AclCommand", "--add", "--allow-principal", "User:bob", "--producer", "--topic",
             topic, "--transactional-id", txn, "--idempotent")
        tool("AclCommand", "--add", "--allow-principal", "User:bob", "--operation", "Read",
             "--topic", "pre", "--resource-pattern-type", "prefixed")
        listed = tool("AclCommand", "--list")
        for resource in (f"resourceType=TOPIC, name={topic}, patternType=LITERAL",
                         f"resourceType=GROUP, name={group}, patternType=LITERAL",
                         f"resourceType=TRANSACTIONAL_ID, name={txn}, patternType=LITERAL",
                         "resourceType=TOPIC, name=pre, patternType=PREFIXED"):
            assert f"Current ACLs for resource `ResourcePattern({resource})`" in listed, listed
        assert "User:eve" not in listed

        # kafka-get-offsets: the tenant's topics only.
        offsets = {line for line in tool("GetOffsetShell").splitlines() if ":" in line}
        assert offsets == {f"{topic}:{p}:{end}" for p, end in ends.items()}, offsets

        # kafka-delete-records
        plan = tmp_path / "delete.json"
        plan.write_text(json.dumps({"version": 1, "partitions": [
            {"topic": topic, "partition": 0, "offset": 10}]}))
        assert f"partition: {topic}-0\tlow_watermark: 10" in tool(
            "DeleteRecordsCommand", "--offset-json-file", str(plan))

        # kafka-leader-election: of the tenant's partition; of every partition refused
        # (it would elect other tenants' leaders), as INVALID_REQUEST.
        assert f"Valid replica already elected for partitions {topic}-0" in tool(
            "LeaderElectionCommand", "--election-type", "preferred", "--topic", topic,
            "--partition", "0")
        assert "InvalidRequestException" in tool(
            "LeaderElectionCommand", "--election-type", "preferred",
            "--all-topic-partitions", ok=False)

        # kafka-log-dirs: the broker's whole log directory, the tenant's partitions in it.
        [report] = [json.loads(line) for line in tool("LogDirsCommand", "--describe")
                    .splitlines() if line.startswith("{")]
        [log_dir] = [d for b in report["brokers"] for d in b["logDirs"]]
        assert {p["partition"] for p in log_dir["partitions"]} == {f"{topic}-0", f"{topic}-1"}

        # kafka-reassign-partitions: a plan for the topic, carried out, verified.
        moving = tmp_path / "topics.json"
        moving.write_text(json.dumps({"version": 1, "topics": [{"topic": topic}]}))
        generated = tool("reassign.ReassignPartitionsCommand", "--generate",
                         "--topics-to-move-json-file",
                         str(moving), "--broker-list", "0")
        proposed = json.loads(generated.split("Proposed partition reassignment configuration")
                              [1].strip().splitlines()[0])
        assert {(p["topic"], p["partition"]) for p in proposed["partitions"]} == {
            (topic, 0), (topic, 1)}
        assignment = tmp_path / "assignment.json"
        assignment.write_text(json.dumps(proposed))
        tool("reassign.ReassignPartitionsCommand", "--execute", "--reassignment-json-file",
             str(assignment))
        verified = tool("reassign.ReassignPartitionsCommand", "--verify", "--reassignment-json-file",
                        str(assignment))
        assert f"Reassignment of partition {topic}-0 is completed" in verified, verified

        # kafka-transactions: the tenant's transactions only, its producers, none hanging.
        rows = [line.split() for line in tool("TransactionsCommand", "list").splitlines()[1:]]
        assert [(row[0], row[3]) for row in rows] == [(txn, "CompleteCommit")], rows
        [described] = tool("TransactionsCommand", "describe", "--transactional-id",
                           txn).splitlines()[1:]
        assert described.split()[1] == txn and "CompleteCommit" in described.split()
        producers = tool("TransactionsCommand", "describe-producers", "--topic", topic,
                         "--partition", "0").splitlines()[1:]
        assert len(producers) == 1, producers  # the transactional one
        assert tool("TransactionsCommand", "find-hanging", "--broker-id", "0"
                    ).splitlines()[1:] == []

        # kafka-features and kafka-metadata-quorum: the cluster's, passed on whole (the
        # quorum's request names the metadata log, no tenant's topic).
        assert "Feature: metadata.version" in tool("FeatureCommand", "describe")
        status = tool("MetadataQuorumCommand", "describe", "--status")
        assert "LeaderId:               0" in status, status
        assert "CONTROLLER://" in status, status
        replication = tool("MetadataQuorumCommand", "describe", "--replication")
        assert "Leader" in replication, replication

    # On the broker: all of it under the prefix, and the other tenant's untouched.
    on = prefix + topic
    assert topic_config(broker, on, "retention.ms") == "5000000"
    assert group_config(kafka.bootstrap, prefix + group, "consumer.session.timeout.ms") == "50000"
    assert watermarks(kafka.bootstrap, on, 0)[0] == 10
    assert acls_on_broker(broker, prefix) == {
        ("TOPIC", on, "LITERAL", op) for op in ("READ", "DESCRIBE", "WRITE", "CREATE")} | {
        ("GROUP", prefix + group, "LITERAL", "READ"),
        ("TRANSACTIONAL_ID", prefix + txn, "LITERAL", "DESCRIBE"),
        ("TRANSACTIONAL_ID", prefix + txn, "LITERAL", "WRITE"),
        ("TOPIC", prefix + "pre", "PREFIXED", "READ")}
    assert ("TOPIC", theirs, "LITERAL", "READ") in acls_on_broker(broker, theirs)
    assert watermarks(kafka.bootstrap, theirs) == (0, 2)


def test_kafkas_operations_tools_through_the_edge_of_a_cluster(kafka_cluster: KafkaCluster,
                                                              tmp_path: Path) -> None:
    """An operator's tools through the proxy at the edge of a 3-broker cluster (no
    rules): each broker is named at the proxy's port for it and at no broker's own, a
    partition reassignment between brokers runs (throttled) to completion, and broker,
    client-quota and client-metrics configs are set and removed."""
    kafka = kafka_cluster
    topic, client = unique("ops"), unique("quota-client")
    brokers_own = {str(node.port) for node in kafka.nodes}
    with ProxyThread(kafka.bootstrap) as proxy:
        admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
        produce({"bootstrap.servers": proxy.bootstrap}, topic, count=200)
        at_proxy = {str(port) for port in proxy.broker_ports}

        def tool(name: str, *args: str, command: tuple[str, ...] = ()) -> str:
            out = run_tool(kafka, proxy.bootstrap, name, *args, command=command)
            assert not brokers_own & set(re.findall(r"\b\d+\b", out)), out
            return out

        # Each broker at the proxy's port for it.
        versions = tool("BrokerApiVersionsCommand")
        assert set(re.findall(r"^127\.0\.0\.1:(\d+) \(id: \d", versions, re.M)) == at_proxy
        assert "Produce(0):" in versions
        endpoints = [line.split() for line in tool("ClusterTool", command=("list-endpoints",))
                     .splitlines()[1:]]
        assert {(row[0], row[2]) for row in endpoints} == {
            (str(node_id), str(broker.port)) for node_id, broker in proxy.proxy.brokers.items()}

        # A reassignment onto other brokers, throttled, verified until done (which
        # also lifts the throttle), the preferred leaders elected.
        plan = tmp_path / "assignment.json"
        plan.write_text(json.dumps({"version": 1, "partitions": [
            {"topic": topic, "partition": 0, "replicas": [1, 2]},
            {"topic": topic, "partition": 1, "replicas": [2, 0]}]}))
        assert f"Successfully started partition reassignments for {topic}-0,{topic}-1" in tool(
            "reassign.ReassignPartitionsCommand", "--execute", "--reassignment-json-file",
            str(plan), "--throttle", "10000000")
        deadline = time.monotonic() + 60
        while "still in progress" in (verified := tool(
                "reassign.ReassignPartitionsCommand", "--verify", "--reassignment-json-file",
                str(plan))):
            assert time.monotonic() < deadline, verified
        assert f"Reassignment of partition {topic}-1 is completed" in verified, verified
        tool("LeaderElectionCommand", "--election-type", "preferred", "--all-topic-partitions")
        described = tool("TopicCommand", "--describe", "--topic", topic)
        assert re.search(r"Partition: 0\tLeader: 1\tReplicas: 1,2\t", described), described
        assert re.search(r"Partition: 1\tLeader: 2\tReplicas: 2,0\t", described), described
        [report] = [json.loads(line) for line in tool("LogDirsCommand", "--describe",
                                                      "--topic-list", topic).splitlines()
                    if line.startswith("{")]
        assert {b["broker"]: {p["partition"] for d in b["logDirs"] for p in d["partitions"]}
                for b in report["brokers"]} == {
            0: {f"{topic}-1"}, 1: {f"{topic}-0"}, 2: {f"{topic}-0", f"{topic}-1"}}
        replication = tool("MetadataQuorumCommand", "describe", "--replication")
        assert sorted(line.split()[-1] for line in replication.splitlines()[1:]) == [
            "Follower", "Follower", "Leader"], replication

        # Configs of a broker, a client id's quota, a client metrics subscription:
        # set, shown, removed.
        for entity, name, setting, shown in (
                ("brokers", "1", "log.cleaner.threads=2", "log.cleaner.threads=2"),
                ("clients", client, "producer_byte_rate=100000",
                 f"Quota configs for client-id '{client}' are producer_byte_rate=100000.0")):
            tool("ConfigCommand", "--entity-type", entity, "--entity-name", name, "--alter",
                 "--add-config", setting)
            assert shown in tool("ConfigCommand", "--entity-type", entity, "--entity-name",
                                 name, "--describe")
            tool("ConfigCommand", "--entity-type", entity, "--entity-name", name, "--alter",
                 "--delete-config", setting.split("=")[0])
            assert shown not in tool("ConfigCommand", "--entity-type", entity,
                                     "--entity-name", name, "--describe")
        subscription = unique("producers")
        tool("ClientMetricsCommand", "--alter", "--name", subscription, "--metrics",
             "org.apache.kafka.producer.", "--interval", "5000")
        assert "metrics=org.apache.kafka.producer." in tool(
            "ClientMetricsCommand", "--describe", "--name", subscription)
        tool("ClientMetricsCommand", "--delete", "--name", subscription)
        assert subscription not in tool("ClientMetricsCommand", "--list")
    # The broker's own view agrees.
    direct = kafka.run_java_tool(TOOLS + "TopicCommand", "--bootstrap-server", kafka.bootstrap,
                                 "--describe", "--topic", topic, check=True).stdout
    assert re.search(r"Partition: 1\tLeader: 2\tReplicas: 2,0\t", direct), direct
