"""``validate_records``' ``registry`` checks on a real Apache Kafka broker and a real
Schema Registry (Apicurio Registry's Confluent-compatible API), with librdkafka
producing records framed by Confluent's own JSON Schema, Avro and Protobuf serializers:
records naming a schema id the registry does not know, JSON that does not match the
schema registered under their id, bytes that do not read as their Avro schema or as the
Protobuf message their indexes name, are refused as each client reports them and never
written; a registry that hangs (SIGSTOP) gets the partitions REQUEST_TIMED_OUT, which
the producer retries until the registry answers, and each record is then written once."""

from __future__ import annotations

import importlib
import json
import logging
import struct
import urllib.request
from pathlib import Path
from typing import Any

import confluent_kafka as ck
import pytest
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.integration.test_rules_records import send
from tests.integration.test_sasl_proxy import logged, wait_for
from tests.support.apicurio import ApicurioRegistry
from tests.support.clients import unique, watermarks
from tests.support.kafka import KafkaCluster
from tests.support.protoc import compile_proto
from tests.support.proxythread import ProxyThread

ORDER = json.dumps({"type": "object", "required": ["id", "total"],
                    "properties": {"id": {"type": "integer"}, "total": {"type": "number"}}})


def rules(url: str, timeout: float = 5) -> str:
    return ("- name: registered\n  validate_records:\n    topics: ['orders-.*']\n"
            f"    value: {{registry: {{url: '{url}', timeout: {timeout}}}}}\n")


def serialized(serializer: Any, value: Any, context: SerializationContext) -> bytes:
    out = serializer(value, context)
    assert isinstance(out, bytes)
    return out


def read_back(kafka: KafkaCluster, topic: str, count: int, deserializer: Any) -> list[Any]:
    """The first ``count`` values of partition 0 of ``topic``, each read back by
    ``deserializer`` (a serializer's own)."""
    consumer = ck.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": unique("g"),
                            "auto.offset.reset": "earliest", "log_level": 0})
    consumer.assign([ck.TopicPartition(topic, 0, 0)])
    read: list[Any] = []
    try:
        while len(read) < count:
            message = consumer.poll(15)
            assert message is not None, f"{len(read)} of {count} read"
            assert message.error() is None
            read.append(deserializer(message.value(), SerializationContext(
                topic, MessageField.VALUE)))
    finally:
        consumer.close()
    return read


def framed(schema_id: int, value: Any) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + json.dumps(value).encode()


def test_unknown_ids_and_mismatched_json_refused_the_rest_written(
        kafka: KafkaCluster, apicurio: ApicurioRegistry,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse")
    topic = unique("orders")
    kafka.create_topic(topic, partitions=3)
    registry = apicurio
    with ProxyThread(kafka.bootstrap, rules_yaml=rules(registry.url)) as proxy:
        to_bytes = JSONSerializer(ORDER, registry.client())
        context = SerializationContext(topic, MessageField.VALUE)
        good = [serialized(to_bytes, {"id": i, "total": i * 1.5}, context) for i in range(50)]
        # The serializer registered the schema under <topic>-value: its id.
        schema_id = registry.register(f"{topic}-value", ORDER)
        assert good[0][:5] == framed(schema_id, None)[:5]
        reports = send(proxy, topic,
                       [(0, None, value) for value in good]
                       + [(1, None, framed(schema_id, {"id": "seven", "total": 1}))]
                       + [(2, None, framed(schema_id + 100000, {"id": 7, "total": 1}))])
        assert [e for p, e in reports if p == 0] == [None] * 50
        assert [(p, None if e is None else e.code()) for p, e in reports if p != 0] == [
            (1, ck.KafkaError.INVALID_RECORD), (2, ck.KafkaError.INVALID_RECORD)]
        # Asked once for each id, however many records and requests named it.
        assert proxy.sample("gatehouse_schema_registry_lookups_total",
                            registry=registry.url, outcome="found") == 1
        assert proxy.sample("gatehouse_schema_registry_lookups_total",
                            registry=registry.url, outcome="not_found") == 1
    # Logged once per connection and topic: the first refused partition's first record.
    [refused] = logged(caplog, "refused")
    assert refused["rule"] == "registered"
    assert refused["reason"] in (
        f"topic {topic} partition 1: record 0: its value does not match schema "
        f'{schema_id}: at $.id, type "integer" (rule registered)',
        f"topic {topic} partition 2: record 0: its value's schema id {schema_id + 100000} is "
        "not in the Schema Registry (rule registered)")
    assert watermarks(kafka.bootstrap, topic, 0) == (0, 50)
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)
    assert watermarks(kafka.bootstrap, topic, 2) == (0, 0)
    # What was written reads back through the serializer's own deserializer.
    read = read_back(kafka, topic, 50, JSONDeserializer(ORDER))
    assert read == [{"id": i, "total": i * 1.5} for i in range(50)]


