"""``validate_records`` on a real Apache Kafka broker, with real producers: librdkafka in
every codec and the Java producer (which names topics by id, Produce v13).  A partition
holding a record that breaks the rule is refused with INVALID_RECORD, as each client
reports it, and never written; the request's other partitions are written; what is
consumed afterwards is exactly the good records; the log says which record and why,
never what it held."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest

from gatehouse.configfile import load_yaml_text
from gatehouse.proxy.hooks import ConnectionInfo
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import parse_rules
from tests.integration.test_sasl_proxy import logged
from tests.support.clients import consume, unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread

RULES = """\
- name: orders
  validate_records:
    topics: ['orders-.*']
    key: {required: true}
    value: json
- name: events
  validate_records:
    topics: ['events-.*']
    value: {format: json, max_bytes: 200}
"""
SECRET = b'{"card": "4111-SECRET-1111"'  # not JSON (no closing brace), never to be logged


def send(proxy: ProxyThread, topic: str, records: Sequence[tuple[int, bytes | None, bytes]],
         **settings: Any) -> list[tuple[int | None, ck.KafkaError | None]]:
    """(partition, delivery error) for each (partition, key, value) a librdkafka
    producer sends, all in one flush (librdkafka sends each partition in requests of its
    own)."""
    reports: list[tuple[int | None, ck.KafkaError | None]] = []
    producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                            "message.timeout.ms": 15000, "linger.ms": 50, **settings})
    for partition, key, value in records:
        producer.produce(topic, value, key, partition=partition,
                         on_delivery=lambda err, m: reports.append((m.partition(), err)))
    producer.flush(30)
    return sorted(reports, key=lambda r: r[0] or 0)


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_librdkafka_bad_partitions_refused_the_rest_written(
        kafka: KafkaCluster, codec: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse.rules")
    topic = unique("orders")
    kafka.create_topic(topic, partitions=2)
    good = [(0, b"k%d" % i, json.dumps({"n": i}).encode()) for i in range(20)]
    bad = [(1, b"k", b'{"n": 1}'), (1, b"k", SECRET), (1, None, b'{"n": 3}')]
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        reports = send(proxy, topic, good + bad, **{"compression.type": codec})
        assert [err for p, err in reports if p == 0] == [None] * 20
        # The batch is refused whole, as a broker refuses it; librdkafka reads KIP-467's
        # record errors: the records named get INVALID_RECORD, the one beside them
        # "a different record in the batch was invalid".
        refused = [None if e is None else e.code() for p, e in reports if p == 1]
        assert refused == [ck.KafkaError._INVALID_DIFFERENT_RECORD,
                           ck.KafkaError.INVALID_RECORD, ck.KafkaError.INVALID_RECORD]
        # A topic the rule does not name takes anything.
        other = unique("audit")
        kafka.create_topic(other)
        assert send(proxy, other, [(0, None, SECRET)]) == [(0, None)]
        assert proxy.sample("gatehouse_rule_decisions_total", rule="orders",
                            action="refuse") >= 1
        assert proxy.sample("gatehouse_responses_total", api="Produce",
                            error="INVALID_RECORD") >= 1
        assert proxy.sample("gatehouse_invalid_records_total", rule="orders", topic=topic,
                            mode="enforce") == 2
    assert watermarks(kafka.bootstrap, topic, 0) == (0, 20)
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)
    assert sorted(consume({"bootstrap.servers": kafka.bootstrap}, topic, 20)) == sorted(
        v for _, _, v in good)
    reasons = [str(f.get("reason")) for f in logged(caplog, "refused")]
    assert any(f"topic {topic} partition 1: record 1: its value is not JSON" in r
               and "(3 records in all)" not in r and "(2 records in all) (rule orders)" in r
               for r in reasons), reasons
    assert b"SECRET".decode() not in caplog.text


def test_one_request_with_a_good_and_a_bad_partition_gets_one_merged_answer(
        kafka: KafkaCluster) -> None:
    """kafka-python sends a broker's ready batches in one request: the good partition
    goes to the broker, the bad one is answered by the proxy, and the client gets one
    answer holding both (each record's future says which)."""
    from kafka.errors import InvalidRecordError

    topic = unique("orders")
    kafka.create_topic(topic, partitions=2)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        good, bad = kafka_python_good_and_bad(proxy, topic, acks="all")
        assert proxy.summed("gatehouse_requests_total", api="Produce") == 1  # one request
        assert [f.get(10).offset for f in good] == list(range(20))
        with pytest.raises(InvalidRecordError):
            bad.get(10)
        assert proxy.sample("gatehouse_invalid_records_total", rule="orders", topic=topic,
                            mode="enforce") == 1
    assert watermarks(kafka.bootstrap, topic, 0) == (0, 20)
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)


