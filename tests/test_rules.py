"""Rules: parsing with file:line, decisions, error responses and topic maps for every API."""

from __future__ import annotations

import logging
import re
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatehouse import codecs
from gatehouse.codecs import produce
from gatehouse.configfile import ConfigError, load_yaml_text
from gatehouse.logs import FIELDS_ATTR, TextFormatter
from gatehouse.proxy.hooks import Close, ConnectionInfo, Forward, Pending, Respond
from gatehouse.proxy.policy import Reloader, RulesPolicy, RulesSource
from gatehouse.rules import (
    Chain,
    ClientFacts,
    IdFilter,
    NameFilter,
    Prefix,
    Rename,
    RuleSet,
    TopicFilter,
    parse_rules,
)
from gatehouse.rules import topics as topic_maps
from gatehouse.rules.errors import answer_plan, error_response
from gatehouse.rules.topics import (
    RewriteStats,
    carries_topics,
    map_request,
    map_response,
    topic_names,
)
from tests.codec_strategies import examples, few_examples, message_body

ISSUE_EXAMPLE = """\
rules:
  - name: no-ancient-producers
    min_api_version: {Produce: 3, Fetch: 4}
  - name: orders-alias
    rename_topics: {orders: prod.orders}
  - name: tenant-a
    match: {client_id: "^tenant-a-"}
    topic_prefix: {broker: "tenant-a.", hide_others: true}
  - name: read-only-edge
    deny_apis: [CreateTopics, DeleteTopics, AlterConfigs]
"""


def rules(text: str) -> Any:
    return parse_rules(load_yaml_text(text, "rules.yaml"), "rules.yaml")


def req(api_key: int, version: int, client_id: str = "app", **fields: Any) -> codecs.Request:
    plain = {"header": {"api_key": api_key, "api_version": version, "correlation_id": 1,
                        "client_id": client_id}, "body": fields}
    built = codecs.request_from_dict(plain)
    return codecs.decode_request(bytes(built.encode()))  # as the proxy sees it: from bytes


def test_issue_example_parses() -> None:
    ruleset = rules(ISSUE_EXAMPLE)
    assert [r.name for r in ruleset.rules] == ["no-ancient-producers", "orders-alias",
                                               "tenant-a", "read-only-edge"]
    assert ruleset.rules[0].min_api_version[0].version == 3
    assert not ruleset.rules[0].min_api_version[0].advertise  # Produce: KAFKA-18727
    assert ruleset.rules[0].min_api_version[1].advertise


