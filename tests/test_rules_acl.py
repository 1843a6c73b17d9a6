"""ACLs in rules (``acls``): operations on topics, groups and transactional ids, as
Kafka's ACLs say them, compiled per API into the names filters; refusals with Kafka's
authorization errors, answers without what the client may not describe."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.configfile import ConfigError
from gatehouse.proxy.hooks import Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import ClientFacts
from gatehouse.rules.acl import (
    API_OPERATIONS,
    CLUSTER_OPERATIONS,
    NO_CLUSTER_CHECK,
    cluster_operation,
    operation,
)
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import answered, conn, listening, metadata_answer, produce

TOPIC_AUTHORIZATION_FAILED, GROUP_AUTHORIZATION_FAILED, UNKNOWN_TOPIC_ID = 29, 30, 100
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


@pytest.mark.parametrize(("extra", "asked", "creates"), [
    ("", ["team-b.new"], False),  # write implies describe, not create
    ('    - {allow: create, topics: ["team-b\\\\..*"]}\n', ["team-b.new"], True),
    ('    - {allow: create, topics: ["team-b\\\\..*"]}\n', ["team-b.new", "billing.eu"],
     False),  # one it may not create: none is created (the flag is the request's)
    ("    - {allow: create, cluster: true}\n", ["team-b.new", "billing.eu"], True),
])
def test_metadata_creates_topics_only_with_create(extra: str, asked: list[str],
                                                  creates: bool) -> None:
    """As Kafka's authorizer: a Metadata request has the broker create a missing topic
    (allow_auto_topic_creation) only where the client may create it."""
    policy = RulesPolicy(rules(ACLS + extra))
    decision = policy.on_request(conn(), req(3, 12, "app-1", topics=[
        {"name": n, "topic_id": uuid.UUID(int=0)} for n in asked],
        allow_auto_topic_creation=True))
    assert isinstance(decision, Forward)
    assert [t.name for t in decision.request.body.topics] == asked
    assert decision.request.body.allow_auto_topic_creation is creates


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
    # Fetching by id: a topic it may describe but not read is refused as Kafka's ACLs
    # refuse it (it sees the topic); one it may not see is no topic to it.
    def fetch(*ids: uuid.UUID) -> codecs.Request:
        return req(1, 17, "app-1", max_wait_ms=1, min_bytes=1, max_bytes=1, session_id=0,
                   session_epoch=-1, topics=[{"topic_id": i, "partitions": [
                       {"partition": 0, "fetch_offset": 0}]} for i in ids])

    def errors(body: Any) -> list[tuple[uuid.UUID, int]]:
        assert body.error_code == 0
        return [(t.topic_id, p.error_code) for t in body.responses for p in t.partitions]

    for topic_id, code in ((TEAM, TOPIC_AUTHORIZATION_FAILED), (OTHER, UNKNOWN_TOPIC_ID)):
        decision = policy.on_request(conn(), fetch(topic_id))
        assert isinstance(decision, Respond)
        assert errors(decision.response.body) == [(topic_id, code)]
    assert isinstance(policy.on_request(conn(), fetch(BILLING)), Forward)
    # All three in one Fetch: billing's goes up, each of the others gets its error.
    decision = policy.on_request(conn(), fetch(OTHER, BILLING, TEAM))
    assert isinstance(decision, Forward)
    assert [t.topic_id for t in decision.request.body.topics] == [BILLING]
    answer = answered(policy, decision, {"responses": [
        {"topic_id": BILLING, "partitions": [{"partition_index": 0}]}]})
    assert sorted(errors(answer), key=repr) == sorted(
        [(BILLING, 0), (TEAM, TOPIC_AUTHORIZATION_FAILED), (OTHER, UNKNOWN_TOPIC_ID)], key=repr)


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
    ("  acls:\n    - {allow: [read], cluster: true}\n", 3,
     "'read' is not an operation on the cluster"),
    ("  acls:\n    - {allow: [cluster_action], topics: [x]}\n", 3,
     "'cluster_action' is not an operation on names"),
    ("  acls:\n    - {allow: [describe], cluster: false}\n", 3, "or cluster: true"),
    ("  acls:\n    - {allow: [describe], cluster: yes-please}\n", 3, "cluster"),
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


CLUSTER_ACLS = ('- name: ops\n  match: {client_id: "^ops"}\n  acls:\n'
                '    - {allow: [describe], cluster: true}\n'
                '    - {allow: [alter_configs], cluster: true}\n'
                '    - {allow: [write], topics: ["ops\\\\..*"]}\n')
CLUSTER_AUTHORIZATION_FAILED = 31


def test_the_clusters_apis_need_their_operation_on_it() -> None:
    assert cluster_operation(API["DescribeAcls"], 3) == "describe"
    assert cluster_operation(API["CreateAcls"], 3) == "alter"
    assert cluster_operation(API["DescribeClientQuotas"], 1) == "describe_configs"
    assert cluster_operation(API["AlterClientQuotas"], 1) == "alter_configs"
    assert cluster_operation(API["DescribeLogDirs"], 4) == "describe"
    assert cluster_operation(API["WriteTxnMarkers"], 1) == "cluster_action"
    # A client's AddPartitionsToTxn (v3 and below) needs nothing on the cluster; the
    # brokers' own (v4+) need cluster_action.
    assert cluster_operation(API["AddPartitionsToTxn"], 3) is None
    assert cluster_operation(API["AddPartitionsToTxn"], 4) == "cluster_action"
    for name in ("Produce", "Fetch", "Metadata", "DescribeCluster", "ApiVersions",
                 "CreateTopics", "InitProducerId", "JoinGroup"):
        assert cluster_operation(API[name], 0) is None, name
    # An API no table names that holds no names (a newer one) needs alter there.
    assert cluster_operation(API["UnregisterController"], 0) == "alter"
    # Every name in the tables is one the codec knows (no misspelt key opens a hole).
    assert set(CLUSTER_OPERATIONS) <= set(API)
    assert set(NO_CLUSTER_CHECK) <= set(API)


def test_the_cluster_acls_refuse_what_no_entry_allows_on_it() -> None:
    ruleset = rules(CLUSTER_ACLS)
    facts = ClientFacts(client_id="ops-1")

    def refusal(api: str, version: int, client: str = "ops-1") -> tuple[str, int, str] | None:
        found = ruleset.evaluate(ClientFacts(client_id=client),
                                 req(API[api], version, client)).refusal
        return None if found is None else (found.action, found.code, found.message)

    assert refusal("DescribeAcls", 3) is None  # describe: allowed
    assert refusal("DescribeUserScramCredentials", 0) is None
    assert refusal("AlterClientQuotas", 1) is None  # alter_configs: allowed
    assert refusal("DescribeClientQuotas", 1) is None  # implied by alter_configs
    assert refusal("CreateAcls", 3) == (
        "acls", CLUSTER_AUTHORIZATION_FAILED, "CreateAcls needs alter on the cluster (rule ops)")
    assert refusal("AlterUserScramCredentials", 0) is not None
    assert refusal("ElectLeaders", 2) is not None
    assert refusal("WriteTxnMarkers", 1) is not None
    assert refusal("DescribeCluster", 1) is None and refusal("ApiVersions", 3) is None
    assert refusal("CreateAcls", 3, client="app") is None  # not this rule's client
    assert ruleset.evaluate(facts, req(API["AddPartitionsToTxn"], 3, "ops-1")).refusal is None
    # A rule whose entries never name the cluster leaves its APIs to the brokers.
    [plain] = rules(ACLS).rules
    assert not plain.cluster_refused


@pytest.mark.parametrize(("entries", "allowed", "refused"), [
    ("    - {allow: [all], cluster: true}\n", ["CreateAcls", "DescribeLogDirs"], []),
    ("    - {allow: [all], cluster: true}\n    - {deny: [alter], cluster: true}\n",
     ["DescribeAcls", "DescribeClientQuotas"], ["CreateAcls", "AlterPartitionReassignments"]),
    ("    - {allow: [alter], cluster: true}\n", ["CreateAcls", "DescribeAcls"],
     ["DescribeClientQuotas", "WriteTxnMarkers"]),
    ("    - {allow: [all], cluster: true}\n    - {deny: [all], cluster: true}\n",
     [], ["DescribeAcls", "UpdateFeatures"]),
])
def test_the_clusters_operations_imply_as_kafkas_do(entries: str, allowed: list[str],
                                                     refused: list[str]) -> None:
    ruleset = rules("- name: r\n  acls:\n" + entries)
    for api in allowed + refused:
        version = codecs.APIS[API[api]].versions.lo
        found = ruleset.evaluate(ClientFacts(), req(API[api], version)).refusal
        assert (found is not None) == (api in refused), api


def test_create_on_the_cluster_creates_any_topic() -> None:
    """Kafka's rule: the cluster's create is enough, whatever the topic's ACLs say."""
    topics_only = '    - {allow: [create], topics: ["ops\\\\..*"]}\n'
    [narrow] = rules("- name: r\n  acls:\n" + topics_only).rules
    creates = narrow.map_for(API["CreateTopics"])
    assert creates is not None and creates.denies("billing") and not creates.denies("ops.x")
    [wide] = rules("- name: r\n  acls:\n" + topics_only
                   + "    - {allow: [create, describe], cluster: true}\n").rules
    creates = wide.map_for(API["CreateTopics"])
    assert creates is None or not creates.denies("billing")
    # Other APIs keep their topic ACLs.
    produce_map = wide.map_for(API["Produce"])
    assert produce_map is not None and produce_map.denies("ops.x")


