"""ACLs at the proxy on a real Apache Kafka broker: clients authenticate with the proxy
(``sasl.downstream``), the broker sees no SASL at all, and the proxy's ``acls`` keep
each user to what it may do, with the errors Kafka's own ACLs give."""

from __future__ import annotations

import time
from pathlib import Path

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from gatehouse.codecs.records import encode_batch
from tests.integration.test_rules_topic_ids import call
from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import JAVA_SOURCES, KafkaCluster
from tests.support.proxythread import ProxyThread

TOPIC_AUTHORIZATION_FAILED = 29

RULES = ("- name: alice-acl\n  match: {principal: '^alice$'}\n  acls:\n"
         "    - {allow: [read], topics: ['billing\\..*'], groups: ['alice-.*']}\n"
         "    - {allow: [write], topics: ['alice\\..*']}\n")


def conf(proxy: ProxyThread, user: str) -> dict[str, object]:
    return {"bootstrap.servers": proxy.bootstrap, "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": user,
            "sasl.password": f"{user}-pw"}


def test_the_proxys_acls_keep_each_user_to_what_it_may_do(kafka: KafkaCluster,
                                                          tmp_path: Path) -> None:
    users = tmp_path / "users.yaml"
    users.write_text("users:\n  alice: {password: alice-pw}\n  bob: {password: bob-pw}\n")
    own, billing, other = unique("alice.own"), unique("billing.eu"), unique("other")
    for topic in (own, billing, other):
        kafka.create_topic(topic)
    sent = produce({"bootstrap.servers": kafka.bootstrap}, billing, count=10)
    sasl = f"sasl:\n  downstream: {{users_file: {users}}}\n"
    with ProxyThread(kafka.bootstrap, extra_config=sasl, rules_yaml=RULES) as proxy:
        alice = conf(proxy, "alice")
        # Write to her own topics, read billing's in her own groups.
        mine = produce(alice, own, count=5)
        assert sorted(consume(alice, billing, 10, group="alice-g")) == sorted(sent)
        # Metadata shows what she may describe: read and write imply it.
        topics = AdminClient(alice).list_topics(timeout=10).topics
        assert own in topics and billing in topics and other not in topics

        # Writing where she may only read: the delivery fails with Kafka's ACL error.
        failures: list[ck.KafkaError] = []
        producer = ck.Producer({**alice, "acks": "all", "log_level": 0,
                                "message.timeout.ms": 10_000})
        producer.produce(billing, b"not hers", on_delivery=lambda err, _m: failures.append(err))
        producer.flush(15)
        assert [f.code() for f in failures] == [ck.KafkaError.TOPIC_AUTHORIZATION_FAILED]

        # A group that is not hers: the consumer is told GROUP_AUTHORIZATION_FAILED.
        consumer = ck.Consumer({**alice, "group.id": unique("someone-else"), "log_level": 0,
                                "auto.offset.reset": "earliest"})
        consumer.subscribe([billing])
        seen = None
        for _ in range(100):
            message = consumer.poll(0.2)
            if message is not None and message.error() is not None:
                seen = message.error().code()
                break
        consumer.close()
        assert seen == ck.KafkaError.GROUP_AUTHORIZATION_FAILED

        # Deleting a topic she may read: refused.
        admin = AdminClient(alice)
        future = admin.delete_topics([billing], operation_timeout=10)[billing]
        with pytest.raises(ck.KafkaException) as caught:
            future.result(timeout=30)
        assert caught.value.args[0].code() == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED

        # kafka-python reads billing by topic id (Fetch v13+) under the same ACLs.
        from kafka import KafkaConsumer

        reader = KafkaConsumer(billing, bootstrap_servers=proxy.bootstrap,
                               security_protocol="SASL_PLAINTEXT",
                               sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="alice",
                               sasl_plain_password="alice-pw", auto_offset_reset="earliest",
                               consumer_timeout_ms=15_000, group_id=unique("alice-kp"))
        read = [m.value for m, _ in zip(reader, range(10), strict=False)]
        reader.close()
        assert sorted(read) == sorted(sent)

        # bob is in no rule: everything, as the broker allows it.
        bob = conf(proxy, "bob")
        assert other in AdminClient(bob).list_topics(timeout=10).topics
        produce(bob, billing, count=3)
        assert proxy.sample("gatehouse_rule_decisions_total", rule="alice-acl",
                            action="refuse") >= 3
    assert watermarks(kafka.bootstrap, own) == (0, len(mine))
    assert watermarks(kafka.bootstrap, billing) == (0, 13)
    assert billing in AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(
        timeout=10).topics


