"""What ``validate_records`` costs per record, without the network: one batch of JSON
orders (id, customer, 8 items, total: about 780 bytes each) read and held to a rule
several ways, best of several timings each, in one run:

    python bench/records.py [--records 200] [--repeat 50]

read (the record reader and a UTF-8 check), json (each value parsed by orjson), schema
(each value also checked against a JSON Schema of the order's shape by jsonschema-rs);
registry json, registry avro and registry protobuf (values in the Schema Registry's
framing, their schema already fetched: the same JSON Schema, or the orders as Avro read
by fastavro against an Avro schema of the same shape, or as Protobuf walked by
``gatehouse.rules.protobuf`` against a .proto of that shape); and the baselines: what
the proxy used before, Python's json and, when the pure-Python ``jsonschema`` package is
installed, the same schema checked by it; Google's protobuf parser (upb, in C) reading
the same Protobuf values into messages, when ``grpcio-tools`` is there to compile them.
"""

from __future__ import annotations

import argparse
import io
import json
import struct
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gatehouse.codecs.records import encode_batch
from gatehouse.compression import decompress
from gatehouse.rules.protobuf import parse_proto_text
from gatehouse.rules.records import (
    FieldCheck,
    RecordValidation,
    RegisteredSchema,
    RegistryCheck,
    load_json_schema,
    verdict,
)

AVRO_ORDER = {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "string"}, {"name": "customer", "type": "string"},
    {"name": "status", "type": {"type": "enum", "name": "Status",
                                "symbols": ["new", "paid", "shipped"]}},
    {"name": "items", "type": {"type": "array", "items": {
        "type": "record", "name": "Line", "fields": [
            {"name": "sku", "type": "string"}, {"name": "quantity", "type": "int"},
            {"name": "price", "type": "double"}]}}},
    {"name": "total", "type": "double"}]}

ORDER_PROTO = """\
syntax = "proto3";
package bench;
message Order {
  string id = 1;
  string customer = 2;
  enum Status { NEW = 0; PAID = 1; SHIPPED = 2; }
  Status status = 3;
  message Line { string sku = 1; int32 quantity = 2; double price = 3; }
  repeated Line items = 4;
  double total = 5;
}
"""

ORDER_SCHEMA = {
    "type": "object",
    "required": ["id", "customer", "items", "total"],
    "properties": {
        "id": {"type": "string", "pattern": "^o-[0-9]+$"},
        "customer": {"type": "string", "minLength": 1},
        "status": {"enum": ["new", "paid", "shipped"]},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["sku", "quantity", "price"],
            "properties": {"sku": {"type": "string"},
                           "quantity": {"type": "integer", "minimum": 1},
                           "price": {"type": "number", "minimum": 0}},
            "additionalProperties": False}},
        "total": {"type": "number", "minimum": 0},
    },
}


def order(n: int, items: int = 8) -> bytes:
    """An order of ``items`` lines as JSON (8: about 650 bytes; 13: about 1 KiB)."""
    lines = [{"sku": f"sku-{n}-{i:04d}-abcdefgh", "quantity": 1 + i % 3,
              "price": 9.99 + i} for i in range(items)]
    return json.dumps({"id": f"o-{n}", "customer": f"customer-{n:08d}-with-a-long-name",
                       "status": "paid", "items": lines,
                       "total": sum(i["price"] * i["quantity"] for i in lines)}).encode()


