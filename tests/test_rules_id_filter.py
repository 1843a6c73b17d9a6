"""The group ids and transactional ids a client may use (``allow_groups`` /
``deny_groups``, ``allow_transactional_ids`` / ``deny_transactional_ids``): the others
are left out of answers, and a request that names one is refused with
GROUP_AUTHORIZATION_FAILED or TRANSACTIONAL_ID_AUTHORIZATION_FAILED, as a broker refuses
a client its ACLs do not allow."""

from __future__ import annotations

from typing import Any

import pytest

from gatehouse import codecs
from gatehouse.configfile import ConfigError, load_yaml_text
from gatehouse.proxy.hooks import Forward, Pending, Respond
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import Chain, IdFilter, Prefix, TopicFilter, parse_rules
from tests.test_rules import req, rules
from tests.test_rules_topic_filter import answered, conn, listening, observed

GROUP_AUTHORIZATION_FAILED, TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 30, 53
TOPIC_AUTHORIZATION_FAILED = 29
IDS = ('- name: team-a\n  match: {client_id: "^app"}\n'
       '  allow_groups: ["team-a\\\\..*"]\n  deny_groups: ["team-a\\\\.admin"]\n'
       '  allow_transactional_ids: ["team-a-.*"]\n')


def answer(decision: Any, api_key: int, version: int) -> Any:
    assert isinstance(decision, Respond)
    return codecs.decode_response(memoryview(bytes(decision.response.encode())), api_key,
                                  version).body


def join(group: str, client_id: str = "app-1") -> codecs.Request:
    return req(11, 9, client_id, group_id=group, session_timeout_ms=10000,
               rebalance_timeout_ms=10000, member_id="", group_instance_id=None,
               protocol_type="consumer", reason=None, protocols=[])


def test_the_filter_says_which_ids_a_client_may_use() -> None:
    [rule] = rules(IDS).rules
    assert isinstance(rule.topic_map, IdFilter)
    id_filter = rule.topic_map
    assert not id_filter.denies_id("group", "team-a.orders")
    assert id_filter.denies_id("group", "team-a.admin")  # denied, though allowed by pattern
    assert id_filter.denies_id("group", "team-b.orders")
    assert not id_filter.denies_id("transactional_id", "team-a-1")
    assert id_filter.denies_id("transactional_id", "payments-1")
    assert not id_filter.denies("any-topic") and not id_filter.hides_others  # topics pass


@pytest.mark.parametrize(("group", "action"), [("team-b.orders", "allow_groups"),
                                               ("team-a.admin", "deny_groups")])
def test_a_request_naming_a_group_not_allowed_is_refused(group: str, action: str) -> None:
    policy = RulesPolicy(rules(IDS))
    counted, refused = listening(policy)
    body = answer(policy.on_request(conn(), join(group)), 11, 9)
    assert body.error_code == GROUP_AUTHORIZATION_FAILED
    assert refused == [("team-a", "refuse")]
    assert [(o.rule, o.action, o.effect) for o in counted] == [("team-a", action, "refuse")]
    # An allowed group goes on untouched; so does any group for another client.
    allowed = join("team-a.orders")
    decision = policy.on_request(conn(), allowed)
    assert isinstance(decision, Forward) and decision.request is allowed
    assert isinstance(policy.on_request(conn(), join(group, "ops")), Forward)


@pytest.mark.parametrize(("version", "fields"), [
    (3, {"key": "team-b.orders", "key_type": 0}),
    (4, {"key_type": 0, "coordinator_keys": ["team-a.orders", "team-b.orders"]}),
])
def test_the_coordinator_of_a_group_not_allowed_is_not_looked_up(
        version: int, fields: dict[str, Any]) -> None:
    policy = RulesPolicy(rules(IDS))
    decision = policy.on_request(conn(), req(10, version, "app-1", **fields))
    if version < 4:
        assert answer(decision, 10, version).error_code == GROUP_AUTHORIZATION_FAILED
    else:
        # Each key answered on its own, as a broker's ACLs answer them: the allowed
        # group's looked up, the other's refused.
        assert isinstance(decision, Forward)
        assert decision.request.body.coordinator_keys == ("team-a.orders",)
        body = answered(policy, decision, {"coordinators": [
            {"key": "team-a.orders", "node_id": 1, "host": "b", "port": 9092}]})
        assert [(c.key, c.error_code) for c in body.coordinators] == [
            ("team-a.orders", 0), ("team-b.orders", GROUP_AUTHORIZATION_FAILED)]
        assert "group 'team-b.orders' is not allowed" in body.coordinators[1].error_message
    ok = req(10, 4, "app-1", key_type=0, coordinator_keys=["team-a.orders"])
    assert isinstance(policy.on_request(conn(), ok), Forward)
    # A transactional id's coordinator is a transactional id's business.
    txn = req(10, 4, "app-1", key_type=1, coordinator_keys=["payments-1"])
    body = answer(policy.on_request(conn(), txn), 10, 4)
    assert [c.error_code for c in body.coordinators] == [TRANSACTIONAL_ID_AUTHORIZATION_FAILED]


