"""``validate_records`` without a broker: the rules file (errors with file:line), what
a record must hold, records read from batches in every codec (within a bound), and the
answer a client gets: bad partitions refused with KIP-467 record errors, the others sent
on and their answers merged, topics named by id matched through the ids the proxy
learned."""

from __future__ import annotations

import gzip
import json
import struct
import uuid
import zlib
from pathlib import Path
from typing import Any

import cramjam
import pytest

from gatehouse import codecs
from gatehouse.codecs.errors import RemoteProtocolError
from gatehouse.codecs.records import crc32c, encode_batch, iter_records, records_section
from gatehouse.compression import DecompressionError, DecompressionLimit, decompress
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import Close, Forward, Pending, Respond
from gatehouse.proxy.policy import Reloader, RulesPolicy, RulesSource
from gatehouse.rules import error_response, load_rules_file
from gatehouse.rules.errors import CORRUPT_MESSAGE, INVALID_RECORD, UNKNOWN_TOPIC_ID
from gatehouse.rules.records import (
    FieldCheck,
    RecordValidation,
    load_json_schema,
    read_records,
    verdict,
)
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import conn, listening, metadata_answer

ORDERS = ("- name: orders-json\n  match: {client_id: '^app'}\n  validate_records:\n"
          "    topics: ['orders.*']\n    key: {required: true}\n    value: json\n"
          "    headers: [trace-id]\n")
ORDERS_ID = uuid.UUID("6f1c2a4e-0d3b-4e8a-9a51-2b7c9d0e1f23")
AUDIT_ID = uuid.UUID(int=7)
TS = 1_700_000_000_000
GOOD = (b"k", b'{"total": 12}')
TRACE: list[tuple[str, bytes | None]] = [("trace-id", b"abc")]


def batch(*records: tuple[bytes | None, bytes | None], compression: str = "none",
          headers: list[tuple[str, bytes | None]] | None = None) -> bytes:
    """A v2 batch of (key, value) records, each with ``headers``, compressed with any of
    Kafka's codecs (the codec's own encoder writes none and gzip)."""
    raw = encode_batch([(TS, k, v) for k, v in records],
                       headers=[TRACE if headers is None else headers] * len(records))
    if compression == "none":
        return raw
    section = bytes(raw[61:])
    packed = {"gzip": lambda d: gzip.compress(d), "lz4": lambda d: bytes(cramjam.lz4.compress(d)),
              "zstd": lambda d: bytes(cramjam.zstd.compress(d)), "snappy": xerial}[compression](
                  section)
    codes = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
    after_crc = bytearray(raw[21:61]) + packed
    struct.pack_into(">h", after_crc, 0, codes[compression])
    head = bytearray(raw[:21])
    struct.pack_into(">i", head, 8, 9 + len(after_crc))  # epoch, magic, CRC, the rest
    struct.pack_into(">I", head, 17, crc32c(after_crc))
    return bytes(head + after_crc)