@pytest.mark.parametrize(("text", "line", "message"), [
    ("- name: a\n  min_api_version: {Prodcue: 3}\n", 2, "unknown API name 'Prodcue'"),
    ("- name: a\n  min_api_version:\n    ApiVersions: 3\n", 3, "KIP-35"),
    ("- name: a\n  rename_topics:\n    x: t\n    y: t\n", 4, "both rename to 't'"),
    ("- name: a\n  rename_topics: {x: y, y: x}\n", 2, "cycle"),
    ("- name: a\n  rename_topic: {x: y}\n", 2, "unknown key 'rename_topic'"),
    ("- name: a\n  mode: enforced\n", 2, "enforce or observe"),
    ("- name: a\n  min_api_version: {Produce: three}\n", 2, "version number"),
    ("- name: a\n- name: a\n", 2, "two rules are named 'a'"),
    ("- name: a\n  match: {client_id: '('}\n", 2, "bad regular expression"),
    ("- name: a\n  rename_topics: {x: 'bad name'}\n", 2, "not a valid Kafka topic name"),
    ("- name: a\n  deny_apis: [ApiVersions]\n", 2, "ApiVersions cannot be denied"),
    ("- name: a\n  rename_topics: {x: t}\n- name: b\n  rename_topics: {y: t}\n", 3,
     "already gives to 'x'"),
])
def test_bad_rules_name_file_and_line(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        rules(text)
    assert (info.value.file, info.value.line) == ("rules.yaml", line), str(info.value)
    assert message in str(info.value)


def test_min_version_refused_with_first_refusal_winning() -> None:
    ruleset = rules(ISSUE_EXAMPLE.replace("Produce: 3", "Produce: 7") +
                    "  - name: second\n    min_api_version: {Produce: 8}\n")
    produce_v5 = req(0, 5, acks=1, timeout_ms=100, topic_data=[])
    ev = ruleset.evaluate(ClientFacts(client_id="app"), produce_v5)
    assert ev.refusal is not None and ev.refusal.code == 35
    assert ev.refusal.rule == "no-ancient-producers"
    ok = ruleset.evaluate(ClientFacts(client_id="app"), req(0, 9, acks=1, topic_data=[]))
    assert ok.refusal is None
    denied = ruleset.evaluate(ClientFacts(), req(19, 5, topics=[]))
    assert denied.refusal is not None and denied.refusal.code == 31


def test_observe_mode_only_reports() -> None:
    ruleset = rules("- name: watch\n  mode: observe\n  min_api_version: {Metadata: 9}\n")
    ev = ruleset.evaluate(ClientFacts(), req(3, 4))
    assert ev.refusal is None
    assert [r.rule for r in ev.would_refuse] == ["watch"]
    assert [(o.effect, o.mode) for o in ev.outcomes] == [("refuse", "observe")]


def test_match_by_client_id_source_and_listener() -> None:
    ruleset = rules("- name: edge\n  match: {client_id: '^legacy-', source: 10.0.0.0/8,"
                    " listener: bootstrap}\n  deny_apis: [Metadata]\n")
    hit = ClientFacts(client_id="legacy-1", address="10.1.2.3:5000", listener="bootstrap")
    assert ruleset.evaluate(hit, req(3, 12, "legacy-1")).refusal is not None
    for miss in (ClientFacts(client_id="new", address="10.1.2.3:5000", listener="bootstrap"),
                 ClientFacts(client_id="legacy-1", address="192.168.0.1:1", listener="bootstrap"),
                 ClientFacts(client_id="legacy-1", address="10.1.2.3:5", listener="broker-1")):
        assert ruleset.evaluate(miss, req(3, 12)).refusal is None


def test_min_client_software_understands_librdkafka_wrappers() -> None:
    ruleset = rules("- name: sw\n  min_client_software: {librdkafka: 2.0.0, "
                    "apache-kafka-java: 3.0.0}\n")
    old = ClientFacts(software_name="confluent-kafka-python",
                      software_version="1.9.2-rdkafka-1.9.2")
    new = ClientFacts(software_name="confluent-kafka-python",
                      software_version="2.6.0-rdkafka-2.6.0")
    java_old = ClientFacts(software_name="apache-kafka-java", software_version="2.8.1")
    metadata = req(3, 12)
    refusal = ruleset.evaluate(old, metadata).refusal
    assert refusal is not None and "librdkafka 1.9.2 is older than 2.0.0" in refusal.message
    assert ruleset.evaluate(new, metadata).refusal is None
    assert ruleset.evaluate(java_old, metadata).refusal is not None
    assert ruleset.evaluate(ClientFacts(), metadata).refusal is None  # unknown: allowed
    # ApiVersions itself is never refused: the client must learn what it may use.
    assert ruleset.evaluate(old, req(18, 3)).refusal is None


def test_version_ranges_for_api_versions() -> None:
    ruleset = rules(ISSUE_EXAMPLE + "  - name: cap\n    max_api_version: {Metadata: 9}\n"
                    "  - name: too-high\n    min_api_version: {ListOffsets: 10}\n")
    facts = ClientFacts()
    assert ruleset.version_ranges(facts, 1, 0, 17) == (4, 17)  # Fetch min raised
    assert ruleset.version_ranges(facts, 0, 0, 12) == (0, 12)  # Produce: not advertised
    assert ruleset.version_ranges(facts, 3, 0, 13) == (0, 9)
    assert ruleset.version_ranges(facts, 2, 0, 9) is None  # min above broker max: left out


# -- error responses, for every API and version --------------------------------------

ALL_VERSIONS = [(k, v) for k, a in sorted(codecs.APIS.items()) for v in a.versions]


@pytest.mark.parametrize(("api_key", "version"), ALL_VERSIONS)
def test_error_response_for_every_api_version(api_key: int, version: int) -> None:
    api = codecs.api(api_key)

    @few_examples(2)
    @given(message_body(api.request, version))
    def check(body: Any) -> None:
        request = codecs.Request.build(api_key, version, 9, "c", body)
        resp = error_response(request, 35, "refused")
        frame = resp.encode()
        back = codecs.decode_response(frame, api_key, version)
        assert back.correlation_id == 9
        found = _error_codes(codecs.to_dict(back)["body"])
        assert set(found) <= {35}
        if _has_unconditional_error_code(api.response.root, version):
            assert found

    check()


def _has_unconditional_error_code(struct: Any, version: int) -> bool:
    """An error_code reachable without going through an array (always present)."""
    for f in struct.fields:
        if version not in f.versions or f.is_array:
            continue
        if f.attr == "error_code" and f.tag is None:
            return True
        if f.struct is not None and _has_unconditional_error_code(f.struct, version):
            return True
    return False


def _error_codes(plain: Any) -> list[int]:
    """Every error_code in a to_dict() tree (only fields present in that version)."""
    out = []
    if isinstance(plain, dict):
        for name, value in plain.items():
            if name == "error_code":
                out.append(value)
            else:
                out.extend(_error_codes(value))
    elif isinstance(plain, list):
        for item in plain:
            out.extend(_error_codes(item))
    return out


def test_produce_error_response_mirrors_topics_and_partitions() -> None:
    produce = req(0, 9, acks=-1, timeout_ms=1000, topic_data=[
        {"name": "a", "partition_data": [{"index": 0, "records": None},
                                         {"index": 3, "records": None}]}])
    body = error_response(produce, 35, "old").body
    assert [(t.name, [(p.index, p.error_code, p.error_message) for p in t.partition_responses])
            for t in body.responses] == [("a", [(0, 35, "old"), (3, 35, "old")])]


def test_find_coordinator_v4_error_response_has_one_entry_per_key() -> None:
    body = error_response(req(10, 4, key_type=0, coordinator_keys=["g1", "g2"]), 31).body
    assert [(c.key, c.error_code) for c in body.coordinators] == [("g1", 31), ("g2", 31)]


def test_error_responses_leave_nullable_structs_null() -> None:
    """As a broker's error answers: a refused listing of every topic ends (a cursor of
    ('', 0) would start it again, for ever), a refused heartbeat changes no assignment
    (an empty one would take every partition away)."""
    listing = error_response(req(75, 0, topics=[], response_partition_limit=5,
                                 cursor={"topic_name": "x", "partition_index": 0}), 42).body
    assert listing.topics == () and listing.next_cursor is None
    heartbeat = error_response(req(68, 0, group_id="g", member_id="m", member_epoch=1,
                                   instance_id=None, rack_id=None, rebalance_timeout_ms=-1,
                                   subscribed_topic_names=None, server_assignor=None,
                                   topic_partitions=None), 29).body
    assert heartbeat.error_code == 29 and heartbeat.assignment is None
    # A struct that is never null is still filled: a Produce partition's current leader.
    produce = error_response(req(0, 12, acks=-1, timeout_ms=1, topic_data=[
        {"name": "a", "partition_data": [{"index": 0, "records": None}]}]), 35).body
    assert produce.responses[0].partition_responses[0].current_leader is not None


def test_answers_by_position_have_one_result_per_thing_asked() -> None:
    """Answers the specs cannot match to their requests by key: as Kafka's
    ``getErrorResponse`` builds them (a client counts on one result per thing asked;
    Java's admin client reports a missing one as an unknown server error)."""
    acl = {"resource_type": 2, "resource_name": "a", "resource_pattern_type": 3,
           "principal": "User:a", "host": "*", "operation": 3, "permission_type": 3}
    body = error_response(req(30, 3, creations=[acl, acl]), 31, "no").body
    assert [(r.error_code, r.error_message) for r in body.results] == [(31, "no")] * 2
    acl_filter = {"resource_type_filter": 2, "resource_name_filter": "a",
                  "pattern_type_filter": 3, "principal_filter": None, "host_filter": None,
                  "operation": 3, "permission_type": 3}
    body = error_response(req(31, 3, filters=[acl_filter]), 31).body
    assert [(r.error_code, r.matching_acls) for r in body.filter_results] == [(31, ())]
    scram = {"mechanism": 1, "iterations": 4096, "salt": b"s", "salted_password": b"p"}
    body = error_response(req(51, 0, deletions=[{"name": "bob", "mechanism": 1}],
                              upsertions=[{"name": "al", **scram}, {"name": "bob", **scram}]),
                          31).body
    assert [(r.user, r.error_code) for r in body.results] == [("al", 31), ("bob", 31)]
    body = error_response(req(50, 0, users=[{"name": "al"}, {"name": "bob"}]), 31).body
    assert body.error_code == 31 and [r.error_code for r in body.results] == [31, 31]
    body = error_response(req(49, 1, entries=[{"entity": [{"entity_type": "user",
                                                           "entity_name": "al"}],
                                                "ops": []}], validate_only=False), 31).body
    assert [([(e.entity_type, e.entity_name) for e in r.entity], r.error_code)
            for r in body.entries] == [([("user", "al")], 31)]
    body = error_response(req(34, 2, dirs=[{"path": "/d", "topics": [
        {"name": "t", "partitions": [0, 1]}]}, {"path": "/e", "topics": [
            {"name": "u", "partitions": [2]}]}]), 31).body
    assert [(t.topic_name, [(p.partition_index, p.error_code) for p in t.partitions])
            for t in body.results] == [("t", [(0, 31), (1, 31)]), ("u", [(2, 31)])]


# -- topic names everywhere, generated from the tables -------------------------------

TOPIC_REQUESTS = [(k, v) for k, v in ALL_VERSIONS if carries_topics(codecs.api(k).request)
                  and k not in (11, 14)]  # group bytes: tested with real payloads below
TOPIC_RESPONSES = [(k, v) for k, v in ALL_VERSIONS if carries_topics(codecs.api(k).response)
                   and k not in (11, 14, 15)]


def test_tables_find_the_topic_apis() -> None:
    names = {codecs.api(k).name for k, _ in TOPIC_REQUESTS}
    assert {"Produce", "Fetch", "ListOffsets", "Metadata", "OffsetCommit", "OffsetFetch",
            "OffsetForLeaderEpoch", "CreateTopics", "DeleteTopics", "CreatePartitions",
            "DeleteRecords", "TxnOffsetCommit", "AddPartitionsToTxn", "DescribeProducers",
            "DescribeConfigs", "AlterConfigs", "IncrementalAlterConfigs", "CreateAcls",
            "DescribeAcls", "ConsumerGroupHeartbeat"} <= names


@pytest.mark.parametrize(("api_key", "version"), TOPIC_REQUESTS)
def test_request_topic_names_prefixed(api_key: int, version: int) -> None:
    api = codecs.api(api_key)
    mapping = Prefix("tenant.")

    @few_examples(3)
    @given(message_body(api.request, version))
    def check(body: Any) -> None:
        request = codecs.decode_request(bytes(
            codecs.Request.build(api_key, version, 1, "c", body).encode()))
        before = [n for n in topic_names(request)]
        mapped = map_request(request, mapping, {}, RewriteStats())
        after = topic_names(codecs.decode_request(bytes(mapped.encode())))
        assert after == ["tenant." + n for n in before]

    check()


@pytest.mark.parametrize(("api_key", "version"), TOPIC_RESPONSES)
def test_response_topic_names_unprefixed(api_key: int, version: int) -> None:
    api = codecs.api(api_key)
    mapping = Prefix("tenant.")

    @few_examples(3)
    @given(message_body(api.response, version))
    def check(body: Any) -> None:
        resp = codecs.Response.build(api_key, version, 1, body)
        prefixed = map_response(resp, _ToBroker(mapping), {}, RewriteStats())
        back = map_response(prefixed, mapping, {}, RewriteStats())
        assert codecs.to_dict(back)["body"] == codecs.to_dict(resp)["body"]

    check()


HIDDEN_MARK = "b.hidden"


# Resource types whose names are a topic's, a group's or a transactional id's: in ACLs
# (TOPIC 2, GROUP 3, TRANSACTIONAL_ID 5) and in configs (TOPIC 2, GROUP 32; 5 is no
# config resource: a broker refuses it).
ACL_NAMED_RESOURCES, CONFIG_NAMED_RESOURCES = frozenset({2, 3, 5}), frozenset({2, 32})


def names_half_hidden(message: Any, version: int, body: Any) -> Any:
    """``body`` with every topic name, group id and transactional id in it (and the
    names of resources of those) replaced by one of a tenant's (``a.``) or of another
    tenant's (``HIDDEN_MARK``), by turns."""
    turn = iter(range(1 << 30))
    named_types = ACL_NAMED_RESOURCES if "Acl" in message.name else CONFIG_NAMED_RESOURCES

    def name() -> str:
        n = next(turn)
        return f"a.seen{n}" if n % 2 else f"{HIDDEN_MARK}{n}"

    def is_name(f: Any) -> bool:
        return (topic_maps.is_topic_field(f) or topic_maps._is_resource_field(f)
                or topic_maps.id_kind(f) is not None)

    def visit(struct: Any, record: Any) -> Any:
        changes: dict[str, Any] = {}
        named_resource = topic_maps.resource_type(record) in named_types
        for f in struct.fields:
            value = getattr(record, f.attr, None)
            if value is None or not is_name(f) or (topic_maps._is_resource_field(f)
                                                   and not named_resource):
                continue
            changes[f.attr] = (tuple(name() for _ in value) if f.is_array else name())
        return record.replace(**changes) if changes else record

    return topic_maps.rewrite(message, version, body, is_name, visit)


NAMING_RESPONSES = [(k, v) for k, v in ALL_VERSIONS
                    if carries_topics(codecs.api(k).response)
                    or topic_maps.carries_ids(codecs.api(k).response, frozenset(topic_maps._KINDS))]


@pytest.mark.parametrize(("api_key", "version"), NAMING_RESPONSES)
def test_no_answer_names_a_hidden_topic(api_key: int, version: int) -> None:
    """Every response version of the tables that names topics, groups or transactional
    ids, with random bodies whose names are half the tenant's, half another's: under a
    prefix that hides the others (groups and transactional ids too) and under topic and
    id filters, the answer the client gets (written to bytes) never names one of the
    others' (a field the tables mark as such a name that the mapper left as it was
    would: a Streams topology node's sink topic did)."""
    api = codecs.api(api_key)
    maps = (Prefix("a.", hide_others=True, groups=True, transactional_ids=True),
            Chain((TopicFilter(allow=(re.compile(r"a\..*"),)), IdFilter({
                kind: NameFilter(allow=(re.compile(r"a\..*"),))
                for kind in (topic_maps.GROUP, topic_maps.TRANSACTION)}))))

    @few_examples(3)
    @given(message_body(api.response, version))
    def check(body: Any) -> None:
        resp = codecs.Response.build(api_key, version, 1,
                                     names_half_hidden(api.response, version, body))
        for mapping in maps:
            for hint in (None, topic_maps.EVERY_TOPIC):
                shown = map_response(resp, mapping, {}, RewriteStats(), hint)
                assert HIDDEN_MARK.encode() not in bytes(shown.encode()), (mapping, hint)

    check()


NAMING_REQUESTS = [(k, v) for k, v in ALL_VERSIONS
                   if carries_topics(codecs.api(k).request)
                   or topic_maps.carries_ids(codecs.api(k).request, frozenset(topic_maps._KINDS))]
HALF_HIDDEN_RULE = ("- name: mine\n  allow_topics: ['a\\..*']\n  allow_groups: ['a\\..*']\n"
                    "  allow_transactional_ids: ['a\\..*']\n")

# The same names as ACLs: every operation on its own, creating some of them only; a
# topic_policy on the topics it creates.
HALF_HIDDEN_ACLS = ("- name: mine\n  acls:\n"
                    "    - {allow: [all], topics: ['a\\..*'], groups: ['a\\..*'],"
                    " transactional_ids: ['a\\..*']}\n"
                    "    - {deny: [create], topics: ['a\\.seen[0-4].*']}\n"
                    "  topic_policy: {names: ['a\\.seen[0-7].*']}\n")


@pytest.mark.parametrize(("api_key", "version"), NAMING_REQUESTS)
def test_no_request_takes_a_hidden_name_to_the_broker(api_key: int, version: int) -> None:
    """Every request version of the tables that names topics, groups or transactional
    ids, with random bodies whose names are half the client's, half ones it may not
    use: under topic and id filters, and under ACLs (with a topic_policy), the request
    is answered by the proxy (refused) or goes up without them (Metadata: the others
    dropped), and can be written."""
    from tests.test_rules_topic_filter import conn

    api = codecs.api(api_key)
    policies = [RulesPolicy(rules(HALF_HIDDEN_RULE)), RulesPolicy(rules(HALF_HIDDEN_ACLS))]

    @few_examples(3)
    @given(message_body(api.request, version))
    def check(body: Any) -> None:
        request = codecs.decode_request(bytes(codecs.Request.build(
            api_key, version, 1, "c", names_half_hidden(api.request, version, body)).encode()))
        for policy in policies:
            decision = policy.on_request(conn(), request)
            if isinstance(decision, Forward):
                assert HIDDEN_MARK.encode() not in bytes(decision.request.encode())
                if decision.wants_response and decision.close_after is None:  # acks=0
                    _answers_every_entry(policy, request, decision)

    check()


def _top_keys(resp: codecs.Response) -> list[Any]:
    """The keys of the entries of ``resp``'s arrays that mirror its request's (but those
    that name nothing: the stand-in broker answers them with an empty name, which a
    filter hides)."""
    keys = []
    for step in answer_plan(resp.api.response.root, resp.api.request.root, resp.api_version):
        if step[0] == "mirror":
            keys += [(step[1], *(getattr(e, r) for r, _ in step[3]))
                     for e in getattr(resp.body, step[1])]
        elif step[0] == "mirror_keys":
            keys += [(step[1], getattr(e, step[3])) for e in getattr(resp.body, step[1])]
    nothing = (None, "", uuid.UUID(int=0))
    return sorted((k for k in keys if any(v not in nothing for v in k[1:])), key=repr)


def _answers_every_entry(policy: RulesPolicy, request: codecs.Request,
                         decision: Forward) -> None:
    """The answer the client gets to ``request``, sent on as ``decision`` (some of its
    entries maybe taken out), when the broker answers every entry sent: an entry for
    each entry of the request (the proxy's for those it took out), written to bytes."""
    from tests.test_rules_topic_filter import conn

    sent = decision.request
    broker = error_response(sent, 0)
    pending = Pending(1, sent.api_key, sent.api_version, 0.0, wants_response=True,
                      context=decision.context)
    got = policy.on_response(conn(), pending, codecs.decode_response(
        memoryview(bytes(broker.encode())), sent.api_key, sent.api_version))
    got = codecs.decode_response(memoryview(bytes(got.encode())), sent.api_key,
                                 sent.api_version)
    if sent.api_key != 3:  # Metadata: the others are dropped, not answered
        asked = _top_keys(error_response(request, 0))
        shown = _top_keys(got)
        # Every entry the proxy took out is answered; nothing is answered twice or
        # that was not asked about.  (The stand-in broker's entries for what was sent
        # may be hidden: it names a topic deleted by id with an empty name.)
        for key in _top_keys(error_response(sent, 0)):
            if key in asked:
                asked.remove(key)
                if key not in shown:
                    continue
                shown.remove(key)
        assert shown == asked


def _each_sent(policy: RulesPolicy, api_key: int, version: int,
               holds: Any) -> None:
    """``holds(sent)`` for what ``policy`` sends the broker (read back from its bytes)
    for random requests of that version it does not answer itself."""
    from tests.test_rules_topic_filter import conn

    @few_examples(3)
    @given(message_body(codecs.api(api_key).request, version))
    def check(body: Any) -> None:
        request = codecs.decode_request(bytes(codecs.Request.build(
            api_key, version, 1, "c", body).encode()))
        decision = policy.on_request(conn(), request)
        if isinstance(decision, Forward):
            holds(codecs.decode_request(bytes(decision.request.encode())))

    check()


@pytest.mark.parametrize(("api_key", "version"), NAMING_REQUESTS)
def test_a_tenants_requests_name_only_its_own(api_key: int, version: int) -> None:
    """Every request version of the tables that names topics, groups or transactional
    ids, with random names: under a prefix that hides the others (groups and
    transactional ids too), whatever goes up names only topics, groups and
    transactional ids inside the prefix (another tenant's cannot be reached)."""

    policy = RulesPolicy(rules("- name: tenant\n  topic_prefix: {broker: 't.', hide_others: "
                               "true, groups: true, transactional_ids: true}\n"))
    kinds = frozenset(topic_maps._KINDS)

    def holds(sent: codecs.Request) -> None:
        names = [*topic_names(sent), *(n for _, n in topic_maps.id_names(sent, kinds))]
        assert all(n.startswith("t.") for n in names), names

    _each_sent(policy, api_key, version, holds)


ID_REQUESTS = [(k, v) for k, v in ALL_VERSIONS if k not in (3, 68) and any(
    f.attr == "topic_id" and f.type == "uuid"
    for _, f in codecs.schema.iter_fields(codecs.api(k).request.root, v))]


@pytest.mark.parametrize(("api_key", "version"), ID_REQUESTS)
def test_a_tenant_reaches_no_topic_by_an_id_it_was_not_shown(api_key: int,
                                                            version: int) -> None:
    """Every request version that names topics by id (but Metadata and
    ConsumerGroupHeartbeat, which are not checked), with random ids the proxy has
    not seen in the tenant's answers: under a prefix that hides the others nothing
    goes up naming one (but a Fetch's forgotten topics: forgetting is harmless)."""
    from gatehouse.rules.topicids import is_topic_id_field

    policy = RulesPolicy(rules("- name: tenant\n  topic_prefix: {broker: 't.', hide_others: "
                               "true}\n"))

    def holds(sent: codecs.Request) -> None:
        ids: list[Any] = []

        def visit(struct: Any, record: Any) -> Any:
            if "Forgotten" not in struct.name:
                ids.extend(getattr(record, f.attr) for f in struct.fields
                           if is_topic_id_field(f) and getattr(record, f.attr, None))
            return record

        topic_maps.rewrite(sent.api.request, version, sent.body, is_topic_id_field, visit)
        assert all(i.int == 0 for i in ids), ids

    _each_sent(policy, api_key, version, holds)


@pytest.mark.parametrize(("api_key", "version"), ID_REQUESTS)
def test_a_tenants_ids_go_up_and_the_others_are_answered_by_the_proxy(api_key: int,
                                                                     version: int) -> None:
    """Every request version that names topics by id (as above), with random ids that
    the proxy learned, by turns, as the tenant's and as another tenant's: what goes up
    names only the tenant's (but forgotten topics), and, the broker answering what was
    sent, the client gets an answer for every entry it asked about."""
    from gatehouse.rules.topicids import is_topic_id_field
    from tests.test_rules_topic_filter import conn

    api = codecs.api(api_key)
    policy = RulesPolicy(rules("- name: tenant\n  topic_prefix: {broker: 't.', hide_others: "
                               "true}\n"))

    def ids_in(request: codecs.Request) -> list[uuid.UUID]:
        ids: list[uuid.UUID] = []

        def visit(struct: Any, record: Any) -> Any:
            if "Forgotten" not in struct.name:
                ids.extend(getattr(record, f.attr) for f in struct.fields
                           if is_topic_id_field(f) and getattr(record, f.attr, None))
            return record

        topic_maps.rewrite(request.api.request, version, request.body, is_topic_id_field,
                           visit)
        return [i for i in ids if i.int]

    @few_examples(3)
    @given(message_body(api.request, version))
    def check(body: Any) -> None:
        request = codecs.decode_request(bytes(codecs.Request.build(
            api_key, version, 1, "c", body).encode()))
        names = policy.topic_ids.names
        names.clear()
        for n, topic_id in enumerate(ids_in(request)):
            names.setdefault(topic_id.bytes, f"t.own{n}" if n % 2 else f"u.other{n}")
        decision = policy.on_request(conn(), request)
        if isinstance(decision, Forward):
            sent = codecs.decode_request(bytes(decision.request.encode()))
            assert all(names[i.bytes].startswith("t.") for i in ids_in(sent))
            if decision.wants_response and decision.close_after is None:  # acks=0: none
                _answers_every_entry(policy, request, decision)

    check()


OBSERVING = """\
- {name: old, mode: observe, min_api_version: {Produce: 9, Fetch: 12, Metadata: 12}}
- {name: new, mode: observe, max_api_version: {Metadata: 1}}
- {name: edge, mode: observe, deny_apis: [CreateTopics, DeleteTopics, AlterConfigs]}
- {name: tenant, mode: observe, topic_prefix: {broker: t., hide_others: true,
   groups: true, transactional_ids: true}}
- {name: mine, mode: observe, allow_topics: ['a\\..*'], allow_groups: ['a\\..*'],
   allow_transactional_ids: ['a\\..*']}
- {name: acl, mode: observe, acls: [{allow: [read], topics: ['a\\..*'],
   groups: ['a\\..*']}, {allow: [describe], cluster: true}]}
- {name: clients, mode: observe, min_client_software: {librdkafka: 9.0.0},
   unknown_software: refuse}
- {name: producers, mode: observe, produce_policy: {acks: all, idempotent: true}}
- {name: records, mode: observe, validate_records: {value: json, key: {required: true}}}
- {name: standards, mode: observe, topic_policy: {names: ['x'], partitions: {max: 1},
   replication_factor: {min: 5}}}
"""


@pytest.mark.parametrize(("api_key", "version"), ALL_VERSIONS)
def test_observe_mode_changes_no_request(api_key: int, version: int) -> None:
    """Every request version, random bodies, under observe-mode rules of every kind
    (versions, APIs, a prefix, filters, ACLs, client software, produce policy, record
    validation, topic policy): each goes up as the client sent it, byte for byte."""
    from tests.test_rules_topic_filter import conn

    api = codecs.api(api_key)
    policy = RulesPolicy(rules(OBSERVING))

    @few_examples(2)
    @given(message_body(api.request, version))
    def check(body: Any) -> None:
        wire = bytes(codecs.Request.build(api_key, version, 1, "c", body).encode())
        decision = policy.on_request(conn(), codecs.decode_request(wire))
        assert isinstance(decision, Forward), decision
        assert bytes(decision.request.encode()) == wire

    check()


def test_a_streams_topology_names_no_hidden_topic() -> None:
    """StreamsGroupDescribe v1's topology (KIP-1071): a node's source topics are a list
    (another tenant's dropped); its sink topic is no key of the node and may be null,
    so another tenant's is nulled, the node kept."""
    node = {"name": "n", "node_type": 1, "source_topics": ["a.in", "b.x"],
            "sink_topic": "b.out", "stores": [], "successors": []}
    group = {"group_id": "g", "group_state": "Stable", "topology_description": {
        "subtopologies": [{"subtopology_id": "0", "nodes": [
            node, {**node, "source_topics": [], "sink_topic": "a.out"}]}],
        "global_stores": []}}
    resp = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "groups": [group]}}, api_key=89, api_version=1)
    shown = map_response(codecs.decode_response(memoryview(bytes(resp.encode())), 89, 1),
                         Prefix("a.", hide_others=True), {}, RewriteStats())
    nodes = shown.body.groups[0].topology_description.subtopologies[0].nodes
    assert [(n.source_topics, n.sink_topic) for n in nodes] == [(("in",), None), ((), "out")]
    assert b"b.out" not in bytes(shown.encode())


