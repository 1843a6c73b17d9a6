"""Rules seen by real clients: transactions on a renamed topic, librdkafka and MinVersion."""

from __future__ import annotations

import logging
import re
import time

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient

from tests.support.clients import unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread


def test_transactional_producer_writes_to_a_renamed_topic(kafka: KafkaCluster) -> None:
    """Consume-transform-produce through a rename: AddPartitionsToTxn, TxnOffsetCommit and
    the transaction markers all name the broker-side topics; the client only its own."""
    source, sink = unique("prod.in"), unique("prod.out")
    kafka.create_topic(source, partitions=2)
    kafka.create_topic(sink, partitions=2)
    rules = ("- name: aliases\n"
             f"  rename_topics: {{payments-in: {source}, payments-out: {sink}}}\n")
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        conf = {"bootstrap.servers": proxy.bootstrap, "log_level": 3}
        seed = ck.Producer({**conf, "acks": "all"})
        for i in range(20):
            seed.produce("payments-in", value=f"in-{i}".encode())
        assert seed.flush(30) == 0

        group = unique("txg")
        consumer = ck.Consumer({**conf, "group.id": group, "auto.offset.reset": "earliest",
                                "enable.auto.commit": False, "session.timeout.ms": 6000,
                                "isolation.level": "read_committed"})
        producer = ck.Producer({**conf, "transactional.id": unique("txid")})
        producer.init_transactions(30)
        taken: list[bytes] = []
        try:
            consumer.subscribe(["payments-in"])
            deadline = time.monotonic() + 60
            while len(taken) < 20 and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is None:
                    continue
                assert msg.error() is None, msg.error()
                assert msg.topic() == "payments-in"
                taken.append(msg.value())
            assert len(taken) == 20
            producer.begin_transaction()
            for value in taken:
                producer.produce("payments-out", value=value.replace(b"in-", b"out-"))
            producer.send_offsets_to_transaction(
                consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30)
            producer.commit_transaction(30)
        finally:
            consumer.close()

        # Through the proxy, a read_committed reader sees the committed output by its alias.
        reader = ck.Consumer({**conf, "group.id": unique("g"), "auto.offset.reset": "earliest",
                              "isolation.level": "read_committed", "session.timeout.ms": 6000})
        got: list[bytes] = []
        try:
            reader.subscribe(["payments-out"])
            deadline = time.monotonic() + 60
            while len(got) < 20 and time.monotonic() < deadline:
                msg = reader.poll(0.5)
                if msg is not None and msg.error() is None:
                    assert msg.topic() == "payments-out"
                    got.append(msg.value())
        finally:
            reader.close()
        assert sorted(got) == sorted(f"out-{i}".encode() for i in range(20))

    # Straight to the broker: data and the transactional offset commit live under the
    # broker-side names, and no client-side name leaked into the cluster.
    direct = AdminClient({"bootstrap.servers": kafka.bootstrap})
    names = set(direct.list_topics(timeout=10).topics)
    assert {source, sink} <= names and not {"payments-in", "payments-out"} & names
    offsets = direct.list_consumer_group_offsets(
        [ck.ConsumerGroupTopicPartitions(group)])[group].result(30)
    assert {tp.topic for tp in offsets.topic_partitions} == {source}
    assert sum(tp.offset for tp in offsets.topic_partitions) == 20
    committed = ck.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": unique("g"),
                             "auto.offset.reset": "earliest",
                             "isolation.level": "read_committed"})
    try:
        lows_highs = [committed.get_watermark_offsets(ck.TopicPartition(sink, p), timeout=10)
                      for p in range(2)]
    finally:
        committed.close()
    # 20 records plus one commit marker per partition written to.
    assert sum(high for _low, high in lows_highs) > 20


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _librdkafka_api_ranges(bootstrap: str) -> dict[str, tuple[int, int]]:
    """The version ranges librdkafka itself recorded from the ApiVersions response."""
    handler = _Lines()
    logger = logging.getLogger(unique("rdkafka"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    admin = AdminClient({"bootstrap.servers": bootstrap, "debug": "protocol,feature",
                         "logger": logger})
    admin.list_topics(timeout=10)
    admin.poll(0)  # deliver the queued log lines to the handler
    ranges: dict[str, tuple[int, int]] = {}
    for line in handler.lines:
        found = re.search(r"ApiKey (\w+) \(\d+\) Versions (\d+)\.\.(\d+)", line)
        if found:
            ranges[found[1]] = (int(found[2]), int(found[3]))
    return ranges


def test_librdkafka_sees_the_raised_min_version(kafka: KafkaCluster) -> None:
    direct = _librdkafka_api_ranges(kafka.bootstrap)
    assert direct["Metadata"][0] == 0 and direct["Produce"][0] == 0
    rules = ("- name: modern\n"
             "  min_api_version: {Metadata: 7, ListOffsets: 2, Produce: 3}\n")
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        seen = _librdkafka_api_ranges(proxy.bootstrap)
        # Raised where advertising is safe; the maximum is the broker's.
        assert seen["Metadata"] == (7, direct["Metadata"][1])
        assert seen["ListOffsets"] == (2, direct["ListOffsets"][1])
        # Produce keeps its advertised minimum by default (librdkafka would disable
        # compression otherwise: KAFKA-18727); old Produce versions are refused anyway.
        assert seen["Produce"] == direct["Produce"]
        assert proxy.sample("gatehouse_rule_decisions_total", rule="modern",
                            action="refuse") == 0  # librdkafka asked for nothing refused