def xerial(data: bytes) -> bytes:
    """Snappy as the Java client frames it (xerial's SnappyOutputStream), in two blocks."""
    out = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
    for part in (data[: len(data) // 2], data[len(data) // 2 :]):
        block = bytes(cramjam.snappy.compress_raw(part))
        out += struct.pack(">i", len(block)) + block
    return out


def legacy(key: bytes | None, value: bytes | None, offset: int = 0) -> bytes:
    """One magic 1 message (Produce v2 and older)."""
    body = struct.pack(">bbq", 1, 0, TS)
    for part in (key, value):
        body += struct.pack(">i", -1) if part is None else struct.pack(">i", len(part)) + part
    return struct.pack(">qiI", offset, 4 + len(body), zlib.crc32(body)) + body


def produce(orders: list[bytes], audit: bytes | None = None, version: int = 9,
            acks: int = -1, client_id: str = "app-1") -> codecs.Request:
    """A Produce request: orders.eu's partitions 0.. with the given batches, and audit's
    partition 3 (by id from v13, as KIP-516 names them)."""
    named = ({"topic_id": ORDERS_ID} if version >= 13 else {"name": "orders.eu"})
    topics = [{**named, "partition_data": [{"index": i, "records": b}
                                           for i, b in enumerate(orders)]}]
    if audit is not None:
        other = {"topic_id": AUDIT_ID} if version >= 13 else {"name": "audit"}
        topics.append({**other, "partition_data": [{"index": 3, "records": audit}]})
    return req(0, version, client_id, acks=acks, timeout_ms=1000, topic_data=topics)


def partitions(resp: codecs.Response) -> dict[tuple[Any, int], Any]:
    """The answer's partitions by (topic name or id, index), read back from its bytes."""
    answer = codecs.decode_response(memoryview(bytes(resp.encode())), 0, resp.api_version)
    return {(t.name or str(t.topic_id), p.index): p
            for t in answer.body.responses for p in t.partition_responses}


def test_the_validation_in_the_rules_file() -> None:
    [rule] = rules(ORDERS).rules
    validation = rule.validate_records
    assert validation is not None
    assert [p.pattern for p in validation.topics or ()] == ["orders.*"]
    assert validation.key == FieldCheck(required=True)
    assert validation.value == FieldCheck(format="json")
    assert validation.headers == ("trace-id",)
    [rule] = rules("- name: r\n  validate_records:\n    value: {format: schema_registry, "
                   "required: true, max_bytes: 1000}\n    max_decompressed_bytes: 4096\n").rules
    assert rule.validate_records == RecordValidation(
        None, FieldCheck(), FieldCheck(True, "schema_registry", 1000), (), 4096)


@pytest.mark.parametrize(("body", "line", "error"), [
    ("{}", 2, "needs at least one of key, value, headers"),
    ("{value: xml}", 2, "'xml' is not one of json, utf8, schema_registry"),
    ("\n    value: {format: avro}", 3, "'avro' is not one of json"),
    ("\n    key: {}", 3, "needs at least one of required: true, format, max_bytes"),
    ("\n    key: {required: true, max_bytes: -1}", 3, "max_bytes must be a number of bytes"),
    ("\n    value: json\n    topics: []", 4, "must name at least one topic"),
    ("\n    value: json\n    topics: ['(']", 4, "not a regular expression"),
    ("\n    value: json\n    max_decompressed_bytes: 0", 4, "must be a positive number"),
    ("\n    value: json\n    schema: orders.avsc", 4, "unknown key 'schema'"),
])
def test_a_bad_validation_is_refused_with_its_line(body: str, line: int, error: str) -> None:
    with pytest.raises(ConfigError, match=error) as caught:
        rules(f"- name: r\n  validate_records: {body}\n")
    assert caught.value.line == line


@pytest.mark.parametrize(("check", "data", "problem"), [
    (FieldCheck(format="json"), b'{"a": [1, 2.5, null]}', None),
    (FieldCheck(format="json"), None, None),  # a tombstone: not required
    (FieldCheck(required=True), None, "its value is null"),
    (FieldCheck(format="json"), b'{"a": -',
     "its value is not JSON (unexpected end of data at character 7)"),
    (FieldCheck(format="json"), b"NaN",
     "its value is not JSON (unexpected character, expected a JSON value at character 0)"),
    (FieldCheck(format="json"), b"[1e400]",
     "its value is not JSON (number is infinity when parsed as double at character 1)"),
    (FieldCheck(format="json"), b'{"a": 1} x',
     "its value is not JSON (unexpected content after document at character 9)"),
    (FieldCheck(format="json"), b'"\xff"', "its value is not JSON (not UTF-8 text)"),
    (FieldCheck(format="json"), b"",
     "its value is not JSON (Input is a zero-length, empty document at character 0)"),
    (FieldCheck(format="json"), b"[" * 1025 + b"]" * 1025,
     "its value is not JSON this proxy reads (nested too deeply)"),
    (FieldCheck(format="json"), b"[" * 1024 + b"]" * 1024, None),
    (FieldCheck(format="utf8"), "zürich".encode(), None),
    (FieldCheck(format="utf8"), b"ab\xc3", "its value is not UTF-8 text (byte 2)"),
    (FieldCheck(format="schema_registry"), b"\x00\x00\x00\x00\x07avro", None),
    (FieldCheck(format="schema_registry"), b"\x01\x00\x00\x00\x07", "is not in the Schema"),
    (FieldCheck(format="schema_registry"), b"\x00\x00\x00", "is not in the Schema"),
    (FieldCheck(max_bytes=3), b"four", "its value is 4 bytes, above 3"),
])
def test_what_a_value_must_be(check: FieldCheck, data: bytes | None,
                              problem: str | None) -> None:
    found = check.problem(data, "value")
    assert found == problem if problem is None or found is None else problem in found


def test_records_read_from_a_batch_with_their_headers() -> None:
    data = batch(GOOD, (None, b"x"), headers=[("trace-id", b"1"), ("empty", None)])
    records = list(read_records(data, decompress, 1 << 20))
    assert [(r.batch_index, r.key, r.value, r.headers) for r in records] == [
        (0, b"k", b'{"total": 12}', (("trace-id", b"1"), ("empty", None))),
        (1, None, b"x", (("trace-id", b"1"), ("empty", None)))]
    # Legacy messages (magic 1): indexed in order, no headers.
    old = legacy(b"a", b"1") + legacy(None, b"2", offset=1)
    assert [(r.batch_index, r.key, r.value) for r in read_records(old, decompress, 1 << 20)] == [
        (0, b"a", b"1"), (1, None, b"2")]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_records_read_from_every_codec(codec: str) -> None:
    values = [(b"k%d" % i, b'{"n": %d}' % i) for i in range(300)]
    data = batch(*values, compression=codec)
    assert [(r.key, r.value) for r in read_records(data, decompress, 1 << 20)] == values
    validation = RecordValidation(value=FieldCheck(format="json"),
                                  max_decompressed_bytes=1000)
    # A batch that decompresses past the bound is not read further: refused, as corrupt.
    found = verdict(validation, data, decompress, (DecompressionError,))
    assert found is not None and found.code == CORRUPT_MESSAGE
    assert "decompress past 1000 bytes" in found.message


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_a_bomb_is_stopped_at_the_bound(codec: str) -> None:
    huge = bytes(20_000_000)
    packed = {"gzip": lambda: gzip.compress(huge, 1), "snappy": lambda: xerial(huge),
              "lz4": lambda: bytes(cramjam.lz4.compress(huge)),
              "zstd": lambda: bytes(cramjam.zstd.compress(huge))}[codec]()
    assert len(packed) < 1_000_000
    with pytest.raises(DecompressionLimit, match="past 1048576 bytes"):
        decompress(codec, packed, 1 << 20)
    # Cut short, under a bound it would not reach: the data's own error.
    with pytest.raises(DecompressionError) as caught:
        decompress(codec, packed[: len(packed) // 3], 1 << 30)
    assert not isinstance(caught.value, DecompressionLimit)


def test_records_that_do_not_parse() -> None:
    good = batch(GOOD)
    section = bytes(records_section(good, next(iter(codecs_batches(good)))))
    with pytest.raises(RemoteProtocolError, match="runs past its batch"):
        list(iter_records(section[:-3], 1))
    with pytest.raises(RemoteProtocolError, match="bytes after the batch's 1 records"):
        list(iter_records(section + b"\x00", 1))
    with pytest.raises(RemoteProtocolError):
        list(iter_records(section, 2))
    validation = RecordValidation(value=FieldCheck(format="json"))
    found = verdict(validation, good[:61] + b"\x7f" * 20, decompress)
    assert found is not None and found.code == CORRUPT_MESSAGE


def codecs_batches(data: bytes) -> Any:
    from gatehouse.codecs.records import iter_batches

    return iter_batches(data)


def test_bad_records_refused_and_the_rest_sent_on() -> None:
    """orders.eu 0 holds a bad record, orders.eu 1 and audit good ones: partition 0 is
    answered by the proxy (INVALID_RECORD, the bad records by index), the rest go to
    the broker, and the client gets one answer with all three."""
    policy = RulesPolicy(rules(ORDERS))
    counted, refused = listening(policy)
    invalid: list[tuple[str, str, str, int]] = []
    policy.invalid_records_listeners.append(lambda *heard: invalid.append(heard))
    bad = batch(GOOD, (b"k", b"{oops"), (None, b"{}"), GOOD)
    request = produce([bad, batch(GOOD)], audit=batch((None, b"not json")))
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.wants_response
    sent = decision.request
    assert [(t.name, [p.index for p in t.partition_data]) for t in sent.body.topic_data] == [
        ("orders.eu", [1]), ("audit", [3])]
    # The broker answers what it got; the proxy adds the withheld partition.
    broker = error_response(sent, 0)
    answer = policy.on_response(conn(), Pending(1, 0, 9, 0.0, context=decision.context), broker)
    got = partitions(answer)
    assert set(got) == {("orders.eu", 0), ("orders.eu", 1), ("audit", 3)}
    assert got[("orders.eu", 1)].error_code == 0 and got[("audit", 3)].error_code == 0
    withheld = got[("orders.eu", 0)]
    assert withheld.error_code == INVALID_RECORD
    assert withheld.error_message == (
        "record 1: its value is not JSON (unexpected character, expected a string key at "
        "character 1) (2 records in all) (rule orders-json)")
    assert [(e.batch_index, e.batch_index_error_message) for e in withheld.record_errors] == [
        (1, "its value is not JSON (unexpected character, expected a string key at "
            "character 1)"), (2, "its key is null")]
    assert refused == [("orders-json", "refuse")]
    assert invalid == [("orders-json", "orders.eu", "enforce", 2)]  # audit: not validated
    assert ("orders-json", "validate_records", "refuse", "enforce") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]


def test_a_request_with_no_good_partition_is_answered_by_the_proxy() -> None:
    policy = RulesPolicy(rules(ORDERS))
    for version in (3, 7, 8, 12):
        decision = policy.on_request(conn(), produce([batch(GOOD, headers=[])],
                                                     version=version))
        assert isinstance(decision, Respond)
        [only] = partitions(decision.response).values()
        assert only.error_code == INVALID_RECORD
        if version >= 8:  # KIP-467: the message and the record's index
            assert only.error_message == ("record 0: it has no 'trace-id' header "
                                          "(rule orders-json)")
            assert [e.batch_index for e in only.record_errors] == [0]
    # acks=0: no answer exists; the connection closes, saying why.
    closed = policy.on_request(conn(), produce([batch((None, b"{}"))], acks=0))
    assert isinstance(closed, Close) and "acks=0" in closed.reason


def test_an_acks_0_request_has_its_good_partitions_written_then_its_connection_closed(
        ) -> None:
    """As a broker does with an acks=0 request some partitions of which it refuses: the
    others are written, then the connection closes (no answer can carry the errors)."""
    policy = RulesPolicy(rules(ORDERS))
    request = produce([batch(GOOD), batch((b"k", b"{oops"))], audit=batch((None, b"x")),
                      acks=0)
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward)
    assert [(t.name, [p.index for p in t.partition_data])
            for t in decision.request.body.topic_data] == [("orders.eu", [0]), ("audit", [3])]
    assert decision.close_after is not None
    assert "acks=0" in decision.close_after and "partition 1" in decision.close_after
    # Nothing refused: sent as it came, the connection kept.
    kept = policy.on_request(conn(), produce([batch(GOOD)], acks=0))
    assert isinstance(kept, Forward) and kept.close_after is None


def test_good_records_pass_untouched() -> None:
    policy = RulesPolicy(rules(ORDERS))
    request = produce([batch(GOOD, compression="zstd")], audit=batch((None, b"anything")))
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.request is request
    # Clients the rule does not match are not held to it.
    other = produce([batch((None, b"x"))], client_id="batch-job")
    assert policy.on_request(conn(), other).request is other  # type: ignore[union-attr]


def test_topics_named_by_id_are_matched_through_the_ids_learned() -> None:
    policy = RulesPolicy(rules(ORDERS))
    request = produce([batch((None, b"x")), batch(GOOD)], audit=batch((None, b"x")),
                      version=13)
    # Not learned yet: no topic can be told in or out of the rule, so every partition
    # is answered UNKNOWN_TOPIC_ID (the client refreshes its metadata and retries).
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Respond)
    codes = {k: p.error_code for k, p in partitions(decision.response).items()}
    assert codes == {(str(ORDERS_ID), 0): UNKNOWN_TOPIC_ID, (str(ORDERS_ID), 1): UNKNOWN_TOPIC_ID,
                     (str(AUDIT_ID), 3): UNKNOWN_TOPIC_ID}
    # A Metadata request is now read for the ids its answer teaches.
    metadata = req(3, 12, "app-1", topics=None, allow_auto_topic_creation=False,
                   include_topic_authorized_operations=False)
    assert policy.forwards_unread(conn(), metadata) is None
    learned = policy.on_request(conn(), metadata)
    assert isinstance(learned, Forward) and learned.wants_response
    policy.on_response(conn(), Pending(1, 3, 12, 0.0, context=learned.context),
                       metadata_answer(("orders.eu", ORDERS_ID), ("audit", AUDIT_ID)))
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward)
    assert [(str(t.topic_id), [p.index for p in t.partition_data])
            for t in decision.request.body.topic_data] == [(str(ORDERS_ID), [1]),
                                                           (str(AUDIT_ID), [3])]
    answer = policy.on_response(conn(), Pending(1, 0, 13, 0.0, context=decision.context),
                                error_response(decision.request, 0))
    codes = {k: p.error_code for k, p in partitions(answer).items()}
    assert codes == {(str(ORDERS_ID), 0): INVALID_RECORD, (str(ORDERS_ID), 1): 0,
                     (str(AUDIT_ID), 3): 0}


