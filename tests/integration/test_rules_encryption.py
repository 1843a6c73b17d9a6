"""``encrypt_records`` on a real Apache Kafka broker, with real clients on both sides:
what they produce through the proxy is stored encrypted (the broker's own log files
hold no plaintext; a consumer that goes to the broker directly reads ciphertext under
the ``gatehouse.encryption`` header), and what they consume through the proxy is what
was produced, keys, headers and offsets included.  librdkafka in several codecs, with
idempotence and in transactions; the Java producer and consumer (topic ids: Produce
v13, Fetch v17); kafka-python pinned to old versions; aiokafka; a consumer the rule
does not match."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from gatehouse.configfile import load_yaml_text
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import parse_rules
from tests.reliability.test_no_loss import (
    CONSUMER_CONFIG,
    PRODUCER_CONFIG,
    consumed_records,
    start_tool,
)
from tests.support.clients import (
    aiokafka_produce,
    kafka_python_produce,
    kafka_python_read,
    unique,
    watermarks,
)
from tests.support.kafka import KafkaCluster, stop_process
from tests.support.proxythread import ProxyThread

SECRET = b"card=4111-1111-1111-1111;"
HEADER = "gatehouse.encryption"


def encrypting(tmp_path: Path, match: str = "  match: {client_id: '^(app|java|kp|aio)'}\n"
               ) -> RulesPolicy:
    """Rules encrypting the pay-* topics for the clients ``match`` matches."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  pay-1: {base64.b64encode(os.urandom(32)).decode()}\n")
    rules = ("- name: payments\n" + match +
             "  encrypt_records:\n"
             "    topics: ['pay-.*']\n"
             "    key_file: keys.yaml\n"
             "    key: pay-1\n")
    source = str(tmp_path / "rules.yaml")
    return RulesPolicy(parse_rules(load_yaml_text(rules, source), source))


@pytest.fixture
def policy(tmp_path: Path) -> RulesPolicy:
    return encrypting(tmp_path)


def read_all(bootstrap: str, topic: str, count: int, client_id: str = "app-reader",
             **extra: Any) -> list[Any]:
    """The first ``count`` messages of ``topic`` (librdkafka, from the start)."""
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": unique("g"),
                            "client.id": client_id, "auto.offset.reset": "earliest",
                            "enable.auto.commit": False, "log_level": 3, **extra})
    got: list[Any] = []
    try:
        consumer.subscribe([topic])
        for _ in range(120):
            if len(got) >= count:
                break
            for msg in consumer.consume(count - len(got), 0.5):
                assert msg.error() is None, msg.error()
                got.append(msg)
    finally:
        consumer.close()
    return got


def stored_plainly(kafka: KafkaCluster, topic: str, needle: bytes) -> list[Path]:
    """The broker's log files of ``topic`` that hold ``needle``."""
    return [path for node in kafka.nodes for path in node.data_dir.glob(f"{topic}-*/*.log")
            if needle in path.read_bytes()]


@pytest.mark.parametrize("codec", ["none", "zstd", "gzip"])
def test_librdkafka_records_stored_encrypted_and_read_back_in_the_clear(
        kafka: KafkaCluster, policy: RulesPolicy, codec: str) -> None:
    topic = unique("pay-rd")
    kafka.create_topic(topic, partitions=2)
    sent = [(f"k{i}".encode(), SECRET + b"%d" % i * (i % 7 + 1), [("trace", b"t%d" % i)])
            for i in range(300)]
    with ProxyThread(kafka.bootstrap, policy=policy) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-w",
                                "enable.idempotence": True, "compression.type": codec,
                                "linger.ms": 20, "log_level": 3})
        for key, value, headers in sent:
            producer.produce(topic, value, key, headers=headers)
        producer.produce(topic, None, b"gone")  # a tombstone stays a tombstone
        assert producer.flush(30) == 0
        got = read_all(proxy.bootstrap, topic, len(sent) + 1)
        encrypted = proxy.sample("gatehouse_encrypted_records_total", rule="payments",
                                 topic=topic, outcome="encrypted")
        decrypted = proxy.sample("gatehouse_encrypted_records_total", rule="payments",
                                 topic=topic, outcome="decrypted")
    assert encrypted == len(sent) and decrypted == len(sent)
    assert sorted((m.key(), m.value(), m.headers()) for m in got if m.value() is not None
                  ) == sorted((k, v, h) for k, v, h in sent)
    assert [m.key() for m in got if m.value() is None] == [b"gone"]
    for partition in (0, 1):  # every offset in place
        offsets = sorted(m.offset() for m in got if m.partition() == partition)
        assert offsets == list(range(len(offsets)))
    # At rest and to a client that bypasses the proxy: ciphertext.
    assert stored_plainly(kafka, topic, SECRET) == []
    assert stored_plainly(kafka, topic, b"k17")  # keys stay as they were
    direct = read_all(kafka.bootstrap, topic, len(sent) + 1)
    assert all(SECRET not in (m.value() or b"") for m in direct)
    sealed = [m for m in direct if m.value() is not None]
    assert len(sealed) == len(sent)
    assert all(m.headers()[-1] == (HEADER, b"\x01") for m in sealed)