class _ToBroker(Rename):
    """Test helper: maps responses *towards* the broker to fabricate broker-side data."""

    def __init__(self, inner: Prefix) -> None:
        super().__init__({})
        object.__setattr__(self, "inner", inner)

    def to_client(self, name: str) -> str | None:
        return self.inner.to_broker(name)  # type: ignore[attr-defined]

    def message_to_client(self, text: str) -> str:
        return text


def test_hide_others_removes_foreign_topics_from_metadata() -> None:
    body = {"brokers": [], "topics": [
        {"name": "tenant-a.orders", "partitions": []},
        {"name": "tenant-b.secrets", "partitions": []},
        {"name": "plain", "partitions": []}]}
    resp = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                     api_key=3, api_version=12)
    shown = map_response(resp, Prefix("tenant-a.", hide_others=True), {}, RewriteStats())
    assert [t.name for t in shown.body.topics] == ["orders"]
    visible = map_response(resp, Prefix("tenant-a."), {}, RewriteStats())
    assert [t.name for t in visible.body.topics] == ["orders", "tenant-b.secrets", "plain"]


def test_error_messages_quote_client_names() -> None:
    body = {"topics": [{"name": "prod.orders", "error_code": 36,
                        "error_message": "Topic 'prod.orders' already exists."}]}
    resp = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                     api_key=19, api_version=5)
    shown = map_response(resp, Rename({"orders": "prod.orders"}), {}, RewriteStats())
    assert shown.body.topics[0].name == "orders"
    assert shown.body.topics[0].error_message == "Topic 'orders' already exists."