def test_a_cluster_api_refused_is_answered_with_its_own_error_response() -> None:
    policy = RulesPolicy(rules(CLUSTER_ACLS))
    counted, refused = listening(policy)
    # An ACL for a group (the rule's entries say nothing of groups: only the cluster).
    create = req(API["CreateAcls"], 3, "ops-1", creations=[{
        "resource_type": 3, "resource_name": "ops-g", "resource_pattern_type": 3,
        "principal": "User:app", "host": "*", "operation": 3, "permission_type": 3}])
    decision = policy.on_request(conn(), create)
    assert isinstance(decision, Respond)
    answer = codecs.decode_response(memoryview(bytes(decision.response.encode())),
                                    API["CreateAcls"], 3)
    assert [r.error_code for r in answer.body.results] == [CLUSTER_AUTHORIZATION_FAILED]
    assert refused == [("ops", "refuse")]
    assert ("ops", "acls", "refuse") in [(o.rule, o.action, o.effect) for o in counted]
    describe = req(API["DescribeAcls"], 3, "ops-1", resource_type_filter=1,
                   resource_name_filter=None, pattern_type_filter=1, principal_filter=None,
                   host_filter=None, operation=1, permission_type=1)
    assert isinstance(policy.on_request(conn(), describe), Forward)
    # Observe mode: counted, forwarded.
    policy = RulesPolicy(rules(CLUSTER_ACLS.replace("match:", "mode: observe\n  match:")))
    counted, refused = listening(policy)
    assert isinstance(policy.on_request(conn(), create), Forward)
    assert refused == [("ops", "would_refuse")]