def test_a_topic_is_created_on_request_only_with_create(kafka: KafkaCluster,
                                                         tmp_path: Path) -> None:
    """As Kafka's ACLs: a producer's Metadata request creates a missing topic
    (auto.create.topics.enable, Kafka's default, as here) only for a user with create
    on it (or on the cluster).  alice may write alice.* but not create: her producer's
    record to a new one fails and nothing is created; with create, it is."""
    users = tmp_path / "users.yaml"
    users.write_text("users:\n  alice: {password: alice-pw}\n  carol: {password: carol-pw}\n")
    rules = RULES + ("- name: carol-acl\n  match: {principal: '^carol$'}\n  acls:\n"
                     "    - {allow: [write, create], topics: ['carol\\..*']}\n")
    hers, carols = unique("alice.new"), unique("carol.new")
    sasl = f"sasl:\n  downstream: {{users_file: {users}}}\n"
    with ProxyThread(kafka.bootstrap, extra_config=sasl, rules_yaml=rules) as proxy:
        results: dict[str, ck.KafkaError | None] = {}
        for user, topic in (("alice", hers), ("carol", carols)):
            producer = ck.Producer({**conf(proxy, user), "log_level": 0,
                                    "message.timeout.ms": 5000})
            producer.produce(topic, b"x",
                             on_delivery=lambda err, _m, t=topic: results.update({t: err}))
            producer.flush(20)
    assert results[hers] is not None and results[carols] is None, results
    topics = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert carols in topics and hers not in topics


MIXED_RULES = ("- name: alice-acl\n  match: {client_id: '^alice'}\n  acls:\n"
               "    - {allow: [read], topics: ['billing\\..*'], groups: ['alice-.*']}\n"
               "    - {allow: [write, delete, read], topics: ['alice\\..*']}\n"
               "    - {allow: [describe], topics: ['audit\\..*']}\n")


def test_each_topic_of_a_request_is_answered_on_its_own(kafka: KafkaCluster) -> None:
    """As Kafka's ACLs answer a request topic by topic, so do the proxy's: alice may
    read billing.*, write, read and delete alice.*, only describe audit.* (her clients see
    it, so put it in the same requests as the others).  A consumer of billing and audit
    reads billing and is told audit is not hers; a producer's one Produce request to
    alice.* and audit writes alice.*'s records; a DeleteTopics of an alice.* topic and
    billing deletes the first.  librdkafka, kafka-python (Fetch by name), Java (Produce
    and Fetch by topic id) and raw requests.  (The proxy used to refuse such a request whole: the Java producer's
    records to alice.* failed with audit's, and librdkafka was never told audit is not
    hers, only that its id was unknown.)"""
    billing, audit = unique("billing.eu"), unique("audit.log")
    own, gone = unique("alice.own"), unique("alice.gone")
    for topic in (billing, audit, own, gone):
        kafka.create_topic(topic)
    sent = produce({"bootstrap.servers": kafka.bootstrap}, billing, count=10)
    produce({"bootstrap.servers": kafka.bootstrap}, audit, count=10)
    with ProxyThread(kafka.bootstrap, rules_yaml=MIXED_RULES) as proxy:
        alice = {"bootstrap.servers": proxy.bootstrap, "client.id": "alice-rd"}
        assert {billing, audit, own} <= set(AdminClient(alice).list_topics(timeout=10).topics)

        # librdkafka fetches both in one Fetch: billing's records, audit's error.
        consumer = ck.Consumer({**alice, "group.id": unique("alice-g"), "log_level": 0,
                                "auto.offset.reset": "earliest"})
        consumer.subscribe([billing, audit])
        read: list[tuple[str, bytes]] = []
        errors: set[int] = set()
        for _ in range(300):
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error() is not None:
                errors.add(message.error().code())
            else:
                read.append((message.topic(), message.value()))
            if len(read) >= 10 and errors:
                break
        consumer.close()
        assert sorted(read) == sorted((billing, v) for v in sent)
        assert ck.KafkaError.TOPIC_AUTHORIZATION_FAILED in errors

        # kafka-python pinned to Kafka 2.8's versions: a Fetch by topic name, the same.
        from kafka import KafkaConsumer
        from kafka.errors import TopicAuthorizationFailedError

        reader = KafkaConsumer(bootstrap_servers=proxy.bootstrap, client_id="alice-kp",
                               group_id=unique("alice-kp"), auto_offset_reset="earliest",
                               api_version=(2, 8))
        reader.subscribe([billing, audit])
        got: list[tuple[str, bytes]] = []
        denied: list[TopicAuthorizationFailedError] = []
        deadline = time.monotonic() + 30
        while (len(got) < 10 or not denied) and time.monotonic() < deadline:
            try:
                for partition, records in reader.poll(timeout_ms=500).items():
                    got.extend((partition.topic, r.value) for r in records)
            except TopicAuthorizationFailedError as error:
                denied.append(error)
        reader.close()
        assert sorted(got) == sorted((billing, v) for v in sent)
        assert denied and audit in str(denied[0])

        # Java: a producer's batches for both topics in one request, then a consumer of
        # both in a group (Fetch by topic id: audit's error is Kafka's ACL error, since
        # alice may describe it, not "unknown topic id").
        java = kafka.run_java_tool(str(JAVA_SOURCES / "TwoTopics.java"), proxy.bootstrap,
                                   "alice-java", unique("alice-j"), own,
                                   audit, "5", timeout=180)
        assert java.returncode == 0, java
        lines = java.stdout.splitlines()
        assert sorted(line for line in lines if line.startswith("sent ")) == sorted(
            [f"sent {own} ok"] * 5 + [f"sent {audit} TopicAuthorizationException"] * 5), lines
        assert sorted(line for line in lines if line.startswith("read ")) == sorted(
            f"read {own} java-{i}" for i in range(5)), lines
        assert f"denied TopicAuthorizationException [{audit}]" in lines, lines

        # One Produce request to both: alice.own written, audit refused.
        batch = encode_batch([(0, None, b"raw-1"), (0, None, b"raw-2")])
        answer = call(proxy.bootstrap, 0, 9, {"acks": -1, "timeout_ms": 10_000, "topic_data": [
            {"name": topic, "partition_data": [{"index": 0, "records": batch}]}
            for topic in (own, audit)]}, client_id="alice-raw")
        assert [(t.name, [p.error_code for p in t.partition_responses])
                for t in answer.responses] == [(own, [0]), (audit, [TOPIC_AUTHORIZATION_FAILED])]

        # One DeleteTopics of both: the one she may delete is deleted.
        admin = AdminClient(alice)
        futures = admin.delete_topics([gone, billing], operation_timeout=10)
        futures[gone].result(timeout=30)
        with pytest.raises(ck.KafkaException) as caught:
            futures[billing].result(timeout=30)
        assert caught.value.args[0].code() == ck.KafkaError.TOPIC_AUTHORIZATION_FAILED
        assert proxy.sample("gatehouse_rule_decisions_total", rule="alice-acl",
                            action="refuse") >= 4
    assert watermarks(kafka.bootstrap, own) == (0, 7)
    assert watermarks(kafka.bootstrap, audit) == (0, 10)
    topics = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert billing in topics and gone not in topics