def test_in_observe_mode_bad_records_are_only_counted() -> None:
    policy = RulesPolicy(rules(ORDERS.replace("  match:", "  mode: observe\n  match:")))
    counted, refused = listening(policy)
    invalid: list[tuple[str, str, str, int]] = []
    policy.invalid_records_listeners.append(lambda *heard: invalid.append(heard))
    request = produce([batch((None, b"x"))])
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.request is request
    assert not decision.wants_response
    assert refused == [("orders-json", "would_refuse")]
    assert invalid == [("orders-json", "orders.eu", "observe", 1)]
    assert ("orders-json", "validate_records", "refuse", "observe") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]


def test_a_validation_keeps_its_clients_produce_requests_off_the_streaming_path() -> None:
    policy = RulesPolicy(rules(ORDERS))
    assert policy.forwards_unread(conn(), produce([batch(GOOD)])) is None
    assert policy.forwards_unread(conn(), produce([batch(GOOD)], client_id="other")) is not None


ORDER_SCHEMA = {"type": "object", "required": ["id", "total"],
                "properties": {"id": {"type": "string"},
                               "total": {"type": "number", "minimum": 0}},
                "additionalProperties": False}
SCHEMA_RULES = ("- name: orders-schema\n  validate_records:\n    value: {schema: "
                "schemas/order.json, required: true}\n")