def test_a_transactional_id_not_allowed_is_refused_in_every_request_naming_it() -> None:
    policy = RulesPolicy(rules(IDS))
    init = req(22, 5, "app-1", transactional_id="payments-1", transaction_timeout_ms=60000,
               producer_id=-1, producer_epoch=-1)
    assert answer(policy.on_request(conn(), init), 22, 5).error_code == \
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    produce = req(0, 9, "app-1", transactional_id="payments-1", acks=-1, timeout_ms=1000,
                  topic_data=[{"name": "t", "partition_data": [
                      {"index": 0, "records": b"\x01" * 70}]}])
    body = answer(policy.on_request(conn(), produce), 0, 9)
    assert {p.error_code for t in body.responses for p in t.partition_responses} == {
        TRANSACTIONAL_ID_AUTHORIZATION_FAILED}
    mine = req(22, 5, "app-1", transactional_id="team-a-1", transaction_timeout_ms=60000,
               producer_id=-1, producer_epoch=-1)
    assert isinstance(policy.on_request(conn(), mine), Forward)


@pytest.mark.parametrize(("resource_type", "name", "code"), [
    (3, "team-b.orders", GROUP_AUTHORIZATION_FAILED),
    (5, "payments-1", TRANSACTIONAL_ID_AUTHORIZATION_FAILED),
])
def test_acls_and_configs_of_an_id_not_allowed_are_refused(resource_type: int, name: str,
                                                           code: int) -> None:
    """A group's or transactional id's ACLs and a group's configs are resources of
    that name: a client may not grant itself another team's group (CreateAcls), nor
    read or change them, where the brokers see the proxy's one user."""
    policy = RulesPolicy(rules(IDS))
    acl = {"resource_type": resource_type, "resource_name": name,
           "resource_pattern_type": 3, "principal": "User:me", "host": "*",
           "operation": 3, "permission_type": 3}
    created = answer(policy.on_request(conn(), req(30, 3, "app-1", creations=[acl])), 30, 3)
    assert [r.error_code for r in created.results] == [code]
    described = answer(policy.on_request(conn(), req(29, 3, "app-1", **{
        "resource_type_filter": resource_type, "resource_name_filter": name,
        "pattern_type_filter": 3, "principal_filter": None, "host_filter": None,
        "operation": 2, "permission_type": 1})), 29, 3)
    assert described.error_code == code
    own = {**acl, "resource_name": "team-a.orders" if resource_type == 3 else "team-a-1"}
    assert isinstance(policy.on_request(conn(), req(30, 3, "app-1", creations=[own])),
                      Forward)
    if resource_type == 3:  # group configs (KIP-848): resource type 32
        configs = answer(policy.on_request(conn(), req(32, 4, "app-1", resources=[
            {"resource_type": 32, "resource_name": name, "configuration_keys": None}],
            include_synonyms=False, include_documentation=False)), 32, 4)
        assert [r.error_code for r in configs.results] == [code]


def test_answers_list_only_the_groups_a_client_may_use() -> None:
    policy = RulesPolicy(rules(IDS))
    decision = policy.on_request(conn(), req(16, 4, "app-1", states_filter=[]))
    assert isinstance(decision, Forward) and decision.wants_response
    listed = codecs.response_from_dict({"header": {"correlation_id": 1}, "body": {
        "error_code": 0, "groups": [
            {"group_id": g, "protocol_type": "consumer", "group_state": "Stable"}
            for g in ("team-a.orders", "team-a.admin", "team-b.orders")]}},
        api_key=16, api_version=4)
    listed = codecs.decode_response(memoryview(bytes(listed.encode())), 16, 4)
    shown = policy.on_response(conn(), Pending(1, 16, 4, 0.0, wants_response=True,
                                               context=decision.context), listed)
    assert [g.group_id for g in shown.body.groups] == ["team-a.orders"]