def test_topic_resources_renamed_other_resources_not() -> None:
    request = req(32, 4, resources=[
        {"resource_type": 2, "resource_name": "orders", "configuration_keys": None},
        {"resource_type": 4, "resource_name": "orders", "configuration_keys": None}])
    mapped = map_request(request, Rename({"orders": "prod.orders"}), {}, RewriteStats())
    assert [r.resource_name for r in mapped.body.resources] == ["prod.orders", "orders"]


def test_consumer_protocol_bytes_renamed_both_ways_with_kip559_and_fallback() -> None:
    mapping = Rename({"orders": "prod.orders"})
    sub = codecs.consumer.subscription(1, topics=("orders",), user_data=None,
                                       owned_partitions=())
    join = req(11, 5, group_id="g", session_timeout_ms=10000, rebalance_timeout_ms=10000,
               member_id="", group_instance_id=None, protocol_type="consumer",
               protocols=[{"name": "range", "metadata": sub.encode()}])
    state: dict[str, Any] = {}
    stats = RewriteStats()
    mapped = map_request(join, mapping, state, stats)
    inner = codecs.consumer.decode_subscription(mapped.body.protocols[0].metadata)
    assert inner.body.topics == ("prod.orders",)
    # JoinGroup response v5 has no ProtocolType: decoded via this connection's JoinGroup.
    broker_sub = codecs.consumer.subscription(1, topics=("prod.orders",), user_data=None,
                                              owned_partitions=())
    join_resp = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "generation_id": 1, "protocol_name": "range", "leader": "m", "member_id": "m",
        "members": [{"member_id": "m", "group_instance_id": None,
                     "metadata": broker_sub.encode()}]}}, api_key=11, api_version=5)
    shown = map_response(join_resp, mapping, state, stats)
    assert codecs.consumer.decode_subscription(
        shown.body.members[0].metadata).body.topics == ("orders",)
    assert stats.protocol_fallbacks == 1
    # SyncGroup v5 says ProtocolType itself (KIP-559): no fallback needed.
    assignment = codecs.consumer.assignment(0, assigned_partitions=[
        codecs.consumer.ASSIGNMENT.structs["TopicPartition"].cls(topic="prod.orders",
                                                                  partitions=(0, 1))],
        user_data=None)
    sync_resp = codecs.response_from_dict({"header": {"correlation_id": 2}, "body": {
        "protocol_type": "consumer", "protocol_name": "range",
        "assignment": assignment.encode()}}, api_key=14, api_version=5)
    shown_sync = map_response(sync_resp, mapping, {}, stats)
    decoded = codecs.consumer.decode_assignment(shown_sync.body.assignment)
    assert [tp.topic for tp in decoded.body.assigned_partitions] == ["orders"]
    assert stats.protocol_fallbacks == 1