def protobuf(value: bytes) -> bytes:
    """An order (JSON) as Protobuf of ``ORDER_PROTO``, written field by field."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while n > 0x7F:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes(out + bytes([n]))

    def text(number: int, s: str) -> bytes:
        raw = s.encode()
        return varint(number << 3 | 2) + varint(len(raw)) + raw

    document = json.loads(value)
    out = text(1, document["id"]) + text(2, document["customer"])
    out += b"\x18" + varint(["new", "paid", "shipped"].index(document["status"]))
    for line in document["items"]:
        body = (text(1, line["sku"]) + b"\x10" + varint(line["quantity"])
                + b"\x19" + struct.pack("<d", line["price"]))
        out += b"\x22" + varint(len(body)) + body
    return out + b"\x29" + struct.pack("<d", document["total"])


def _compiled() -> Any:
    """``ORDER_PROTO`` compiled by protoc (grpcio-tools), None without it."""
    try:
        from tests.support.protoc import compile_proto
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as folder:
        module, _ = compile_proto(ORDER_PROTO, "bench_order", Path(folder))
    return module


def per_record_us(check: Callable[[], object], records: int, repeat: int) -> float:
    return min(timeit.repeat(check, number=1, repeat=repeat)) / records * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    values = [order(n) for n in range(args.records)]
    batch = encode_batch([(0, None, value) for value in values])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "order.json"
        path.write_text(json.dumps(ORDER_SCHEMA))
        schema = load_json_schema(path)
    checks = {
        "read": FieldCheck(format="utf8"),
        "json": FieldCheck(format="json"),
        "schema": FieldCheck(format="json", schema=schema),
    }
    # Framed for the Schema Registry: ids 1 (the JSON Schema), 2 (Avro), 3 (Protobuf).
    import fastavro

    avro_schema = fastavro.parse_schema(AVRO_ORDER)
    known = {1: RegisteredSchema(1, "JSON", json=schema),
             2: RegisteredSchema(2, "AVRO", avro=avro_schema),
             3: RegisteredSchema(3, "PROTOBUF", protobuf=parse_proto_text(ORDER_PROTO))}

    def avro(value: bytes) -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, avro_schema, json.loads(value))
        return out.getvalue()

    batches = {
        "registry json": encode_batch([(0, None, b"\x00\x00\x00\x00\x01" + value)
                                       for value in values]),
        "registry avro": encode_batch([(0, None, b"\x00\x00\x00\x00\x02" + avro(value))
                                       for value in values]),
        "registry protobuf": encode_batch([(0, None, b"\x00\x00\x00\x00\x03\x00"
                                            + protobuf(value)) for value in values]),
    }
    registry = FieldCheck(format="schema_registry", registry=RegistryCheck("http://r"))
    checks["registry json"] = checks["registry avro"] = registry
    checks["registry protobuf"] = registry
    costs: dict[str, float] = {}
    for name, check in checks.items():
        validation = RecordValidation(value=check)
        records = batches.get(name, batch)

        def judge(v: RecordValidation = validation, r: bytes = records) -> object:
            return verdict(v, r, decompress, lookup=lambda c, i: known[i])

        assert judge() is None, name
        costs[name] = per_record_us(judge, args.records, args.repeat)
    # The baseline: what the proxy used before (Python's json, then jsonschema), over
    # the same records read the same way.
    parsed = per_record_us(lambda: [json.loads(v.decode()) for v in values], args.records,
                           args.repeat)
    costs["json (stdlib)"] = costs["read"] + parsed
    generated = _compiled()
    if generated is not None:
        messages = [protobuf(value) for value in values]
        costs["protobuf (google, upb)"] = costs["read"] + per_record_us(
            lambda: [generated.Order.FromString(m) for m in messages], args.records,
            args.repeat)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        validator = jsonschema.validators.validator_for(ORDER_SCHEMA)(ORDER_SCHEMA)
        documents = [json.loads(value) for value in values]
        assert all(validator.is_valid(d) for d in documents)
        only = per_record_us(lambda: [validator.is_valid(d) for d in documents],
                             args.records, args.repeat)
        costs["schema (json, jsonschema)"] = costs["json (stdlib)"] + only
    size = sum(map(len, values)) / len(values)
    print(f"{args.records} records of {size:.0f} bytes, best of {args.repeat}:")
    for name, cost in costs.items():
        print(f"  {name:<26} {cost:8.2f} us a record")
    print(f"schema / json: {costs['schema'] / costs['json']:.2f}")
    print(f"registry json / schema: {costs['registry json'] / costs['schema']:.2f}, "
          f"registry avro / schema: {costs['registry avro'] / costs['schema']:.2f}, "
          f"registry protobuf / schema: {costs['registry protobuf'] / costs['schema']:.2f}")
    if "protobuf (google, upb)" in costs:
        print("registry protobuf / google's parser: "
              f"{costs['registry protobuf'] / costs['protobuf (google, upb)']:.2f}")
    print(f"json: stdlib / ours: {costs['json (stdlib)'] / costs['json']:.2f}")
    if "schema (json, jsonschema)" in costs:
        print("schema: json and jsonschema / ours: "
              f"{costs['schema (json, jsonschema)'] / costs['schema']:.1f}")

if __name__ == "__main__":
    main()
