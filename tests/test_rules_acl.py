"""ACLs in rules (``acls``): operations on topics, groups and transactional ids, as
Kafka's ACLs say them, compiled per API into the names filters; refusals with Kafka's
authorization errors, answers without what the client may not describe."""

from __future__ import annotations

import uuid

import pytest

from gatehouse import codecs
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules.acl import API_OPERATIONS, operation
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import conn, listening, metadata_answer, produce

TOPIC_AUTHORIZATION_FAILED, GROUP_AUTHORIZATION_FAILED = 29, 30
BILLING, TEAM, OTHER = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
ACLS = ('- name: team-b\n  match: {client_id: "^app"}\n  acls:\n'
        '    - {allow: [read], topics: ["billing\\\\..*"], groups: ["team-b-.*"]}\n'
        '    - {allow: write, topics: ["team-b\\\\..*"]}\n'
        '    - {deny: [all], topics: ["billing\\\\.secret"]}\n')
API = codecs.API_KEYS_BY_NAME


def test_each_api_needs_its_operation() -> None:
    assert operation(API["Produce"], "topic") == "write"
    assert operation(API["Fetch"], "topic") == "read"
    assert operation(API["Metadata"], "topic") == "describe"
    assert operation(API["JoinGroup"], "group") == "read"
    assert operation(API["JoinGroup"], "topic") is None
    assert operation(API["DeleteTopics"], "topic") == "delete"
    assert operation(API["IncrementalAlterConfigs"], "topic") == "alter_configs"
    assert operation(API["TxnOffsetCommit"], "transactional_id") == "write"
    assert operation(API["ApiVersions"], "topic") is None
    # Every API name in the table is one the codec knows (no misspelt key opens a hole).
    assert set(API_OPERATIONS) <= set(API)
    # An API the table leaves out that holds topics needs the strictest operation.
    assert operation(API["WriteTxnMarkers"], "topic") == "alter"


def test_the_acls_say_which_operation_on_which_name() -> None:
    [rule] = rules(ACLS).rules
    produce_map, fetch_map = rule.map_for(API["Produce"]), rule.map_for(API["Fetch"])
    metadata_map = rule.map_for(API["Metadata"])
    delete_map = rule.map_for(API["DeleteTopics"])
    assert produce_map is not None and fetch_map is not None
    assert metadata_map is not None and delete_map is not None
    assert not produce_map.denies("team-b.orders") and produce_map.denies("billing.eu")
    assert not fetch_map.denies("billing.eu") and fetch_map.denies("team-b.orders")
    # read and write both imply describe: Metadata shows both; others are hidden.
    assert metadata_map.to_client("billing.eu") == "billing.eu"
    assert metadata_map.to_client("team-b.orders") == "team-b.orders"
    assert metadata_map.to_client("other") is None
    assert metadata_map.to_client("billing.secret") is None  # deny all wins
    assert fetch_map.denies("billing.secret")
    assert delete_map.denies("team-b.orders")  # nothing grants delete
    join = rule.map_for(API["JoinGroup"])
    assert join is not None and join.denies_id("group", "other-g")
    assert not join.denies_id("group", "team-b-g")
    assert rule.map_for(API["Heartbeat"]) is not None  # groups restricted there too
    assert rule.map_for(API["ApiVersions"]) is None


def test_a_produce_to_a_topic_it_may_only_read_is_refused() -> None:
    policy = RulesPolicy(rules(ACLS))
    counted, refused = listening(policy)
    decision = policy.on_request(conn(), produce("billing.eu"))
    assert isinstance(decision, Respond)
    answer = codecs.decode_response(memoryview(bytes(decision.response.encode())), 0, 9)
    assert {p.error_code for t in answer.body.responses
            for p in t.partition_responses} == {TOPIC_AUTHORIZATION_FAILED}
    assert refused == [("team-b", "refuse")]
    assert [(o.rule, o.action, o.effect) for o in counted] == [("team-b", "acls", "refuse")]
    assert isinstance(policy.on_request(conn(), produce("team-b.orders")), Forward)


