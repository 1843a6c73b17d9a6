"""``encrypt_records.kms`` on a real Apache Kafka broker with librdkafka on both sides,
the data keys made and opened by each KMS the proxy speaks to (tests/support/kms.py: AWS
KMS' API served by moto, and Vault's transit engine behind Vault's HTTP API):
records stored encrypted under keys the proxy never holds at rest, read back in the
clear by a second proxy that shares nothing with the first but the KMS; and through a
KMS outage (its process stopped) nothing is lost, duplicated or handed over as
ciphertext: producers are answered retriably until the KMS is back, consumers are
answered retriably for the partitions it must open."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from gatehouse.configfile import load_yaml_text
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import parse_rules
from tests.integration.test_rules_encryption import (
    HEADER,
    SECRET,
    java_round_trip,
    read_all,
    stored_plainly,
)
from tests.support.clients import unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.kms import (
    CREDENTIALS,
    REGION,
    VAULT_TOKEN,
    KmsServer,
    VaultServer,
    kms_server,
    vault_server,
)
from tests.support.proxythread import ProxyThread

OUTCOMES = "gatehouse_encrypted_records_total"


Kms = KmsServer | VaultServer


@pytest.fixture(scope="module", params=["aws", "vault"])
def kms(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Kms]:
    serve = kms_server if request.param == "aws" else vault_server
    server: Kms
    with serve(tmp_path_factory.mktemp("kms") / "kms.log") as server:
        server.key_for("payments")
        yield server


@pytest.fixture(autouse=True)
def kms_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**CREDENTIALS, "VAULT_TOKEN": VAULT_TOKEN}.items():
        monkeypatch.setenv(name, value)


def kms_policy(kms: Kms, key: str = "payments", client: str = "app") -> RulesPolicy:
    """A proxy's rules (each call: a proxy of its own, with no data keys yet): the
    values of pay-* topics its ``client`` clients write sealed under ``key`` of ``kms``."""
    rules = ("- name: payments\n"
             f"  match: {{client_id: '^{client}'}}\n"
             "  encrypt_records:\n"
             "    topics: ['pay-.*']\n"
             f"    kms: {kms.rule_kms(kms.key_name(key))}\n")
    return RulesPolicy(parse_rules(load_yaml_text(rules, "rules.yaml"), "rules.yaml"))


def kek_name(kms: Kms, key: str) -> bytes:
    """The name the envelopes give ``key`` of ``kms``."""
    return f"{kms.type}-kms:{kms.key_name(key)}".encode()


def reached(proxy: ProxyThread, outcome: str, topic: str, timeout: float = 60) -> float:
    """The proxy's count of ``outcome`` for ``topic``, once it is above 0."""
    return proxy.sample_reaches(OUTCOMES, 1, timeout, rule="payments", topic=topic,
                                outcome=outcome)


def test_records_sealed_under_a_kms_key_and_read_through_another_proxy(
        kafka: KafkaCluster, kms: Kms) -> None:
    topic = unique("pay-kms")
    kafka.create_topic(topic, partitions=2)
    sent = [(b"k%d" % i, SECRET + b"%d" % i) for i in range(200)]
    with ProxyThread(kafka.bootstrap, policy=kms_policy(kms)) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-w",
                                "enable.idempotence": True, "compression.type": "zstd",
                                "linger.ms": 20, "log_level": 3})
        for key, value in sent:
            producer.produce(topic, value, key)
        assert producer.flush(30) == 0
        assert proxy.sample(OUTCOMES, rule="payments", topic=topic,
                            outcome="encrypted") == len(sent)
    assert stored_plainly(kafka, topic, SECRET) == []
    direct = read_all(kafka.bootstrap, topic, len(sent))
    assert all(SECRET not in m.value() and kek_name(kms, "payments") in m.value()
               and m.headers()[-1] == (HEADER, b"\x01") for m in direct)
    with ProxyThread(kafka.bootstrap, policy=kms_policy(kms)) as other:
        got = read_all(other.bootstrap, topic, len(sent))
        assert other.sample(OUTCOMES, rule="payments", topic=topic,
                            outcome="decrypted") == len(sent)
    assert sorted((m.key(), m.value()) for m in got) == sorted(sent)