def test_a_topic_the_broker_compresses(kafka: KafkaCluster, policy: RulesPolicy) -> None:
    """compression.type=lz4 on the topic: the broker compresses the batches the proxy
    writes uncompressed; its consumers still read every value, and a Fetch answer the
    proxy opened is compressed again (zstd), not grown to its records' full size."""
    topic = unique("pay-lz4")
    kafka.create_topic(topic, config={"compression.type": "lz4"})
    sent = [SECRET * 20 + b"%d" % i for i in range(200)]
    with ProxyThread(kafka.bootstrap, policy=policy) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-w",
                                "linger.ms": 50, "log_level": 3})
        for value in sent:
            producer.produce(topic, value)
        assert producer.flush(30) == 0
        got = read_all(proxy.bootstrap, topic, len(sent))
        answered = proxy.sample("gatehouse_bytes_total", direction="proxy_to_client")
    assert sorted(m.value() for m in got) == sorted(sent)
    assert stored_plainly(kafka, topic, SECRET) == []
    # What went to the clients (both connections' answers, all of them) is less than the
    # records' own bytes: the opened batches were compressed.
    assert 0 < answered < sum(len(v) for v in sent)


def test_transactions_and_read_committed(kafka: KafkaCluster, policy: RulesPolicy) -> None:
    topic = unique("pay-tx")
    kafka.create_topic(topic)
    with ProxyThread(kafka.bootstrap, policy=policy) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-tx",
                                "transactional.id": unique("tx"), "log_level": 3})
        producer.init_transactions(30)
        for commit in (True, False, True):
            producer.begin_transaction()
            for i in range(20):
                producer.produce(topic, SECRET + (b"c" if commit else b"a") + b"%d" % i)
            (producer.commit_transaction if commit else producer.abort_transaction)(30)
        got = read_all(proxy.bootstrap, topic, 40, **{"isolation.level": "read_committed"})
    assert sorted(m.value() for m in got) == sorted([SECRET + b"c%d" % i for i in range(20)] * 2)
    assert stored_plainly(kafka, topic, SECRET) == []


def test_java_producer_and_consumer_by_topic_id(kafka: KafkaCluster, policy: RulesPolicy,
                                                 tmp_path: Path) -> None:
    """VerifiableProducer (idempotent, Produce v13: topics by id) and VerifiableConsumer
    (Fetch v17) through the proxy: every acked value read back, at its offset."""
    topic = unique("pay-java")
    kafka.create_topic(topic, partitions=2)
    java_round_trip(kafka, policy, tmp_path, topic)