def test_with_a_tenant_prefix_the_filter_sees_the_clients_ids() -> None:
    ruleset = rules('- name: t\n  topic_prefix: {broker: "a.", groups: true}\n'
                    '  allow_groups: [orders]\n  allow_topics: [in]\n')
    topic_map = ruleset.rules[0].topic_map
    assert isinstance(topic_map, Chain)
    assert [type(m) for m in topic_map.maps] == [TopicFilter, IdFilter, Prefix]
    policy = RulesPolicy(ruleset)
    decision = policy.on_request(conn(), join("orders"))
    assert isinstance(decision, Forward) and decision.request.body.group_id == "a.orders"
    assert answer(policy.on_request(conn(), join("a.orders")), 11, 9).error_code == \
        GROUP_AUTHORIZATION_FAILED  # the broker's name is not the client's
    # A topic refused first, then a group: the error says which.
    commit = req(8, 8, "app-1", group_id="other", generation_id_or_member_epoch=1,
                 member_id="m", group_instance_id=None, topics=[
                     {"name": "out", "partitions": [{"partition_index": 0,
                                                      "committed_offset": 1,
                                                      "committed_leader_epoch": -1,
                                                      "committed_metadata": None}]}])
    body = answer(policy.on_request(conn(), commit), 8, 8)
    assert {p.error_code for t in body.topics for p in t.partitions} == {
        TOPIC_AUTHORIZATION_FAILED}


def test_in_observe_mode_nothing_is_refused_and_what_would_be_is_counted() -> None:
    observed(IDS, join("team-b.orders"), "team-a", "allow_groups")


def test_bad_id_patterns_say_file_and_line() -> None:
    with pytest.raises(ConfigError, match="not a regular expression") as info:
        parse_rules(load_yaml_text("- name: f\n  deny_transactional_ids:\n    - ok\n"
                                   "    - '(x'\n", "rules.yaml"), "rules.yaml")
    assert str(info.value).startswith("rules.yaml:4: ")


def test_an_id_filter_matched_by_client_id_gets_the_advice() -> None:
    [advice] = rules(IDS).advice()
    assert "limits the groups or transactional ids" in advice and "client id" in advice
    assert rules(IDS.replace('client_id: "^app"', 'principal: "^app$"')).advice() == []


def test_a_large_produce_request_streams_unless_its_transactional_id_is_filtered() -> None:
    """Checked whole only where the filter restricts a name the request can hold."""
    def produce(transactional_id: str | None) -> codecs.Request:
        return req(0, 9, "app-1", transactional_id=transactional_id, acks=-1,
                   timeout_ms=1000, topic_data=[{"name": "t", "partition_data": [
                       {"index": 0, "records": b"\x01" * 70}]}])

    groups_only = RulesPolicy(rules('- name: g\n  allow_groups: [a]\n'))
    assert isinstance(groups_only.forwards_unread(conn(), produce(None)), Forward)
    assert RulesPolicy(rules(IDS)).forwards_unread(conn(), produce("team-a-1")) is None


def test_mapping_and_checking_add_no_walker_plans_per_request() -> None:
    """The walker keeps a plan per (message, predicate, version): requests that are
    mapped or checked again and again must reuse theirs, not add one each (a closure
    made per call as the predicate would grow the cache without end)."""
    from gatehouse.codecs import walk
    from gatehouse.rules import Rename, RewriteStats, map_request, map_response
    from gatehouse.rules.topics import id_names

    subscription = codecs.consumer.subscription(1, topics=("orders",), user_data=None,
                                                owned_partitions=())
    member = req(11, 5, "app-1", group_id="team-a.g", session_timeout_ms=10000,
                 rebalance_timeout_ms=10000, member_id="", group_instance_id=None,
                 protocol_type="consumer",
                 protocols=[{"name": "range", "metadata": subscription.encode()}])
    assignment = codecs.consumer.assignment(0, assigned_partitions=[
        codecs.consumer.ASSIGNMENT.structs["TopicPartition"].cls(topic="prod.orders",
                                                                  partitions=(0,))],
        user_data=None)
    synced = codecs.response_from_dict({"header": {"correlation_id": 2}, "body": {
        "protocol_type": "consumer", "protocol_name": "range", "error_code": 0,
        "assignment": assignment.encode()}}, api_key=14, api_version=5)
    rename = Rename({"orders": "prod.orders"})
    policy = RulesPolicy(rules(IDS))

    def once() -> None:
        map_request(member, rename, {}, RewriteStats())
        map_response(synced, rename, {}, RewriteStats())
        id_names(member, frozenset({"group", "transactional_id"}))
        policy.on_request(conn(), join("team-b.orders"))

    once()
    plans = walk._plan.cache_info().currsize
    for _ in range(50):
        once()
    assert walk._plan.cache_info().currsize == plans