def test_a_group_it_may_not_read_is_refused_and_metadata_shows_what_it_may_describe() -> None:
    policy = RulesPolicy(rules(ACLS))
    join = req(11, 9, "app-1", group_id="other-g", session_timeout_ms=10000,
               rebalance_timeout_ms=10000, member_id="", protocol_type="consumer",
               protocols=[])
    decision = policy.on_request(conn(), join)
    assert isinstance(decision, Respond)
    answer = codecs.decode_response(memoryview(bytes(decision.response.encode())), 11, 9)
    assert answer.body.error_code == GROUP_AUTHORIZATION_FAILED
    ok = req(11, 9, "app-1", group_id="team-b-g", session_timeout_ms=10000,
             rebalance_timeout_ms=10000, member_id="", protocol_type="consumer", protocols=[])
    assert isinstance(policy.on_request(conn(), ok), Forward)

    decision = policy.on_request(conn(), req(3, 12, "app-1", topics=None))
    assert isinstance(decision, Forward) and decision.wants_response
    shown = policy.on_response(conn(), Pending(1, 3, 12, 0.0, wants_response=True,
                                               context=decision.context),
                               metadata_answer(("billing.eu", BILLING), ("team-b.x", TEAM),
                                               ("other", OTHER)))
    assert [t.name for t in shown.body.topics] == ["billing.eu", "team-b.x"]
    # Fetching by id: a topic it may describe but not read is refused.
    fetch = req(1, 17, "app-1", max_wait_ms=1, min_bytes=1, max_bytes=1, session_id=0,
                session_epoch=-1, topics=[{"topic_id": TEAM, "partitions": [
                    {"partition": 0, "fetch_offset": 0}]}])
    assert isinstance(policy.on_request(conn(), fetch), Respond)
    fetch_billing = req(1, 17, "app-1", max_wait_ms=1, min_bytes=1, max_bytes=1,
                        session_id=0, session_epoch=-1, topics=[{"topic_id": BILLING,
                                                                 "partitions": [
                                                                     {"partition": 0,
                                                                      "fetch_offset": 0}]}])
    assert isinstance(policy.on_request(conn(), fetch_billing), Forward)


def test_in_observe_mode_the_acls_only_count() -> None:
    policy = RulesPolicy(rules(ACLS.replace("match:", "mode: observe\n  match:")))
    counted, refused = listening(policy)
    request = produce("billing.eu")
    decision = policy.on_request(conn(), request)
    assert isinstance(decision, Forward) and decision.request is request
    assert refused == [("team-b", "would_refuse")]
    assert ("team-b", "acls", "refuse", "observe") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]


@pytest.mark.parametrize(("acls", "line", "error"), [
    ("  acls: []\n", 2, "at least one entry"),
    ("  acls:\n    - {allow: [read]}\n", 3, "needs topics, groups or transactional_ids"),
    ("  acls:\n    - {allow: [read], deny: [write], topics: [x]}\n", 3, "exactly one of"),
    ("  acls:\n    - {topics: [x]}\n", 3, "exactly one of allow or deny"),
    ("  acls:\n    - {allow: [reed], topics: [x]}\n", 3, "'reed' is not an operation"),
    ("  acls:\n    - {allow: [], topics: [x]}\n", 3, "at least one operation"),
    ("  acls:\n    - {allow: [read], topics: ['(']}\n", 3, "not a regular expression"),
    ("  acls:\n    - {allow: [read], clusters: [x], topics: [x]}\n", 3, "unknown key"),
    ("  allow_topics: [x]\n  acls:\n    - {allow: [read], topics: [x]}\n", 3,
     "both acls and allow_"),
])
def test_bad_acls_are_refused_with_their_line(acls: str, line: int, error: str) -> None:
    with pytest.raises(ConfigError, match=error) as caught:
        rules("- name: r\n" + acls)
    assert caught.value.line == line, caught.value


def test_acls_and_a_prefix_compose_in_one_rule() -> None:
    """The ACLs speak of the client's names; the prefix maps them after."""
    [rule] = rules('- name: t\n  topic_prefix: {broker: "a."}\n  acls:\n'
                   '    - {allow: [write], topics: [orders]}\n').rules
    produce_map = rule.map_for(API["Produce"])
    assert produce_map is not None
    assert produce_map.to_broker("orders") == "a.orders" and not produce_map.denies("orders")
    assert produce_map.denies("payroll")
    assert rule.map_for(API["JoinGroup"]) is rule.topic_map  # no group ACLs: the prefix


def test_the_impact_report_counts_what_the_acls_would_refuse() -> None:
    """The pipeline's "what would this rule block": the same per-API decision over the
    observation log's rows."""
    from gatehouse.pipeline.impact import decide

    ruleset = rules(ACLS)

    def row(api_key: int, *topics: str) -> dict[str, object]:
        return {"client_id": "app-1", "api_key": api_key, "api_version": 9,
                "topic_names": list(topics)}

    refused = decide(ruleset, row(API["Produce"], "team-b.orders", "billing.eu"))
    assert [(d[0], d[2], d[3], d[6]) for d in refused] == [
        ("team-b", "acls", "refuse", ["billing.eu"])]
    assert decide(ruleset, row(API["Produce"], "team-b.orders")) == []
    assert decide(ruleset, row(API["Fetch"], "billing.eu")) == []
    assert [d[6] for d in decide(ruleset, row(API["Fetch"], "team-b.orders"))] == [
        ["team-b.orders"]]
