"""ACLs at the proxy on a real Apache Kafka broker: clients authenticate with the proxy
(``sasl.downstream``), the broker sees no SASL at all, and the proxy's ``acls`` keep
each user to what it may do, with the errors Kafka's own ACLs give."""

from __future__ import annotations

from pathlib import Path

import confluent_kafka as ck
import pytest
from confluent_kafka.admin import AdminClient

from tests.support.clients import consume, produce, unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

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
