"""``validate_records``' ``registry`` checks without a broker: the rules file (errors
with file:line, no password in them), what a record naming a schema id must be, the
proxy's kept schemas (one fetch per id, unknown ids and failures remembered for a
while, bounded), the registry client's requests on the wire, and the answers a client
gets: unknown ids and JSON not matching its registered schema refused with record
errors, a registry outage answered REQUEST_TIMED_OUT (retriable), never let through."""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
from typing import Any

import fastavro
import pytest
import trio
import trio.testing

from gatehouse.compression import decompress
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import Forward, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.proxy.registry import SchemaRegistries, fetch_schema, parse_schema
from gatehouse.rules.errors import INVALID_RECORD, REQUEST_TIMED_OUT
from gatehouse.rules.records import (
    NOT_REGISTERED,
    FieldCheck,
    Lookup,
    RegisteredSchema,
    RegistryCheck,
    RegistryUnavailable,
    SchemaRegistryUnavailable,
    compile_json_schema,
    verdict,
)
from tests.support.registry import TestRegistry
from tests.test_rules import rules
from tests.test_rules_records import batch, partitions, produce
from tests.test_rules_topic_filter import conn, listening

REGISTRY = RegistryCheck("http://registry:8081")
ORDER_SCHEMA = {"type": "object", "required": ["id"],
                "properties": {"id": {"type": "integer"}}}
AVRO_ORDER = {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "long"}, {"name": "note", "type": ["null", "string"]}]}
KNOWN: dict[int, Lookup] = {
    1: RegisteredSchema(1, "PROTOBUF"),  # its id is what is checked
    2: RegisteredSchema(2, "JSON", compile_json_schema(ORDER_SCHEMA, "test",
                                                       label="schema 2")),
    3: RegisteredSchema(3, "AVRO", avro=fastavro.parse_schema(AVRO_ORDER)),
}


def avro(datum: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(AVRO_ORDER), datum)
    return out.getvalue()

RULES = ("- name: registered\n  match: {client_id: '^app'}\n  validate_records:\n"
         "    topics: ['orders.*']\n    value: {registry: http://registry:8081}\n")