def test_a_kms_outage_loses_nothing_and_hands_over_no_ciphertext(
        kafka: KafkaCluster, kms: Kms) -> None:
    topic = unique("pay-outage")
    kafka.create_topic(topic, partitions=2)
    sent = {b"%d" % i: SECRET + b"%d" % i for i in range(100)}
    # Producing while the KMS is down: refused retriably (REQUEST_TIMED_OUT) until it is
    # back; the idempotent producer sends them again, each stored once.
    with ProxyThread(kafka.bootstrap, policy=kms_policy(kms)) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-w",
                                "enable.idempotence": True, "linger.ms": 5,
                                "message.timeout.ms": 120000, "log_level": 3})
        failed: list[Any] = []
        with kms.paused():
            for key, value in sent.items():
                producer.produce(topic, value, key,
                                 on_delivery=lambda err, _m: err and failed.append(err))
            producer.poll(0)
            assert reached(proxy, "kms_unavailable", topic) >= 1
            assert proxy.sample(OUTCOMES, rule="payments", topic=topic,
                                outcome="encrypted") == 0
        assert producer.flush(60) == 0 and failed == []
        assert proxy.sample(OUTCOMES, rule="payments", topic=topic,
                            outcome="encrypted") == len(sent)
    assert sum(watermarks(kafka.bootstrap, topic, p)[1] for p in (0, 1)) == len(sent)
    assert stored_plainly(kafka, topic, SECRET) == []
    # Consuming through a proxy that has no data key open while the KMS is down: the
    # partitions are answered UNKNOWN_SERVER_ERROR (fetched again), never as ciphertext;
    # once the KMS is back every value arrives, once.
    with ProxyThread(kafka.bootstrap, policy=kms_policy(kms)) as other:
        consumer = ck.Consumer({"bootstrap.servers": other.bootstrap, "client.id": "app-r",
                                "group.id": unique("g"), "auto.offset.reset": "earliest",
                                "enable.auto.commit": False, "log_level": 3})
        got: dict[bytes, bytes] = {}
        errors: list[Any] = []
        try:
            consumer.subscribe([topic])
            with kms.paused():
                deadline = time.monotonic() + 60
                while (other.sample(OUTCOMES, rule="payments", topic=topic,
                                    outcome="kms_unavailable") < 1
                       and time.monotonic() < deadline):
                    for msg in consumer.consume(10, 0.2):
                        if msg.error() is not None:
                            errors.append(msg.error())
                        else:
                            got[msg.key()] = msg.value()
                assert reached(other, "kms_unavailable", topic, timeout=0) >= 1
            assert got == {}  # nothing handed over while it could not be opened
            deadline = time.monotonic() + 60
            while len(got) < len(sent) and time.monotonic() < deadline:
                for msg in consumer.consume(100, 0.5):
                    if msg.error() is not None:
                        errors.append(msg.error())
                    else:
                        assert msg.key() not in got, "a record handed over twice"
                        got[msg.key()] = msg.value()
        finally:
            consumer.close()
    assert got == sent
    assert all(e.code() == ck.KafkaError.UNKNOWN for e in errors), errors


def test_nothing_needs_the_kms_where_the_rule_does_not_apply(
        kafka: KafkaCluster, kms: Kms) -> None:
    """Other topics and other clients go on while the KMS is down."""
    topic = unique("orders")
    kafka.create_topic(topic)
    with ProxyThread(kafka.bootstrap, policy=kms_policy(kms)) as proxy, kms.paused():
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-w",
                                "log_level": 3})
        for i in range(20):
            producer.produce(topic, b"plain %d" % i)
        assert producer.flush(30) == 0
        assert len(read_all(proxy.bootstrap, topic, 20)) == 20


