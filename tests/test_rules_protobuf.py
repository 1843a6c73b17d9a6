"""Protobuf records against their registered schema (``gatehouse.rules.protobuf``): the
schema read from ``.proto`` text is the one the real ``protoc`` compiles (its
``FileDescriptorProto``, which Confluent's Python serializer registers in base64, reads
the same); messages the generated code writes are taken in both index framings; a
message ``problem`` takes is one Google's own parser takes (hypothesis, over mutated
bytes too); what is refused is said by field name and number, never by value."""

from __future__ import annotations

import base64
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatehouse.proxy.hooks import Forward, Respond
from gatehouse.proxy.policy import Reloader, RulesPolicy, RulesSource
from gatehouse.rules import load_rules_file, protobuf
from gatehouse.rules.protobuf import (
    ProtoSchema,
    ProtoSchemaError,
    parse_proto_schema,
    parse_proto_text,
    read_file_descriptor,
)
from gatehouse.rules.records import FieldCheck, Lookup, RegisteredSchema, RegistryCheck
from tests.codec_strategies import examples
from tests.support.mutants import mutant
from tests.support.protoc import compile_proto
from tests.test_rules_records import batch, partitions, produce, refused_at_its_line
from tests.test_rules_topic_filter import conn

SHOP = """\
syntax = "proto3";
package shop.v1;
import "google/protobuf/timestamp.proto";
option java_package = "com.example.shop";

/* An order; its items nested. */
message Order {
  int64 id = 1;
  string customer = 2 [json_name = "cust"];
  repeated Item items = 3;
  map<string, int32> tags = 4;
  Status status = 5;
  oneof payment { string card = 6; Cash cash = 7; }
  google.protobuf.Timestamp placed = 8;  // another file's type
  repeated sint32 deltas = 9;
  double total = 10;
  fixed32 crc = 11;
  message Item {
    string sku = 1;
    uint32 qty = 2;
    reserved 3, 15 to 20;
    reserved "price";
  }
  enum Status { option allow_alias = true; NEW = 0; PAID = 1; SETTLED = 1; }
  option deprecated = false;
}
message Cash { bytes note = 1; }
service Shop { rpc Place(Order) returns (Cash) { option deprecated = true; } }
"""

LEGACY = """\
syntax = "proto2";
package legacy;
message Event {
  required int64 id = 1;
  optional string name = 2;
  repeated int32 codes = 3 [packed = true];
  repeated fixed64 stamps = 4;
  optional group Origin = 5 { required string host = 6; optional int32 port = 7; }
  optional Kind kind = 8 [default = LOW];
  map<int32, Event> children = 9;
  enum Kind { LOW = 0; HIGH = 1; }
  extensions 100 to 199;
}
extend Event { optional string note = 100; }
"""

EDITION = """\
edition = "2023";
package ed;
message Point {
  int32 x = 1;
  int32 y = 2 [features.field_presence = IMPLICIT];
  string label = 3;
  repeated int32 path = 4 [features.repeated_field_encoding = EXPANDED];
  repeated float weights = 5;
  Point next = 6;
}
"""

OPAQUE = """\
syntax = "proto3";
import public "elsewhere/things.proto";
message Holder { other.Thing thing = 1; other.Kind kind = 2; }
"""

MONEY = """\
syntax = "proto3";
package fin;
import "google/protobuf/wrappers.proto";
message Money { string currency = 1; int64 units = 2; google.protobuf.StringValue memo = 3; }
"""

PAY = """\
syntax = "proto3";
package shop;
import "money.proto";
message Pay { fin.Money amount = 1; repeated fin.Money fees = 2; }
"""

# Every wire type and kind, no imports: Google's parser reads all of it, the property's
# reference.
KITCHEN = """\
syntax = "proto3";
package kitchen;
message Sink {
  int32 i32 = 1; int64 i64 = 2; uint32 u32 = 3; uint64 u64 = 4; sint32 s32 = 5;
  sint64 s64 = 6; bool flag = 7; fixed32 f32 = 8; fixed64 f64 = 9; sfixed32 sf32 = 10;
  sfixed64 sf64 = 11; float fl = 12; double db = 13; string text = 14; bytes raw = 15;
  Colour colour = 16;
  repeated int64 many = 17;
  repeated double doubles = 18;
  repeated string names = 19;
  map<string, Sink> children = 20;
  Sink inner = 21;
  oneof choice { string word = 22; fixed32 number = 23; }
  enum Colour { RED = 0; GREEN = 1; }
}
"""