def test_unknown_protocol_type_bytes_pass_untouched() -> None:
    sync = req(14, 5, group_id="g", generation_id=1, member_id="m", group_instance_id=None,
               protocol_type="connect", protocol_name="default",
               assignments=[{"member_id": "m", "assignment": b"\x00\x01opaque"}])
    stats = RewriteStats()
    mapped = map_request(sync, Rename({"orders": "prod.orders"}), {}, stats)
    assert mapped is sync
    assert stats.unknown_protocol_bytes == 1


# -- the policy in the proxy, and hot reload -----------------------------------------

def test_policy_answers_refusals_with_the_api_error() -> None:
    policy = RulesPolicy(rules("- name: r\n  min_api_version: {Fetch: 6}\n"))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    decision = policy.on_request(conn, req(1, 5, max_wait_ms=1, min_bytes=1, max_bytes=1,
                                           topics=[]))
    assert isinstance(decision, Respond)
    assert decision.response.api_key == 1 and decision.response.api_version == 5
    codes = [p.error_code for t in decision.response.body.responses for p in t.partitions]
    assert codes == []  # Fetch v5 has no top-level code and the request named no topics
    assert conn.state["refusals_logged"] == {
        (1, "r", False, "Fetch v5 is below the minimum v6 (rule r)")}


def test_a_refusal_is_logged_once_per_connection_and_api_with_who_asked(
        caplog: pytest.LogCaptureFixture) -> None:
    policy = RulesPolicy(rules("- name: modern\n  min_api_version: {Fetch: 6, Metadata: 4}\n"))
    conn = ConnectionInfo(id=7, client="10.1.2.3:5555", listener="bootstrap",
                          client_id="legacy-app", software_name="kafka-python",
                          software_version="2.0.2")
    fetch = req(1, 5, client_id="legacy-app", max_wait_ms=1, min_bytes=1, max_bytes=1,
                topics=[])
    metadata = req(3, 1, client_id="legacy-app", topics=None)
    with caplog.at_level("INFO", logger="gatehouse.rules"):
        for request in (fetch, fetch, metadata, fetch, metadata):
            assert isinstance(policy.on_request(conn, request), Respond)
    lines = [TextFormatter().format(r) for r in caplog.records if r.levelname == "INFO"]
    assert len(lines) == 2, lines  # one per API on this connection, not one per request
    for line, api in zip(lines, ("Fetch", "Metadata"), strict=True):
        assert "refused" in line and api in line and "modern" in line
        assert "10.1.2.3:5555" in line and "legacy-app" in line
        assert "kafka-python/2.0.2" in line
    other = ConnectionInfo(id=8, client="10.1.2.4:1", listener="bootstrap")
    with caplog.at_level("INFO", logger="gatehouse.rules"):
        policy.on_request(other, fetch)
    assert sum("10.1.2.4:1" in TextFormatter().format(r) for r in caplog.records) == 1


def test_kip848_regex_subscription_under_a_rename_is_refused_clearly() -> None:
    policy = RulesPolicy(rules("- name: alias\n  rename_topics: {orders: prod.orders}\n"))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    heartbeat = req(68, 1, group_id="g", member_id="m", member_epoch=0, instance_id=None,
                    rack_id=None, rebalance_timeout_ms=30000, subscribed_topic_names=None,
                    server_assignor=None, topic_partitions=None,
                    subscribed_topic_regex="ord.*")
    decision = policy.on_request(conn, heartbeat)
    assert isinstance(decision, Respond)
    body = decision.response.body
    assert body.error_code == 42  # INVALID_REQUEST
    assert "regex subscription 'ord.*'" in body.error_message
    named = req(68, 1, group_id="g", member_id="m", member_epoch=0, instance_id=None,
                rack_id=None, rebalance_timeout_ms=30000, subscribed_topic_names=["orders"],
                server_assignor=None, topic_partitions=None)
    forwarded = policy.on_request(conn, named)
    assert not isinstance(forwarded, Respond)


def test_a_streams_topology_with_a_source_regex_under_a_prefix_is_refused() -> None:
    """KIP-1071: a Streams group's topology may read every topic a regex matches, which
    the broker matches against all of them (another tenant's too): under a prefix the
    heartbeat is refused, as a KIP-848 regex subscription; one naming its topics goes
    on with them prefixed."""
    policy = RulesPolicy(rules("- name: t\n  topic_prefix: {broker: 't.', hide_others: true}\n"))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")

    def heartbeat(**subtopology: Any) -> codecs.Request:
        return req(88, 0, group_id="app", member_id="m", member_epoch=0,
                   endpoint_information_epoch=0, instance_id=None, rack_id=None,
                   rebalance_timeout_ms=30000, topology={"epoch": 1, "subtopologies": [{
                       "subtopology_id": "0", "source_topics": [], "source_topic_regex": [],
                       "state_changelog_topics": [], "repartition_sink_topics": [],
                       "repartition_source_topics": [], "copartition_groups": [],
                       **subtopology}]},
                   active_tasks=None, standby_tasks=None, warmup_tasks=None,
                   process_id="p", user_endpoint=None, client_tags=None, task_offsets=None,
                   task_end_offsets=None, shutdown_application=False)

    decision = policy.on_request(conn, heartbeat(source_topic_regex=["orders-.*"]))
    assert isinstance(decision, Respond)
    assert decision.response.body.error_code == 42  # INVALID_REQUEST
    assert "regex subscription 'orders-.*'" in decision.response.body.error_message
    named = policy.on_request(conn, heartbeat(source_topics=["orders"]))
    assert isinstance(named, Forward)
    assert named.request.body.topology.subtopologies[0].source_topics == ("t.orders",)


