"""Rules' quotas on a real Apache Kafka broker with real clients: a producer and a
consumer over their byte rates are slowed to them (the proxy holds their requests back),
everything still arrives, a client the rule does not match is not slowed, and the
metrics count the holds."""

from __future__ import annotations

import time

import confluent_kafka as ck

from tests.support.clients import unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

RATE = 200_000  # bytes a second
RULES = (f"- name: slow-writer\n  match: {{client_id: '^slow'}}\n"
         f"  quota: {{produce_bytes_per_second: {RATE}, per: client_id}}\n"
         f"- name: slow-reader\n  match: {{client_id: '^reader'}}\n"
         f"  quota: {{fetch_bytes_per_second: {RATE}}}\n")
VALUES = [bytes([i % 256]) * 1000 for i in range(1000)]  # 1 MB of values


def produce_timed(bootstrap: str, client_id: str, topic: str) -> float:
    """Seconds to produce VALUES with librdkafka in Java-sized batches (16 KiB)."""
    producer = ck.Producer({"bootstrap.servers": bootstrap, "client.id": client_id,
                            "acks": "all", "linger.ms": 5, "batch.size": 16384,
                            "log_level": 3})
    delivered: list[bytes] = []
    errors: list[object] = []

    def on_delivery(err: object, msg: ck.Message) -> None:
        if err is not None:
            errors.append(err)
        else:
            delivered.append(msg.value())

    producer.list_topics(timeout=30)  # connected before the clock starts
    start = time.monotonic()
    for value in VALUES:
        producer.produce(topic, value=value, on_delivery=on_delivery)
    assert producer.flush(60) == 0
    elapsed = time.monotonic() - start
    assert errors == [] and sorted(delivered) == sorted(VALUES)
    return elapsed


def consume_timed(bootstrap: str, client_id: str, topic: str) -> float:
    """Seconds to read VALUES from the start of ``topic`` (assigned, no group), with
    fetches of 64 KiB."""
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "client.id": client_id,
                            "group.id": unique("unused"), "enable.auto.commit": False,
                            "fetch.max.bytes": 65536, "max.partition.fetch.bytes": 65536,
                            "message.max.bytes": 65536,
                            "log_level": 3})
    consumer.assign([ck.TopicPartition(topic, 0, ck.OFFSET_BEGINNING)])
    got: list[bytes] = []
    start = time.monotonic()
    deadline = start + 60
    while len(got) < len(VALUES) and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None:
            assert message.error() is None, message.error()
            got.append(message.value())
    elapsed = time.monotonic() - start
    consumer.close()
    assert sorted(got) == sorted(VALUES)
    return elapsed


def test_clients_over_their_quota_are_slowed_to_it_and_lose_nothing(
        kafka: KafkaCluster) -> None:
    topic = unique("quota")
    kafka.create_topic(topic, partitions=1)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        # 1 MB through a 200 kB/s quota (a second's worth at once): about 4 s at least.
        slow = produce_timed(proxy.bootstrap, "slow-1", topic)
        assert slow >= 3.0, slow
        held = proxy.sample("gatehouse_throttle_seconds_total", rule="slow-writer")
        assert held >= 2.5, held
        assert proxy.sample("gatehouse_rule_decisions_total", rule="slow-writer",
                            action="throttle") > 0
        # Another client id is in no quota: its requests are never held.
        produce_timed(proxy.bootstrap, "fast-1", topic)
        assert proxy.sample("gatehouse_throttle_seconds_total", rule="slow-writer") == held

        # Reading the first 1 MB back under a fetch quota: slowed as much.
        reading = consume_timed(proxy.bootstrap, "reader-1", topic)
        assert reading >= 3.0, reading
        assert proxy.sample("gatehouse_throttle_seconds_total", rule="slow-reader") >= 2.5
