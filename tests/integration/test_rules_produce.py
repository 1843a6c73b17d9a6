"""``produce_policy`` on a real Apache Kafka broker, with real producers: librdkafka and
the Java producer held to acks=all, zstd or gzip batches and idempotence; what breaks
it is refused with POLICY_VIOLATION, as each client reports it, and never written; an
acks=0 producer's connection is closed; observe mode only counts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from tests.integration.test_sasl_proxy import logged
from tests.support.clients import unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = ("- name: strict-producers\n  match: {client_id: '^strict-'}\n  produce_policy:\n"
         "    acks: all\n    compression: [zstd, gzip]\n    idempotent: true\n")


def deliveries(proxy: ProxyThread, topic: str, count: int, **settings: Any
               ) -> list[ck.KafkaError | None]:
    """The delivery report of each of ``count`` records a librdkafka producer sends."""
    reports: list[ck.KafkaError | None] = []
    producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                            "message.timeout.ms": 15000, "linger.ms": 5, **settings})
    for i in range(count):
        producer.produce(topic, f"r-{i}".encode(), on_delivery=lambda err, _m: reports.append(err))
    producer.flush(30)
    return reports


def java_producer(kafka: KafkaCluster, proxy: ProxyThread, topic: str, client_id: str,
                  *settings: str) -> Any:
    return kafka.run_java_tool(
        "org.apache.kafka.tools.ProducerPerformance", "--topic", topic, "--num-records", "50",
        "--record-size", "100", "--throughput", "-1", "--producer-props",
        f"bootstrap.servers={proxy.bootstrap}", f"client.id={client_id}", *settings,
        timeout=120)


def test_producers_are_held_to_the_policy(kafka: KafkaCluster, tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.proxy")
    caplog.set_level(logging.INFO, logger="gatehouse.rules")
    topic = unique("policy")
    kafka.create_topic(topic)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        good = deliveries(proxy, topic, 20, **{"client.id": "strict-good", "acks": "all",
                                               "compression.type": "zstd",
                                               "enable.idempotence": True})
        assert good == [None] * 20
        uncompressed = deliveries(proxy, topic, 5, **{"client.id": "strict-plain",
                                                      "enable.idempotence": True})
        assert {e.code() for e in uncompressed if e is not None} == {
            ck.KafkaError.POLICY_VIOLATION}
        assert len(uncompressed) == 5
        leader_only = deliveries(proxy, topic, 5, **{"client.id": "strict-leader", "acks": 1,
                                                     "compression.type": "gzip"})
        assert {e.code() for e in leader_only if e is not None} == {
            ck.KafkaError.POLICY_VIOLATION}
        # Clients the rule does not match write as they like.
        assert deliveries(proxy, topic, 5, **{"client.id": "batch-job", "acks": 1}) == [None] * 5

        # The Java producer: idempotent with zstd (its defaults: acks=all, idempotence).
        java = java_producer(kafka, proxy, topic, "strict-java", "compression.type=zstd")
        assert java.returncode == 0 and "50 records sent" in java.stdout, java.stderr[-2000:]
        refused = java_producer(kafka, proxy, topic, "strict-java-lz4", "compression.type=lz4")
        out = refused.stdout + refused.stderr
        assert "PolicyViolationException" in out, out[-3000:]
        assert "batches compressed with lz4 are not allowed" in out

        # acks=0: nothing can carry the error, so the connection closes; nothing written.
        deliveries(proxy, topic, 5, **{"client.id": "strict-fire", "acks": 0,
                                       "compression.type": "zstd"})
        # (acks=0: the client's flush does not wait for the proxy to have read them.)
        assert proxy.sample_reaches("gatehouse_rule_decisions_total", 4,
                                    rule="strict-producers", action="refuse") >= 4
        assert proxy.sample("gatehouse_responses_total", api="Produce",
                            error="POLICY_VIOLATION") >= 3
    assert watermarks(kafka.bootstrap, topic) == (0, 20 + 5 + 50)
    reasons = [str(f.get("reason")) for f in logged(caplog, "refused")]
    assert any("acks=1 is not allowed (use acks=all)" in r for r in reasons), reasons
    assert any("the producer is not idempotent" in r or "compressed with none" in r
               for r in reasons), reasons
    closed = [str(f.get("reason")) for f in logged(caplog, "connection closed")]
    assert any("refused acks=0 Produce" in r and "acks=0 is not allowed" in r
               for r in closed), closed


def test_in_observe_mode_the_policy_only_counts(kafka: KafkaCluster) -> None:
    topic = unique("policy-observe")
    kafka.create_topic(topic)
    rules = RULES.replace("  match:", "  mode: observe\n  match:")
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        assert deliveries(proxy, topic, 10, **{"client.id": "strict-plain", "acks": 1}) == (
            [None] * 10)
        assert proxy.sample("gatehouse_rule_decisions_total", rule="strict-producers",
                            action="would_refuse") >= 1
        assert proxy.sample("gatehouse_rule_decisions_total", rule="strict-producers",
                            action="refuse") == 0
    assert watermarks(kafka.bootstrap, topic) == (0, 10)


def test_a_policy_for_some_topics_with_the_java_producer(kafka: KafkaCluster) -> None:
    """The Java producer names topics by id (Produce v13): a policy limited to some
    topics is matched through the ids the proxy learned from the Metadata answers."""
    held, free = unique("held"), unique("free")
    for topic in (held, free):
        kafka.create_topic(topic)
    rules = "- name: held-topics\n  produce_policy:\n    topics: ['held-.*']\n    compression: zstd\n"
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        loose = java_producer(kafka, proxy, free, "any-java", "compression.type=lz4")
        assert loose.returncode == 0 and "50 records sent" in loose.stdout, loose.stderr[-2000:]
        refused = java_producer(kafka, proxy, held, "any-java", "compression.type=lz4")
        out = refused.stdout + refused.stderr
        assert "PolicyViolationException" in out, out[-3000:]
        kept = java_producer(kafka, proxy, held, "any-java", "compression.type=zstd")
        assert kept.returncode == 0 and "50 records sent" in kept.stdout, kept.stderr[-2000:]
        assert proxy.summed("gatehouse_requests_total", api="Produce", version="13") >= 1
    assert watermarks(kafka.bootstrap, free) == (0, 50)
    assert watermarks(kafka.bootstrap, held) == (0, 50)