def java_round_trip(kafka: KafkaCluster, policy: RulesPolicy, tmp_path: Path, topic: str,
                    rule: str = "payments") -> None:
    """The Java VerifiableProducer's values through the proxy under ``policy``, each
    read back by the VerifiableConsumer at its offset, and stored encrypted."""
    messages = 2000
    producer = consumer = None
    with ProxyThread(kafka.bootstrap, policy=policy) as proxy:
        try:
            producer = start_tool(
                "producer", "org.apache.kafka.tools.VerifiableProducer",
                ["--topic", topic, "--bootstrap-server", proxy.bootstrap, "--max-messages",
                 str(messages), "--acks", "-1", "--value-prefix", "4111"],
                {**PRODUCER_CONFIG, "client.id": "java-producer"}, tmp_path, kafka.libs)
            assert producer.process.wait(120) == 0
            acked = {e["value"]: (e["partition"], e["offset"])
                     for e in producer.named("producer_send_success")}
            assert len(acked) == messages and producer.named("producer_send_error") == []
            consumer = start_tool(
                "consumer", "org.apache.kafka.tools.VerifiableConsumer",
                ["--topic", topic, "--bootstrap-server", proxy.bootstrap, "--group-id",
                 unique("g"), "--verbose", "--reset-policy", "earliest"],
                {**CONSUMER_CONFIG, "client.id": "java-consumer"}, tmp_path, kafka.libs)
            until = time.monotonic() + 120
            while {r[2] for r in consumed_records(consumer)} < acked.keys():
                assert time.monotonic() < until, "the Java consumer did not read every value"
                assert consumer.process.poll() is None, "the Java consumer stopped"
                time.sleep(0.2)
            seen = {(p, o): value for p, o, value in consumed_records(consumer)}
            assert all(acked[value] == (p, o) for (p, o), value in seen.items())
        finally:
            for tool in (producer, consumer):
                if tool is not None:
                    stop_process(tool.process, 30)  # type: ignore[arg-type]
        assert proxy.summed("gatehouse_requests_total", api="Produce", version="13") > 0
        assert proxy.sample("gatehouse_encrypted_records_total", rule=rule,
                            topic=topic, outcome="encrypted") == messages
    direct = read_all(kafka.bootstrap, topic, messages)
    assert all(m.headers()[-1][0] == HEADER for m in direct)
    assert not any(m.value().startswith(b"4111.") for m in direct)


def test_kafka_python_old_versions_and_aiokafka(kafka: KafkaCluster,
                                                policy: RulesPolicy) -> None:
    """kafka-python pinned to Kafka 0.11's versions (Produce v3, Fetch v5) and
    aiokafka: sealed as they produce, opened as they consume."""
    topic = unique("pay-py")
    kafka.create_topic(topic)
    with ProxyThread(kafka.bootstrap, policy=policy) as proxy:
        old = {"bootstrap_servers": proxy.bootstrap, "client_id": "kp-old",
               "api_version": (0, 11)}
        kafka_python_produce(old, [SECRET + b"kp%d" % i for i in range(30)], topic)
        aiokafka_produce([SECRET + b"aio%d" % i for i in range(30)], topic,
                         bootstrap_servers=proxy.bootstrap, client_id="aio-w")
        got = kafka_python_read(old, topic, 60)
        # A client the rule does not match reads what the broker holds.
        other = kafka_python_read({"bootstrap_servers": proxy.bootstrap,
                                   "client_id": "analytics"}, topic, 60)
        assert proxy.summed("gatehouse_requests_total", api="Produce", version="3") > 0
    assert sorted(got) == sorted([SECRET + b"kp%d" % i for i in range(30)]
                                 + [SECRET + b"aio%d" % i for i in range(30)])
    assert len(other) == 60 and not any(SECRET in v for v in other)
    assert watermarks(kafka.bootstrap, topic) == (0, 60)
    assert stored_plainly(kafka, topic, SECRET) == []


def test_a_share_group_member_reads_in_the_clear(kafka: KafkaCluster,
                                                 tmp_path: Path) -> None:
    """A Java share consumer (KIP-932) through the proxy: its ShareFetch answers
    (topics by id) are decrypted like Fetch answers."""
    from tests.integration.test_metrics_groups import JavaMember

    topic = unique("pay-share")
    kafka.create_topic(topic)
    values = [SECRET + b"s%d" % i for i in range(5)]
    with ProxyThread(kafka.bootstrap, policy=encrypting(tmp_path, match="")) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 3})
        for value in values:
            producer.produce(topic, value)
        assert producer.flush(30) == 0
        args = [proxy.bootstrap, topic, unique("workers")]
        with JavaMember("ShareMember.java", kafka.libs, args, tmp_path / "share.log") as member:
            got = [member.wait_for("record ") for _ in values]
        assert proxy.summed("gatehouse_requests_total", api="ShareFetch") > 0
        assert proxy.sample("gatehouse_encrypted_records_total", rule="payments",
                            topic=topic, outcome="decrypted") >= len(values)
    assert sorted(got) == sorted(f"record {v.decode()}" for v in values)
    assert stored_plainly(kafka, topic, SECRET) == []