def test_check_probe_makes_and_opens_a_data_key(kafka: KafkaCluster, kms: Kms,
                                                tmp_path: Path) -> None:
    """`gatehouse check --probe` asks the KMS as the proxy would (with the credentials
    the proxy would find), and says so; exit 1 when it makes no data key."""
    rules = tmp_path / "rules.yaml"
    config = tmp_path / "proxy.yaml"
    config.write_text(f"listen: 127.0.0.1:9192\nupstream: [{kafka.bootstrap}]\n"
                      f"rules_file: {rules}\n")

    def probe(key: str) -> subprocess.CompletedProcess[str]:
        rules.write_text("rules:\n  - name: payments\n    encrypt_records:\n"
                         f"      kms: {kms.rule_kms(kms.key_name(key))}\n")
        return subprocess.run([sys.executable, "-m", "gatehouse.cli", "check", "--config",
                               str(config), "--probe"], capture_output=True, text=True,
                              timeout=120)

    if isinstance(kms, KmsServer):
        made_by = (f"AWS KMS under its key 'alias/payments' (region {REGION}, endpoint "
                   f"{kms.endpoint})")
        missing = f"{kms.endpoint}: NotFoundException"
    else:
        made_by = (f"the Vault transit engine at {kms.address}/v1/transit under its key "
                   "'payments' (token from VAULT_TOKEN)")
        missing = f"Vault {kms.address} (transit): HTTP 400: encryption key not found"
    result = probe("payments")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (f"encrypt_records (rule payments): values of every topic encrypted under data "
            f"keys made by {made_by}, each KMS call bounded by 1 s") in result.stdout
    name = kek_name(kms, "payments").decode()
    assert re.search(rf"  encrypt_records \(rule payments\): {re.escape(name)}: a data "
                     r"key made and opened in \d+ ms", result.stdout), result.stdout
    result = probe("nowhere")
    assert result.returncode == 1
    assert (f"  encrypt_records (rule payments): {kek_name(kms, 'nowhere').decode()}: "
            f"{missing}") in result.stdout, result.stdout
    assert "rule payments's KMS makes or opens no data key" in result.stderr


def test_each_topic_under_its_own_kms_key(kafka: KafkaCluster, kms: Kms) -> None:
    """``kms.key: alias/pay-{topic}`` (Vault: ``pay-{topic}``): librdkafka producing to
    two topics at once, each stored under its own key, both read back through another
    proxy."""
    topics = [unique("pay-a"), unique("pay-b")]
    for topic in topics:
        kafka.create_topic(topic)
        kms.key_for(f"pay-{topic}")

    with ProxyThread(kafka.bootstrap, policy=kms_policy(kms, "pay-{topic}")) as proxy:
        producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "app-w",
                                "enable.idempotence": True, "linger.ms": 20, "log_level": 3})
        for i in range(100):
            for topic in topics:
                producer.produce(topic, SECRET + topic.encode() + b"%d" % i)
        assert producer.flush(30) == 0
    for topic in topics:
        direct = read_all(kafka.bootstrap, topic, 100)
        name = kek_name(kms, f"pay-{topic}")
        assert all(name in m.value() for m in direct)
        assert stored_plainly(kafka, topic, SECRET) == []
    with ProxyThread(kafka.bootstrap, policy=kms_policy(kms, "pay-{topic}")) as other:
        for topic in topics:
            got = read_all(other.bootstrap, topic, 100)
            assert sorted(m.value() for m in got) == sorted(
                SECRET + topic.encode() + b"%d" % i for i in range(100))


def test_java_clients_by_topic_id_under_a_topic_key(kafka: KafkaCluster, kms: Kms,
                                                    tmp_path: Path) -> None:
    """The Java VerifiableProducer (Produce v13: topics by id) and VerifiableConsumer
    (Fetch v17) under a per-topic KMS key: the key is named once the topic's id is
    learned (the first requests are asked to look again), every acked value read back
    at its offset."""
    topic = unique("pay-java")
    kafka.create_topic(topic, partitions=2)
    kms.key_for(f"pay-{topic}")
    java_round_trip(kafka, kms_policy(kms, "pay-{topic}", client="java"), tmp_path, topic)
    direct = read_all(kafka.bootstrap, topic, 10)
    assert all(kek_name(kms, f"pay-{topic}") in m.value() for m in direct)