@pytest.fixture(params=["c", "python"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The schemas parsed in the test walk records in C (then in Python where the C walk
    does not say "it reads"), or in Python alone."""
    if request.param == "python":
        monkeypatch.setattr(protobuf, "protowire", None)
    return str(request.param)


def test_the_c_walk_is_built() -> None:
    assert protobuf.protowire is not None  # a C compiler is part of `make test`'s set-up


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ModuleType, bytes]]:
    where: Path = tmp_path_factory.mktemp("protoc")
    return {name: compile_proto(text, name, where) for name, text in
            (("shop", SHOP), ("legacy", LEGACY), ("edition", EDITION),
             ("kitchen", KITCHEN))}


TEXTS = {"shop": SHOP, "legacy": LEGACY, "edition": EDITION, "kitchen": KITCHEN}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_text_reads_as_protoc_compiles_it(
        compiled: dict[str, tuple[ModuleType, bytes]], name: str) -> None:
    from_text = parse_proto_text(TEXTS[name])
    from_protoc = read_file_descriptor(compiled[name][1])
    assert from_text.syntax == from_protoc.syntax
    assert from_text.top == from_protoc.top
    assert from_text.messages == from_protoc.messages
    # As a registry holds it: the text, or (Confluent's Python serializer) base64.
    assert parse_proto_schema(TEXTS[name]).messages == from_text.messages
    assert parse_proto_schema(
        base64.b64encode(compiled[name][1]).decode()).messages == from_text.messages


def test_what_the_schema_holds() -> None:
    shop = parse_proto_text(SHOP)
    assert shop.syntax == "proto3"
    assert shop.top == ("shop.v1.Order", "shop.v1.Cash")
    order = shop.messages["shop.v1.Order"]
    # Map entries are nested messages where protoc puts them: message indexes count them.
    assert order.nested == ("shop.v1.Order.TagsEntry", "shop.v1.Order.Item")
    assert shop.message_at((0, 1)) is shop.messages["shop.v1.Order.Item"]
    assert shop.message_at((1,)) is shop.messages["shop.v1.Cash"]
    assert shop.message_at((2,)) is None
    assert {n: (f.name, f.type) for n, f in order.fields.items()} == {
        1: ("id", "int64"), 2: ("customer", "string"), 3: ("items", "message"),
        4: ("tags", "message"), 5: ("status", "enum"), 6: ("card", "string"),
        7: ("cash", "message"), 8: ("placed", "message"), 9: ("deltas", "sint32"),
        10: ("total", "double"), 11: ("crc", "fixed32")}
    # The C walk goes where it can say all the Python walk says: not where proto2
    # fields are required (it counts no fields) or tables would be large.
    assert shop._native is not None
    assert parse_proto_text(LEGACY)._native is None
    assert parse_proto_text("message A { int32 far = 100000; }")._native is None
    legacy = parse_proto_text(LEGACY).messages["legacy.Event"]
    assert [f.name for f in legacy.required] == ["id"]
    assert (legacy.fields[5].type, legacy.fields[5].message) == ("group", "legacy.Event.Origin")


def framed_java(payload: bytes) -> bytes:
    """Java's serializer: the first message's indexes as one zero byte."""
    return b"\x00" + payload


def framed(indexes: list[int], payload: bytes) -> bytes:
    """Confluent's Python serializer: a count, then each index (zigzag varints)."""
    return bytes([len(indexes) * 2] + [i * 2 for i in indexes]) + payload


def test_messages_protoc_writes_are_taken(
        compiled: dict[str, tuple[ModuleType, bytes]], walk: str) -> None:
    shop_pb2, _ = compiled["shop"]
    shop = parse_proto_text(SHOP)
    order = shop_pb2.Order(id=5, customer="Zoë", items=[shop_pb2.Order.Item(sku="x", qty=2)],
                           tags={"a": 1, "b": -3}, status=1, cash=shop_pb2.Cash(note=b"\xff"),
                           deltas=[-1, 2, -300], total=2.5, crc=7)
    order.placed.seconds = 1_700_000_000
    payload = order.SerializeToString()
    assert shop.problem(framed_java(payload)) is None
    assert shop.problem(framed([0], payload)) is None
    assert shop.problem(framed([0], b"")) is None  # every field at its default
    item = shop_pb2.Order.Item(sku="y", qty=1).SerializeToString()
    assert shop.problem(framed([0, 1], item)) is None
    assert shop.problem(framed([1], shop_pb2.Cash(note=b"1").SerializeToString())) is None
    legacy_pb2, _ = compiled["legacy"]
    event = legacy_pb2.Event(id=1, name="n", codes=[1, 2, 3], stamps=[9, 10], kind=1)
    event.origin.host = "h"
    event.children[4].id = 2
    event.Extensions[legacy_pb2.note] = "undeclared in Event: read past"
    assert parse_proto_text(LEGACY).problem(framed_java(event.SerializeToString())) is None
    edition_pb2, _ = compiled["edition"]
    point = edition_pb2.Point(x=1, y=2, label="p", path=[1, 2], weights=[0.5],
                              next=edition_pb2.Point(x=3))
    assert parse_proto_text(EDITION).problem(framed_java(point.SerializeToString())) is None


@pytest.mark.parametrize(("schema", "data", "problem"), [
    (SHOP, framed_java(b"\x08\x05\x12\x01"), "as shop.v1.Order: field 'customer' (2) runs "
                                            "past the end"),
    (SHOP, framed_java(b"\x0a\x01x"), "as shop.v1.Order: field 'id' (1) is written as "
                                      "length-delimited, and its type (int64) is a varint"),
    (SHOP, framed_java(b"\x12\x02\xc3\x28"), "as shop.v1.Order: field 'customer' (2) is not "
                                             "UTF-8 text (byte 0)"),
    (SHOP, framed_java(b"\x1a\x04\x08\x01\x10\x02"),
     "as shop.v1.Order: in items: field 'sku' (1) is written as a varint, and its type "
     "(string) is length-delimited"),
    (SHOP, framed_java(b"\x1a\x03\x0a\x01\xff"),
     "as shop.v1.Order: in items: field 'sku' (1) is not UTF-8 text (byte 0)"),
    (SHOP, framed_java(b"\x22\x04\x0a\x01k\x10"),  # a map entry's value cut short
     "as shop.v1.Order: in tags: it ends inside a varint"),
    (SHOP, framed_java(b"\x4a\x03\x01\x02"), "as shop.v1.Order: field 'deltas' (9) runs "
                                             "past the end"),
    (SHOP, framed_java(b"\x4a\x02\x01\x82"), "as shop.v1.Order: it ends inside a varint"),
    (SHOP, framed_java(b"\x5a\x03abc"), "as shop.v1.Order: field 'crc' (11) is written as "
                                        "length-delimited, and its type (fixed32) is 4 bytes"),
    (SHOP, framed_java(b"\x5d\x01\x02"), "as shop.v1.Order: field 'crc' (11) runs past "
                                         "the end"),
    (SHOP, framed_java(b"\x07"), "as shop.v1.Order: a field numbered 0"),
    (SHOP, framed_java(b"\xf8\xff\xff\xff\x1f\x01"), "a field numbered 1073741823"),
    (SHOP, framed_java(b"\xa6\x06"), "as shop.v1.Order: field 100 has wire type 6, which "
                                     "no field has"),
    (SHOP, framed_java(b"\xa4\x06"), "as shop.v1.Order: a group's end (field 100) with no "
                                     "group open"),
    (SHOP, framed_java(b"\xa3\x06\x08\x01"), "it ends inside a varint"),  # group never ends
    (SHOP, framed_java(b"\xa3\x06\xac\x06"), "group 100 ends as 101"),
    (SHOP, framed_java(b"\x08" + b"\xff" * 10 + b"\x01"), "a varint longer than 10 bytes"),
    (SHOP, framed([2], b""), "it names message [2], which the schema does not have"),
    (SHOP, framed([0, 5], b""), "it names message [0, 5], which the schema does not have"),
    (SHOP, b"\x81\x01", "its message indexes do not read: a count of -65"),
    (SHOP, b"", "its message indexes do not read: it ends inside a varint"),
    # Undeclared fields are read past (a newer writer's), a group's too.
    (SHOP, framed_java(b"\xa0\x06\x01\xa3\x06\x08\x01\x1a\x00\xa4\x06\x08\x02"), None),
    # A well-known type (a Timestamp) is read as its fields.
    (SHOP, framed_java(b"\x42\x02\x08\x01"), None),
    (SHOP, framed_java(b"\x42\x02\x10\x80"), "as shop.v1.Order: in placed: it ends inside "
                                             "a varint"),
    # Another file's type, not at hand: a varint or length-delimited, not read.
    (OPAQUE, framed_java(b"\x0a\x03\xff\xff\xff\x10\x05"), None),
    (OPAQUE, framed_java(b"\x0d\x00\x00\x00\x00"), "field 'thing' (1) is written as 4 "
                                                  "bytes, and its type (unknown) is a varint or "
                                                  "length-delimited"),
    (LEGACY, framed_java(b"\x12\x01\xff"), "as legacy.Event: it has no required field 'id'"),
    (LEGACY, framed_java(b"\x08\x01\x12\x01\xff"), None),  # proto2: bytes as they are
    (LEGACY, framed_java(b"\x08\x01\x2b\x38\x01\x2c"),
     "as legacy.Event: in origin: it has no required field 'host'"),
    (LEGACY, framed_java(b"\x08\x01\x2b\x32\x00"), "in origin: a group that does not end"),
    (LEGACY, framed_java(b"\x08\x01\x22\x07" + b"\x00" * 7),
     "packed field 'stamps' (4) is 7 bytes, not a whole number of fixed64 values"),
    (LEGACY, framed_java(b"\x08\x01\x1a\x02\x01\x02\x18\x03"), None),  # packed and not
    (LEGACY, framed_java(b"\x08\x01\x4a\x04\x12\x02\x12\x00"),
     "as legacy.Event: in children.value: it has no required field 'id'"),
])
def test_what_is_refused_and_why(schema: str, data: bytes, problem: str | None,
                                 walk: str) -> None:
    found = parse_proto_text(schema).problem(data)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found


def test_nesting_is_bounded(walk: str) -> None:
    schema = parse_proto_text(EDITION)
    payload = b""
    for _ in range(70):  # Point.next, 70 deep
        payload = b"\x32" + bytes([len(payload)]) + payload if len(payload) < 128 else (
            b"\x32" + bytes([len(payload) & 0x7F | 0x80, len(payload) >> 7]) + payload)
    found = schema.problem(framed_java(payload))
    assert found is not None and "messages nested more than 64 deep" in found


@pytest.mark.parametrize(("text", "error"), [
    ('syntax = "proto3";\nmessage A {\n  int32 x = ;\n}\n', "line 3: a field number expected"),
    ('syntax = "proto3";\nmessage A {\n  int32 x = 0;\n}\n', "line 3: field number 0 out"),
    ("message A {\n  int32 x = 1;\n", "line 3: it ends early"),
    ("message A { int32 x = 1; }\n}\n", "line 2: '}' where a declaration belongs"),
    ("message A { int32 x = 1 }", "line 1: ';' expected, found '}'"),
    ("message A { int32 x = 1; } @", "line 1: an unexpected character '@'"),
])
def test_a_schema_that_does_not_read_says_where(text: str, error: str) -> None:
    with pytest.raises(ProtoSchemaError, match=error):
        parse_proto_schema(text)


def test_imports_from_references(compiled: dict[str, tuple[ModuleType, bytes]],
                                 tmp_path: Path, walk: str) -> None:
    """The files a schema imports, as the registry's references give them (text or
    base64), are read with it: their messages are checked too."""
    pay_pb2, pay_descriptor = compile_proto(PAY, "pay", tmp_path, {"money.proto": MONEY})
    from_text = parse_proto_text(PAY, {"money.proto": MONEY})
    money_descriptor = base64.b64encode(_file_descriptor(tmp_path, "money")).decode()
    from_protoc = read_file_descriptor(pay_descriptor, {"money.proto": money_descriptor})
    assert from_text.messages == from_protoc.messages
    assert from_text.top == ("shop.Pay",)
    assert from_text.messages["shop.Pay"].fields[1].message == "fin.Money"
    assert from_text.messages["fin.Money"].fields[3].message == "google.protobuf.StringValue"
    money = importlib.import_module("money_pb2").Money  # compiled with pay.proto
    payment = pay_pb2.Pay(amount=money(currency="EUR", units=5), fees=[money(units=1)])
    payment.amount.memo.value = "tip"
    assert from_text.problem(framed_java(payment.SerializeToString())) is None
    # A Money's units as a string: refused inside the imported message.
    found = from_text.problem(framed_java(b"\x0a\x03\x12\x01x"))
    assert found == ("as shop.Pay: in amount: field 'units' (2) is written as "
                     "length-delimited, and its type (int64) is a varint")
    found = from_text.problem(framed_java(b"\x0a\x05\x1a\x03\x0a\x01\xff"))
    assert found == "as shop.Pay: in amount.memo: field 'value' (1) is not UTF-8 text (byte 0)"
    # Without the reference: fin.Money is another file's type, not read.
    alone = parse_proto_text(PAY)
    assert alone.messages["shop.Pay"].fields[1].type == "unknown"
    assert alone.problem(framed_java(b"\x0a\x03\x12\x01x")) is None
    with pytest.raises(ProtoSchemaError, match=r"money\.proto \(imported\): line 1"):
        parse_proto_text(PAY, {"money.proto": "message {"})


def _file_descriptor(where: Path, name: str) -> bytes:
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet.FromString((where / f"{name}.desc").read_bytes())
    [found] = [f for f in files.file if f.name == f"{name}.proto"]
    return found.SerializeToString()


def test_a_descriptor_that_does_not_read() -> None:
    with pytest.raises(ProtoSchemaError, match="not a FileDescriptorProto"):
        parse_proto_schema(base64.b64encode(b"\x22\x05\x0a").decode())


def test_through_the_registry_check(walk: str) -> None:
    registered: dict[int, Lookup] = {
        7: RegisteredSchema(7, "PROTOBUF", protobuf=parse_proto_text(SHOP))}
    check = FieldCheck(format="schema_registry", registry=RegistryCheck("http://r"))

    def lookup(_: RegistryCheck, schema_id: int) -> Lookup:
        return registered[schema_id]

    head = b"\x00\x00\x00\x00\x07"
    assert check.problem(head + framed_java(b"\x08\x05"), "value", lookup) is None
    assert check.problem(head + framed_java(b"\x0a\x01x"), "value", lookup) == (
        "its value is not Protobuf of schema 7 (as shop.v1.Order: field 'id' (1) is written "
        "as length-delimited, and its type (int64) is a varint)")
    unchecked = FieldCheck(format="schema_registry",
                           registry=RegistryCheck("http://r", validate=False))
    assert unchecked.problem(head + framed_java(b"\x0a\x01x"), "value", lookup) is None


# --- the property: what problem() takes, Google's parser takes ------------------------


def _sink(kitchen_pb2: ModuleType, draw: Any, depth: int = 0) -> Any:
    sink = kitchen_pb2.Sink(
        i32=draw(st.integers(-(2**31), 2**31 - 1)), i64=draw(st.integers(-(2**63), 2**63 - 1)),
        u32=draw(st.integers(0, 2**32 - 1)), s64=draw(st.integers(-(2**63), 2**63 - 1)),
        flag=draw(st.booleans()), f64=draw(st.integers(0, 2**64 - 1)),
        fl=draw(st.floats(width=32)), text=draw(st.text(max_size=8)),
        raw=draw(st.binary(max_size=8)), colour=draw(st.sampled_from([0, 1, 7])),
        many=draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)),
        doubles=draw(st.lists(st.floats(), max_size=3)),
        names=draw(st.lists(st.text(max_size=4), max_size=3)))
    if draw(st.booleans()):
        sink.word = draw(st.text(max_size=4))
    else:
        sink.number = draw(st.integers(0, 2**32 - 1))
    if depth < 2:
        for key in draw(st.lists(st.text(max_size=3), max_size=2)):
            sink.children[key].CopyFrom(_sink(kitchen_pb2, draw, depth + 1))
        if draw(st.booleans()):
            sink.inner.CopyFrom(_sink(kitchen_pb2, draw, depth + 1))
    return sink