def schema_rules(tmp_path: Path, schema: Any = ORDER_SCHEMA) -> Path:
    (tmp_path / "schemas").mkdir(exist_ok=True)
    (tmp_path / "schemas" / "order.json").write_text(json.dumps(schema))
    path = tmp_path / "rules.yaml"
    path.write_text(SCHEMA_RULES)
    return path


def test_values_held_to_a_json_schema(tmp_path: Path) -> None:
    """The schema is read beside the rules file; a value that does not match is refused
    saying where and which keyword, never what the value held."""
    [rule] = load_rules_file(schema_rules(tmp_path)).rules
    assert rule.validate_records is not None
    check = rule.validate_records.value
    assert check.format == "json" and check.schema is not None
    assert check.schema.path == tmp_path / "schemas" / "order.json"
    assert check.problem(b'{"id": "a-1", "total": 12.5}', "value") is None
    assert check.problem(b'{"id": "a-1", "total": -4}', "value") == (
        "its value does not match order.json: at $.total, minimum 0")
    assert check.problem(b'{"id": "SECRET-7", "total": "SECRET"}', "value") == (
        'its value does not match order.json: at $.total, type "number"')
    assert check.problem(b'{"id": "a-1"}', "value") == (
        'its value does not match order.json: at $, required ["id","total"]')
    assert check.problem(b'[1]', "value") == (
        'its value does not match order.json: at $, type "object"')
    assert check.problem(b'{"id": 1', "value") == (
        "its value is not JSON (unexpected end of data at character 8)")
    deep = b'{"id": "a", "total": 1, "x": ' + b"[" * 900 + b"]" * 900 + b"}"
    assert check.problem(deep, "value") in (
        "its value is nested too deeply to check against order.json",
        'its value does not match order.json: at $, additionalProperties false')
    assert check.problem(b"[" * 100_000 + b"]" * 100_000, "value") == (
        "its value is not JSON this proxy reads (nested too deeply)")
    # Through the policy: the record's index and the schema's complaint.
    policy = RulesPolicy(load_rules_file(tmp_path / "rules.yaml"))
    decision = policy.on_request(conn(), produce([batch(
        (None, b'{"id": "a", "total": 1}'), (None, b'{"id": "b", "total": "SECRET"}'))]))
    assert isinstance(decision, Respond)
    [only] = partitions(decision.response).values()
    assert [(e.batch_index, e.batch_index_error_message) for e in only.record_errors] == [
        (1, 'its value does not match order.json: at $.total, type "number"')]
    assert "SECRET" not in only.error_message