CLUSTER_RULES = ("- name: ops-acl\n  match: {client_id: '^ops-'}\n  acls:\n"
                 "    - {allow: [describe, create], cluster: true}\n"
                 "    - {allow: [write], topics: ['ops\\..*']}\n"
                 "- name: nobody-acl\n  match: {client_id: '^nobody-'}\n  acls:\n"
                 "    - {deny: [all], cluster: true}\n")


def test_the_clusters_acls_at_the_proxy(kafka: KafkaCluster, tmp_path: Path) -> None:
    """``cluster: true`` entries: what the cluster's APIs need there, refused with
    CLUSTER_AUTHORIZATION_FAILED as seen by librdkafka's and Java's admin clients; what
    the entries allow reaches the broker."""
    user = unique("scram-user")
    broker_id = str(kafka.nodes[0].node_id)
    with ProxyThread(kafka.bootstrap, rules_yaml=CLUSTER_RULES) as proxy:

        def java_admin(client_id: str) -> list[str]:
            """What tests/support/java/ClusterAdmin.java's calls got, a line each."""
            java = kafka.run_java_tool(str(JAVA_SOURCES / "ClusterAdmin.java"),
                                       proxy.bootstrap, client_id, user, broker_id,
                                       timeout=180)
            assert java.returncode == 0, java
            return java.stdout.splitlines()

        ops = AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": "ops-admin"})
        # describe is allowed: the broker answers (no such user).
        described = ops.describe_user_scram_credentials([user])[user]
        with pytest.raises(ck.KafkaException) as caught:
            described.result(timeout=30)
        assert caught.value.args[0].code() == ck.KafkaError.RESOURCE_NOT_FOUND
        # alter is not: refused at the proxy, the user never made.
        upsert = ck.admin.UserScramCredentialUpsertion(
            user, ck.admin.ScramCredentialInfo(ck.admin.ScramMechanism.SCRAM_SHA_256, 4096),
            b"secret")
        altered = ops.alter_user_scram_credentials([upsert])[user]
        with pytest.raises(ck.KafkaException) as caught:
            altered.result(timeout=30)
        assert caught.value.args[0].code() == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED
        # ACLs are the cluster's to alter: one error per binding asked for.
        bindings = [ck.admin.AclBinding(ck.admin.ResourceType.GROUP, f"ops-{i}",
                                        ck.admin.ResourcePatternType.LITERAL, "User:app",
                                        "*", ck.admin.AclOperation.READ,
                                        ck.admin.AclPermissionType.ALLOW) for i in range(2)]
        for future in ops.create_acls(bindings, request_timeout=30).values():
            with pytest.raises(ck.KafkaException) as caught:
                future.result(timeout=30)
            assert caught.value.args[0].code() == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED
        # A broker's configs are the cluster's: describe_configs is not allowed there.
        broker = ck.admin.ConfigResource(ck.admin.ResourceType.BROKER, broker_id)
        with pytest.raises(ck.KafkaException) as caught:
            ops.describe_configs([broker])[broker].result(timeout=30)
        assert caught.value.args[0].code() == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED
        # Java's admin client reads the same answers: one error per binding asked for
        # (a missing one would be an UnknownServerException), the SCRAM upsert refused,
        # the describe answered by the broker.
        assert java_admin("ops-java") == [
            "createAcls ClusterAuthorizationException",
            "createAcls ClusterAuthorizationException",
            "alterUserScramCredentials ClusterAuthorizationException",
            "describeUserScramCredentials ResourceNotFoundException",
            "describeConfigs ClusterAuthorizationException"]
        # create on the cluster creates any topic, whatever the topic entries say.
        billing = unique("billing")
        ops.create_topics([ck.admin.NewTopic(billing, 1)])[billing].result(timeout=30)
        # Nothing on the cluster, not even a look: every call refused, the SCRAM
        # describe too (answered as Kafka's brokers answer it: Java reads it; this
        # librdkafka crashes on that answer, whoever sends it, so it is not asked).
        assert java_admin("nobody-java") == ["createAcls ClusterAuthorizationException"] * 2 + [
            f"{call} ClusterAuthorizationException" for call in (
                "alterUserScramCredentials", "describeUserScramCredentials", "describeConfigs")]
        # Someone no rule matches: the broker decides (SCRAM on this broker).
        other = AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": "app"})
        other.alter_user_scram_credentials([upsert])[user].result(timeout=30)
        assert other.describe_configs([broker])[broker].result(timeout=30)
        # One refusal a request: three from each admin client.
        assert proxy.sample("gatehouse_rule_decisions_total", rule="ops-acl",
                            action="refuse") == 6
        assert proxy.sample("gatehouse_rule_decisions_total", rule="nobody-acl",
                            action="refuse") == 4
    direct = AdminClient({"bootstrap.servers": kafka.bootstrap})
    assert billing in direct.list_topics(timeout=10).topics
    # Only the unmatched client's upsert reached the broker.
    credentials = direct.describe_user_scram_credentials([user])[user].result(timeout=30)
    assert [c.mechanism for c in credentials.scram_credential_infos] == [
        ck.admin.ScramMechanism.SCRAM_SHA_256]