@pytest.fixture(scope="module")
def kitchen(compiled: dict[str, tuple[ModuleType, bytes]]
            ) -> tuple[ModuleType, ProtoSchema, ProtoSchema]:
    """The generated module, the schema walked in C (then Python), and in Python alone."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(protobuf, "protowire", None)
        python_only = parse_proto_text(KITCHEN)
    return compiled["kitchen"][0], parse_proto_text(KITCHEN), python_only


def c_reads(schema: ProtoSchema, data: bytes) -> bool:
    """The C walk's own answer for a message framed as ``framed_java`` frames it."""
    assert protobuf.protowire is not None
    assert schema._native is not None
    tables, index = schema._native
    return bool(protobuf.protowire.reads(data, 1, tables, index[schema.top[0]]))


@settings(max_examples=examples(300), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_written_messages_are_taken_and_mutants_never_wrongly(
        kitchen: tuple[ModuleType, ProtoSchema, ProtoSchema], data: st.DataObject) -> None:
    kitchen_pb2, schema, python_only = kitchen
    payload = _sink(kitchen_pb2, data.draw).SerializeToString()
    assert c_reads(schema, framed_java(payload))  # the fast path, taken
    assert python_only.problem(framed_java(payload)) is None
    # Mutants: bytes flipped, inserted, cut.  Whatever problem() takes, Google's parser
    # takes too; what Google's parser takes and problem() refuses is a declared field in
    # a wire type its type never uses (the parser would set it aside as unknown).
    spoiled = mutant(data, payload)
    found = schema.problem(framed_java(spoiled))
    # The C walk says "it reads" only where the Python walk finds nothing; the answer
    # is the Python walk's either way.
    assert found == python_only.problem(framed_java(spoiled))
    if c_reads(schema, framed_java(spoiled)):
        assert found is None
    try:
        kitchen_pb2.Sink.FromString(spoiled)
    except DecodeError:
        assert found is not None, "taken here, refused by Google's parser"
    else:
        assert found is None or "is written as" in found or "more than 64 deep" in found, found


@settings(max_examples=examples(300), deadline=None)
@given(name=st.sampled_from(sorted(TEXTS)), indexes=st.sampled_from([b"\x00", b"\x04\x00\x00"]),
       payload=st.binary(max_size=64))
def test_any_bytes_get_one_answer_from_both_walks(name: str, indexes: bytes,
                                                  payload: bytes) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(protobuf, "protowire", None)
        python_only = parse_proto_text(TEXTS[name])
    assert parse_proto_text(TEXTS[name]).problem(indexes + payload) == (
        python_only.problem(indexes + payload))


# --- a local .proto file: raw Protobuf values, no registry ---------------------------

LOCAL_RULES = ("- name: orders-protobuf\n  validate_records:\n    topics: [orders.eu]\n"
               "    value: {protobuf: schemas/pay.proto, required: true}\n")


def local_rules(tmp_path: Path, rules_text: str = LOCAL_RULES) -> Path:
    (tmp_path / "schemas").mkdir(exist_ok=True)
    (tmp_path / "schemas" / "pay.proto").write_text(PAY)
    (tmp_path / "schemas" / "money.proto").write_text(MONEY)
    path = tmp_path / "rules.yaml"
    path.write_text(rules_text)
    return path


def test_values_held_to_a_local_proto_file(tmp_path: Path, walk: str) -> None:
    """``protobuf: FILE`` (beside the rules' file): each value must be the file's first
    message (or ``message``), as its bytes are; the files it imports are read from
    beside it and watched with it; refused records say where, never what."""
    path = local_rules(tmp_path)
    loaded = load_rules_file(path)
    [rule] = loaded.rules
    assert rule.validate_records is not None
    check = rule.validate_records.value
    assert check.format == "protobuf" and check.protobuf is not None
    assert check.protobuf.message == "shop.Pay"
    assert loaded.files == (tmp_path / "schemas" / "pay.proto",
                            tmp_path / "schemas" / "money.proto")
    assert check.problem(b"\x0a\x05\x0a\x03EUR", "value") is None
    assert check.problem(b"\x0a\x03\x12\x01x", "value") == (
        "its value is not Protobuf of pay.proto (as shop.Pay: in amount: field 'units' (2) "
        "is written as length-delimited, and its type (int64) is a varint)")
    assert check.problem(None, "value") == "its value is null"
    # Through the policy: the bad record's index and what is wrong with it.
    policy = RulesPolicy(loaded)
    decision = policy.on_request(conn(), produce([batch(
        (None, b"\x0a\x02\x10\x05"), (None, b"\x0a\x01\x10"))]))
    assert isinstance(decision, Respond)
    [only] = partitions(decision.response).values()
    assert [(e.batch_index, e.batch_index_error_message) for e in only.record_errors] == [
        (1, "its value is not Protobuf of pay.proto (as shop.Pay: in amount: it ends "
            "inside a varint)")]
    # Another message of the file, by its full name.
    named = local_rules(tmp_path, LOCAL_RULES.replace(
        "{protobuf: schemas/pay.proto,",
        "{protobuf: {file: schemas/money.proto, message: fin.Money},"))
    [rule] = load_rules_file(named).rules
    assert rule.validate_records is not None
    assert rule.validate_records.value.problem(b"\x10\x05", "value") is None


@pytest.mark.parametrize(("value", "error"), [
    ("{protobuf: schemas/missing.proto}", "missing.proto cannot be read"),
    ("{protobuf: schemas/broken.proto}", r"broken\.proto: line 2: '=' expected"),
    ("{protobuf: schemas/imports-broken.proto}",
     r"imports-broken\.proto: broken\.proto \(imported\): line 2"),
    ("{protobuf: {file: schemas/pay.proto, message: Pay}}",
     r"has no message 'Pay' \(its messages: shop\.Pay; name one with its package\)"),
    ("{protobuf: schemas/empty.proto}", "empty.proto declares no message"),
    ("{protobuf: schemas/pay.proto, format: json}", r"takes no format \(json\)"),
    ("{protobuf: {message: shop.Pay}}", "needs 'file'"),
])
def test_a_bad_proto_file_is_refused_with_its_line(tmp_path: Path, value: str,
                                                  error: str) -> None:
    local_rules(tmp_path)
    (tmp_path / "schemas" / "broken.proto").write_text("message A {\n  int32 x 1;\n}\n")
    (tmp_path / "schemas" / "imports-broken.proto").write_text('import "broken.proto";\n')
    (tmp_path / "schemas" / "empty.proto").write_text('syntax = "proto3";\n')
    refused_at_its_line(tmp_path, value, error)


def test_a_changed_proto_file_reloads_the_rules(tmp_path: Path) -> None:
    """The .proto file and what it imports are watched with the rules file: a change
    reloads them; a file made unreadable keeps the old rules in force."""
    path = local_rules(tmp_path)
    policy = RulesPolicy(load_rules_file(path))
    reloader = Reloader(policy, RulesSource(None, path))
    assert not reloader.changed()
    units_as_text = produce([batch((None, b"\x0a\x03\x12\x01x"))])
    assert isinstance(policy.on_request(conn(), units_as_text), Respond)
    # An imported file changed: Money's units now a string.
    (tmp_path / "schemas" / "money.proto").write_text(MONEY.replace("int64 units",
                                                                    "string units"))
    assert reloader.changed() and reloader.reload()
    assert isinstance(policy.on_request(conn(), units_as_text), Forward)
    (tmp_path / "schemas" / "pay.proto").write_text("message {")
    assert reloader.changed() and not reloader.reload()
    assert reloader.last_error is not None and "pay.proto: line 1" in reloader.last_error
    assert isinstance(policy.on_request(conn(), units_as_text), Forward)  # the old rules