def test_a_version_kafka_4_removed_is_refused_in_its_own_format() -> None:
    # Produce v2 left the specs in Kafka 4.0 (3.x brokers serve it; the tables take it
    # from 3.9's): its refusal is a Produce v2 answer, each partition UNSUPPORTED_VERSION.
    policy = RulesPolicy(rules(ISSUE_EXAMPLE))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    frame = (struct.pack(">hhih", 0, 2, 7, 1) + b"c" + struct.pack(">hii", 1, 100, 1)
             + struct.pack(">h", 6) + b"orders" + struct.pack(">iii", 1, 4, 0))
    decision = policy.on_request(conn, codecs.decode_request(frame))
    assert isinstance(decision, Respond)
    answer = codecs.decode_response(memoryview(bytes(decision.response.encode())), 0, 2)
    assert [(t.name, [(p.index, p.error_code) for p in t.partition_responses])
            for t in answer.body.responses] == [("orders", [(4, 35)])]


def test_policy_closes_when_the_refused_version_is_unknown_to_the_codec() -> None:
    # CreateTopics v8 is newer than the tables: no table to build its error response from.
    policy = RulesPolicy(rules(ISSUE_EXAMPLE))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    frame = struct.pack(">hhih", 19, 8, 7, 1) + b"c" + b"\0\0\0\0"
    decision = policy.on_request(conn, codecs.decode_request(frame))
    assert isinstance(decision, Close) and "CreateTopics v8" in decision.reason