def test_the_clusters_configs_need_its_configs_operations() -> None:
    """A broker's, a broker logger's or a client-metrics subscription's configs are the
    cluster's: a request naming one is refused whole without describe_configs /
    alter_configs there; one naming only topics is the topic ACLs' to decide."""
    policy = RulesPolicy(rules(CLUSTER_ACLS))  # describe and alter_configs on the cluster
    counted, refused = listening(policy)

    def describe(*resources: tuple[int, str]) -> codecs.Request:
        return req(API["DescribeConfigs"], 4, "ops-1", include_synonyms=False,
                   include_documentation=False, resources=[
                       {"resource_type": t, "resource_name": n, "configuration_keys": None}
                       for t, n in resources])

    # alter_configs implies describe_configs: a broker's configs may be read.
    assert isinstance(policy.on_request(conn(), describe((4, "0"))), Forward)
    ruleset = rules('- name: ops\n  match: {client_id: "^ops"}\n  acls:\n'
                    '    - {allow: [describe], cluster: true}\n'
                    '    - {allow: [describe_configs], topics: ["ops\\\\..*"]}\n')
    [rule] = ruleset.rules
    policy = RulesPolicy(ruleset)
    counted, refused = listening(policy)
    for resources in ([(4, "0")], [(2, "ops.x"), (8, "1")], [(16, "subscription")]):
        decision = policy.on_request(conn(), describe(*resources))
        assert isinstance(decision, Respond), resources
        answer = codecs.decode_response(memoryview(bytes(decision.response.encode())),
                                        API["DescribeConfigs"], 4)
        assert [(r.resource_type, r.error_code) for r in answer.body.results] == [
            (t, CLUSTER_AUTHORIZATION_FAILED) for t, _ in resources]
    assert refused == [("ops", "refuse")] * 3
    assert [(o.rule, o.action, o.effect) for o in counted][-1] == ("ops", "acls", "refuse")
    assert isinstance(policy.on_request(conn(), describe((2, "ops.x"))), Forward)
    alter = req(API["IncrementalAlterConfigs"], 1, "ops-1", validate_only=False, resources=[
        {"resource_type": 4, "resource_name": "", "configs": [
            {"name": "log.cleaner.threads", "config_operation": 0, "value": "2"}]}])
    assert isinstance(policy.on_request(conn(), alter), Respond)
    assert rule.cluster_configs == {API["DescribeConfigs"]: "describe_configs",
                                    API["AlterConfigs"]: "alter_configs",
                                    API["IncrementalAlterConfigs"]: "alter_configs"}
    # Observe mode: counted and logged as it would refuse, forwarded.
    policy = RulesPolicy(rules('- name: ops\n  mode: observe\n  match: {client_id: "^ops"}\n'
                               '  acls:\n    - {allow: [describe], cluster: true}\n'))
    counted, refused = listening(policy)
    assert isinstance(policy.on_request(conn(), describe((4, "0"))), Forward)
    assert refused == [("ops", "would_refuse")]
    assert ("ops", "acls", "refuse", "observe") in [
        (o.rule, o.action, o.effect, o.mode) for o in counted]
    # Rules that never name the cluster leave its configs to the brokers.
    assert not rules(ACLS).rules[0].cluster_configs


def test_the_impact_report_counts_what_the_cluster_acls_would_refuse() -> None:
    from gatehouse.pipeline.impact import decide

    row = {"client_id": "ops-1", "api_key": API["CreateAcls"], "api_version": 3,
           "topic_names": []}
    assert [(d[0], d[2], d[3]) for d in decide(rules(CLUSTER_ACLS), row)] == [
        ("ops", "acls", "refuse")]
    assert decide(rules(CLUSTER_ACLS), {**row, "api_key": API["DescribeAcls"]}) == []
