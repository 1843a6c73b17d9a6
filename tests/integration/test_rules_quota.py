"""Rules' quotas on a real Apache Kafka broker with real clients: a producer and a
consumer over their byte rates are slowed to them (the proxy holds their requests back),
everything still arrives, a client the rule does not match is not slowed, and the
metrics count the holds."""

from __future__ import annotations

import re
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


def produce_timed(bootstrap: str, client_id: str, topic: str,
                  throttles: list[float] | None = None) -> float:
    """Seconds to produce VALUES with librdkafka in Java-sized batches (16 KiB); the
    throttle times the answers asked for (librdkafka's throttle events) go into
    ``throttles``."""
    producer = ck.Producer({"bootstrap.servers": bootstrap, "client.id": client_id,
                            "acks": "all", "linger.ms": 5, "batch.size": 16384,
                            "log_level": 3, "throttle_cb": lambda event: (
                                throttles.append(event.throttle_time)
                                if throttles is not None else None)})
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


def consume_timed(bootstrap: str, client_id: str, topic: str,
                  throttles: list[float]) -> float:
    """Seconds to read VALUES from the start of ``topic`` (assigned, no group), with
    fetches of 64 KiB; the throttle times the answers asked for go into ``throttles``."""
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "client.id": client_id,
                            "group.id": unique("unused"), "enable.auto.commit": False,
                            "fetch.max.bytes": 65536, "max.partition.fetch.bytes": 65536,
                            "message.max.bytes": 65536, "throttle_cb": lambda event:
                            throttles.append(event.throttle_time),
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
        throttles: list[float] = []
        slow = produce_timed(proxy.bootstrap, "slow-1", topic, throttles)
        assert slow >= 3.0, slow
        # The answers said so too, as a broker's quota would (throttle_time_ms): the
        # client's own throttle metrics and callbacks see it.
        assert throttles and max(throttles) > 0.05, throttles
        held = proxy.sample("gatehouse_throttle_seconds_total", rule="slow-writer")
        assert held >= 2.5, held
        assert proxy.sample("gatehouse_rule_decisions_total", rule="slow-writer",
                            action="throttle") > 0
        # Another client id is in no quota: its requests are never held.
        unthrottled: list[float] = []
        produce_timed(proxy.bootstrap, "fast-1", topic, unthrottled)
        assert not any(unthrottled), unthrottled
        assert proxy.sample("gatehouse_throttle_seconds_total", rule="slow-writer") == held

        # Reading the first 1 MB back under a fetch quota: slowed as much.
        fetch_throttles: list[float] = []
        reading = consume_timed(proxy.bootstrap, "reader-1", topic, fetch_throttles)
        assert reading >= 3.0, reading
        assert fetch_throttles and max(fetch_throttles) > 0.05, fetch_throttles
        assert proxy.sample("gatehouse_throttle_seconds_total", rule="slow-reader") >= 2.5


def test_the_java_producer_is_told_its_throttle_time(kafka: KafkaCluster) -> None:
    """The Java client honours an answer's throttle_time_ms itself (KIP-219: it sends
    nothing to that broker for that long) and reports it in its metrics."""
    topic = unique("quota-java")
    kafka.create_topic(topic, partitions=1)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        result = kafka.run_java_tool(
            "org.apache.kafka.tools.ProducerPerformance", "--topic", topic,
            "--num-records", "800", "--record-size", "1000", "--throughput", "-1",
            "--print-metrics", "--producer-props", f"bootstrap.servers={proxy.bootstrap}",
            "acks=all", "client.id=slow-java", "linger.ms=5", timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "800 records sent" in result.stdout
        found = re.search(r"producer-metrics:produce-throttle-time-max:\{client-id=slow-java\}"
                          r"\s*:\s*([0-9.]+)", result.stdout)
        assert found is not None, result.stdout[-3000:]
        assert float(found.group(1)) > 50, found.group(0)  # milliseconds
        assert proxy.sample("gatehouse_rule_decisions_total", rule="slow-writer",
                            action="throttle") > 0