def framed(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + payload


def lookup(check: RegistryCheck, schema_id: int) -> Lookup:
    return KNOWN.get(schema_id, NOT_REGISTERED)


def test_the_registry_in_the_rules_file() -> None:
    [rule] = rules(RULES).rules
    assert rule.validate_records is not None
    assert rule.validate_records.value == FieldCheck(format="schema_registry",
                                                     registry=REGISTRY)
    [rule] = rules("- name: r\n  validate_records:\n    key:\n      required: true\n"
                   "      registry: {url: 'https://u:p@sr.example.com/apis/ccompat/v7/', "
                   "validate: false, timeout: 2}\n").rules
    assert rule.validate_records is not None
    assert rule.validate_records.key == FieldCheck(True, "schema_registry", registry=(
        RegistryCheck("https://u:p@sr.example.com/apis/ccompat/v7", False, 2.0)))
    assert rule.validate_records.key.registry is not None
    assert rule.validate_records.key.registry.shown == (
        "https://u:***@sr.example.com/apis/ccompat/v7")
    assert rules(RULES).looks_up_schemas
    assert not rules("- name: r\n  validate_records: {value: schema_registry}\n"
                     ).looks_up_schemas


@pytest.mark.parametrize(("value", "line", "error"), [
    ("{format: json, registry: 'http://r'}", 3,
     "registry looks up Schema Registry ids: its format is schema_registry, not json"),
    ("{registry: 'ftp://u:secret@r'}", 3,
     r"'ftp://u:\*\*\*@r' is not an http:// or https:// URL"),
    ("{registry: 'http://'}", 3, "is not an http:// or https:// URL"),
    ("{registry: {validate: true}}", 3, "needs 'url'"),
    ("\n      registry: {url: 'http://r', timeout: 0}", 4, "timeout must be 0-60 seconds"),
    ("\n      registry: {url: 'http://r', strategy: x}", 4, "unknown key 'strategy'"),
    ("\n      registry: {url: 'http://r', subject: '{name}-value'}", 4,
     "'{name}-value' is not a subject name"),
])
def test_a_bad_registry_is_refused_with_its_line(value: str, line: int, error: str) -> None:
    with pytest.raises(ConfigError, match=error) as caught:
        rules(f"- name: r\n  validate_records:\n    value: {value}\n")
    assert caught.value.line == line
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(("data", "problem"), [
    (framed(1, b"\x00\x08protobuf"), None),  # a Protobuf schema: its id is checked
    (framed(3, avro({"id": 5, "note": "hi"})), None),
    (framed(3, avro({"id": 5, "note": "hi"})[:-1]),
     "its value is not Avro of schema 3 (it ends early)"),
    (framed(3, avro({"id": 5, "note": None}) + b"\x00"),
     "its value is not Avro of schema 3 (1 byte after the datum)"),
    (framed(3, b"\x02\x09"),  # union index -5
     "its value is not Avro of schema 3 (its bytes do not read as the schema's types)"),
    (framed(2, b'{"id": 7}'), None),
    (framed(9, b'{"id": 7}'), "its value's schema id 9 is not in the Schema Registry"),
    (framed(2, b'{"id": "seven"}'),
     'its value does not match schema 2: at $.id, type "integer"'),
    (framed(2, b"{}"), 'its value does not match schema 2: at $, required ["id"]'),
    (framed(2, b"{oops"), "its value is not JSON (unexpected character, expected a string "
                          "key at character 1), but schema 2 is a JSON Schema"),
    (b"{}", "its value is not in the Schema Registry's framing"),
    (None, None),  # a tombstone: not required
])
def test_what_a_record_naming_a_schema_must_be(data: bytes | None,
                                               problem: str | None) -> None:
    check = FieldCheck(format="schema_registry", registry=REGISTRY)
    found = check.problem(data, "value", lookup)
    assert found is None if problem is None else found is not None and found.startswith(problem)


def test_validate_false_checks_the_id_only() -> None:
    check = FieldCheck(format="schema_registry",
                       registry=RegistryCheck(REGISTRY.url, validate=False))
    assert check.problem(framed(2, b'{"id": "seven"}'), "value", lookup) is None
    assert check.problem(framed(9, b"{}"), "value", lookup) is not None


def test_a_schema_not_looked_up_leaves_the_partition_unjudged() -> None:
    check = FieldCheck(format="schema_registry", registry=REGISTRY)
    down = RegistryUnavailable("http://registry:8081 could not be reached: refused")
    with pytest.raises(SchemaRegistryUnavailable, match="could not be reached"):
        check.problem(framed(2, b"{}"), "value", lambda c, i: down)
    [rule] = rules(RULES).rules
    assert rule.validate_records is not None
    records = batch((None, framed(1, b"")), (None, framed(2, b"{}")))
    found = verdict(rule.validate_records, records, decompress, lookup=lambda c, i: down)
    assert found is not None and found.code == REQUEST_TIMED_OUT
    assert "could not be reached: refused" in found.message and found.invalid == 0


def test_the_registry_answers_parsed() -> None:
    found = parse_schema(REGISTRY, 5, json.dumps(
        {"schema": json.dumps(ORDER_SCHEMA), "schemaType": "JSON"}).encode())
    assert isinstance(found, RegisteredSchema) and found.json is not None
    assert found.json.name == "schema 5"
    plain = parse_schema(REGISTRY, 6, b'{"schema": "\\"string\\""}')  # no type: Avro
    assert isinstance(plain, RegisteredSchema) and plain.schema_type == "AVRO"
    assert plain.json is None and plain.avro == "string"
    # An Avro schema naming a type of another schema (a reference): its id only.
    named = parse_schema(REGISTRY, 9, json.dumps({"schema": json.dumps(
        {"type": "record", "name": "A", "fields": [{"name": "b", "type": "B"}]})}).encode())
    assert isinstance(named, RegisteredSchema) and named.avro is None
    # A JSON Schema this proxy cannot compile (a reference to another document): the id
    # is still known.
    unref = parse_schema(REGISTRY, 7, json.dumps(
        {"schema": json.dumps({"$ref": "other.json"}), "schemaType": "JSON"}).encode())
    assert isinstance(unref, RegisteredSchema) and unref.json is None
    # Protobuf: .proto text (Java's serializers) or a base64 FileDescriptorProto
    # (Confluent's Python serializer), the same messages either way.
    text = 'syntax = "proto3";\nmessage Order { int64 id = 1; }\n'
    proto = parse_schema(REGISTRY, 10, json.dumps(
        {"schema": text, "schemaType": "PROTOBUF"}).encode())
    assert isinstance(proto, RegisteredSchema) and proto.protobuf is not None
    assert proto.protobuf.top == ("Order",)
    descriptor = base64.b64encode(b"\x22\x11\x0a\x05Order\x12\x08\x0a\x02id\x18\x01\x28\x03"
                                  b"\x62\x06proto3").decode()
    from_descriptor = parse_schema(REGISTRY, 11, json.dumps(
        {"schema": descriptor, "schemaType": "PROTOBUF"}).encode())
    assert isinstance(from_descriptor, RegisteredSchema)
    assert from_descriptor.protobuf == proto.protobuf
    unread = parse_schema(REGISTRY, 12, json.dumps(
        {"schema": "message Order { int64 id = 1 }", "schemaType": "PROTOBUF"}).encode())
    assert isinstance(unread, RegisteredSchema) and unread.protobuf is None  # its id only
    broken = parse_schema(REGISTRY, 8, b"<html>")
    assert isinstance(broken, RegistryUnavailable)
    assert broken.reason == "http://registry:8081 answered schema 8 with no schema in it"


async def test_each_schema_is_fetched_once_and_failures_are_remembered_a_while(
        mock_clock: trio.testing.MockClock) -> None:
    # A clock that moves only when told: the fetches run in threads, which an
    # autojumping clock would take for idleness and time out.
    asked: list[int] = []
    outage = {"on": False}

    def fetch(check: RegistryCheck, schema_id: int) -> Lookup:
        asked.append(schema_id)
        if outage["on"]:
            return RegistryUnavailable("refused")
        return KNOWN.get(schema_id, NOT_REGISTERED)

    schemas = SchemaRegistries(fetch, max_schemas=2, miss_seconds=10, error_seconds=2)
    heard: list[tuple[str, str]] = []
    schemas.listeners.append(lambda registry, outcome: heard.append((registry, outcome)))
    assert isinstance(schemas.lookup(REGISTRY, 1), RegistryUnavailable)  # not fetched
    async with trio.open_nursery() as nursery:  # two connections ask at once: one fetch
        for _ in range(2):
            nursery.start_soon(schemas.fetch, [(REGISTRY, 1), (REGISTRY, 9)])
    assert sorted(asked) == [1, 9]
    assert schemas.lookup(REGISTRY, 1) is KNOWN[1]
    assert schemas.lookup(REGISTRY, 9) is NOT_REGISTERED
    await schemas.fetch([(REGISTRY, 1), (REGISTRY, 9)])
    assert sorted(asked) == [1, 9]  # kept; the unknown id remembered
    mock_clock.jump(10)
    await schemas.fetch([(REGISTRY, 9)])
    assert sorted(asked) == [1, 9, 9]  # asked again after miss_seconds
    outage["on"] = True
    await schemas.fetch([(REGISTRY, 2)])
    assert schemas.lookup(REGISTRY, 2) == RegistryUnavailable("refused")
    await schemas.fetch([(REGISTRY, 2)])
    assert asked.count(2) == 1  # within error_seconds: not asked again
    outage["on"] = False
    mock_clock.jump(2)
    await schemas.fetch([(REGISTRY, 2), (REGISTRY, 1)])
    assert asked.count(2) == 2 and schemas.lookup(REGISTRY, 2) is KNOWN[2]
    # At most two kept: the first found went first.
    assert isinstance(schemas.lookup(REGISTRY, 1), (RegistryUnavailable, RegisteredSchema))
    assert len([i for i in (1, 2) if isinstance(schemas.lookup(REGISTRY, i),
                                                RegisteredSchema)]) <= 2
    assert heard.count(("http://registry:8081", "error")) == 1
    assert heard.count(("http://registry:8081", "not_found")) == 2


async def test_a_registry_that_does_not_answer_is_given_up_on(
        autojump_clock: trio.testing.MockClock) -> None:
    release = threading.Event()

    def hang(check: RegistryCheck, schema_id: int) -> Lookup:
        release.wait(30)
        return KNOWN[1]

    schemas = SchemaRegistries(hang)
    slow = RegistryCheck(REGISTRY.url, timeout=1.0)
    try:
        with trio.fail_after(5):
            await schemas.fetch([(slow, 1)])
    finally:
        release.set()
    found = schemas.lookup(slow, 1)
    assert found == RegistryUnavailable("http://registry:8081 did not answer for schema 1 "
                                        "in 1 s")


def test_the_client_asks_for_ids_with_basic_authentication_from_the_url() -> None:
    with TestRegistry("/apis/ccompat/v7") as registry:
        assert registry.register("orders-value", json.dumps(ORDER_SCHEMA)) == 1
        address = registry.address
        check = RegistryCheck(f"http://key%40x:s%3Acret@{address}/apis/ccompat/v7")
        found = fetch_schema(check, 1)
        assert isinstance(found, RegisteredSchema) and found.json is not None
        assert fetch_schema(check, 3) is NOT_REGISTERED
        # "key@x:s:cret", base64: the credentials go in the header, never the path.
        assert registry.seen == [
            ("/apis/ccompat/v7/schemas/ids/1", "Basic a2V5QHg6czpjcmV0"),
            ("/apis/ccompat/v7/schemas/ids/3", "Basic a2V5QHg6czpjcmV0")]
        failed = fetch_schema(RegistryCheck(f"http://{address}/broken"), 4)
        assert isinstance(failed, RegistryUnavailable)
        assert failed.reason == (f"http://{address}/broken answered HTTP 404 Not Found "
                                 "for schema 4")
    gone = fetch_schema(RegistryCheck("http://u:pw@127.0.0.1:1", timeout=2), 4)
    assert isinstance(gone, RegistryUnavailable)
    assert gone.reason.startswith("http://u:***@127.0.0.1:1 could not be reached")


async def test_the_proxy_fetches_then_judges() -> None:
    """Unknown ids and JSON that does not match its schema refused with record errors;
    good records sent on; a registry outage answered REQUEST_TIMED_OUT, whatever the
    records hold; in observe mode an outage refuses and counts nothing."""
    outage = {"on": False}

    def fetch(check: RegistryCheck, schema_id: int) -> Lookup:
        if outage["on"]:
            return RegistryUnavailable(f"{check.shown} could not be reached: refused")
        return KNOWN.get(schema_id, NOT_REGISTERED)

    policy = RulesPolicy(rules(RULES))
    policy.schemas = SchemaRegistries(fetch, error_seconds=2)
    counted, refused = listening(policy)

    async def decided(request: Any) -> Any:
        connection = conn()
        prepare = policy.lookups(connection, request)
        assert prepare is not None
        await prepare()
        return policy.on_request(connection, request)

    good = batch((None, framed(2, b'{"id": 1}')), (None, framed(1, b"\x02")))
    bad = batch((None, framed(2, b'{"id": 1}')), (None, framed(2, b'{"id": "x"}')),
                (None, framed(77, b"{}")))
    decision = await decided(produce([good, bad]))
    assert isinstance(decision, Forward)
    assert [(t.name, [p.index for p in t.partition_data])
            for t in decision.request.body.topic_data] == [("orders.eu", [0])]
    decision = await decided(produce([bad]))
    assert isinstance(decision, Respond)
    [only] = partitions(decision.response).values()
    assert only.error_code == INVALID_RECORD
    assert [(e.batch_index, e.batch_index_error_message) for e in only.record_errors] == [
        (1, 'its value does not match schema 2: at $.id, type "integer"'),
        (2, "its value's schema id 77 is not in the Schema Registry")]
    assert refused == [("registered", "refuse")] * 2
    # Another client: not held to the rule, nothing fetched for it.
    assert policy.lookups(conn(), produce([bad], client_id="other")) is None
    # The registry down: not judged, answered retriable.
    outage["on"] = True
    decision = await decided(produce([batch((None, framed(3, b"{}")))]))
    assert isinstance(decision, Respond)
    [only] = partitions(decision.response).values()
    assert only.error_code == REQUEST_TIMED_OUT
    assert only.error_message == (
        "the records' schemas cannot be looked up now (the Schema Registry: "
        "http://registry:8081 could not be reached: refused); try again (rule registered)")
    # Known schemas are still checked while it is down.
    assert isinstance(await decided(produce([good])), Forward)
    # Observe mode: an outage is nothing found wrong.
    observer = RulesPolicy(rules(RULES.replace("  match:", "  mode: observe\n  match:")))
    observer.schemas = SchemaRegistries(fetch)
    counted.clear()
    observer.outcome_listeners.append(counted.append)
    prepare = observer.lookups(conn(), produce([batch((None, framed(3, b"{}")))]))
    assert prepare is not None
    await prepare()
    decision = observer.on_request(conn(), produce([batch((None, framed(3, b"{}")))]))
    assert isinstance(decision, Forward)
    assert not [o for o in counted if o.action == "validate_records"]


async def test_records_are_read_once_when_their_schemas_are_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The request is judged while its ids are looked up: once when every id is kept,
    twice (before and after the fetch) on first sight, and the ids of every record are
    fetched together, not one per judging; ``on_request`` and ``offload`` use that
    judgement instead of reading the records again."""
    from gatehouse.proxy import policy as policy_module

    judged: list[int] = []
    real_verdict = policy_module.verdict

    def counting(*args: Any, **kwargs: Any) -> Any:
        judged.append(1)
        return real_verdict(*args, **kwargs)

    monkeypatch.setattr(policy_module, "verdict", counting)
    asked: list[int] = []

    def fetch(check: RegistryCheck, schema_id: int) -> Lookup:
        asked.append(schema_id)
        return KNOWN.get(schema_id, NOT_REGISTERED)

    policy = RulesPolicy(rules(RULES))
    policy.schemas = SchemaRegistries(fetch)
    # One partition, two ids never seen, and enough records for a request past 64 KiB.
    records = batch(*[(None, framed(2, b'{"id": %d, "pad": "%s"}' % (i, b"x" * 100)))
                      for i in range(600)], (None, framed(3, avro({"id": 1, "note": None}))))
    request = produce([records])
    assert request.frame is not None and len(request.frame) > 64 * 1024
    connection = conn()
    prepare = policy.lookups(connection, request)
    assert prepare is not None
    await prepare()
    assert sorted(asked) == [2, 3] and len(judged) == 2
    assert policy.offload(connection, request) is None  # judged already
    assert isinstance(policy.on_request(connection, request), Forward)
    assert len(judged) == 2
    # Kept now: judged once, nothing asked.
    again = produce([records])
    connection = conn()
    prepare = policy.lookups(connection, again)
    assert prepare is not None
    await prepare()
    assert isinstance(policy.on_request(connection, again), Forward)
    assert sorted(asked) == [2, 3] and len(judged) == 3


def test_the_subject_a_schema_must_be_registered_under() -> None:
    """``subject: "{topic}-value"`` (the serializers' TopicNameStrategy): a schema
    registered under another topic's subject is refused; a topic known only by an id
    not learned yet leaves the partition unjudged."""
    check = FieldCheck(format="schema_registry", registry=RegistryCheck(
        REGISTRY.url, subject="{topic}-value"))
    found = RegisteredSchema(2, "JSON", KNOWN[2].json,  # type: ignore[union-attr]
                             subjects=frozenset({"orders.eu-value", "audit-value"}))

    def listed(c: RegistryCheck, i: int) -> Lookup:
        return found

    assert check.problem(framed(2, b'{"id": 1}'), "value", listed, "orders.eu") is None
    assert check.problem(framed(2, b'{"id": 1}'), "value", listed, "payments") == (
        "its value's schema 2 is not registered under subject 'payments-value'")
    # The subject holds, the record must still match the schema.
    assert check.problem(framed(2, b"{}"), "value", listed, "audit") is not None
    with pytest.raises(SchemaRegistryUnavailable, match="name is not known yet"):
        check.problem(framed(2, b"{}"), "value", listed, None)


def test_the_client_fetches_the_subjects_for_a_subject_check() -> None:
    with TestRegistry() as registry:
        schema = json.dumps(ORDER_SCHEMA)
        schema_id = registry.register("orders-value", schema)
        assert registry.register("audit-value", schema) == schema_id
        check = RegistryCheck(registry.url, subject="{topic}-value")
        found = fetch_schema(check, schema_id)
        assert isinstance(found, RegisteredSchema)
        assert found.subjects == {"orders-value", "audit-value"}
        plain = fetch_schema(RegistryCheck(registry.url), schema_id)
        assert isinstance(plain, RegisteredSchema) and plain.subjects is None
        assert [path for path, _ in registry.seen] == [
            f"/schemas/ids/{schema_id}", f"/schemas/ids/{schema_id}/subjects",
            f"/schemas/ids/{schema_id}"]


ADDRESS = {"type": "object", "required": ["city"],
           "properties": {"city": {"$ref": "#/$defs/name"}, "where": {"$ref": "geo.json"}},
           "$defs": {"name": {"type": "string", "minLength": 2}}}
GEO = {"type": "array", "items": {"type": "number"}, "maxItems": 2}
CUSTOMER = {"type": "object", "required": ["name", "address"],
            "properties": {"name": {"type": "string"}, "address": {"$ref": "address.json"}}}


def test_schemas_referred_to_are_fetched_and_read_with_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """A schema's references (``{name, subject, version}``), and theirs, are fetched
    from the subjects' versions and read with it: a JSON Schema's ``$ref``s, an Avro
    schema's named types, a Protobuf file's imports; records are held to all of it."""
    with TestRegistry() as registry:
        registry.register("geo", json.dumps(GEO))
        registry.register("address", json.dumps(ADDRESS),
                          references=[{"name": "geo.json", "subject": "geo", "version": 1}])
        customer = registry.register("customers-value", json.dumps(CUSTOMER), references=[
            {"name": "address.json", "subject": "address", "version": 1}])
        check = RegistryCheck(registry.url)
        found = fetch_schema(check, customer)
        assert isinstance(found, RegisteredSchema) and found.json is not None
        assert [path for path, _ in registry.seen] == [
            f"/schemas/ids/{customer}", "/subjects/address/versions/1",
            "/subjects/geo/versions/1"]
        field = FieldCheck(format="schema_registry", registry=check)

        def problem(document: Any) -> str | None:
            return field.problem(framed(customer, json.dumps(document).encode()), "value",
                                 lambda c, i: found)

        assert problem({"name": "a", "address": {"city": "xy", "where": [1, 2]}}) is None
        assert problem({"name": "a", "address": {"city": "x"}}) == (
            f"its value does not match schema {customer}: at $.address.city, minLength 2")
        assert problem({"name": "a", "address": {"where": [1]}}) == (
            f'its value does not match schema {customer}: at $.address, required ["city"]')
        assert problem({"name": "a", "address": {"city": "xy", "where": [1, 2, 3]}}) == (
            f"its value does not match schema {customer}: at $.address.where, maxItems 2")

        # Avro: a record naming a type of the schema it refers to.
        money = {"type": "record", "name": "Money", "namespace": "fin",
                 "fields": [{"name": "units", "type": "long"}]}
        registry.register("money", json.dumps(money), "AVRO")
        payment = {"type": "record", "name": "Payment", "fields": [
            {"name": "amount", "type": "fin.Money"}, {"name": "note", "type": "string"}]}
        paid = registry.register("payments-value", json.dumps(payment), "AVRO",
                                 [{"name": "fin.Money", "subject": "money", "version": 1}])
        found = fetch_schema(check, paid)
        assert isinstance(found, RegisteredSchema) and found.avro is not None
        out = io.BytesIO()
        fastavro.schemaless_writer(out, found.avro, {"amount": {"units": 5}, "note": "n"})
        assert field.problem(framed(paid, out.getvalue()), "value",
                             lambda c, i: found) is None
        assert field.problem(framed(paid, out.getvalue()[:1]), "value",
                             lambda c, i: found) == (
            f"its value is not Avro of schema {paid} (it ends early)")

        # Protobuf: a file importing another (the reference's name is the import's).
        registry.register("money.proto", 'syntax = "proto3"; package fin; '
                          "message Money { int64 units = 1; }", "PROTOBUF")
        pay = registry.register("pay-value", 'syntax = "proto3"; import "money.proto"; '
                                "message Pay { fin.Money amount = 1; }", "PROTOBUF",
                                [{"name": "money.proto", "subject": "money.proto",
                                  "version": "latest"}])
        found = fetch_schema(check, pay)
        assert isinstance(found, RegisteredSchema) and found.protobuf is not None
        assert field.problem(framed(pay, b"\x00\x0a\x02\x08\x05"), "value",
                             lambda c, i: found) is None
        assert field.problem(framed(pay, b"\x00\x0a\x02\x0a\x00"), "value",
                             lambda c, i: found) == (
            f"its value is not Protobuf of schema {pay} (as Pay: in amount: field 'units' "
            "(1) is written as length-delimited, and its type (int64) is a varint)")

        # A reference the registry does not have: the schema does not compile here, its
        # id is still checked, and that is logged.
        dangling = registry.register("orphans-value", json.dumps(CUSTOMER) + " ",
                                     references=[{"name": "address.json",
                                                  "subject": "gone", "version": 1}])
        found = fetch_schema(check, dangling)
        assert isinstance(found, RegisteredSchema) and found.json is None
        [warned] = [r.gatehouse_fields for r in caplog.records  # type: ignore[attr-defined]
                    if "does not compile here" in r.getMessage()]
        assert warned["schema_id"] == dangling
        assert "address.json" in warned["error"]
        # A reference the registry fails to answer: no verdict now (retriable).
        registry.broken.add("address")
        failed = fetch_schema(check, customer)
        assert isinstance(failed, RegistryUnavailable)
        assert failed.reason == (f"{registry.url} answered HTTP 500 Internal Server Error "
                                 f"for schema {customer}")


def test_references_are_bounded() -> None:
    """A chain of references longer than MAX_REFERENCES: the rest is not fetched."""
    with TestRegistry() as registry:
        previous = registry.register("s0", json.dumps({"type": "string"}))
        del previous
        for i in range(1, 120):
            registry.register(f"s{i}", json.dumps({"$ref": f"s{i - 1}.json"}) + " " * i,
                              references=[{"name": f"s{i - 1}.json", "subject": f"s{i - 1}",
                                           "version": 1}])
        top = registry.register("top", json.dumps({"$ref": "s119.json"}),
                                references=[{"name": "s119.json", "subject": "s119",
                                             "version": 1}])
        found = fetch_schema(RegistryCheck(registry.url), top)
        assert isinstance(found, RegisteredSchema) and found.json is None  # its id only
        assert len([p for p, _ in registry.seen if p.startswith("/subjects/")]) == 100


def test_a_schema_guid_in_a_header_is_named_in_the_refusal() -> None:
    """Newer Confluent serializers can name the schema by its GUID in a
    ``__value_schema_id`` header, the value unframed: refused (the proxy looks ids up,
    not GUIDs), saying so and what to change."""
    from gatehouse.codecs.records import Record
    from gatehouse.rules.records import RecordValidation

    validation = RecordValidation(value=FieldCheck(format="schema_registry"),
                                  key=FieldCheck(format="schema_registry"))
    guid = b"\x01" + bytes(range(16))
    plain = "its value is not in the Schema Registry's framing (a zero byte, then a " \
            "4-byte schema id)"
    assert validation.problem(Record(0, framed(1, b""), b'{"id": 1}', ())) == plain
    assert validation.problem(Record(0, framed(1, b""), b'{"id": 1}',
                                     (("__value_schema_id", guid),))) == (
        plain + "; its schema is named by a __value_schema_id header (a schema GUID), "
        "which this proxy does not look up: configure the serializer to frame the id in "
        "the value")
    assert validation.problem(Record(0, b"k", framed(1, b""),
                                     (("__key_schema_id", guid),))).endswith(
        "configure the serializer to frame the id in the key")
    # Another header alone: the plain refusal.
    assert validation.problem(Record(0, framed(1, b""), b"{}", (("trace", b"1"),))) == plain