def test_acks_0_the_good_partitions_written_then_the_connection_closed(
        kafka: KafkaCluster, caplog: pytest.LogCaptureFixture) -> None:
    """An acks=0 request has no answer to carry a refusal: as a broker does, the proxy
    writes the partitions that pass and then closes the connection."""
    caplog.set_level(logging.INFO, logger="gatehouse")
    topic = unique("orders")
    kafka.create_topic(topic, partitions=2)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        good, bad = kafka_python_good_and_bad(proxy, topic, acks=0)
        assert all(f.succeeded() for f in [*good, bad])  # acks=0: sent is delivered
        assert proxy.sample_reaches("gatehouse_invalid_records_total", 1, rule="orders",
                                    topic=topic, mode="enforce") == 1
        assert proxy.summed("gatehouse_requests_total", api="Produce") == 1  # one request
    assert watermarks(kafka.bootstrap, topic, 0) == (0, 20)
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)
    closes = [str(f) for f in logged(caplog, "connection closed")]
    assert any("refused records of an acks=0 Produce (topic " in c and "partition 1)" in c
               for c in closes), closes
    assert b"SECRET".decode() not in caplog.text


def kafka_python_good_and_bad(proxy: ProxyThread, topic: str, acks: int | str
                              ) -> tuple[list[Any], Any]:
    """kafka-python, which sends a broker's ready batches in one request (both
    partitions'), producing 20 JSON records to partition 0 and one that is not JSON to
    partition 1, flushed and closed: the good records' futures and the bad one's."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, acks=acks, linger_ms=200,
                             retries=0)
    try:
        good = [producer.send(topic, json.dumps({"n": i}).encode(), b"k%d" % i, partition=0)
                for i in range(20)]
        bad = producer.send(topic, SECRET, b"k", partition=1)
        producer.flush(30)
    finally:
        producer.close(10)
    return good, bad


def java_producer(kafka: KafkaCluster, proxy: ProxyThread, topic: str, payloads: Path,
                  *settings: str) -> Any:
    return kafka.run_java_tool(
        "org.apache.kafka.tools.ProducerPerformance", "--topic", topic, "--num-records", "50",
        "--payload-file", str(payloads), "--throughput", "-1", "--producer-props",
        f"bootstrap.servers={proxy.bootstrap}", "linger.ms=5", *settings, timeout=120)


def test_the_java_producer_by_topic_id(kafka: KafkaCluster, tmp_path: Path) -> None:
    """The Java producer names topics by id (Produce v13): the proxy learns the ids from
    the Metadata answers it passes, and holds the records to the rule of the topic's
    name; JSON is written, anything else refused with the record's reason."""
    topic = unique("events")
    kafka.create_topic(topic)
    good = tmp_path / "good.txt"
    good.write_text("\n".join(json.dumps({"event": i, "kind": "click"}) for i in range(10)))
    bad = tmp_path / "bad.txt"
    # ProducerPerformance picks each record's payload from the file at random: every
    # line breaks the rule, so every batch is refused whatever the draw.
    bad.write_text("\n".join(["click", json.dumps({"pad": "x" * 300}), "{\"event\": 1"]))
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        written = java_producer(kafka, proxy, topic, good, "compression.type=lz4")
        assert written.returncode == 0 and "50 records sent" in written.stdout, (
            written.stdout[-2000:] + written.stderr[-2000:])
        refused = java_producer(kafka, proxy, topic, bad, "compression.type=zstd")
        out = refused.stdout + refused.stderr
        assert "InvalidRecordException" in out, out[-3000:]
        assert ("its value is not JSON" in out or "above 200" in out), out[-3000:]
        assert proxy.sample("gatehouse_responses_total", api="Produce",
                            error="INVALID_RECORD") >= 1
        assert proxy.summed("gatehouse_requests_total", api="Produce", version="13") >= 1
        # Named by id on the wire, counted by name (the id learned from Metadata).
        assert proxy.sample("gatehouse_invalid_records_total", rule="events", topic=topic,
                            mode="enforce") >= 1
    assert watermarks(kafka.bootstrap, topic) == (0, 50)  # only the good run's


def test_in_observe_mode_bad_records_are_written_and_counted(kafka: KafkaCluster) -> None:
    topic = unique("orders")
    kafka.create_topic(topic)
    rules = RULES.replace("- name: orders\n", "- name: orders\n  mode: observe\n")
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        assert send(proxy, topic, [(0, None, b"not json")] * 5) == [(0, None)] * 5
        assert proxy.sample("gatehouse_rule_decisions_total", rule="orders",
                            action="would_refuse") >= 1
        assert proxy.sample("gatehouse_invalid_records_total", rule="orders", topic=topic,
                            mode="observe") == 5
        assert proxy.sample("gatehouse_rule_decisions_total", rule="orders",
                            action="refuse") == 0
    assert watermarks(kafka.bootstrap, topic) == (0, 5)