SHARE_ACLS = """\
- name: workers
  acls:
    - {allow: [read], topics: ["jobs-.*"], groups: ["workers-.*"]}
    - {allow: [describe_configs, alter_configs], groups: [".*"]}
"""


def test_a_share_consumer_is_held_to_the_acls_of_its_group_and_topics(
        kafka: KafkaCluster, tmp_path: Path) -> None:
    """A Java share consumer (KIP-932) under the proxy's ACLs: in its group, of its topic,
    it reads every record; in a group it may not read, or subscribed to a topic it may
    not read, it fails with Kafka's own authorization errors, reading nothing."""
    from tests.integration.test_metrics_groups import JavaMember

    jobs, secret = unique("jobs"), unique("secret")
    for topic in (jobs, secret):
        kafka.create_topic(topic)
        produce({"bootstrap.servers": kafka.bootstrap}, topic, count=3, tag=topic)
    with ProxyThread(kafka.bootstrap, rules_yaml=SHARE_ACLS) as proxy:
        for topic, group, refused in ((jobs, unique("workers"), None),
                                      (jobs, unique("intruders"), "GroupAuthorizationException"),
                                      (secret, unique("workers"), "TopicAuthorizationException")):
            log = tmp_path / f"{group}.log"
            with JavaMember("ShareMember.java", kafka.libs, [proxy.bootstrap, topic, group],
                            log) as member:
                if refused is None:
                    got = [member.wait_for("record ") for _ in range(3)]
                    assert sorted(got) == [f"record {topic}-{i}" for i in range(3)]
                    member.leave()
                    continue
                assert member.process.wait(90) != 0, member.stderr_tail()
                assert refused in log.read_text(), member.stderr_tail()
                assert member.lines.get(timeout=10) is None  # it printed nothing: read nothing