def test_a_schema_is_checked_as_its_draft_says(tmp_path: Path) -> None:
    """Formats are asserted by drafts 4 to 7 and annotations from 2019-09 on (as each
    says); a $ref's complaint names the keyword where the reference leads; places in
    the document are written as JSONPath, odd names quoted."""
    def loaded(schema: Any) -> Any:
        schema_rules(tmp_path, schema)
        return load_json_schema(tmp_path / "schemas" / "order.json")

    when = {"type": "string", "format": "date-time"}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **when}
    assert loaded(draft7).problem("yesterday", "value") == (
        'its value does not match order.json: at $, format "date-time"')
    assert loaded(when).problem("yesterday", "value") is None
    referring = {"$defs": {"money": {"type": "number", "minimum": 0}},
                 "properties": {"lines": {"items": {"properties": {
                     "unit price": {"$ref": "#/$defs/money"}}}}}}
    assert loaded(referring).problem({"lines": [{}, {"unit price": -2}]}, "value") == (
        'its value does not match order.json: at $.lines[1]["unit price"], minimum 0')


@pytest.mark.parametrize(("schema_text", "value", "error"), [
    (None, "{schema: schemas/missing.json}", "cannot read .*missing.json"),
    ("{not json", "{schema: schemas/order.json}", "order.json is not JSON"),
    ('{"type": 5}', "{schema: schemas/order.json}", "is not a valid JSON Schema: 5 is not"),
    ('[1, 2]', "{schema: schemas/order.json}", "holds no JSON Schema"),
    ('{"$ref": "https://example.com/order.json"}', "{schema: schemas/order.json}",
     "is not a valid JSON Schema: .*retrieving it failed"),
    ('{"$schema": "https://example.com/mine"}', "{schema: schemas/order.json}",
     "is not a valid JSON Schema: its \\$schema 'https://example.com/mine' is not a draft"),
    ('{}', "{schema: schemas/order.json, format: utf8}", "its format is json, not utf8"),
])
def test_a_bad_schema_is_refused_with_its_line(tmp_path: Path, schema_text: str | None,
                                               value: str, error: str) -> None:
    (tmp_path / "schemas").mkdir()
    if schema_text is not None:
        (tmp_path / "schemas" / "order.json").write_text(schema_text)
    refused_at_its_line(tmp_path, value, error)