class Offloads(RulesPolicy):
    """The rules, counting the requests whose records were read in a thread."""

    offloaded = 0

    def offload(self, conn: ConnectionInfo, req: Any) -> Any:
        work = super().offload(conn, req)
        self.offloaded += work is not None
        return work


def test_values_held_to_a_json_schema(kafka: KafkaCluster, tmp_path: Path) -> None:
    schema = tmp_path / "reading.json"
    schema.write_text(json.dumps({
        "type": "object", "required": ["sensor", "celsius"],
        "properties": {"sensor": {"type": "string"},
                       "celsius": {"type": "number", "minimum": -90, "maximum": 60}}}))
    rules = (f"- name: readings\n  validate_records:\n    topics: ['readings-.*']\n"
             f"    value: {{schema: '{schema}'}}\n")
    topic = unique("readings")
    kafka.create_topic(topic, partitions=2)
    # Enough records for requests past 64 KiB: read in a thread (Policy.offload).
    good = [(0, None, json.dumps({"sensor": f"s{i}", "celsius": i % 60}).encode())
            for i in range(3000)]
    bad = [(1, None, json.dumps({"sensor": "s1", "celsius": 21}).encode()),
           (1, None, json.dumps({"sensor": "s2", "celsius": 900}).encode())]
    policy = Offloads(parse_rules(load_yaml_text(rules, "rules.yaml"), "rules.yaml"))
    with ProxyThread(kafka.bootstrap, policy=policy) as proxy:
        reports = send(proxy, topic, good + bad)
    assert policy.offloaded >= 1  # a request past 64 KiB: its records read in a thread
    assert [e for p, e in reports if p == 0] == [None] * 3000
    # One record error: librdkafka (2.x) gives the partition's INVALID_RECORD to every
    # record of the batch (with two or more it tells them apart, as the test above shows).
    assert [None if e is None else e.code() for p, e in reports if p == 1] == [
        ck.KafkaError.INVALID_RECORD] * 2
    assert watermarks(kafka.bootstrap, topic, 0) == (0, 3000)
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)


ORDER_PROTO = """\
syntax = "proto3";
package shop;
import "google/protobuf/timestamp.proto";
message Order {
  string id = 1;
  repeated Line lines = 2;
  google.protobuf.Timestamp placed = 3;
  message Line { string sku = 1; uint32 qty = 2; }
}
"""


def test_raw_protobuf_values_held_to_a_local_proto_file(
        kafka: KafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``protobuf: FILE``: values written by Google's own generated code are taken and
    read back as they were written; a value of another message (a Line where an Order
    belongs) or cut short is refused as INVALID_RECORD and never written."""
    from tests.support.protoc import compile_proto

    caplog.set_level(logging.INFO, logger="gatehouse")
    order_pb2, _ = compile_proto(ORDER_PROTO, "local_order", tmp_path)
    proto = tmp_path / "local_order.proto"
    topic = unique("orders")
    kafka.create_topic(topic, partitions=2)
    rules = ("- name: orders-protobuf\n  validate_records:\n    topics: ['orders-.*']\n"
             f"    value: {{protobuf: {{file: '{proto}', message: shop.Order}}}}\n")
    orders = [order_pb2.Order(id=f"o-{i}", lines=[order_pb2.Order.Line(sku="k", qty=i)])
              for i in range(20)]
    for order in orders:
        order.placed.seconds = 1_700_000_000 + order.lines[0].qty
    good = [order.SerializeToString() for order in orders]
    line = order_pb2.Order.Line(sku="k" * 20, qty=1).SerializeToString()  # qty: field 2
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        reports = send(proxy, topic, [(0, None, value) for value in good]
                       + [(1, None, line), (1, None, good[3][:-2])])
    assert [e for p, e in reports if p == 0] == [None] * 20
    assert [None if e is None else e.code() for p, e in reports if p == 1] == [
        ck.KafkaError.INVALID_RECORD] * 2
    [refused] = logged(caplog, "refused")
    assert refused["reason"] == (
        f"topic {topic} partition 1: record 0: its value is not Protobuf of "
        "local_order.proto (as shop.Order: field 'lines' (2) is written as a varint, and "
        "its type (message) is length-delimited) (2 records in all) (rule orders-protobuf)")
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)
    read = consume({"bootstrap.servers": kafka.bootstrap}, topic, 20)
    assert sorted(order_pb2.Order.FromString(value).id for value in read) == sorted(
        order.id for order in orders)