def test_bad_reload_keeps_old_rules(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(ISSUE_EXAMPLE)
    policy = RulesPolicy(rules(ISSUE_EXAMPLE))
    reloader = Reloader(policy, RulesSource(None, path))
    old = policy.ruleset
    path.write_text(ISSUE_EXAMPLE + "  - name: broken\n    deny_apis: [NoSuchApi]\n")
    assert reloader.changed()
    assert not reloader.reload()
    assert policy.ruleset is old
    assert reloader.failed == 1 and f"{path}:12: unknown API name" in str(reloader.last_error)
    path.write_text("rules:\n  - name: only\n    deny_apis: [Metadata]\n")
    assert reloader.reload()
    assert [r.name for r in policy.ruleset.rules] == ["only"]


def test_a_reload_where_the_brokers_see_one_user_advises_cluster_acls(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text("rules:\n  - name: a\n    match: {principal: '^a$'}\n    acls:\n"
                    "      - {allow: [read], topics: [x]}\n")
    for shared, advised in ((False, 0), (True, 1)):
        caplog.clear()
        reloader = Reloader(RulesPolicy(RuleSet()), RulesSource(None, path),
                            shared_identity=shared)
        with caplog.at_level(logging.WARNING, logger="gatehouse"):
            assert reloader.reload()
        advice = [getattr(r, FIELDS_ATTR)["advice"] for r in caplog.records
                  if r.getMessage() == "rules advice"]
        assert len(advice) == advised and all(
            "rule a: its acls say nothing of the cluster" in text for text in advice), advice
    # A tenant's prefix says nothing of the cluster either.
    tenant = rules("- name: t\n  match: {principal: '^t$'}\n  topic_prefix: "
                   "{broker: 't.', hide_others: true, groups: true, transactional_ids: true}\n")
    assert tenant.advice() == []
    [advised_tenant] = tenant.advice(shared_identity=True)
    assert "rule t: it keeps tenants apart (hide_others) but has no acls" in advised_tenant


# One rule per thing a rule can look at (and two that look at no fact of the client).
FACT_RULES = {
    "client_id": "- name: by-id\n  match: {client_id: '^legacy-'}\n  deny_apis: [Metadata]\n",
    "software_name": "- name: by-name\n  match: {client_software_name: '^kafka-python$'}\n"
                     "  min_api_version: {Produce: 9}\n",
    "software_version": "- name: by-version\n  match: {client_software_version: '^1\\.'}\n"
                        "  deny_apis: [Produce]\n",
    "software": "- name: by-software\n  min_client_software: {librdkafka: 2.0.0}\n"
                "  unknown_software: refuse\n",
    "address": "- name: by-source\n  match: {source: 10.1.0.0/16}\n  deny_apis: [Fetch]\n",
    "listener": "- name: by-listener\n  match: {listener: broker-1}\n  deny_apis: [Metadata]\n",
    "none": "- name: everyone\n  min_api_version: {Fetch: 4}\n  mode: observe\n",
    "prefix": "- name: tenant\n  topic_prefix: t.\n",
    "principal": "- name: by-user\n  match: {principal: '^alice$'}\n  deny_apis: [Fetch]\n",
}
FACT_VALUES = {
    "client_id": [None, "legacy-1", "app"],
    "software_name": [None, "kafka-python", "confluent-kafka-python", "apache-kafka-java"],
    "software_version": [None, "1.4.7", "2.6.0-rdkafka-2.6.0", "1.9.2-rdkafka-1.9.2"],
    "address": [None, "10.1.2.3:5000", "10.1.2.3:6000", "192.168.0.1:5000", "[::1]:9"],
    "listener": [None, "bootstrap", "broker-1"],
    "principal": [None, "alice", "bob"],
}


@settings(max_examples=examples(300), deadline=None)
@given(st.sets(st.sampled_from(sorted(FACT_RULES)), min_size=1),
       st.fixed_dictionaries({k: st.sampled_from(v) for k, v in FACT_VALUES.items()}),
       st.fixed_dictionaries({k: st.sampled_from(v) for k, v in FACT_VALUES.items()}),
       st.sampled_from([(0, 3), (0, 9), (1, 4), (1, 12), (3, 1), (3, 12), (18, 3)]))
def test_facts_read_names_every_fact_a_decision_depends_on(
        chosen: set[str], one: dict[str, Any], other: dict[str, Any],
        api: tuple[int, int]) -> None:
    """The report decides once per distinct combination of ``facts_read()``: two clients
    that agree on those fields must get the same evaluation, whatever else differs."""
    ruleset = rules("".join(FACT_RULES[name] for name in sorted(chosen)))
    read = ruleset.facts_read()
    # The other client takes the first client's values for every field the rules read.
    other = {k: one[k] if k in read else v for k, v in other.items()}
    request = req(*api)
    assert (ruleset.evaluate(ClientFacts(**one), request)
            == ruleset.evaluate(ClientFacts(**other), request))


def test_facts_read_of_version_rules_is_empty() -> None:
    assert rules("- name: v\n  min_api_version: {Produce: 9}\n").facts_read() == frozenset()
    assert rules(FACT_RULES["software"] + FACT_RULES["address"]).facts_read() == {
        "software_name", "software_version", "address"}


def test_topic_ids_need_no_mapping_so_nothing_is_decoded_in_their_versions() -> None:
    """Produce v13 and Fetch v13+ name topics by id: under a tenant prefix their requests
    go up undecoded, Fetch answers are not asked for (so they stream), and a Produce v13
    answer is decoded only when it holds error text, whose broker names are mapped."""
    import uuid

    from gatehouse.proxy.hooks import Forward, Pending

    policy = RulesPolicy(rules('- name: tenant\n  topic_prefix: {broker: "t-"}\n'))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    topic_id = uuid.uuid4()
    fetch = req(1, 17, max_wait_ms=1, min_bytes=1, max_bytes=1, topics=[
        {"topic_id": topic_id, "partitions": [{"partition": 0, "fetch_offset": 0}]}])
    decision = policy.on_request(conn, fetch)
    assert isinstance(decision, Forward) and decision.request is fetch
    assert not fetch.body_decoded and not decision.wants_response
    named = req(1, 12, max_wait_ms=1, min_bytes=1, max_bytes=1, topics=[
        {"topic": "orders", "partitions": [{"partition": 0, "fetch_offset": 0}]}])
    decision = policy.on_request(conn, named)
    assert isinstance(decision, Forward) and decision.wants_response
    assert decision.request.body.topics[0].topic == "t-orders"

    produce = req(0, 13, acks=-1, timeout_ms=1000, topic_data=[
        {"topic_id": topic_id, "partition_data": [{"index": 0, "records": None}]}])
    decision = policy.on_request(conn, produce)
    assert isinstance(decision, Forward) and decision.request is produce
    assert not produce.body_decoded and decision.wants_response  # error text may come

    def answer(error_message: str | None) -> codecs.Response:
        partition = {"index": 0, "error_code": 3 if error_message else 0, "base_offset": 0,
                     "error_message": error_message}
        body = {"responses": [{"topic_id": topic_id, "partition_responses": [partition]}]}
        frame = bytes(codecs.response_from_dict(
            {"header": {"correlation_id": 1}, "body": body}, api_key=0, api_version=13
        ).encode())
        return codecs.decode_response(memoryview(frame), 0, 13)

    def pending() -> Pending:
        return Pending(1, 0, 13, 0.0, wants_response=True, context=decision.context,
                       policy=policy)

    quiet = answer(None)
    assert policy.on_response(conn, pending(), quiet) is quiet
    assert not quiet.body_decoded
    loud = answer("This server does not host t-orders-0")
    mapped = policy.on_response(conn, pending(), loud)
    message = mapped.body.responses[0].partition_responses[0].error_message
    assert message == "This server does not host orders-0"


def test_a_produce_v13_answer_has_no_names_to_change_in_its_bytes_unless_it_has_text() -> None:
    def frame(error_message: str | None) -> bytes:
        partition = {"index": 0, "error_code": 3 if error_message else 0, "base_offset": 0,
                     "error_message": error_message}
        body = {"responses": [{"topic_id": "00000000-0000-0000-0000-0000000000aa",
                               "partition_responses": [partition]}]}
        return bytes(codecs.response_from_dict({"header": {"correlation_id": 1}, "body": body},
                                               api_key=0, api_version=13).encode())

    quiet = frame(None)
    assert produce.rename_response_topics(quiet, 13, lambda name: "t-" + name) is quiet
    assert produce.rename_response_topics(frame("not t-orders-0"), 13, lambda n: n) is None


PRODUCE_NAMED_VERSIONS = [v for k, v in ALL_VERSIONS if k == 0 and 3 <= v <= 12]


@pytest.mark.parametrize("version", PRODUCE_NAMED_VERSIONS)
@pytest.mark.parametrize("hide_others", [False, True])
def test_produce_names_changed_in_the_bytes_as_the_decoder_would(version: int,
                                                                 hide_others: bool) -> None:
    """Produce requests and answers are renamed in their bytes (records copied, not
    decoded): the same messages as the full decode-rewrite-encode, whatever the body."""
    api = codecs.api(0)
    mapping = Prefix("tenant.", hide_others=hide_others)

    @few_examples(25)
    @given(request=message_body(api.request, version),
           answer=message_body(api.response, version))
    def check(request: Any, answer: Any) -> None:
        wire = bytes(codecs.Request.build(0, version, 1, "c", request).encode())
        fast = map_request(codecs.decode_request(wire), mapping, {}, RewriteStats())
        slow = map_request(codecs.Request.build(0, version, 1, "c", request), mapping, {},
                           RewriteStats())
        assert bytes(fast.encode()) == bytes(slow.encode())
        broker_side = map_response(codecs.Response.build(0, version, 1, answer),
                                   _ToBroker(mapping), {}, RewriteStats())
        frame = bytes(broker_side.encode())
        fast_answer = map_response(codecs.decode_response(frame, 0, version), mapping, {},
                                   RewriteStats())
        slow_answer = map_response(broker_side, mapping, {}, RewriteStats())
        assert bytes(fast_answer.encode()) == bytes(slow_answer.encode())

    check()


def test_produce_renamed_in_the_bytes_keeps_the_records_and_skips_the_decoder() -> None:
    records = b"\x00" * 8 + struct.pack(">i", 49) + b"\x00\x02" + b"\x07" * 47
    wire = bytes(req(0, 9, acks=-1, timeout_ms=1000, topic_data=[
        {"name": "orders", "partition_data": [{"index": 0, "records": records}]},
        {"name": "audit", "partition_data": [{"index": 1, "records": None}]}]).encode())
    request = codecs.decode_request(wire)
    mapped = map_request(request, Rename({"orders": "prod.orders"}), {}, RewriteStats())
    assert not request.body_decoded  # renamed in the bytes
    assert [t.name for t in mapped.body.topic_data] == ["prod.orders", "audit"]
    assert mapped.body.topic_data[0].partition_data[0].records == records
    same = map_request(codecs.decode_request(wire), Rename({"x": "y"}), {}, RewriteStats())
    assert bytes(same.encode()) == wire[4:] or bytes(same.encode()) == wire


def test_a_produce_request_that_has_begun_to_arrive_is_forwarded_renamed_or_left_whole(
) -> None:
    """``forwards_unread`` decides from a request's first bytes: untouched with no rule
    on its topics; with its one topic renamed (and its answer to be named back) under a rename;
    left for ``on_request`` when its name has not all come, it names two topics, or a
    rule refuses or only observes.  A decision made early counts once, when the proxy
    reports it (after the observers), as on_request's."""
    from gatehouse.proxy.hooks import Forward

    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")
    records = b"\x07" * 200
    one = bytes(req(0, 9, acks=-1, timeout_ms=1000, topic_data=[
        {"name": "orders", "partition_data": [{"index": 0, "records": records}]}]).encode())
    two = bytes(req(0, 9, acks=-1, timeout_ms=1000, topic_data=[
        {"name": "orders", "partition_data": [{"index": 0, "records": records}]},
        {"name": "audit", "partition_data": [{"index": 0, "records": None}]}]).encode())

    def head(wire: bytes, n: int) -> codecs.Request:
        return codecs.decode_request(memoryview(wire)[:n])  # as far as it has arrived

    plain = RulesPolicy(rules("- name: r\n  min_api_version: {Fetch: 6}\n"))
    decision = plain.forwards_unread(conn, head(one, 60))
    assert isinstance(decision, Forward) and decision.new_head is None
    assert not decision.wants_response

    policy = RulesPolicy(rules("- name: alias\n  rename_topics: {orders: prod.orders}\n"))
    counted: list[Any] = []
    policy.outcome_listeners.append(counted.append)
    decision = policy.forwards_unread(conn, head(one, 60))
    assert decision is not None and decision.new_head is not None
    assert decision.wants_response and decision.context is not None
    new, end = decision.new_head
    renamed = codecs.decode_request(new + one[end:])
    assert [t.name for t in renamed.body.topic_data] == ["prod.orders"]
    assert renamed.body.topic_data[0].partition_data[0].records == records
    assert counted == []  # reported once the observers have seen the request
    assert decision.report is not None
    decision.report()
    assert [o.rule for o in counted] == ["alias"]
    name_at = one.index(b"orders")
    assert policy.forwards_unread(conn, head(one, name_at + 3)) is None  # half a name
    assert policy.forwards_unread(conn, head(two, 300)) is None
    assert [o.rule for o in counted] == ["alias"]  # no decision, nothing to count

    refusing = RulesPolicy(rules("- name: old\n  min_api_version: {Produce: 10}\n"))
    assert refusing.forwards_unread(conn, head(one, 60)) is None
    watching = RulesPolicy(rules("- name: alias\n  mode: observe\n"
                                 "  rename_topics: {orders: prod.orders}\n"))
    assert watching.forwards_unread(conn, head(one, 60)) is None


def test_remembered_evaluations_follow_reloads_and_the_client_id() -> None:
    """The policy remembers a connection's evaluations per API version: a reload or a
    new client id on the connection is evaluated afresh."""
    from gatehouse.proxy.hooks import Forward

    policy = RulesPolicy(rules('- name: r\n  match: {client_id: "^legacy"}\n'
                               '  min_api_version: {Fetch: 6}\n'))
    conn = ConnectionInfo(id=1, client="127.0.0.1:1", listener="bootstrap")

    def fetch(client_id: str) -> codecs.Request:
        return req(1, 5, client_id=client_id, max_wait_ms=1, min_bytes=1, max_bytes=1,
                   topics=[])

    assert isinstance(policy.on_request(conn, fetch("legacy-1")), Respond)
    assert isinstance(policy.on_request(conn, fetch("legacy-1")), Respond)
    assert isinstance(policy.on_request(conn, fetch("modern-1")), Forward)
    assert isinstance(policy.on_request(conn, fetch("legacy-1")), Respond)
    policy.ruleset = rules('- name: r\n  match: {client_id: "^legacy"}\n'
                           '  min_api_version: {Fetch: 4}\n')
    assert isinstance(policy.on_request(conn, fetch("legacy-1")), Forward)


def test_a_request_newer_than_the_tables_goes_on_unread_only_where_no_rule_must_read_it(
        ) -> None:
    """``RulesPolicy.refuses_unread``: what the connection asks before it forwards a
    request the codec cannot read (the ApiVersions answer never offered its version)."""
    from gatehouse.proxy.policy import RulesPolicy
    from tests.test_rules_topic_filter import conn

    def future(api_key: int, **fields: Any) -> codecs.Request:
        newest = max(codecs.api(api_key).request.valid)
        frame = bytearray(req(api_key, newest, **fields).encode())
        frame[2:4] = (newest + 1).to_bytes(2, "big")  # the same bytes, a newer version
        unread = codecs.decode_request(bytes(frame))
        assert not unread.known
        return unread

    metadata = future(3, topics=None, allow_auto_topic_creation=False,
                      include_topic_authorized_operations=False)
    versions = future(18, client_software_name="x", client_software_version="1")
    creates = future(19, topics=[], timeout_ms=1, validate_only=False)
    produces = future(0, transactional_id=None, acks=-1, timeout_ms=1, topic_data=[])
    unknown_key = codecs.decode_request(struct.pack(">hhih", 999, 0, 5, 1) + b"x" + bytes(40))
    cases = [
        ("- name: t\n  topic_prefix: tenant-a.\n", metadata,
         "the rules map or filter the names in it"),
        ("- name: t\n  topic_prefix: tenant-a.\n", versions, None),  # ApiVersions: KIP-511
        ("- name: t\n  deny_topics: [secret]\n", metadata, "the rules map or filter"),
        ("- name: t\n  max_api_version: {Metadata: 12}\n", metadata, "the rules refuse it"),
        ("- name: t\n  min_api_version: {Fetch: 4}\n", metadata, None),
        ("- name: t\n  produce_policy: {acks: all}\n", produces, "the rules read its records"),
        ("- name: t\n  produce_policy: {acks: all}\n", metadata, None),
        ("- name: t\n  topic_policy: {partitions: {max: 3}}\n", creates,
         "the rules hold its topics to a topic_policy"),
        ("- name: t\n  topic_policy: {partitions: {max: 3}}\n", metadata, None),
        ("- name: t\n  topic_policy: {names: ['[a-z.]+']}\n", metadata,
         "the rules hold its topics to a topic_policy"),  # it may create topics
        ("- name: t\n  mode: observe\n  topic_prefix: tenant-a.\n", metadata, None),
        ("- name: t\n  topic_prefix: tenant-a.\n", unknown_key,
         "API key 999 is not in the proxy's tables"),
        ("- name: t\n  match: {client_id: '^other$'}\n  topic_prefix: tenant-a.\n", metadata,
         None),
    ]
    for text, request, why in cases:
        refusal = RulesPolicy(rules(text)).refuses_unread(conn(), request)
        if why is None:
            assert refusal is None, (text, refusal)
        else:
            assert refusal is not None and why in refusal, (text, refusal)
            assert request is unknown_key or refusal.startswith(
                f"{codecs.api_name(request.api_key)} v{request.api_version} is newer than "
                "the proxy's tables"), refusal
    # Kafka 3.9's preview of share groups (ShareFetch v0): below the tables.
    preview = codecs.decode_request(struct.pack(">hhih", 78, 0, 5, 1) + b"x\0" + bytes(40))
    assert not preview.known
    refusal = RulesPolicy(rules("- name: t\n  topic_prefix: tenant-a.\n")).refuses_unread(
        conn(), preview)
    assert refusal is not None and refusal.startswith(
        "ShareFetch v0 is older than the proxy's tables"), refusal


def test_every_entry_a_map_may_hide_is_dropped_by_its_holder() -> None:
    """A name that hides its entry (another tenant's topic, group, transaction) makes
    the entry a hole its array must drop: so the struct holding that array is visited
    too, in every response of every version the tables know (ListConfigResources' and
    DescribeTopicPartitions' were not: their answers could not be written)."""
    from gatehouse.codecs.walk import _plan

    holes = []
    for api in codecs.APIS.values():
        for kinds in (frozenset(), frozenset({"group", "transactional_id"})):
            predicate = topic_maps._predicates(kinds)[1]
            for version in api.response.valid:
                plan = _plan(api.response.root, predicate, version)
                todo = [api.response.root]
                while todo:
                    holder = todo.pop()
                    for f in holder.fields:
                        if f.struct is None or version not in f.versions:
                            continue
                        todo.append(f.struct)
                        hides = id(f.struct) in plan and any(
                            hide for _, _, hide, _ in
                            topic_maps._visit_plan(f.struct, True, kinds))
                        # (a lone struct too: DescribeTopicPartitions' cursor, nulled)
                        if hides and not (id(holder) in plan and plan[id(holder)][1]):
                            holes.append((api.name, version, holder.name, f.attr))
    assert not holes, holes[:10]


def test_describe_topic_partitions_of_every_topic_pages_through_the_prefix_only() -> None:
    """Under a prefix that hides the others: the listing starts at the prefix (its
    topics are together in name order), and a cursor at another tenant's topic (after
    them) ends it instead of naming it; a tenant's own cursor and named topics are
    mapped as any name."""
    from gatehouse.proxy.hooks import Forward, Pending
    from gatehouse.proxy.policy import RulesPolicy
    from tests.test_rules_topic_filter import conn

    policy = RulesPolicy(rules("- name: t\n  topic_prefix: {broker: 'a.', hide_others: true}\n"))
    every = policy.on_request(conn(), req(75, 0, topics=[], response_partition_limit=10,
                                          cursor=None))
    assert isinstance(every, Forward)
    cursor = every.request.body.cursor
    assert (cursor.topic_name, cursor.partition_index) == ("a.", 0)
    later = policy.on_request(conn(), req(75, 0, topics=[], response_partition_limit=10,
                                          cursor={"topic_name": "x", "partition_index": 3}))
    assert isinstance(later, Forward)
    assert later.request.body.cursor.topic_name == "a.x"
    named = policy.on_request(conn(), req(75, 0, topics=[{"name": "x"}],
                                          response_partition_limit=10, cursor=None))
    assert isinstance(named, Forward) and named.request.body.cursor is None

    def answer(next_topic: str) -> codecs.Response:
        topic = {"error_code": 0, "name": "a.x", "topic_id": "00000000-0000-0000-0000-000000000001",
                 "is_internal": False, "partitions": [], "topic_authorized_operations": 0}
        built = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
            "throttle_time_ms": 0, "topics": [topic, {**topic, "name": "b.y"}],
            "next_cursor": {"topic_name": next_topic, "partition_index": 2}}},
            api_key=75, api_version=0)
        resp = codecs.decode_response(memoryview(bytes(built.encode())), 75, 0)
        mapped = policy.on_response(conn(), Pending(1, 75, 0, 0.0, context=every.context),
                                    resp)
        return codecs.decode_response(memoryview(bytes(mapped.encode())), 75, 0)

    own = answer("a.z")
    assert [t.name for t in own.body.topics] == ["x"]
    assert (own.body.next_cursor.topic_name, own.body.next_cursor.partition_index) == ("z", 2)
    assert answer("b.z").body.next_cursor is None