def refused_at_its_line(tmp_path: Path, value: str, error: str) -> None:
    """A rules file whose ``validate_records.value`` (on its line 4) is ``value`` is
    refused with ``error``, naming that file and line."""
    path = tmp_path / "rules.yaml"
    path.write_text(f"- name: r\n  validate_records:\n\n    value: {value}\n")
    with pytest.raises(ConfigError, match=error) as caught:
        load_rules_file(path)
    assert caught.value.line == 4 and caught.value.file == str(path)


def test_a_changed_schema_reloads_the_rules(tmp_path: Path) -> None:
    """The schema file is watched with the rules file: a change reloads them; a schema
    made invalid keeps the old rules in force."""
    path = schema_rules(tmp_path)
    policy = RulesPolicy(load_rules_file(path))
    reloader = Reloader(policy, RulesSource(None, path))
    assert not reloader.changed()
    cheap = produce([batch((None, b'{"id": "a", "total": 1, "note": "x"}'))])
    assert isinstance(policy.on_request(conn(), cheap), Respond)  # additionalProperties
    looser = {**ORDER_SCHEMA, "additionalProperties": True, "description": "v2"}
    (tmp_path / "schemas" / "order.json").write_text(json.dumps(looser))
    assert reloader.changed() and reloader.reload()
    assert isinstance(policy.on_request(conn(), cheap), Forward)
    (tmp_path / "schemas" / "order.json").write_text('{"type": "no-such-type", "x": 1}')
    assert reloader.changed() and not reloader.reload()
    assert reloader.last_error is not None and "not a valid JSON Schema" in reloader.last_error
    assert isinstance(policy.on_request(conn(), cheap), Forward)  # the old rules hold