def test_a_registry_that_hangs_is_retried_never_let_through(
        kafka: KafkaCluster, apicurio: ApicurioRegistry,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gatehouse")
    topic = unique("orders")
    kafka.create_topic(topic)
    registry = apicurio
    # A schema of its own (ids are global): not fetched by the other tests' proxies.
    schema = json.loads(ORDER)
    schema["title"] = topic
    with ProxyThread(kafka.bootstrap, rules_yaml=rules(registry.url, timeout=1)) as proxy:
        schema_id = registry.register(f"{topic}-value", json.dumps(schema))
        registry.pause()
        try:
            reports: list[ck.KafkaError | None] = []
            producer = ck.Producer({"bootstrap.servers": proxy.bootstrap, "log_level": 0,
                                    "enable.idempotence": True,
                                    "message.timeout.ms": 60000, "retry.backoff.ms": 200})
            for i in range(5):
                producer.produce(topic, framed(schema_id, {"id": i, "total": 1.0}),
                                 on_delivery=lambda err, m: reports.append(err))
            producer.poll(0)
            # The proxy gives up on the registry after 1 s and answers
            # REQUEST_TIMED_OUT; the producer retries; nothing is written meanwhile.
            assert proxy.sample_reaches("gatehouse_responses_total", 2, timeout=30,
                                        api="Produce", error="REQUEST_TIMED_OUT") >= 2
            assert watermarks(kafka.bootstrap, topic) == (0, 0)
            assert reports == []
        finally:
            registry.resume()  # the other tests share it
        producer.flush(60)
        assert reports == [None] * 5
    assert watermarks(kafka.bootstrap, topic) == (0, 5)  # each record once
    failures = wait_for(lambda: logged(caplog, "Schema Registry lookup failed: records "
                                       "naming the schema are answered REQUEST_TIMED_OUT "
                                       "(retriable) for 2 s"))
    assert failures and failures[0]["registry"] == registry.url
    assert failures[0]["schema_id"] == schema_id
    assert failures[0]["error"] == (f"{registry.url} did not answer for schema {schema_id} "
                                    "in 1 s")


def test_avro_records_read_against_their_schema(kafka: KafkaCluster,
                                               apicurio: ApicurioRegistry) -> None:
    """Confluent's Avro serializer's records are written; bytes that do not read as the
    schema their id names (another schema's datum, a truncated one) are refused."""
    order = json.dumps({"type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "long"}, {"name": "note", "type": ["null", "string"]}]})
    other = json.dumps({"type": "record", "name": "Note", "fields": [
        {"name": "text", "type": "string"}]})
    topic = unique("orders")
    kafka.create_topic(topic, partitions=2)
    registry = apicurio
    with ProxyThread(kafka.bootstrap, rules_yaml=rules(registry.url)) as proxy:
        client = registry.client()
        context = SerializationContext(topic, MessageField.VALUE)
        to_order = AvroSerializer(client, order)
        good = [serialized(to_order, {"id": i, "note": None if i % 2 else f"n{i}"}, context)
                for i in range(20)]
        note = AvroSerializer(client, other, conf={"auto.register.schemas": True,
                                                   "subject.name.strategy":
                                                   lambda ctx, name: "notes-value"})
        # A Note's bytes framed with the Order schema's id: "n" is not a long and a union.
        order_id = good[0][1:5]
        wrong = b"\x00" + order_id + serialized(note, {"text": "x" * 40}, context)[5:]
        reports = send(proxy, topic, [(0, None, value) for value in good]
                       + [(1, None, wrong), (1, None, good[0][:-1])])
        assert [e for p, e in reports if p == 0] == [None] * 20
        assert [None if e is None else e.code() for p, e in reports if p == 1] == [
            ck.KafkaError.INVALID_RECORD] * 2
    assert watermarks(kafka.bootstrap, topic, 0) == (0, 20)
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)


def test_a_schema_registered_for_another_topic_is_refused(
        kafka: KafkaCluster, apicurio: ApicurioRegistry) -> None:
    """``subject: "{topic}-value"``: a producer writing to one topic with a schema
    registered only for another's values (a copied serializer config) is refused; the
    serializer's own records, registered under ``<topic>-value``, are written."""
    registry = apicurio
    topic = unique("orders")
    kafka.create_topic(topic)
    schema = json.loads(ORDER)
    schema["title"] = f"elsewhere {topic}"
    stray = registry.register(f"{unique('payments')}-value", json.dumps(schema))
    checked = ("- name: registered\n  validate_records:\n    topics: ['orders-.*']\n"
               f"    value: {{registry: {{url: '{registry.url}', "
               "subject: '{topic}-value'}}\n")
    with ProxyThread(kafka.bootstrap, rules_yaml=checked) as proxy:
        to_bytes = JSONSerializer(ORDER, registry.client())
        context = SerializationContext(topic, MessageField.VALUE)
        good = serialized(to_bytes, {"id": 1, "total": 2.0}, context)
        assert send(proxy, topic, [(0, None, good)]) == [(0, None)]
        [(_, error)] = send(proxy, topic, [(0, None, framed(stray, {"id": 1, "total": 2}))])
        assert error is not None and error.code() == ck.KafkaError.INVALID_RECORD
    assert watermarks(kafka.bootstrap, topic) == (0, 1)


ORDERS_PROTO = """\
syntax = "proto3";
package registered;
message Order {
  int64 id = 1;
  string customer = 2;
  repeated Line lines = 3;
  message Line { string sku = 1; uint32 qty = 2; }
}
"""


def test_protobuf_records_read_against_their_schema(
        kafka: KafkaCluster, apicurio: ApicurioRegistry, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Confluent's Protobuf serializer registers a base64 FileDescriptorProto; Java's
    register .proto text and frame the first message as one zero byte: records of both
    are written and read back; a record whose bytes do not read as the message its
    indexes name (a string where the schema has an int64, a message the file does not
    have) is refused and never written."""
    caplog.set_level(logging.INFO, logger="gatehouse")
    orders_pb2, _ = compile_proto(ORDERS_PROTO, "registered_orders", tmp_path)
    topic = unique("orders")
    kafka.create_topic(topic, partitions=3)
    registry = apicurio
    with ProxyThread(kafka.bootstrap, rules_yaml=rules(registry.url)) as proxy:
        to_bytes = ProtobufSerializer(orders_pb2.Order,
                                      registry.client(),
                                      {"use.deprecated.format": False})
        context = SerializationContext(topic, MessageField.VALUE)
        written = [orders_pb2.Order(id=i, customer=f"c{i}", lines=[
            orders_pb2.Order.Line(sku="s", qty=i)] * (i % 3)) for i in range(30)]
        good = [serialized(to_bytes, order, context) for order in written]
        serializer_id = struct.unpack(">I", good[0][1:5])[0]
        text_id = registry.register(f"{topic}-text-value", ORDERS_PROTO, "PROTOBUF")
        assert text_id != serializer_id  # the text and the descriptor: two schemas
        line = orders_pb2.Order.Line(sku="k", qty=1).SerializeToString()
        by_text = [b"\x00" + struct.pack(">I", text_id) + b"\x00"
                   + written[0].SerializeToString(),
                   b"\x00" + struct.pack(">I", text_id) + b"\x04\x00\x00" + line]
        wrong_type = (b"\x00" + struct.pack(">I", serializer_id) + b"\x00"
                      + b"\x0a\x03abc")  # field 1, id, written as a string
        no_message = b"\x00" + struct.pack(">I", serializer_id) + b"\x02\x0a" + line
        reports = send(proxy, topic, [(0, None, value) for value in good + by_text]
                       + [(1, None, wrong_type), (2, None, no_message)])
        assert [e for p, e in reports if p == 0] == [None] * 32
        assert [(p, None if e is None else e.code()) for p, e in reports if p != 0] == [
            (1, ck.KafkaError.INVALID_RECORD), (2, ck.KafkaError.INVALID_RECORD)]
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)
    assert watermarks(kafka.bootstrap, topic, 2) == (0, 0)
    reasons = {entry["reason"] for entry in logged(caplog, "refused")}
    assert reasons <= {
        f"topic {topic} partition 1: record 0: its value is not Protobuf of schema "
        f"{serializer_id} (as registered.Order: field 'id' (1) is written as "
        "length-delimited, and its type (int64) is a varint) (rule registered)",
        f"topic {topic} partition 2: record 0: its value is not Protobuf of schema "
        f"{serializer_id} (it names message [5], which the schema does not have) "
        "(rule registered)"}
    assert reasons
    # What was written reads back through the serializer's own deserializer.
    read = read_back(kafka, topic, 31, ProtobufDeserializer(
        orders_pb2.Order, {"use.deprecated.format": False}))
    assert read == [*written, written[0]]


LEDGER_PROTO = """\
syntax = "proto3";
package ledger;
message Amount { string currency = 1; int64 units = 2; }
"""

INVOICE_PROTO = """\
syntax = "proto3";
package invoicing;
import "ledger.proto";
import "google/protobuf/timestamp.proto";
message Invoice { string number = 1; ledger.Amount total = 2; google.protobuf.Timestamp due = 3; }
"""


def test_schemas_referred_to_are_read_with_it(
        kafka: KafkaCluster, apicurio: ApicurioRegistry, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """References: Confluent's Protobuf serializer registers the file a message's file
    imports under a subject of its own and the message's file with a reference to it;
    a JSON Schema's ``$ref`` names another subject's schema.  What the referred-to
    schemas say is held too: an Amount's units written as a string, an address without
    its city, are refused and never written; the rest is."""
    caplog.set_level(logging.INFO, logger="gatehouse")
    invoice_pb2, _ = compile_proto(INVOICE_PROTO, "invoice", tmp_path,
                                   {"ledger.proto": LEDGER_PROTO})
    amount = importlib.import_module("ledger_pb2").Amount
    topic = unique("orders")
    kafka.create_topic(topic, partitions=3)
    registry = apicurio
    address = json.dumps({"type": "object", "required": ["city"],
                          "properties": {"city": {"type": "string"}, "tag": {"const": topic}}})
    registry.register(f"{topic}-address", address)
    customer = registry.register(
        f"{topic}-customer-value",
        json.dumps({"type": "object", "properties": {"address": {"$ref": "address.json"}}}),
        references=[{"name": "address.json", "subject": f"{topic}-address", "version": 1}])
    with ProxyThread(kafka.bootstrap, rules_yaml=rules(registry.url)) as proxy:
        to_bytes = ProtobufSerializer(invoice_pb2.Invoice,
                                      registry.client(),
                                      {"use.deprecated.format": False})
        context = SerializationContext(topic, MessageField.VALUE)
        invoices = [invoice_pb2.Invoice(number=f"n{i}", total=amount(currency="EUR", units=i))
                    for i in range(10)]
        good = [serialized(to_bytes, invoice, context) for invoice in invoices]
        # The serializer registered ledger.proto first, then the invoice referring to it.
        invoice_id = struct.unpack(">I", good[0][1:5])[0]
        with urllib.request.urlopen(f"{registry.url}/schemas/ids/{invoice_id}") as answer:
            [reference] = json.load(answer)["references"]
        assert reference["name"] == "ledger.proto"
        head = good[0][:5] + b"\x00"
        units_as_text = head + b"\x12\x03\x12\x01x"  # total.units, length-delimited
        late = head + b"\x1a\x02\x08\x80"  # due.seconds cut short
        good_customer = framed(customer, {"address": {"city": "Oslo", "tag": topic}})
        no_city = framed(customer, {"address": {"tag": topic}})
        reports = send(proxy, topic, [(0, None, value) for value in [*good, good_customer]]
                       + [(1, None, units_as_text), (1, None, late)])
        assert [e for p, e in reports if p == 0] == [None] * 11
        assert [(p, None if e is None else e.code()) for p, e in reports if p != 0] == [
            (1, ck.KafkaError.INVALID_RECORD), (1, ck.KafkaError.INVALID_RECORD)]
        [(_, error)] = send(proxy, topic, [(2, None, no_city)])  # a connection of its own
        assert error is not None and error.code() == ck.KafkaError.INVALID_RECORD
    reasons = [entry["reason"] for entry in logged(caplog, "refused")]
    assert reasons == [
        f"topic {topic} partition 1: record 0: its value is not Protobuf of schema "
        f"{invoice_id} (as invoicing.Invoice: in total: field 'units' (2) is written as "
        "length-delimited, and its type (int64) is a varint) (2 records in all) "
        "(rule registered)",
        f"topic {topic} partition 2: record 0: its value does not match schema {customer}: "
        'at $.address, required ["city"] (rule registered)']
    assert watermarks(kafka.bootstrap, topic, 0) == (0, 11)
    assert watermarks(kafka.bootstrap, topic, 1) == (0, 0)
    assert watermarks(kafka.bootstrap, topic, 2) == (0, 0)