def test_the_quorum_is_described_to_a_tenant_as_it_is() -> None:
    """DescribeQuorum names KRaft's metadata log (``__cluster_metadata``), which is no
    tenant's topic: under a prefix that hides the others and under a topic filter the
    request goes up as the client sent it and the answer comes back whole (mapped, the
    broker was asked about a topic there is not, and the answer hid the quorum:
    kafka-metadata-quorum timed out)."""
    from tests.test_rules_topic_filter import conn

    policy = RulesPolicy(rules(
        "- name: tenant\n  topic_prefix: {broker: 't.', hide_others: true, groups: true,"
        " transactional_ids: true}\n- name: mine\n  allow_topics: ['orders']\n"))
    for version in codecs.api(55).versions:
        request = req(55, version, topics=[{"topic_name": "__cluster_metadata",
                                            "partitions": [{"partition_index": 0}]}])
        decision = policy.on_request(conn(), request)
        assert isinstance(decision, Forward) and decision.request is request
        answer = error_response(request, 0)
        pending = Pending(1, 55, version, 0.0, wants_response=decision.wants_response,
                          context=decision.context)
        shown = policy.on_response(conn(), pending, codecs.decode_response(
            memoryview(bytes(answer.encode())), 55, version))
        assert [t.topic_name for t in shown.body.topics] == ["__cluster_metadata"]
        assert [p.partition_index for p in shown.body.topics[0].partitions] == [0]