def test_a_large_requests_records_are_read_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From 64 KiB on, ``offload`` gives the proxy the reading to run in a thread; what
    it found is what ``on_request`` answers with, without reading the records again."""
    import gatehouse.proxy.policy as policy_module

    calls: list[int] = []
    real = policy_module.verdict

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(policy_module, "verdict", counted)
    policy = RulesPolicy(rules(ORDERS))
    small = produce([batch(GOOD)])
    assert policy.offload(conn(), small) is None
    big_good = batch(*[GOOD] * 400)
    assert len(big_good) > 4096
    large = produce([big_good] * 10 + [batch(GOOD, (None, b"{}"))] * 10)
    assert len(large.frame or b"") >= 64 * 1024
    assert policy.offload(conn(), produce([big_good] * 20, client_id="other")) is None
    connection = conn()
    work = policy.offload(connection, large)
    assert work is not None
    work()
    assert len(calls) == 20
    decision = policy.on_request(connection, large)
    assert len(calls) == 20  # read once, in the work
    assert isinstance(decision, Forward)
    assert [len(t.partition_data) for t in decision.request.body.topic_data] == [10]
    assert "record_verdicts" not in connection.state  # nothing held after the request


def test_records_checked_against_a_schema_are_read_in_the_thread_from_the_same_size(
        tmp_path: Path) -> None:
    """A JSON Schema costs little more than parsing the JSON (bench/records.py): the
    same 64 KiB from which requests are read in a thread."""
    doc = (None, b'{"id": "a", "total": 1}')
    medium = produce([batch(*[doc] * 300)])
    assert 4096 <= len(medium.frame or b"") < 64 * 1024
    large = produce([batch(*[doc] * 3000)])
    assert len(large.frame or b"") >= 64 * 1024
    policy = RulesPolicy(load_rules_file(schema_rules(tmp_path)))
    assert policy.offload(conn(), medium) is None
    assert policy.offload(conn(), large) is not None


def test_the_proxy_loads_the_record_libraries_only_for_rules_that_use_them() -> None:
    """jsonschema_rs (8 MiB) and cramjam (3 MiB) are imported on first use: a proxy whose
    rules read no records does not carry them (its memory goal: bench/proxy.py)."""
    import subprocess
    import sys

    probe = ("import sys, gatehouse.cli, gatehouse.proxy.setup, gatehouse.proxy.policy; "
             "print(sorted(m for m in ('jsonschema_rs', 'cramjam', 'orjson') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
